"""dattn's CPU platform for the vllm-omni diffusion engine (an out-of-tree ``OmniPlatform``).

Activated by the ``vllm_omni.platform_plugins`` entry point
(:func:`dattn.vllm_omni.plugin.platform_plugin`). The class is vLLM's own ``CpuPlatform`` under
the engine's ``OmniPlatform`` interface, with what the engine calls on a diffusion platform
answered truly for a CPU host (found by running the engine: docs/vllm-omni.md):

- **Attention.** The platform's diffusion attention is dattn's backend
  (``dattn.vllm_omni.DattnAttentionBackend``): by default (unless dattn runs far below this CPU,
  ``dattn.far_below_cpu()``: then the default is the engine's ``TORCH_SDPA``, with one warning
  saying why) and for the name ``DATTN``, resolved
  here without the engine's closed ``DiffusionAttentionBackendEnum``. dattn's own backend names
  (``FLASH``, ``SAGE``, ``REFERENCE``, ``VIDEO_SPARSE``) select dattn's backend as well, and the
  layer then runs on that dattn backend. ``SAGE_ATTN`` and ``SAGE_ATTN_3`` select dattn's SAGE
  (``dattn.vllm_omni.DattnSageAttentionBackend``). ``TORCH_SDPA`` selects the engine's own SDPA
  backend, which runs here because dattn gives the engine's ``SDPAImpl`` a forward on this
  platform (:func:`dattn.vllm_omni.patches.serve_engine_sdpa`). The engine's other names
  (``FLASH_ATTN``, ...) are refused at once with a ``ValueError`` naming the valid ones: their
  implementations run on CUDA, ROCm, NPU, XPU and MUSA only.
- **Devices are processes on the host.** A sequence-parallel rank is a process; the platform
  counts :data:`MAX_RANKS` devices, so a parallel config of N ranks needs no setting (more ranks
  than cores run with one thread each, with a warning); ``DATTN_VLLM_OMNI_VISIBLE_DEVICES``
  (the platform's ``device_control_env_var``, e.g. ``0,1``) restricts them. The device lists
  the engine's deploy files pin for GPUs (``devices: "0"``) are not applied to it: a CPU stage
  has no device to hide. Each rank's torch and dattn threads are the host's cores divided among
  the ranks (:meth:`DattnCpuOmniPlatform.init_diffusion_model_runner_runtime`).
- **Memory figures are the process's**, as vLLM's ``CpuPlatform`` reports them: allocated and
  reserved = resident set size, their peaks = its high-water mark (which
  ``reset_peak_memory_stats`` resets where Linux allows), free and total = the host's;
  ``empty_cache`` returns dattn's idle buffers to the OS (``dattn.empty_cache()``) and
  ``synchronize`` has nothing to do.

The class is made on first access of ``DattnCpuOmniPlatform`` (a module ``__getattr__``):
importing this module imports nothing of the engine's, so importing it before vllm_omni (which
resolves its platform, i.e. this class, while it imports itself) is no import cycle.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Tuple

logger = logging.getLogger(__name__)

#: The class path the platform returns for dattn's backend.
BACKEND_QUALNAME = "dattn.vllm_omni.DattnAttentionBackend"

#: The name the engine's users select dattn with (DIFFUSION_ATTENTION_BACKEND, AttentionSpec).
NAME = "DATTN"

#: The engine's backend names that run on this platform as the engine's own implementation.
ENGINE_NAMES = ("TORCH_SDPA",)

#: The engine's SageAttention names, served here by dattn's SAGE backend.
SAGE_NAMES = ("SAGE_ATTN", "SAGE_ATTN_3")
SAGE_QUALNAME = "dattn.vllm_omni.DattnSageAttentionBackend"

#: The environment variable that restricts the platform's devices (comma-separated ids).
VISIBLE_DEVICES_ENV = "DATTN_VLLM_OMNI_VISIBLE_DEVICES"

#: How many devices (process slots for sequence-parallel ranks) the platform counts.
MAX_RANKS = 256


def dattn_names() -> Tuple[str, ...]:
    """The backend names this platform maps to dattn: DATTN and dattn's own backends."""
    from ..backends import backends

    return (NAME,) + tuple(b.name for b in backends())


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def rank_threads(world_size: int, cores: Optional[int] = None) -> int:
    """Each of ``world_size`` ranks' threads on ``cores`` cores (default: this process's):
    the cores divided evenly, at least one."""
    cores = host_cores() if cores is None else cores
    return max(1, cores // max(1, int(world_size)))


def _host_memory() -> Tuple[int, int]:
    """(available, total) bytes of the host."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0, 0
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    if available is None:  # pragma: no cover
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    return int(available), int(total)


def _process_memory() -> Tuple[int, int]:
    """(resident set size, its high-water mark) of this process in bytes."""
    rss = hwm = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    if hwm is None:  # pragma: no cover
        import resource

        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (hwm if rss is None else rss), hwm


def _reset_peak() -> None:
    """Resets the high-water mark of the resident set to its current size (Linux: "5" into
    /proc/self/clear_refs); a no-op where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _visible_devices() -> Optional[list]:
    value = os.environ.get(VISIBLE_DEVICES_ENV, "").strip()
    if not value:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def _make_platform_class():
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import PlatformEnum
    from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

    class DattnCpuOmniPlatform(OmniPlatform, CpuPlatform):
        """The engine's out-of-tree platform kind (``OmniPlatformEnum.OOT``) on the host CPU,
        with dattn as its diffusion attention (see the module docstring)."""

        _omni_enum = OmniPlatformEnum.OOT
        _enum = PlatformEnum.OOT
        device_name = "cpu"  # also the key of DattnAttentionImpl._supported_kv_cache_dtypes
        device_type = "cpu"
        dispatch_key = "CPU"
        device_control_env_var = VISIBLE_DEVICES_ENV
        dist_backend = "gloo"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            from . import patches

            patches.apply_early()  # the engine makes its platform once per process, early

        def __getattr__(self, name: str):
            # A name this class does not define: vLLM's answer (torch.cpu's attribute, or None
            # with a warning), noted in the call log: the tests require that none is asked.
            if not name.startswith("__"):
                from . import patches

                patches.note_platform_fallback(name)
            return super().__getattr__(name)

        # --- attention ---------------------------------------------------------------------

        @classmethod
        def get_diffusion_attn_backend_cls(cls, selected_backend: Optional[str], head_size: int,
                                           allow_trtllm_default: bool = False,
                                           **kwargs: Any) -> str:
            del allow_trtllm_default, kwargs
            from .patches import serve_engine_sdpa

            # Every engine layer also builds the engine's SDPA (its sdpa_fallback), and Ring
            # runs the engine's SDPA ring: both run here once served (the general plugin too).
            serve_engine_sdpa()
            name = None if selected_backend is None else selected_backend.strip().upper()
            if name in ENGINE_NAMES:
                return cls.engine_backend_cls(name, head_size)
            if name in SAGE_NAMES:  # SageAttention's scheme on the CPU: dattn's SAGE
                from ..slow_cpu import warn_explicit

                warn_explicit(f"DIFFUSION_ATTENTION_BACKEND={name}")
                cls.validate_dattn_backend(head_size)
                return SAGE_QUALNAME
            if name is not None and name not in dattn_names():
                raise ValueError(
                    f"The {selected_backend.strip().upper()} diffusion attention backend has no "
                    f"forward on dattn's CPU platform (the engine's implementations run on cuda, "
                    f"rocm, npu, xpu and musa). Valid here: DATTN (the default: unset "
                    f"DIFFUSION_ATTENTION_BACKEND), dattn's backends "
                    f"{', '.join(dattn_names()[1:])}, and the engine's "
                    f"{', '.join(ENGINE_NAMES + SAGE_NAMES)}; or switch dattn's platform off "
                    f"with DATTN_VLLM_OMNI=0.")
            if name is None:
                from ..slow_cpu import keep_host_attention

                # Never silently slow: where dattn runs far below this CPU (no engine with SIMD
                # serves it), the default is the engine's own SDPA, with one warning saying why.
                if keep_host_attention("vllm-omni's diffusion engine", "TORCH_SDPA"):
                    return cls.engine_backend_cls("TORCH_SDPA", head_size)
            else:
                from ..slow_cpu import warn_explicit

                warn_explicit(f"DIFFUSION_ATTENTION_BACKEND={name}")
            cls.validate_dattn_backend(head_size)
            if name is None or name == NAME:
                return BACKEND_QUALNAME
            # A dattn backend by name: the class whose layers run on it (the engine hands its
            # impl only the options).
            from .backends import bound_backend

            bound = bound_backend(name)
            return f"{bound.__module__}.{bound.__name__}"

        @classmethod
        def engine_backend_cls(cls, name: str, head_size: int) -> str:
            """The class path of the engine's backend ``name`` (one of ``ENGINE_NAMES``) from its
            registry (overrides included), with its forward on this platform installed."""
            from vllm.utils.import_utils import resolve_obj_by_qualname
            from vllm_omni.diffusion.attention.backends.registry import (
                DiffusionAttentionBackendEnum,
            )

            path = DiffusionAttentionBackendEnum[name].get_path()
            backend = resolve_obj_by_qualname(path)
            if head_size > 0 and not backend.supports_head_size(head_size):
                raise ValueError(
                    f"The {name} diffusion attention backend does not take head size {head_size}")
            return path

        @classmethod
        def validate_dattn_backend(cls, head_size: int) -> None:
            """The engine's checks (``validate_diffusion_attn_backend``) for dattn's backend:
            this platform's ``OmniPlatformEnum`` value among its ``supported_platforms``, the
            backend available here, and the head size."""
            from .backends import DattnAttentionBackend

            supported = DattnAttentionBackend.supported_platforms
            platform = cls._omni_enum.value
            if supported is not None and platform not in supported:
                raise ValueError(
                    f"The DATTN diffusion attention backend runs on {', '.join(supported)} only, "
                    f"but the current platform is {platform}.")
            DattnAttentionBackend.validate_available()
            if head_size > 0 and not DattnAttentionBackend.supports_head_size(head_size):
                raise ValueError(
                    f"The DATTN diffusion attention backend does not take head size {head_size}")

        @classmethod
        def supports_diffusion_dense_flash_attention(cls) -> bool:
            return False

        @classmethod
        def has_flash_attn_package(cls) -> bool:
            return False

        @classmethod
        def supports_torch_inductor(cls) -> bool:
            return False  # the engine's compile path is tuned for GPUs: eager on the CPU

        @classmethod
        def supports_talker_mtp_graph_capture(cls) -> bool:
            return False

        @classmethod
        def supports_cpu_offload(cls) -> bool:
            return False  # the model already lives in host memory

        # --- devices: processes on the host --------------------------------------------------

        @classmethod
        def get_torch_device(cls, local_rank: Optional[int] = None) -> "torch.device":
            return torch.device("cpu")

        @classmethod
        def get_device_count(cls) -> int:
            visible = _visible_devices()
            return MAX_RANKS if visible is None else len(visible)

        @classmethod
        def current_device(cls) -> int:
            return int(os.environ.get("LOCAL_RANK", "0") or 0)

        @classmethod
        def is_available(cls) -> bool:
            return True

        @classmethod
        def is_initialized(cls) -> bool:
            return True

        @classmethod
        def get_device_version(cls) -> Optional[str]:
            return None

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            import platform as _platform

            name = _platform.processor() or _platform.machine()
            try:
                with open("/proc/cpuinfo") as f:
                    for line in f:
                        if line.startswith("model name"):
                            name = line.split(":", 1)[1].strip()
                            break
            except OSError:  # pragma: no cover - not Linux
                pass
            return name or "cpu"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return _host_memory()[1]

        @classmethod
        def set_device(cls, device) -> None:
            """Each rank's device: there is one, the host."""
            return None

        @classmethod
        def set_device_control_env_var(cls, devices) -> None:
            """The engine narrows a stage's GPUs while it spawns the stage: a CPU stage has no
            device to hide, and ``DATTN_VLLM_OMNI_VISIBLE_DEVICES`` stays the user's."""
            logger.debug("dattn's CPU platform: stage devices %r not applied (processes on the "
                         "host)", devices)

        @classmethod
        def unset_device_control_env_var(cls) -> None:
            return None

        @classmethod
        def synchronize(cls) -> None:
            return None

        @classmethod
        def manual_seed(cls, seed: int) -> None:
            torch.manual_seed(seed)

        @classmethod
        def init_diffusion_model_runner_runtime(cls, vllm_config: Any, od_config: Any,
                                                device: Any) -> None:
            """Each rank's threads: the host's cores divided among the stage's ranks (one
            each, with a warning, where there are more ranks than cores)."""
            world = int(getattr(getattr(od_config, "parallel_config", None), "world_size", 1) or 1)
            world = max(world, int(getattr(od_config, "num_gpus", 1) or 1))
            if world <= 1:
                return
            cores = host_cores()
            threads = rank_threads(world, cores)
            if world > cores:
                logger.warning(
                    "dattn's CPU platform: %d sequence-parallel ranks on %d cores; each rank "
                    "runs one thread (the ranks share cores)", world, cores)
            torch.set_num_threads(threads)
            logger.info("dattn's CPU platform: %d rank(s) x %d thread(s) on %d core(s)", world,
                        threads, cores)

        # --- memory: the process's -------------------------------------------------------------

        @classmethod
        def get_free_memory(cls, device=None) -> int:
            return _host_memory()[0]

        @classmethod
        def get_device_memory(cls, device=None) -> Tuple[int, int]:
            return _host_memory()

        @classmethod
        def mem_get_info(cls, device=None) -> Tuple[int, int]:
            return _host_memory()

        @classmethod
        def memory_allocated(cls, device=None) -> int:
            return _process_memory()[0]

        @classmethod
        def memory_reserved(cls, device=None) -> int:
            return _process_memory()[0]

        @classmethod
        def max_memory_allocated(cls, device=None) -> int:
            return _process_memory()[1]

        @classmethod
        def max_memory_reserved(cls, device=None) -> int:
            return _process_memory()[1]

        @classmethod
        def reset_peak_memory_stats(cls, device=None) -> None:
            _reset_peak()

        @classmethod
        def empty_cache(cls) -> None:
            # The engine's "give back what you cache": dattn's idle buffers (the rest of host
            # memory is returned by the allocator itself).
            from ..memory import empty_cache

            empty_cache()
            return None

    DattnCpuOmniPlatform.__module__ = __name__
    DattnCpuOmniPlatform.__qualname__ = "DattnCpuOmniPlatform"
    return DattnCpuOmniPlatform


def __getattr__(name: str):
    if name == "DattnCpuOmniPlatform":
        cls = globals().get("_platform_class")
        if cls is None:
            cls = _make_platform_class()
            # Importing the engine above may have made the class already (the engine resolves
            # its platform while it imports itself): keep the first one.
            cls = globals().setdefault("_platform_class", cls)
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
