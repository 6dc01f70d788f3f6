"""dattn's CPU platform for the vllm-omni diffusion engine (an out-of-tree ``OmniPlatform``).

Activated by the ``vllm_omni.platform_plugins`` entry point
(:func:`dattn.vllm_omni_plugin.platform_plugin`). Its diffusion attention is dattn's backend
(``dattn.vllm_omni.DattnAttentionBackend``): by default and for the name ``DATTN``, resolved
here without the engine's closed ``DiffusionAttentionBackendEnum``. dattn's own backend names
(``FLASH``, ``REFERENCE``, ``VIDEO_SPARSE``) select dattn's backend as well, and the layer then
runs on that dattn backend. The engine's backend names (``TORCH_SDPA``, ``FLASH_ATTN``, ...)
are refused with a ``ValueError`` naming the valid ones: their implementations dispatch
``forward`` only to CUDA, ROCm, NPU, XPU and MUSA, so on this platform they could not run.

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
        if selected_backend is not None and selected_backend.strip().upper() not in dattn_names():
            raise ValueError(
                f"The {selected_backend.upper()} diffusion attention backend has no forward on "
                f"dattn's CPU platform (the engine's implementations run on cuda, rocm, npu, xpu "
                f"and musa). Select DATTN (or unset DIFFUSION_ATTENTION_BACKEND), or one of "
                f"dattn's backends: {', '.join(dattn_names()[1:])}; or switch dattn's platform "
                f"off with DATTN_VLLM_OMNI=0."
            )
        cls.validate_dattn_backend(head_size)
        return BACKEND_QUALNAME

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
    def get_free_memory(cls, device=None) -> int:
        return _host_memory()[0]

    @classmethod
    def get_device_memory(cls, device=None) -> Tuple[int, int]:
        return _host_memory()

    @classmethod
    def supports_cpu_offload(cls) -> bool:
        return False  # the model already lives in host memory
