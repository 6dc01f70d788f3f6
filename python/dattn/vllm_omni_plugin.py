"""dattn's vllm-omni plugins: the entry points the engine loads (installed with the package).

    [project.entry-points."vllm_omni.platform_plugins"]
    dattn = "dattn.vllm_omni_plugin:platform_plugin"

    [project.entry-points."vllm_omni.general_plugins"]
    dattn = "dattn.vllm_omni_plugin:general_plugin"

vllm-omni calls every function of the group ``vllm_omni.platform_plugins`` when it first
resolves ``vllm_omni.platforms.current_omni_platform``; a function returning a class path
activates that out-of-tree platform, and an out-of-tree platform that activates wins over the
built-in ones (CUDA, ROCm, NPU, XPU, MUSA). So :func:`platform_plugin` activates dattn's CPU
platform (:class:`dattn.vllm_omni_platform.DattnCpuOmniPlatform`) only where it should:

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
- makes the engine's own SDPA run on dattn's platform (:func:`serve_engine_sdpa`): its
  ``SDPAImpl``, which every engine ``Attention`` layer builds (``layer.sdpa_fallback``), some
  models call directly (Sana-Video and Sana-WM for masked cross-attention) and ``TORCH_SDPA``
  selects, and whose base class dispatches ``forward`` only to the engine's built-in platforms
  (``NotImplementedError`` on an out-of-tree one); and the per-block kernel of its SDPA ring
  (Ring sequence parallelism), which calls a CUDA-only PyTorch op.

This module imports nothing of the engine's at import time (the engine loads every plugin of the
group, on every host); the platform module is imported only when the engine resolves the
returned class path.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Optional

logger = logging.getLogger(__name__)

#: The platform class the plugin activates.
PLATFORM_QUALNAME = "dattn.vllm_omni_platform.DattnCpuOmniPlatform"

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


def _on_dattn_platform() -> bool:
    """Whether the engine's current platform is dattn's."""
    module = sys.modules.get("dattn.vllm_omni_platform")
    if module is None:
        return False  # never imported: the engine did not resolve to it
    try:
        from vllm_omni.platforms import current_omni_platform
    except Exception:  # pragma: no cover - an engine that cannot resolve a platform
        return False
    return isinstance(current_omni_platform, module.DattnCpuOmniPlatform)


def serve_engine_sdpa() -> bool:
    """Make the engine's own SDPA paths run on dattn's platform, where its platform dispatch
    has no branch for an out-of-tree platform and its ring kernel calls a CUDA-only op:

    - ``SDPAImpl.forward`` (``vllm_omni.diffusion.attention.backends.sdpa``): while the
      engine's current platform is dattn's, the engine's own
      ``SDPAImpl._forward_impl(..., mask_mode="broadcast_k")``, exactly what its CUDA, ROCm and
      XPU forwards run (PyTorch's scaled_dot_product_attention, with the engine's mask and GQA
      handling);
    - the per-block kernel of the engine's SDPA ring (``ring_kernels.pytorch_attn_forward``,
      used by Ring sequence parallelism): for CPU tensors on dattn's platform, dattn (out and
      LSE, counted on :func:`ring_client`) inside a Ring call of a layer on dattn's backend
      (:func:`_serve_ring_runner`), else PyTorch's CPU kernel with the log-sum-exp
      (``aten._scaled_dot_product_flash_attention_for_cpu``) in place of
      ``aten._scaled_dot_product_efficient_attention``, which exists for CUDA only.

    On any other platform (or device) the engine's own code runs unchanged. Idempotent;
    returns whether the engine's SDPA module was importable."""
    try:
        from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    except Exception as e:  # absent or broken engine: nothing to serve
        logger.debug("dattn: the engine's SDPA backend is not importable (%s)", e)
        return False
    _serve_ring_runner()
    if "_dattn_engine_forward" not in SDPAImpl.__dict__:
        engine_forward = SDPAImpl.forward

        def forward(self, query, key, value, attn_metadata=None):
            if _on_dattn_platform():
                return self._forward_impl(query, key, value, attn_metadata,
                                          mask_mode="broadcast_k")
            return engine_forward(self, query, key, value, attn_metadata)

        forward.__doc__ = (
            "The engine's platform dispatch; on dattn's CPU platform the engine's own "
            "_forward_impl (installed by dattn.vllm_omni_plugin.serve_engine_sdpa)."
        )
        SDPAImpl._dattn_engine_forward = engine_forward
        SDPAImpl.forward = forward
    _serve_ring_kernel()
    return True


#: Ring calls of the engine's layers on dattn's backend that are running in this thread (their
#: blocks are dattn's), see _serve_ring_runner.
_RING = threading.local()
_RING_CLIENTS: dict = {}

#: The Ring preferences (the layer's backend name, upper case) of layers on dattn's SAGE.
_SAGE_PREFS = ("DATTN_SAGE", "SAGE_ATTN", "SAGE_ATTN_3", "SAGE")


def ring_client(backend: Optional[str] = None):
    """The counters of the Ring blocks dattn computed (a :class:`dattn.torch_adapter.Client`:
    ``calls``, ``fallbacks`` by reason); ``backend="SAGE"``: those of layers on dattn's SAGE."""
    key = "SAGE" if backend == "SAGE" else None
    if key not in _RING_CLIENTS:
        from .torch_adapter import Client

        _RING_CLIENTS[key] = Client("vllm_omni_ring" + ("_sage" if key else ""), backend=key)
    return _RING_CLIENTS[key]


def _serve_ring_runner() -> None:
    """The engine's Ring for a layer on dattn's backend: its SDPA ring (its exchange of K/V
    blocks and its LSE merge, ``ring_pytorch_attn_func``) with every block computed by dattn
    (out and LSE), whether dattn was the platform's default or named explicitly. The engine
    has no ring kernel for an out-of-tree backend: it would run PyTorch's SDPA per block for a
    default, and refuse float32 for an explicit choice rather than substitute PyTorch's."""
    try:
        from vllm_omni.diffusion.attention.parallel.ring import RingParallelAttention
    except Exception as e:  # pragma: no cover - an engine without Ring
        logger.debug("dattn: the engine's Ring strategy is not importable (%s)", e)
        return
    if "_dattn_engine_run" in RingParallelAttention.__dict__:
        return
    engine_run = RingParallelAttention.run_attention

    def run_attention(self, query, key, value, attn_metadata, softmax_scale=None, causal=False):
        pref = (self.attn_backend_pref or "").strip().upper()
        ours = pref in _dattn_names() or pref in _SAGE_PREFS
        if not (query.device.type == "cpu" and _on_dattn_platform() and ours):
            return engine_run(self, query, key, value, attn_metadata, softmax_scale, causal)
        saved = (self.attn_backend_pref, self.attn_backend_explicit)
        depth, backend = getattr(_RING, "depth", 0), getattr(_RING, "backend", None)
        self.attn_backend_pref, self.attn_backend_explicit = "torch_sdpa", False
        _RING.depth, _RING.backend = depth + 1, ("SAGE" if pref in _SAGE_PREFS else None)
        try:
            return engine_run(self, query, key, value, attn_metadata, softmax_scale, causal)
        finally:
            self.attn_backend_pref, self.attn_backend_explicit = saved
            _RING.depth, _RING.backend = depth, backend

    run_attention.__doc__ = (
        "The engine's Ring; for a layer on dattn's backend on dattn's platform, the engine's SDPA "
        "ring with dattn computing every block (dattn.vllm_omni_plugin._serve_ring_runner).")
    RingParallelAttention._dattn_engine_run = engine_run
    RingParallelAttention.run_attention = run_attention


def _dattn_names():
    module = sys.modules.get("dattn.vllm_omni_platform")
    return module.dattn_names() if module is not None else ()


def _serve_ring_kernel() -> None:
    try:
        from vllm_omni.diffusion.attention.backends.ring import ring_kernels
    except Exception as e:  # pragma: no cover - an engine without the SDPA ring
        logger.debug("dattn: the engine's ring kernels are not importable (%s)", e)
        return
    engine_op = ring_kernels._scaled_dot_product_efficient_attention
    if engine_op is None or getattr(engine_op, "_dattn_engine_op", None) is not None:
        return  # MUSA's build has no efficient op; or already served

    def efficient(query, key, value, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0,
                  is_causal=False, *, scale=None):
        if query.device.type == "cpu" and _on_dattn_platform():
            import torch

            if getattr(_RING, "depth", 0) > 0 and not dropout_p:  # a block of dattn's Ring
                from . import torch_adapter as ta

                causal = ta.CAUSAL_TOP_LEFT if is_causal else ta.CAUSAL_NONE
                return ta.attention(ring_client(getattr(_RING, "backend", None)), query, key,
                                    value, attn_bias, causal, scale, False, "BHSD", True)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
            return out, lse
        return engine_op(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal,
                         scale=scale)

    efficient._dattn_engine_op = engine_op
    ring_kernels._scaled_dot_product_efficient_attention = efficient


def general_plugin() -> None:
    """The engine's ``vllm_omni.general_plugins`` hook: where dattn's platform is active, the
    engine's SDPA forward on it (:func:`serve_engine_sdpa`) and the member ``DATTN`` of
    ``DiffusionAttentionBackendEnum`` (dattn's backend's class path). Safe to run several times
    (the engine's rule for general plugins); does nothing elsewhere, or when the engine (or, for
    the enum member, aenum) is not importable."""
    if platform_plugin() is None:
        return
    serve_engine_sdpa()
    try:
        from aenum import extend_enum
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    except ImportError as e:
        logger.debug("dattn: DATTN not added to the engine's backend enum (%s)", e)
        return
    if "DATTN" in DiffusionAttentionBackendEnum.__members__:
        return
    extend_enum(DiffusionAttentionBackendEnum, "DATTN", BACKEND_QUALNAME)
