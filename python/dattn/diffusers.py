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
  method) that marks the calls it makes as this model's (a ``contextvars`` variable, so other
  models, threads and the text encoders are not concerned) and then calls the module's own
  ``forward``. The processors are not replaced: the same objects stay in place.
- The attention function the processor calls is served by dattn while that mark is set:
  ``dispatch_attention_fn`` as bound in the processor's module (Flux, Wan, Qwen-Image,
  HunyuanVideo's main blocks; whatever diffusers backend is active), and
  ``torch.nn.functional.scaled_dot_product_attention`` (SD3's ``JointAttnProcessor2_0``,
  HunyuanVideo's token refiner on ``AttnProcessor2_0``). Outside a marked call both names
  behave exactly as before (the wrappers call the originals); the originals are put back when
  the last handle is disabled.
- A call dattn does not serve goes to the original function and is counted in
  ``handle.fallbacks`` under its reason: ``"device"`` (not CPU), ``"dtype"`` (float64,
  mixed dtypes, a float mask of another dtype), ``"grad"`` (inputs requiring grad with grad
  mode on), ``"dropout"``, ``"context_parallel"`` (a diffusers ``parallel_config``),
  ``"attention_kwargs"`` (backend-specific keywords such as ``return_lse``), ``"gqa"``
  (fewer K/V heads without ``enable_gqa``, which PyTorch refuses), ``"shape"`` (ranks or
  shapes dattn's mapping does not take; PyTorch computes or refuses them), ``"mask_and_causal"``
  (PyTorch's own error) and ``"unsupported:<field>"`` (dattn raised :class:`dattn.Unsupported`
  or :class:`dattn.NotAvailable` for that field).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import threading
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from .attention import Attention
from .backends import adapter_backend
from .errors import InvalidArgument, NotAvailable, Unsupported, _with_field
from .metadata import AttentionMetadata

try:
    import torch
except ImportError:  # pragma: no cover - diffusers needs torch
    torch = None

__all__ = ["DiffusersHandle", "enable", "disable", "handle_of"]

#: The handle whose attention module is running in this context (None outside one).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("dattn_diffusers_active", default=None)

_LOCK = threading.RLock()

#: Marks an attribute dattn set, with the value it replaced.
_MISSING = object()

_SERVED_DTYPES = ("float32", "bfloat16", "float16")


class _Fallback(Exception):
    """Internal: the call goes to the original function, counted under ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --- the computation ---------------------------------------------------------------------


def _check_tensors(q, k, v, mask, dropout_p):
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor):
            raise _Fallback("shape")
    tensors = [q, k, v] + ([mask] if isinstance(mask, torch.Tensor) else [])
    if any(t.device.type != "cpu" for t in tensors):
        raise _Fallback("device")
    dt = q.dtype
    if str(dt).replace("torch.", "") not in _SERVED_DTYPES or k.dtype != dt or v.dtype != dt:
        raise _Fallback("dtype")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise _Fallback("shape")
        if mask.dtype != torch.bool and mask.dtype != dt:
            raise _Fallback("dtype")  # PyTorch refuses a float mask of another dtype
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise _Fallback("grad")
    if dropout_p:
        raise _Fallback("dropout")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise _Fallback("shape")


def _mask_4d(mask, batch: int, heads: int, sq: int, skv: int):
    """PyTorch's attn_mask (broadcasting to [B, H, Sq, Skv]) as dattn's 4-D mask view
    [B|1, H|1, Sq, Skv] (stride-0 expands, never a copy)."""
    if mask.dim() > 4:
        raise _Fallback("shape")
    m = mask[(None,) * (4 - mask.dim())]
    full = (batch, heads, sq, skv)
    if any(have not in (1, want) for have, want in zip(m.shape, full)):
        raise _Fallback("shape")  # PyTorch raises its own error for it
    return m.expand(m.shape[0], m.shape[1], sq, skv)


def _compute(handle, layout: str, q, k, v, mask, is_causal: bool, scale, enable_gqa: bool):
    """dattn's answer for PyTorch-semantics attention on 4-D views in ``layout`` ("BSHD": the
    dispatcher's [B, S, H, D]; "BHSD": SDPA's [B, H, S, D])."""
    if layout == "BSHD":
        (b, sq, h, d), (bk, skv, hkv, _) = q.shape, k.shape
        hv, dv, bv, sv = v.shape[2], v.shape[3], v.shape[0], v.shape[1]
    else:
        (b, h, sq, d), (bk, hkv, skv, _) = q.shape, k.shape
        hv, dv, bv, sv = v.shape[1], v.shape[3], v.shape[0], v.shape[2]
    if bk != b or bv != b or hv != hkv or sv != skv or k.shape[-1] != d:
        raise _Fallback("shape")
    if hkv != h:
        if not enable_gqa:
            raise _Fallback("gqa")  # PyTorch refuses it: its error is the answer
        if hkv == 0 or h % hkv:
            raise _Fallback("shape")
    if mask is not None and is_causal:
        raise _Fallback("mask_and_causal")
    meta = None
    if is_causal:
        # PyTorch's causal is top-left (key j visible to query i iff j <= i): both starts 0.
        meta = AttentionMetadata(q_global_start=0, k_global_start=0)
    elif mask is not None:
        meta = AttentionMetadata(attn_mask=_mask_4d(mask, b, h, sq, skv))
    layer = handle._layer(layout, h, hkv, d, bool(is_causal), None if scale is None else float(scale))
    try:
        return layer.forward(q, k, v, meta)
    except (Unsupported, NotAvailable) as e:
        raise _Fallback(f"unsupported:{getattr(e, 'field', '') or 'call'}") from e


# --- the routed functions ----------------------------------------------------------------


def _serve_or_fallback(handle, serve, fallback):
    """Runs ``serve()``; on a _Fallback, counts it and runs ``fallback()`` with the mark
    cleared (so the original's own inner calls are not served again)."""
    try:
        out = serve()
    except _Fallback as f:
        handle.fallbacks[f.reason] += 1
        token = _ACTIVE.set(None)
        try:
            return fallback()
        finally:
            _ACTIVE.reset(token)
    handle.calls += 1
    return out


def _make_dispatch(original):
    """A ``dispatch_attention_fn`` that dattn serves inside a marked module, else the original."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatch_attention_fn(*args, **kwargs):
        handle = _ACTIVE.get()
        if handle is None:
            return original(*args, **kwargs)

        def serve():
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                raise _Fallback("shape") from None  # the original raises its own TypeError
            a = bound.arguments
            if a.get("parallel_config") is not None:
                raise _Fallback("context_parallel")
            if a.get("attention_kwargs"):
                raise _Fallback("attention_kwargs")
            q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
            _check_tensors(q, k, v, mask, a.get("dropout_p", 0.0))
            if (
                mask is not None
                and mask.dim() == 2
                and mask.shape[0] == q.shape[0]
                and mask.shape[1] == k.shape[1]
            ):
                mask = mask[:, None, None, :]  # diffusers' native rule: [B, Skv] keys
            return _compute(
                handle, "BSHD", q, k, v, mask, bool(a.get("is_causal", False)),
                a.get("scale"), bool(a.get("enable_gqa", False)),
            )

        return _serve_or_fallback(handle, serve, lambda: original(*args, **kwargs))

    dispatch_attention_fn._dattn_original = original
    return dispatch_attention_fn


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _make_sdpa(original):
    """A ``scaled_dot_product_attention`` that dattn serves inside a marked module."""

    @functools.wraps(original)
    def scaled_dot_product_attention(*args, **kwargs):
        handle = _ACTIVE.get()
        if handle is None:
            return original(*args, **kwargs)

        def serve():
            if len(args) > len(_SDPA_ARGS) or set(kwargs) - set(_SDPA_ARGS) - {"enable_gqa"}:
                raise _Fallback("attention_kwargs")
            a = dict(zip(_SDPA_ARGS, args), **kwargs)
            if not all(n in a for n in ("query", "key", "value")):
                raise _Fallback("shape")
            q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
            _check_tensors(q, k, v, mask, a.get("dropout_p", 0.0))
            return _compute(
                handle, "BHSD", q, k, v, mask, bool(a.get("is_causal", False)), a.get("scale"),
                bool(a.get("enable_gqa", False)),
            )

        return _serve_or_fallback(handle, serve, lambda: original(*args, **kwargs))

    scaled_dot_product_attention._dattn_original = original
    return scaled_dot_product_attention


# --- process-wide installation (reference-counted) -----------------------------------------


class _Installed:
    """What dattn replaced in the process: (owner object, attribute) -> [original, wrapper,
    handles using it]."""

    entries: Dict[Tuple[int, str], list] = {}


def _install(owner, attr: str, make, handle) -> None:
    key = (id(owner), attr)
    entry = _Installed.entries.get(key)
    current = getattr(owner, attr)
    if entry is None or current is not entry[2]:
        # First user, or someone replaced our wrapper since: wrap what is there now.
        entry = [owner, current, make(current), set()]
        _Installed.entries[key] = entry
        setattr(owner, attr, entry[2])
    entry[3].add(id(handle))
    handle._installed.append(key)


def _uninstall(key, handle) -> None:
    entry = _Installed.entries.get(key)
    if entry is None:
        return
    owner, original, wrapper, users = entry
    users.discard(id(handle))
    if users:
        return
    del _Installed.entries[key]
    if getattr(owner, key[1]) is wrapper:
        setattr(owner, key[1], original)
    # else someone patched over ours: theirs stays; ours, inside it, is inert without a mark.


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
    ``disable()`` undoes everything (also on leaving a ``with`` block)."""

    def __init__(self, model, backend: Optional[str], backend_kwargs: Optional[dict]):
        self.model = model
        self.calls = 0
        self.fallbacks: Counter = Counter()
        self.active = False
        self.modules: List[str] = []
        self.routes: Dict[str, Tuple[str, ...]] = {}
        self._backend, self._allow_fallback = adapter_backend(backend)
        self._backend_kwargs = dict(backend_kwargs or {})
        self._layers: Dict[tuple, Attention] = {}
        self._installed: List[tuple] = []
        self._forwards: List[Tuple[Any, Any, Any]] = []  # (module, previous __dict__ forward, ours)

    @property
    def backend_name(self) -> str:
        """The dattn backend the handle's layers are built with (e.g. "FLASH")."""
        return self._backend

    def _layer(self, layout, heads, kv_heads, head_size, causal, scale) -> Attention:
        key = (layout, heads, kv_heads, head_size, causal, scale)
        layer = self._layers.get(key)
        if layer is None:
            layer = Attention(
                heads, head_size, softmax_scale=scale, causal=causal, num_kv_heads=kv_heads,
                qkv_layout=layout, prefix="dattn.diffusers", backend=self._backend,
                backend_kwargs=self._backend_kwargs, allow_fallback=self._allow_fallback,
            )
            self._layers[key] = layer
        return layer

    def _enable(self):
        modules = _attention_modules(self.model)
        if not modules:
            raise _with_field(
                InvalidArgument,
                f"model: {type(self.model).__name__} has no diffusers attention modules (no "
                f"submodule with a `processor`); dattn.diffusers.enable takes a diffusers model "
                f"such as FluxTransformer2DModel",
                "model",
            )
        # Validate the backend choice once, before anything is changed.
        self._layer("BSHD", 1, 1, 64, False, None)
        self._layers.clear()
        functional = torch.nn.functional
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
                        _install(proc_module, "dispatch_attention_fn", _make_dispatch, self)
                        routes.append("dispatch_attention_fn")
                    if _uses(proc, "scaled_dot_product_attention"):
                        _install(functional, "scaled_dot_product_attention", _make_sdpa, self)
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
                        f"{type(self.model).__name__} has a processor that calls "
                        f"dispatch_attention_fn or F.scaled_dot_product_attention "
                        f"(processors: {', '.join(kinds)}); dattn cannot serve this model",
                        "model",
                    )
                _Handles.by_model[id(self.model)] = self
                self.active = True
            except BaseException:
                self._undo()
                raise
        return self

    def _wrap_forward(self, module):
        previous = module.__dict__.get("forward", _MISSING)
        inner = module.forward  # the bound class method, or a forward set on the instance
        handle = self

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not handle.active:
                return inner(*args, **kwargs)
            token = _ACTIVE.set(handle)
            try:
                return inner(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        forward._dattn_handle = self
        module.__dict__["forward"] = forward
        self._forwards.append((module, previous, forward))

    def _undo(self):
        for module, previous, ours in reversed(self._forwards):
            if module.__dict__.get("forward") is ours:
                if previous is _MISSING:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = previous
            # else something wrapped over ours since: ours stays inside it, inert (inactive).
        self._forwards.clear()
        for key in reversed(self._installed):
            _uninstall(key, self)
        self._installed.clear()
        self._layers.clear()

    def disable(self) -> None:
        """Puts the model back as it was (no forward of dattn's left on its modules; the
        process's functions restored when no other handle uses them). Harmless twice."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            self._undo()
            if _Handles.by_model.get(id(self.model)) is self:
                del _Handles.by_model[id(self.model)]

    def __enter__(self) -> "DiffusersHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def __repr__(self) -> str:
        return (
            f"DiffusersHandle({type(self.model).__name__}, active={self.active}, "
            f"modules={len(self.modules)}, calls={self.calls}, fallbacks={dict(self.fallbacks)})"
        )


class _Handles:
    by_model: Dict[int, DiffusersHandle] = {}


def enable(model, backend: Optional[str] = None, backend_kwargs: Optional[dict] = None) -> DiffusersHandle:
    """Runs the attention of ``model`` (one diffusers model, e.g. a pipeline's
    ``transformer``) on dattn and returns its :class:`DiffusersHandle`.

    ``backend``: the dattn backend (e.g. "REFERENCE"; default: dattn's
    ``DIFFUSION_ATTENTION_BACKEND`` when it names a dattn backend, else the automatic choice,
    FLASH); ``backend_kwargs``: that backend's options (e.g. ``{"isa": "avx2"}``). Only this
    model changes. Enabling a model twice is an error (:class:`dattn.InvalidArgument` naming
    ``model``); disable it first."""
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
        if id(model) in _Handles.by_model:
            raise _with_field(
                InvalidArgument,
                f"model: {type(model).__name__} already runs on dattn; disable its handle first",
                "model",
            )
        return DiffusersHandle(model, backend, backend_kwargs)._enable()


def handle_of(model) -> Optional[DiffusersHandle]:
    """The active handle of ``model``, or None."""
    return _Handles.by_model.get(id(model))


def disable(model) -> None:
    """Undoes :func:`enable` for ``model`` (nothing if it is not enabled)."""
    handle = handle_of(model)
    if handle is not None:
        handle.disable()
