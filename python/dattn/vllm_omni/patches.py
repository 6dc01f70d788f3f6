"""What dattn changes in vllm-omni's engine where the engine has no seam for it, applied by
dattn's general plugin (:func:`dattn.vllm_omni.plugin.general_plugin`, run in every engine
process) where dattn's CPU platform is active. Each change is scoped to that platform (the
engine's own code runs unchanged on any other), marked on what it replaces (so it is applied
once), and listed with the vllm-omni versions it is for in :data:`PATCHES` and
docs/vllm-omni.md:

- ``engine_sdpa`` (every version): the engine's ``SDPAImpl.forward`` dispatches to CUDA, ROCm,
  NPU, XPU and MUSA only; on dattn's platform it runs the engine's own ``_forward_impl``
  (:func:`serve_engine_sdpa`), so ``TORCH_SDPA`` and every layer's ``sdpa_fallback`` work;
- ``ring`` (every version): the engine's Ring runs its own per-block kernels, not the selected
  backend: for a layer on dattn's backend its SDPA ring runs with every block computed by
  dattn with its LSE (counted on :func:`ring_client`); PyTorch's CPU kernel for the rest (the
  engine's calls ``aten._scaled_dot_product_efficient_attention``, CUDA-only);
- ``block_sparse`` (every version with ``BLOCK_SPARSE_BACKENDS``): the engine's attention
  config takes its typed ``block_sparse`` spec (``sparsity``, ``start_step``, ``end_step``,
  ``skip_layers``) for the backends of that set only: ``VIDEO_SPARSE`` joins it, so its
  options go through the engine's own config (dattn.vllm_omni.backends maps them);
- ``output_loop`` (0.30): a multi-process engine's worker sends each result from a thread that
  asks for the accelerator (``torch.accelerator.current_accelerator().type``) and its streams;
  on a host without one that thread died at its start and the engine waited forever. dattn's
  loop (:func:`serve_output_loop`) packs each result without a side stream, sends an error for
  any result it cannot pack, and ends the worker process (which the engine's executor reports
  as a dead worker) if the loop itself fails, so no failure of it hangs the engine.

``DATTN_VLLM_OMNI_SKIP_PATCHES=name,...`` leaves those out (to see the engine without them).
``DATTN_VLLM_OMNI_CALL_LOG=FILE`` (a diagnostic, used by the tests) appends one JSON line per
call of the engine's ``Attention`` layer: its prefix, role, backend, implementation class,
parallel path and what computed it (``dattn:<backend>``, ``dattn-ring:<backend>``,
``engine:SDPA``, ``engine-ring:pytorch``), and a line for each platform attribute the engine
asked for that dattn's platform does not define (``platform_fallback``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Dict, Optional, Tuple

logger = logging.getLogger(__name__)

#: The patches and the vllm-omni versions (major, minor) they are applied to: (first, last);
#: None = no bound.
PATCHES: Dict[str, Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]]] = {
    "engine_sdpa": (None, None),
    "ring": (None, None),
    "block_sparse": (None, None),
    "output_loop": ((0, 30), (0, 30)),
}

#: The diagnostic's environment variable (a file the JSON lines are appended to).
CALL_LOG_ENV = "DATTN_VLLM_OMNI_CALL_LOG"

#: Patches to leave out (comma-separated names of PATCHES): to see the engine without them.
SKIP_ENV = "DATTN_VLLM_OMNI_SKIP_PATCHES"


def engine_version() -> Optional[Tuple[int, int]]:
    """vllm-omni's (major, minor), or None where it is not installed."""
    try:
        from importlib.metadata import version

        parts = version("vllm-omni").split(".")
        return int(parts[0]), int(parts[1])
    except Exception:
        return None


def applies(name: str, version: Optional[Tuple[int, int]] = None) -> bool:
    """Whether patch ``name`` is for this vllm-omni (``version``: its (major, minor))."""
    first, last = PATCHES[name]
    skipped = {n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()}
    unknown = skipped - set(PATCHES)
    if unknown:
        raise ValueError(f"{SKIP_ENV}: {', '.join(sorted(unknown))} is not a patch of dattn's; "
                         f"valid: {', '.join(PATCHES)}")
    if name in skipped:
        return False
    version = engine_version() if version is None else version
    if version is None:
        return first is None and last is None
    return (first is None or version >= first) and (last is None or version <= last)


def on_dattn_platform() -> bool:
    """Whether the engine's current platform is dattn's."""
    module = sys.modules.get("dattn.vllm_omni.platform")
    if module is None or "_platform_class" not in vars(module):
        return False  # never resolved: the engine's platform is another
    try:
        from vllm_omni.platforms import current_omni_platform
    except Exception:  # pragma: no cover - an engine that cannot resolve a platform
        return False
    return isinstance(current_omni_platform, module._platform_class)


def when_imported(module: str, patch) -> None:
    """Runs ``patch()`` once ``module`` is imported: now if it is, else right after the module
    has executed (a post-import hook), so that a module half-way through its import is never
    patched (the engine imports its platform, hence dattn, while it imports itself)."""
    import importlib.abc
    import importlib.machinery

    loaded = sys.modules.get(module)
    if loaded is not None:
        if getattr(getattr(loaded, "__spec__", None), "_initializing", False):
            _PENDING.append(patch)  # half-way through its import: apply() runs it later
        else:
            patch()
        return

    class _AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != module:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(m):
                execute(m)
                patch()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterImport())


#: Patches whose module was half-way through its import when they were asked for.
_PENDING: list = []


def apply_early() -> None:
    """What must be in place before the engine reads its configuration (the platform's
    constructor runs this, in every engine process): VIDEO_SPARSE in the engine's
    ``BLOCK_SPARSE_BACKENDS``."""
    if applies("block_sparse"):
        when_imported("vllm_omni.diffusion.data", serve_block_sparse_spec)


def apply() -> None:
    """Every patch of :data:`PATCHES` this vllm-omni needs, and the call log where asked for.
    Safe to run several times; a patch whose engine module is missing is skipped."""
    while _PENDING:
        _PENDING.pop()()
    serve_engine_sdpa()
    if applies("block_sparse"):
        serve_block_sparse_spec()
    if applies("output_loop"):
        serve_output_loop()
    if os.environ.get(CALL_LOG_ENV):
        record_calls()


# --- the engine's SDPA on dattn's platform ------------------------------------------------------


def serve_engine_sdpa() -> bool:
    """Make the engine's own SDPA paths run on dattn's platform, where its platform dispatch
    has no branch for an out-of-tree platform and its ring kernel calls a CUDA-only op (the
    patches ``engine_sdpa`` and ``ring``):

    - ``SDPAImpl.forward`` (``vllm_omni.diffusion.attention.backends.sdpa``): while the
      engine's current platform is dattn's, the engine's own
      ``SDPAImpl._forward_impl(..., mask_mode="broadcast_k")``, exactly what its CUDA, ROCm and
      XPU forwards run (PyTorch's scaled_dot_product_attention, with the engine's mask and GQA
      handling);
    - the engine's Ring for a layer on dattn's backend (:func:`_serve_ring_runner`) and the
      per-block kernel of its SDPA ring (:func:`_serve_ring_kernel`).

    On any other platform (or device) the engine's own code runs unchanged. Idempotent;
    returns whether the engine's SDPA module was importable."""
    try:
        from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    except Exception as e:  # absent or broken engine: nothing to serve
        logger.debug("dattn: the engine's SDPA backend is not importable (%s)", e)
        return False
    if applies("ring"):
        _serve_ring_runner()
        _serve_ring_kernel()
    if applies("engine_sdpa") and "_dattn_engine_forward" not in SDPAImpl.__dict__:
        engine_forward = SDPAImpl.forward

        def forward(self, query, key, value, attn_metadata=None):
            if on_dattn_platform():
                note_computed("engine:SDPA")
                return self._forward_impl(query, key, value, attn_metadata,
                                          mask_mode="broadcast_k")
            return engine_forward(self, query, key, value, attn_metadata)

        forward.__doc__ = (
            "The engine's platform dispatch; on dattn's CPU platform the engine's own "
            "_forward_impl (installed by dattn.vllm_omni.patches.serve_engine_sdpa)."
        )
        SDPAImpl._dattn_engine_forward = engine_forward
        SDPAImpl.forward = forward
    return True


# --- Ring: dattn computes every block of a layer on dattn's backend --------------------------------

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
        from ..torch_adapter import Client

        _RING_CLIENTS[key] = Client("vllm_omni_ring" + ("_sage" if key else ""), backend=key)
    return _RING_CLIENTS[key]


def _dattn_names():
    module = sys.modules.get("dattn.vllm_omni.platform")
    return module.dattn_names() if module is not None else ()


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
        if not (query.device.type == "cpu" and on_dattn_platform() and ours):
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
        "ring with dattn computing every block (dattn.vllm_omni.patches._serve_ring_runner).")
    RingParallelAttention._dattn_engine_run = engine_run
    RingParallelAttention.run_attention = run_attention


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
        if query.device.type == "cpu" and on_dattn_platform():
            import torch

            if getattr(_RING, "depth", 0) > 0 and not dropout_p:  # a block of dattn's Ring
                from .. import torch_adapter as ta

                backend = getattr(_RING, "backend", None)
                note_computed("dattn-ring:" + (backend or "FLASH"))
                causal = ta.CAUSAL_TOP_LEFT if is_causal else ta.CAUSAL_NONE
                return ta.attention(ring_client(backend), query, key, value, attn_bias, causal,
                                    scale, False, "BHSD", True)
            note_computed("engine-ring:pytorch")
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
            return out, lse
        return engine_op(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal,
                         scale=scale)

    efficient._dattn_engine_op = engine_op
    ring_kernels._scaled_dot_product_efficient_attention = efficient


# --- VIDEO_SPARSE's options in the engine's attention config ------------------------------------


def serve_block_sparse_spec() -> bool:
    """``VIDEO_SPARSE`` among the engine's ``BLOCK_SPARSE_BACKENDS`` (the backends whose
    ``AttentionSpec`` takes ``block_sparse``). Returns whether it is there now."""
    try:
        from vllm_omni.diffusion import data
    except Exception as e:
        logger.debug("dattn: the engine's diffusion config is not importable (%s)", e)
        return False
    names = getattr(data, "BLOCK_SPARSE_BACKENDS", None)
    if names is None:
        return False
    if "VIDEO_SPARSE" not in names:
        data.BLOCK_SPARSE_BACKENDS = frozenset(names) | {"VIDEO_SPARSE"}
    return True


# --- the multi-process worker's output loop ------------------------------------------------------


def serve_output_loop() -> bool:
    """A multi-process engine's worker (``WorkerProc``) on a host without an accelerator: its
    result thread (``_async_output_loop``) without the accelerator's side stream. Each result is
    packed into shared memory on the thread (``pack_diffusion_output_shm`` without a stream:
    the synchronous copy) and sent as ``OUTPUT_READY``; one that cannot be packed is sent as an
    error, as the engine's loop does; if the loop itself fails, the worker process ends (the
    engine's executor then reports the dead worker) rather than leaving the engine waiting.
    Returns whether the loop is dattn's now."""
    try:
        import torch
        from vllm_omni.diffusion.worker import diffusion_worker as dw
    except Exception as e:
        logger.debug("dattn: the engine's diffusion worker is not importable (%s)", e)
        return False
    proc = getattr(dw, "WorkerProc", None)
    if proc is None or not hasattr(proc, "_async_output_loop"):
        return False
    if "_dattn_engine_output_loop" in proc.__dict__:
        return True
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.current_accelerator() is not None:
        return False  # the engine's loop has its device

    engine_loop = proc._async_output_loop

    def _async_output_loop(self):
        try:
            while True:
                item = self._async_output_queue.get()
                if item is None:
                    break
                output, async_output_id, _event = item
                try:
                    dw.pack_diffusion_output_shm(output, d2h_stream=None)
                    reply = dw.AsyncDiffusionOutput(kind=dw.AsyncOutputKind.OUTPUT_READY,
                                                    async_output_id=async_output_id,
                                                    output=output)
                except Exception:
                    logger.exception("dattn: packing output %r failed; sending an error",
                                     async_output_id)
                    reply = dw.AsyncDiffusionOutput(kind=dw.AsyncOutputKind.OUTPUT_READY,
                                                    async_output_id=async_output_id,
                                                    error="output packing failed on the CPU")
                try:
                    self._enqueue_result(reply)
                finally:
                    with self._async_output_done:
                        self._async_output_pending = max(0, self._async_output_pending - 1)
                        self._async_output_done.notify_all()
        except BaseException:
            logger.exception("dattn: the worker's output loop failed; ending the worker so that "
                             "the engine reports it")
            os._exit(70)

    _async_output_loop.__doc__ = serve_output_loop.__doc__
    proc._dattn_engine_output_loop = engine_loop
    proc._async_output_loop = _async_output_loop
    return True


# --- the call log -------------------------------------------------------------------------------

_CALL = threading.local()


def note_computed(by: str) -> None:
    """Records what computed the engine ``Attention`` layer call in progress (call log only)."""
    stack = getattr(_CALL, "stack", None)
    if stack:
        stack[-1].add(by)


_FALLBACKS: set = set()


def note_platform_fallback(name: str) -> None:
    """Records (call log only, once per name and process) a platform attribute the engine
    asked for that dattn's platform does not define."""
    path = os.environ.get(CALL_LOG_ENV)
    if not path or name in _FALLBACKS:
        return
    _FALLBACKS.add(name)
    with open(path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "platform_fallback": name}) + "\n")


def record_calls() -> bool:
    """The diagnostic ``DATTN_VLLM_OMNI_CALL_LOG``: every call of the engine's ``Attention``
    layer (``_forward_impl``) appended to that file as one JSON line."""
    try:
        from vllm_omni.diffusion.attention.layer import Attention
    except Exception as e:
        logger.debug("dattn: the engine's Attention layer is not importable (%s)", e)
        return False
    if "_dattn_engine_forward_impl" in Attention.__dict__:
        return True
    engine_forward_impl = Attention._forward_impl
    path = os.environ[CALL_LOG_ENV]

    def _forward_impl(self, query, key, value, attn_metadata=None):
        stack = getattr(_CALL, "stack", None)
        if stack is None:
            stack = _CALL.stack = []
        stack.append(set())
        try:
            return engine_forward_impl(self, query, key, value, attn_metadata)
        finally:
            computed = stack.pop()
            backend = getattr(self, "attn_backend", None)
            step = None
            try:
                from vllm_omni.diffusion.forward_context import (get_forward_context,
                                                                 is_forward_context_available)

                if is_forward_context_available():
                    step = get_forward_context().denoise_step_idx
            except Exception:  # an engine without the step: None
                pass
            record = {
                "pid": os.getpid(),
                "prefix": getattr(self, "prefix", ""),
                "role": getattr(self, "role", None),
                "backend": backend.get_name() if backend is not None else None,
                "impl": type(getattr(self, "attention", None)).__name__,
                "ring": getattr(self, "ring_runner", None) is not None,
                "computed_by": sorted(computed),
                "shape": list(query.shape),
                "step": step,
            }
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    Attention._dattn_engine_forward_impl = engine_forward_impl
    Attention._forward_impl = _forward_impl
    return True
