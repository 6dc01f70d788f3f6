"""The model handle of :mod:`dattn.diffusers`: dattn as the attention of one diffusers model.

    import dattn.diffusers
    handle = dattn.diffusers.enable(transformer)        # this model's attention runs on dattn
    image = pipe(prompt).images[0]
    print(handle.calls, dict(handle.fallbacks))        # served calls; calls handed to PyTorch
    handle.disable()                                    # or dattn.diffusers.disable(transformer)

    with dattn.diffusers.enable(transformer):           # the same, undone on leaving the block
        ...

How it routes (docs/python.md, "diffusers", has the table per model and the reasons):

- Each attention module of the model (a module with a ``processor`` attribute: diffusers'
  ``Attention`` and every ``AttentionModuleMixin`` class such as ``FluxAttention`` and
  ``WanAttention``) gets a thin ``forward`` of its own (an instance attribute over the class's
  method) that marks the calls it makes as this model's (a per-thread stack, so other models,
  threads and the text encoders are not concerned) and then calls the module's own
  ``forward``. The processors are not replaced: the same objects stay in place.
- The attention function the processor calls is served by dattn while that mark is set:
  ``dispatch_attention_fn`` as bound in the processor's module (Flux, Wan, Qwen-Image,
  HunyuanVideo's main blocks; whatever diffusers backend is active), and
  ``torch.nn.functional.scaled_dot_product_attention`` (SD3's ``JointAttnProcessor2_0``,
  HunyuanVideo's token refiner on ``AttnProcessor2_0``), through the hooks of
  :mod:`dattn.torch_adapter` (shared with ``dattn.patch_torch_sdpa``, reference-counted).
  Outside a marked call both names behave exactly as before; the originals are put back when
  the last user is gone.
- A call dattn does not serve goes to the original function and is counted in
  ``handle.fallbacks`` under its reason (the torch adapter's reasons, docs/python.md):
  ``"device"``, ``"dtype"``, ``"grad"``, ``"dropout"``, ``"attention_kwargs"``
  (backend-specific keywords such as ``return_lse``), ``"gqa"``, ``"shape"``,
  ``"mask_and_causal"``, ``"torch_function"``,
  ``"functorch"``, ``"jit_trace"``, ``"non_finite"``, ``"unsupported:<field>"``, ...

A call with a diffusers ``parallel_config`` (under :func:`enable_parallelism`) runs diffusers'
ring / Ulysses machinery with dattn's forward op, as the named backend does.

diffusers' own backend by name: importing this module registers ``"dattn"`` and
``"dattn_sage"`` (:func:`register`, :func:`unregister`), so ``model.set_attention_backend("dattn")``
and ``with attention_backend("dattn"):`` work; :func:`enable_parallelism` is diffusers'
context parallelism on a CPU (gloo). Both live in :mod:`dattn.diffusers_backend`.

The handle holds its model weakly (a dropped model is freed, and its hooks released); a
``copy.deepcopy`` or a pickle (``torch.save``) of an enabled model is a plain model (its
attention runs diffusers' own way until it is enabled itself); enabling a model that contains,
or is inside, an enabled one is refused.
"""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

from ..errors import InvalidArgument, Unsupported, _with_field

try:
    import torch
except ImportError:  # pragma: no cover - diffusers needs torch
    torch = None

__all__ = ["DiffusersHandle", "enable", "disable", "handle_of", "register", "unregister",
           "registered", "backend_client", "enable_parallelism"]

_LOCK = threading.RLock()


def _serve_dispatch(hook, *args, **kwargs):
    from .. import torch_adapter as ta

    handle = ta.marked_handle()
    if handle is None or not handle.active:
        return hook.original(*args, **kwargs)
    signature = _SIGNATURES.get(id(hook))
    if signature is None:
        signature = _SIGNATURES[id(hook)] = inspect.signature(hook.original)
    if handle.video is not None and handle.video.in_grid_module():
        return _serve_grid_dispatch(handle, hook.original, signature, args, kwargs)
    return serve_dispatch(handle.client, hook.original, signature, args, kwargs)


def serve_dispatch(client, original, signature, args, kwargs):
    """diffusers' ``dispatch_attention_fn(*args, **kwargs)`` (BSHD tensors, diffusers' native
    mask rule: a 2-D ``[B, Skv]`` mask is a key mask) for ``client``; what dattn does not serve
    goes to ``original`` (whatever backend diffusers would use)."""
    from .. import torch_adapter as ta

    compiling = torch.compiler.is_compiling()
    try:
        a = signature.bind(*args, **kwargs).arguments
    except TypeError:
        ta._count(client, "arguments", compiling)
        return original(*args, **kwargs)
    parallel = a.get("parallel_config")
    if a.get("attention_kwargs"):
        reason = "attention_kwargs"
    else:
        reason = None
    q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask")
    if reason is None and (not all(isinstance(t, torch.Tensor) for t in (q, k, v))
                           or not (mask is None or isinstance(mask, torch.Tensor))):
        reason = "arguments"
    if reason is None and not compiling and ta.torch_function_active(
            tuple(t for t in (q, k, v, mask) if t is not None)):
        reason = "torch_function"
    if reason is None and not compiling:
        route = ta.dispatch_route([t for t in (q, k, v, mask) if t is not None], trace_as_op=False)
        reason = route if route not in (None, "graph") else None
        graph = route == "graph"
    else:
        graph = compiling
    if reason is None:
        if (mask is not None and mask.dim() == 2 and q.dim() == 4
                and mask.shape[0] == q.shape[0] and mask.shape[1] == k.shape[1]):
            mask = mask[:, None, None, :]  # diffusers' native rule: [B, Skv] keys
        bound = {"query": q, "key": k, "value": v, "attn_mask": mask,
                 "dropout_p": a.get("dropout_p", 0.0), "is_causal": a.get("is_causal", False),
                 "scale": a.get("scale"), "enable_gqa": a.get("enable_gqa", False)}
        reason = ta._eager_reason(bound, "BSHD", not compiling)
    if reason is None and parallel is not None:
        # diffusers' context parallelism: its ring / Ulysses machinery with dattn's forward op
        # (the named backend's, dattn.diffusers_backend), merging the ranks' (out, lse) itself.
        from .backend import context_parallel_attention

        return context_parallel_attention(
            client, q, k, v, a.get("attn_mask"), bound["dropout_p"], bound["is_causal"],
            bound["scale"], bound["enable_gqa"], False, parallel)
    if reason is not None:
        ta._count(client, reason, compiling)
        return original(*args, **kwargs)
    causal = ta.CAUSAL_TOP_LEFT if bound["is_causal"] else ta.CAUSAL_NONE
    return ta._compute(client, bound, "BSHD", causal, graph)




def _serve_grid_dispatch(handle, original, signature, args, kwargs):
    """A ``dispatch_attention_fn`` call of an attention module over the video grid."""
    try:
        a = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return original(*args, **kwargs)  # diffusers' own TypeError
    for name in ("attention_kwargs", "parallel_config"):
        if a.get(name):
            raise _with_field(
                Unsupported,
                f"{name}: VIDEO_SPARSE does not serve a grid call with {name} (dattn.diffusers "
                f"does not hand grid calls to another backend)", name)
    return handle.video.serve(
        a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask"),
        scale=a.get("scale"), is_causal=a.get("is_causal", False),
        dropout_p=a.get("dropout_p", 0.0), enable_gqa=a.get("enable_gqa", False), bhsd=False,
        dense=lambda: serve_dispatch(handle.client, original, signature, args, kwargs))


def _serve_grid_sdpa(handle, public, original, args, kwargs):
    """An ``F.scaled_dot_product_attention`` call (BHSD) of a module over the video grid."""
    from .. import torch_adapter as ta

    bound = ta.bind_sdpa(args, kwargs)
    if bound is None:
        return original(*args, **kwargs)  # PyTorch's own TypeError
    return handle.video.serve(
        bound["query"], bound["key"], bound["value"], bound.get("attn_mask"),
        scale=bound.get("scale"), is_causal=bound.get("is_causal", False),
        dropout_p=bound.get("dropout_p", 0.0), enable_gqa=bound.get("enable_gqa", False),
        bhsd=True, dense=lambda: ta.serve_sdpa(handle.client, public, original, args, kwargs))


_SIGNATURES: Dict[int, inspect.Signature] = {}


# --- the per-module forward ----------------------------------------------------------------------


class _PlainForward:
    """What a copied or unpickled module gets in place of dattn's forward: its class's own."""

    def __init__(self, module):
        self._module = weakref.ref(module)

    def __call__(self, *args, **kwargs):
        module = self._module()
        return type(module).forward(module, *args, **kwargs)

    def __reduce__(self):
        return (_PlainForward, (self._module(),))

    def __deepcopy__(self, memo):
        import copy

        return _PlainForward(copy.deepcopy(self._module(), memo))


class _MarkedForward:
    """An attention module's forward while a handle serves it: marks the calls it makes as the
    handle's, then calls what the module's forward was (its class's method, or ``previous``,
    an instance forward someone set before). It holds the module weakly, so a handle never
    keeps its model alive. A copy (deepcopy, pickle) is plain."""

    def __init__(self, handle, module, previous, grid: bool = False):
        self._handle = handle
        self._grid = grid  # an attention module over the video grid (VIDEO_SPARSE handles)
        self._module = weakref.ref(module)
        self._previous = previous
        self._forward = type(module).forward  # the class's function (no reference to module)
        self.__name__ = "forward"
        self.__doc__ = self._forward.__doc__

    def _inner(self, args, kwargs):
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return self._forward(self._module(), *args, **kwargs)

    def __call__(self, *args, **kwargs):
        from .. import torch_adapter as ta

        handle = self._handle
        if not handle.active:
            return self._inner(args, kwargs)
        video = handle.video
        ta.push_mark(handle)
        if video is not None:
            video.enter_module(self._grid)
        try:
            return self._inner(args, kwargs)
        finally:
            if video is not None:
                video.leave_module()
            ta.pop_mark()

    def __reduce__(self):
        return (_PlainForward, (self._module(),))

    def __deepcopy__(self, memo):
        import copy

        return _PlainForward(copy.deepcopy(self._module(), memo))


# --- the handle ------------------------------------------------------------------------------


def _attention_modules(model) -> List[Tuple[str, Any]]:
    """The model's attention modules: submodules with a diffusers ``processor``."""
    found = []
    for name, module in model.named_modules():
        proc = getattr(module, "processor", None)
        if proc is not None and callable(proc):
            found.append((name, module))
    return found


def _uses(processor, name: str) -> bool:
    """Whether the processor's ``__call__`` names ``name`` (a global or attribute it reads)."""
    call = getattr(type(processor), "__call__", None)
    code = getattr(call, "__code__", None)
    return code is not None and name in code.co_names


class DiffusersHandle:
    """dattn serving one model's attention. ``calls``: attention computations dattn served;
    ``fallbacks``: a Counter of calls handed to PyTorch (or the diffusers backend), by reason;
    ``modules``: the attention modules routed, by name; ``routes``: per module, which function
    is served ("dispatch_attention_fn" and/or "scaled_dot_product_attention");
    ``model``: the model (None once it has been freed); ``disable()`` undoes everything (also
    on leaving a ``with`` block)."""

    def __init__(self, model, backend: Optional[str], backend_kwargs: Optional[dict]):
        from .. import torch_adapter as ta

        from ..backends import adapter_backend

        self._model = weakref.ref(model)
        self._model_name = type(model).__name__
        #: The VIDEO_SPARSE side (geometry, step policy, selections), or None.
        self.video = None
        if adapter_backend(backend)[0] == "VIDEO_SPARSE":
            from .video import VideoSparsity

            self.video = VideoSparsity(model, backend_kwargs)
            self.client = self.video.flash  # FLASH for every call that is not over the grid
        else:
            self.client = ta.Client("dattn.diffusers", backend, backend_kwargs)
        self._pre_hook = None
        self.active = False
        self.modules: List[str] = []
        self.routes: Dict[str, Tuple[str, ...]] = {}
        self._hooks: List[Any] = []
        self._forwards: List[Tuple[Any, Any, Any]] = []  # (module ref, previous forward, ours)

    @property
    def model(self):
        return self._model()

    @property
    def calls(self) -> int:
        return self.client.calls

    @property
    def fallbacks(self):
        return self.client.fallbacks

    @property
    def backend_name(self) -> str:
        """The dattn backend the handle's layers are built with (e.g. "FLASH"; "VIDEO_SPARSE"
        for the grid calls of a video model, whose other calls run on FLASH)."""
        return "VIDEO_SPARSE" if self.video is not None else self.client.backend

    # -- VIDEO_SPARSE (docs/video.md) --

    def _video_or_raise(self, what: str):
        if self.video is None:
            raise _with_field(
                InvalidArgument,
                f"backend: {what} reports VIDEO_SPARSE's steps; this handle runs "
                f"{self.client.backend}", "backend")
        return self.video

    def stats(self) -> List[dict]:
        """Per denoising step (the last 512 kept), oldest first: ``{"generation", "step",
        "timestep", "calls": [...]}``, each grid call ``{"layer", "branch", "layout", "rows",
        "heads", "mode": "dense" | "sparse", "block_sparsity", "selection_seconds", "reused",
        "selection_step" (sparse: the step whose selection ran), "seconds"}``."""
        return self._video_or_raise("stats()").stats()

    def reset(self) -> None:
        """Starts a new generation: the next forward is step 0, no selection is reused."""
        self._video_or_raise("reset()").reset()

    def selection_memory(self) -> int:
        """Bytes the kept block selections take now (bounded by ``max_selection_mb``)."""
        return self._video_or_raise("selection_memory()").selection_memory()

    def selection(self, layer: int, branch: int = 0):
        """The kept block map of grid call ``layer`` of CFG ``branch`` (bool ``[B|1, H|1, query
        blocks, key blocks]``), or None (nothing kept: ``refresh_steps`` 1, or not yet)."""
        return self._video_or_raise("selection()").selection(layer, branch)

    def serve_sdpa(self, public, original, args, kwargs):
        """An ``F.scaled_dot_product_attention`` call made inside this model's attention."""
        from .. import torch_adapter as ta

        if self.video is not None and self.video.in_grid_module():
            return _serve_grid_sdpa(self, public, original, args, kwargs)
        return ta.serve_sdpa(self.client, public, original, args, kwargs)

    @property
    def engines(self) -> List[str]:
        """The compute engines the served calls ran on (e.g. ["amx"]; under VIDEO_SPARSE
        those of the sparse grid calls too)."""
        engines = set(self.client.engines())
        if self.video is not None:
            engines |= {layer.last_engine for layer in self.video._layers.values()}
        return sorted(engines - {""})

    def _enable(self, model):
        from .. import torch_adapter as ta

        modules = _attention_modules(model)
        if not modules:
            raise _with_field(
                InvalidArgument,
                f"model: {type(model).__name__} has no diffusers attention modules (no "
                f"submodule with a `processor`); dattn.diffusers.enable takes a diffusers model "
                f"such as FluxTransformer2DModel",
                "model",
            )
        for name, module in modules:
            other = getattr(module.__dict__.get("forward"), "_handle", None)
            if isinstance(other, DiffusersHandle) and other.active:
                raise _with_field(
                    InvalidArgument,
                    f"model: its attention module {name or type(module).__name__!r} already "
                    f"runs on dattn through the handle of {other._model_name}; enabling models "
                    f"that contain one another does not nest: disable that handle first",
                    "model",
                )
        # Validate the backend choice once, before anything is changed.
        ta._layer(self.client, "BSHD", 1, 1, 64, False, None)
        with _LOCK:
            try:
                for name, module in modules:
                    proc = module.processor
                    routes = []
                    proc_module = sys.modules.get(type(proc).__module__)
                    if (
                        _uses(proc, "dispatch_attention_fn")
                        and proc_module is not None
                        and callable(getattr(proc_module, "dispatch_attention_fn", None))
                    ):
                        self._hooks.append(ta.Hook.acquire(
                            proc_module, "dispatch_attention_fn", _serve_dispatch, self))
                        routes.append("dispatch_attention_fn")
                    if _uses(proc, "scaled_dot_product_attention"):
                        self._hooks.append(ta.acquire_sdpa(self))
                        routes.append("scaled_dot_product_attention")
                    self.routes[name] = tuple(routes)
                    if routes:
                        grid = self.video is not None and self.video.geometry.grid_module(name)
                        self._wrap_forward(module, grid)
                        self.modules.append(name)
                if not self.modules:
                    kinds = sorted({type(m.processor).__name__ for _, m in modules})
                    raise _with_field(
                        Unsupported,
                        f"model: none of the {len(modules)} attention modules of "
                        f"{type(model).__name__} has a processor that calls "
                        f"dispatch_attention_fn or F.scaled_dot_product_attention "
                        f"(processors: {', '.join(kinds)}); dattn cannot serve this model",
                        "model",
                    )
                if self.video is not None:
                    grid_modules = [n for n in self.modules if self.video.geometry.grid_module(n)]
                    if not grid_modules:
                        raise _with_field(
                            InvalidArgument,
                            f"model: {type(model).__name__} has no attention module over the "
                            f"video grid that dattn can serve; VIDEO_SPARSE has nothing to do",
                            "model")
                    self._pre_hook = model.register_forward_pre_hook(
                        _GridHook(self.video), with_kwargs=True)
                _Handles.by_model[model] = self
                # A model dropped while enabled: its hooks are released with it.
                self._finalizer = weakref.finalize(model, _released, weakref.ref(self))
                self.active = True
            except BaseException:
                self._undo()
                raise
        return self

    def _wrap_forward(self, module, grid: bool = False):
        previous = module.__dict__.get("forward", _MISSING)
        ours = _MarkedForward(self, module, None if previous is _MISSING else previous, grid)
        module.__dict__["forward"] = ours
        self._forwards.append((weakref.ref(module), previous, weakref.ref(ours)))

    def _undo(self):
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        for module_ref, previous, ours_ref in reversed(self._forwards):
            module, ours = module_ref(), ours_ref()
            if module is not None and ours is not None and module.__dict__.get("forward") is ours:
                if previous is _MISSING:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = previous
            # else something wrapped over ours since: ours stays inside it, inert (inactive).
        self._forwards.clear()
        for hook in reversed(self._hooks):
            hook.release(self)
        self._hooks.clear()

    def disable(self) -> None:
        """Puts the model back as it was (no forward of dattn's left on its modules; the
        process's functions restored when no other user needs them). Harmless twice."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            self._undo()
            model = self.model
            if model is not None and _Handles.by_model.get(model) is self:
                del _Handles.by_model[model]
            finalizer = getattr(self, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()

    def __enter__(self) -> "DiffusersHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def __reduce__(self):
        raise TypeError("a dattn.diffusers handle cannot be pickled; pickle the model and "
                        "enable the copy with dattn.diffusers.enable")

    def __repr__(self) -> str:
        return (
            f"DiffusersHandle({self._model_name}, active={self.active}, "
            f"modules={len(self.modules)}, calls={self.calls}, fallbacks={dict(self.fallbacks)})"
        )


_MISSING = object()


class _GridHook:
    """The model's forward pre-hook under a VIDEO_SPARSE handle (its grid and step). Holds the
    handle's state weakly; a copy (deepcopy, pickle) of the model gets an inert one."""

    def __init__(self, video):
        self._video = weakref.ref(video)

    def __call__(self, module, args, kwargs):
        video = self._video()
        if video is not None:
            video.before_forward(module, args, kwargs)
        return None

    def __reduce__(self):
        return (_InertHook, ())

    def __deepcopy__(self, memo):
        return _InertHook()


class _InertHook:
    """What a copied or unpickled model keeps of a VIDEO_SPARSE handle's pre-hook: nothing."""

    def __call__(self, module, args, kwargs):
        return None


def _released(handle_ref) -> None:
    """The model of a still-enabled handle was freed: give up its hooks."""
    handle = handle_ref()
    if handle is None:
        return
    with _LOCK:
        handle.active = False
        handle._forwards.clear()
        for hook in reversed(handle._hooks):
            hook.release(handle)
        handle._hooks.clear()


class _Handles:
    by_model: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def enable(model, backend: Optional[str] = None, backend_kwargs: Optional[dict] = None) -> DiffusersHandle:
    """Runs the attention of ``model`` (one diffusers model, e.g. a pipeline's
    ``transformer``) on dattn and returns its :class:`DiffusersHandle`.

    ``backend``: the dattn backend (e.g. "REFERENCE" or "SAGE"; default: dattn's
    ``DIFFUSION_ATTENTION_BACKEND`` when it names a dattn backend, else the automatic choice,
    FLASH); ``backend_kwargs``: that backend's options (e.g. ``{"isa": "avx2"}``). Only this
    model changes. Enabling a model twice, or a model inside (or around) an enabled one, is an
    error (:class:`dattn.InvalidArgument` naming ``model``); disable it first."""
    if torch is None:  # pragma: no cover
        raise _with_field(Unsupported, "dattn.diffusers needs torch", "torch")
    if not isinstance(model, torch.nn.Module):
        raise _with_field(
            InvalidArgument,
            f"model: expected a diffusers model (a torch.nn.Module), got {type(model).__name__}; "
            f"for a pipeline pass pipe.transformer",
            "model",
        )
    with _LOCK:
        if model in _Handles.by_model:
            raise _with_field(
                InvalidArgument,
                f"model: {type(model).__name__} already runs on dattn; disable its handle first",
                "model",
            )
        return DiffusersHandle(model, backend, backend_kwargs)._enable(model)


# --- diffusers' own backend by name, and context parallelism (dattn.diffusers_backend) -----------


def register() -> list:
    """Adds the attention backend names "dattn" (dattn's automatic choice, FLASH) and
    "dattn_sage" (SAGE) to diffusers, so that ``model.set_attention_backend("dattn")`` and
    ``with attention_backend("dattn"):`` work; idempotent (importing dattn.diffusers calls it
    where diffusers is installed). Returns the names."""
    from . import backend as diffusers_backend

    return diffusers_backend.register()


def unregister() -> None:
    """Removes dattn's names from diffusers (nothing if absent); diffusers' own backends are
    untouched. Reset models set to a dattn name first (``model.reset_attention_backend()``)."""
    from . import backend as diffusers_backend

    diffusers_backend.unregister()


def registered() -> bool:
    """Whether dattn's names are registered with diffusers now."""
    from . import backend as diffusers_backend

    return diffusers_backend.registered()


def backend_client(name: str = "dattn"):
    """The counters of a named backend: ``.calls``, ``.fallbacks`` (by reason), ``.engines()``."""
    from . import backend as diffusers_backend

    return diffusers_backend.backend_client(name)


def enable_parallelism(model, config, cp_plan=None):
    """diffusers' context parallelism for a CPU model: ``config`` is diffusers'
    ``ContextParallelConfig`` (ring_degree / ulysses_degree); the caller initialises
    torch.distributed (gloo). Builds the device mesh on the CPU, where diffusers 0.42.1's
    ``model.enable_parallelism`` needs an accelerator, then runs diffusers' own machinery.
    Set the backend first (``model.set_attention_backend("dattn")``, or
    ``dattn.diffusers.enable(model)``). Typed errors (:class:`dattn.InvalidArgument`) name a
    degree that does not match the world size or divide the heads, and differing input dtypes
    between ranks (checked at each forward on every rank). docs/python.md has the steps."""
    from . import backend as diffusers_backend

    return diffusers_backend.enable_parallelism(model, config, cp_plan)


def handle_of(model) -> Optional[DiffusersHandle]:
    """The active handle of ``model``, or None."""
    return _Handles.by_model.get(model)


def disable(model) -> None:
    """Undoes :func:`enable` for ``model`` (nothing if it is not enabled)."""
    handle = handle_of(model)
    if handle is not None:
        handle.disable()


def _register_at_import() -> None:
    try:
        import diffusers.models.attention_dispatch  # noqa: F401
    except Exception:  # diffusers absent (or broken): enable() still reports its own errors
        return
    register()

