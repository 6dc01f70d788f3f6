"""dattn's CPU platform for the vllm-omni diffusion engine (an out-of-tree ``OmniPlatform``).

Activated by the ``vllm_omni.platform_plugins`` entry point
(:func:`dattn.vllm_omni_plugin.platform_plugin`). Its diffusion attention is dattn's backend
(``dattn.vllm_omni.DattnAttentionBackend``): by default and for the name ``DATTN``, resolved
here without the engine's closed ``DiffusionAttentionBackendEnum``. dattn's own backend names
(``FLASH``, ``REFERENCE``, ``VIDEO_SPARSE``) select dattn's backend as well, and the layer then
runs on that dattn backend. ``TORCH_SDPA`` selects the engine's own SDPA backend (the class
path its registry holds), which runs here because dattn gives the engine's ``SDPAImpl`` a
forward on this platform (:func:`dattn.vllm_omni_plugin.serve_engine_sdpa`: the engine's own
``_forward_impl``, as on CUDA; the per-block kernel of its SDPA ring, used by Ring sequence
parallelism, on PyTorch's CPU kernel). ``SAGE_ATTN`` and ``SAGE_ATTN_3`` select
dattn's SAGE backend (``dattn.vllm_omni.DattnSageAttentionBackend``: 8-bit attention in
SageAttention's manner on the CPU). The engine's other backend names (``FLASH_ATTN``, ...) are
refused with a ``ValueError`` naming the valid ones: their
implementations dispatch ``forward`` only to CUDA, ROCm, NPU, XPU and MUSA.

The platform is a single host "device" with ``gloo`` as the distributed backend, so the
engine's sequence-parallel groups (Ulysses, Ring) form over processes on the host.

Importing this module needs the engine (``vllm_omni.platforms.interface``, hence vllm).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import torch
from vllm.platforms.interface import PlatformEnum
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from .backends import backends

#: The class path the platform returns for dattn's backend.
BACKEND_QUALNAME = "dattn.vllm_omni.DattnAttentionBackend"

#: The name the engine's users select dattn with (DIFFUSION_ATTENTION_BACKEND, AttentionSpec).
NAME = "DATTN"

#: The engine's backend names that run on this platform as the engine's own implementation.
ENGINE_NAMES = ("TORCH_SDPA",)

#: The engine's SageAttention names, served here by dattn's SAGE backend.
SAGE_NAMES = ("SAGE_ATTN", "SAGE_ATTN_3")
SAGE_QUALNAME = "dattn.vllm_omni.DattnSageAttentionBackend"


def dattn_names() -> Tuple[str, ...]:
    """The backend names this platform maps to dattn: DATTN and dattn's own backends."""
    return (NAME,) + tuple(b.name for b in backends())


def _host_memory() -> Tuple[int, int]:
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0, 0


class DattnCpuOmniPlatform(OmniPlatform):
    """The engine's out-of-tree platform kind (``OmniPlatformEnum.OOT``) on the host CPU, with
    dattn as its diffusion attention."""

    _omni_enum = OmniPlatformEnum.OOT
    _enum = PlatformEnum.OOT
    device_name = "cpu"  # also the key of DattnAttentionImpl._supported_kv_cache_dtypes
    device_type = "cpu"
    dispatch_key = "CPU"
    device_control_env_var = "DATTN_VLLM_OMNI_VISIBLE_DEVICES"  # no devices to hide on a CPU
    dist_backend = "gloo"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls,
        selected_backend: Optional[str],
        head_size: int,
        allow_trtllm_default: bool = False,
        **kwargs: Any,
    ) -> str:
        del allow_trtllm_default, kwargs
        from .vllm_omni_plugin import serve_engine_sdpa

        # Every engine layer also builds the engine's SDPA (its sdpa_fallback), and Ring runs
        # the engine's SDPA ring: both run here once served (also done by the general plugin).
        serve_engine_sdpa()
        name = None if selected_backend is None else selected_backend.strip().upper()
        if name in ENGINE_NAMES:
            return cls.engine_backend_cls(name, head_size)
        if name in SAGE_NAMES:  # SageAttention's scheme on the CPU: dattn's SAGE
            cls.validate_dattn_backend(head_size)
            return SAGE_QUALNAME
        if name is not None and name not in dattn_names():
            raise ValueError(
                f"The {selected_backend.upper()} diffusion attention backend has no forward on "
                f"dattn's CPU platform (the engine's implementations run on cuda, rocm, npu, xpu "
                f"and musa). Select DATTN (or unset DIFFUSION_ATTENTION_BACKEND), one of "
                f"dattn's backends: {', '.join(dattn_names()[1:])}, or the engine's "
                f"{', '.join(ENGINE_NAMES + SAGE_NAMES)}; or switch dattn's platform off with "
                f"DATTN_VLLM_OMNI=0."
            )
        cls.validate_dattn_backend(head_size)
        return BACKEND_QUALNAME

    @classmethod
    def engine_backend_cls(cls, name: str, head_size: int) -> str:
        """The class path of the engine's backend ``name`` (one of ``ENGINE_NAMES``) from its
        registry (overrides included), with its forward on this platform installed."""
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        from .vllm_omni_plugin import serve_engine_sdpa

        serve_engine_sdpa()
        path = DiffusionAttentionBackendEnum[name].get_path()
        backend = resolve_obj_by_qualname(path)
        if head_size > 0 and not backend.supports_head_size(head_size):
            raise ValueError(
                f"The {name} diffusion attention backend does not take head size {head_size}")
        return path

    @classmethod
    def validate_dattn_backend(cls, head_size: int) -> None:
        """The engine's checks (``validate_diffusion_attn_backend``) for dattn's backend: this
        platform's ``OmniPlatformEnum`` value among its ``supported_platforms``, the backend
        available here, and the head size."""
        from .vllm_omni import DattnAttentionBackend

        supported = DattnAttentionBackend.supported_platforms
        platform = cls._omni_enum.value
        if supported is not None and platform not in supported:
            raise ValueError(
                f"The DATTN diffusion attention backend runs on {', '.join(supported)} only, but "
                f"the current platform is {platform}."
            )
        DattnAttentionBackend.validate_available()
        if head_size > 0 and not DattnAttentionBackend.supports_head_size(head_size):
            raise ValueError(f"The DATTN diffusion attention backend does not take head size {head_size}")

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def has_flash_attn_package(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: Optional[int] = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> Optional[str]:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """The engine's ``init_distributed_environment`` selects each rank's device: there is
        one, the host."""
        return None

    @classmethod
    def manual_seed(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def get_free_memory(cls, device=None) -> int:
        return _host_memory()[0]

    @classmethod
    def get_device_memory(cls, device=None) -> Tuple[int, int]:
        return _host_memory()

    @classmethod
    def supports_cpu_offload(cls) -> bool:
        return False  # the model already lives in host memory
