"""dattn's vllm-omni plugins: the entry points the engine loads (installed with the package).

    [project.entry-points."vllm_omni.platform_plugins"]
    dattn = "dattn.vllm_omni.plugin:platform_plugin"

    [project.entry-points."vllm_omni.general_plugins"]
    dattn = "dattn.vllm_omni.plugin:general_plugin"

vllm-omni calls every function of the group ``vllm_omni.platform_plugins`` when it first
resolves ``vllm_omni.platforms.current_omni_platform``; a function returning a class path
activates that out-of-tree platform, and an out-of-tree platform that activates wins over the
built-in ones (CUDA, ROCm, NPU, XPU, MUSA). So :func:`platform_plugin` activates dattn's CPU
platform (:class:`dattn.vllm_omni.platform.DattnCpuOmniPlatform`) only where it should:

- ``DATTN_VLLM_OMNI`` unset, empty or ``auto``: only on a machine with no accelerator, i.e.
  when none of the engine's own built-in platform checks (``builtin_omni_platform_plugins``:
  NVML for CUDA, amdsmi for ROCm, torch.npu, torch.xpu, torchada for MUSA) finds a device and
  torch sees no CUDA/XPU device either. On a CUDA host it returns None: nothing changes there.
- ``DATTN_VLLM_OMNI=1`` (``on``, ``true``, ``yes``): always (e.g. a CPU stage on a GPU host).
- ``DATTN_VLLM_OMNI=0`` (``off``, ``false``, ``no``): never.

:func:`general_plugin` (the group ``vllm_omni.general_plugins``, run in every engine process)
applies the same rule and, where dattn's platform is active:

- adds the name ``DATTN`` to the engine's ``DiffusionAttentionBackendEnum`` (with
  ``aenum.extend_enum``, as vllm-omni's own ``vllm_omni.patch`` extends vllm's enums), pointing
  at dattn's backend. The platform resolves ``DATTN`` without the enum; the member is for the
  engine's code that indexes the enum by the configured name (the selector's
  ``get_attn_backend_for_capability``, used by sequence-parallel auto-padding), which would
  otherwise refuse ``DIFFUSION_ATTENTION_BACKEND=DATTN``;
- applies the engine patches this vllm-omni needs (:mod:`dattn.vllm_omni.patches`: the engine's
  SDPA forward on this platform, Ring's blocks on dattn, the multi-process worker's output
  loop without an accelerator).

This module imports nothing of the engine's at import time (the engine loads every plugin of the
group, on every host); the platform module is imported only when the engine resolves the
returned class path.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

#: The platform class the plugin activates.
PLATFORM_QUALNAME = "dattn.vllm_omni.platform.DattnCpuOmniPlatform"

#: The environment variable that switches the platform on (1) or off (0); default auto.
ENV = "DATTN_VLLM_OMNI"

_ON = ("1", "on", "true", "yes")
_OFF = ("0", "off", "false", "no")


def mode() -> str:
    """``"on"``, ``"off"`` or ``"auto"``, from ``DATTN_VLLM_OMNI`` (an unknown value counts as
    auto, with a warning)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    if value not in ("", "auto"):
        logger.warning("%s=%r is not one of 1/on, 0/off, auto; treated as auto", ENV, value)
    return "auto"


def accelerator_present() -> Optional[str]:
    """The name of an accelerator the engine (or torch) sees on this machine, else None."""
    try:
        from vllm_omni.platforms import builtin_omni_platform_plugins
    except Exception:  # pragma: no cover - an engine without the table: torch's view only
        builtin_omni_platform_plugins = {}
    for name, detect in builtin_omni_platform_plugins.items():
        try:
            if detect() is not None:
                return name
        except Exception:  # each check already swallows its own failures; be as lenient
            continue
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            return "xpu"
    except Exception:  # pragma: no cover
        pass
    return None


def platform_plugin() -> Optional[str]:
    """The engine's ``vllm_omni.platform_plugins`` hook: dattn's CPU platform's class path where
    it should be active (see the module docstring), else None."""
    m = mode()
    if m == "off":
        return None
    if m == "on":
        return PLATFORM_QUALNAME
    found = accelerator_present()
    if found is not None:
        logger.debug("dattn's CPU platform stays off: the engine's %s platform applies", found)
        return None
    return PLATFORM_QUALNAME


#: The class path of dattn's backend (the value of the engine's enum member DATTN).
BACKEND_QUALNAME = "dattn.vllm_omni.DattnAttentionBackend"


def general_plugin() -> None:
    """The engine's ``vllm_omni.general_plugins`` hook: where dattn's platform is active, the
    engine patches this vllm-omni needs (:func:`dattn.vllm_omni.patches.apply`) and the member
    ``DATTN`` of ``DiffusionAttentionBackendEnum`` (dattn's backend's class path). Safe to run
    several times (the engine's rule for general plugins); does nothing elsewhere, or when the
    engine (or, for the enum member, aenum) is not importable."""
    if platform_plugin() is None:
        return
    from . import patches

    patches.apply()
    try:
        from aenum import extend_enum
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    except ImportError as e:
        logger.debug("dattn: DATTN not added to the engine's backend enum (%s)", e)
        return
    if "DATTN" in DiffusionAttentionBackendEnum.__members__:
        return
    extend_enum(DiffusionAttentionBackendEnum, "DATTN", BACKEND_QUALNAME)


def serve_engine_sdpa() -> bool:
    """:func:`dattn.vllm_omni.patches.serve_engine_sdpa` (its earlier home)."""
    from .patches import serve_engine_sdpa as serve

    return serve()


def ring_client(backend: Optional[str] = None):
    """:func:`dattn.vllm_omni.patches.ring_client` (its earlier home)."""
    from .patches import ring_client as client

    return client(backend)
