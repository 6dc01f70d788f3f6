"""dattn as the attention of one Hugging Face diffusers model.

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

import functools
import inspect
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

from .errors import InvalidArgument, Unsupported, _with_field

try:
    import torch
except ImportError:  # pragma: no cover - diffusers needs torch
    torch = None

__all__ = ["DiffusersHandle", "enable", "disable", "handle_of", "register", "unregister",
           "registered", "backend_client", "enable_parallelism"]

_LOCK = threading.RLock()


def _serve_dispatch(hook, *args, **kwargs):
    from . import torch_adapter as ta

    handle = ta.marked_handle()
    if handle is None or not handle.active:
        return hook.original(*args, **kwargs)
    signature = _SIGNATURES.get(id(hook))
    if signature is None:
        signature = _SIGNATURES[id(hook)] = inspect.signature(hook.original)
    return ta.serve_dispatch(handle.client, hook.original, signature, args, kwargs)


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

    def __init__(self, handle, module, previous):
        self._handle = handle
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
        from . import torch_adapter as ta

        handle = self._handle
        if not handle.active:
            return self._inner(args, kwargs)
        ta.push_mark(handle)
        try:
            return self._inner(args, kwargs)
        finally:
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
        from . import torch_adapter as ta

        self._model = weakref.ref(model)
        self._model_name = type(model).__name__
        self.client = ta.Client("dattn.diffusers", backend, backend_kwargs)
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
        """The dattn backend the handle's layers are built with (e.g. "FLASH")."""
        return self.client.backend

    @property
    def engines(self) -> List[str]:
        """The compute engines the served calls ran on (e.g. ["amx"])."""
        return self.client.engines()

    def _enable(self, model):
        from . import torch_adapter as ta

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
                        self._wrap_forward(module)
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
                _Handles.by_model[model] = self
                # A model dropped while enabled: its hooks are released with it.
                self._finalizer = weakref.finalize(model, _released, weakref.ref(self))
                self.active = True
            except BaseException:
                self._undo()
                raise
        return self

    def _wrap_forward(self, module):
        previous = module.__dict__.get("forward", _MISSING)
        ours = _MarkedForward(self, module, None if previous is _MISSING else previous)
        module.__dict__["forward"] = ours
        self._forwards.append((weakref.ref(module), previous, weakref.ref(ours)))

    def _undo(self):
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
    from . import diffusers_backend

    return diffusers_backend.register()


def unregister() -> None:
    """Removes dattn's names from diffusers (nothing if absent); diffusers' own backends are
    untouched. Reset models set to a dattn name first (``model.reset_attention_backend()``)."""
    from . import diffusers_backend

    diffusers_backend.unregister()


def registered() -> bool:
    """Whether dattn's names are registered with diffusers now."""
    from . import diffusers_backend

    return diffusers_backend.registered()


def backend_client(name: str = "dattn"):
    """The counters of a named backend: ``.calls``, ``.fallbacks`` (by reason), ``.engines()``."""
    from . import diffusers_backend

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
    from . import diffusers_backend

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


if torch is not None:
    _register_at_import()
