"""dattn as ComfyUI's attention (docs/comfyui.md). Importable without ComfyUI.

ComfyUI's models call ``optimized_attention(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)``; every such function honours
``transformer_options["optimized_attention_override"]``, which it calls as
``override(func, *args, **kwargs)``, ``func`` being ComfyUI's own function for the call.
:func:`override` makes that callable on dattn:

- layouts as ComfyUI's: ``[B, S, H*D]`` (a 4-D ``[B, S, H, D]`` value too, as SD3 passes it),
  or ``[B, H, S, D]`` with ``skip_reshape``; the output ``[B, Sq, H*D]``, or ``[B, H, Sq, D]``
  with ``skip_output_reshape``; cross-attention lengths; f32, bf16 and f16;
- masks with ComfyUI's meaning (``attention_pytorch``'s): a 2-D mask is ``[Sq, Skv]`` broadcast
  over the batch and heads, a 3-D one ``[B|1, Sq|1, Skv]`` over the heads, a 4-D one
  ``[B|1, H|1, Sq|1, Skv]``; bool keeps (True = attend), float adds;
- ``attn_precision``: float32 (ComfyUI's ``get_attn_precision`` applied where ComfyUI is
  loaded, so its upcast flags count) computes half-precision inputs in f32;
- what dattn cannot serve (a device other than the CPU, gradients, dtypes, what PyTorch's own
  SDPA would refuse) goes to ComfyUI's ``func``, or to the override the model carried before
  (which dattn's then wraps), counted in ``calls`` / ``fallbacks``;
- options are strict: a misspelled backend option is an error naming it.

``VIDEO_SPARSE`` serves ComfyUI's video models' self-attention over the latent grid, which
:func:`patch_model` (or the node pack's DattnAttention node) learns from the model's input
through a model wrapper (:mod:`dattn.comfyui.video`; docs/comfyui.md says what that covers).

:func:`register` names dattn in ComfyUI's attention registry (``register_attention_function``:
``"dattn"`` and ``"dattn_sage"``), for nodes that look attention functions up by name.
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..errors import InvalidArgument, Unsupported, _with_field

#: The name under which the override and the grid wrapper live in ComfyUI's model options.
OPTIONS_KEY = "dattn"

#: Backends a ComfyUI override may name (VIDEO_SPARSE needs the grid: patch_model).
BACKENDS = ("FLASH", "SAGE", "REFERENCE", "VIDEO_SPARSE")


#: Keywords ComfyUI passes to every call that cannot change the answer: its own bookkeeping.
IGNORED_KEYWORDS = frozenset({"transformer_options", "_inside_attn_wrapper"})
#: Keywords that change the answer, all of which dattn honours: the softmax scale (replacing
#: ``dim_head ** -0.5``), K/V with fewer heads than Q, and ``low_precision_attention=False``
#: (an exact answer: SAGE and VIDEO_SPARSE step aside for FLASH).
HONOURED_KEYWORDS = frozenset({"scale", "enable_gqa", "low_precision_attention"})


def _signature(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
               skip_output_reshape=False, **kwargs):
    """ComfyUI's attention functions' signature (comfy/ldm/modules/attention.py)."""


_SIGNATURE = inspect.signature(_signature)


def _comfy_precision(attn_precision, dtype):
    """ComfyUI's ``get_attn_precision`` where ComfyUI is loaded (its upcast flags), else the
    value as passed."""
    attention = sys.modules.get("comfy.ldm.modules.attention")
    get = getattr(attention, "get_attn_precision", None)
    return get(attn_precision, dtype) if get is not None else attn_precision


def _comfy_mask(mask: torch.Tensor) -> torch.Tensor:
    """ComfyUI's mask as the 4-D mask PyTorch's SDPA broadcasts (attention_pytorch's rule)."""
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    return mask


class Override:
    """The ``optimized_attention_override`` callable (:func:`override`). ``calls``: calls dattn
    computed; ``fallbacks``: calls handed to ComfyUI's function (or the previous override), by
    reason. A deep copy (ComfyUI's ``ModelPatcher.clone`` copies the model options) is the same
    object."""

    def __init__(self, backend: str = "FLASH", backend_kwargs: Optional[dict] = None,
                 previous: Optional[Callable] = None):
        from .. import torch_adapter as ta
        from ..sparse_steps import split_options

        name = str(backend).strip().upper()
        if name not in BACKENDS:
            raise _with_field(InvalidArgument,
                              f"backend: {str(backend)[:40]!r} is not a backend dattn serves "
                              f"ComfyUI with; valid: {', '.join(BACKENDS)}", "backend")
        self.backend = name
        self.backend_kwargs = dict(backend_kwargs or {})
        self.previous = previous
        self.video = None
        options = self.backend_kwargs
        if name == "VIDEO_SPARSE":
            from .video import VideoPolicy

            policy, sparse, flash = split_options(options)
            self.video = VideoPolicy(policy, sparse)
            self.client = ta.Client(f"comfyui:{name}:dense", "FLASH", flash)
        else:
            self.client = ta.Client(f"comfyui:{name}", name, options)
        # Calls asking for an exact answer (low_precision_attention=False) while the backend is
        # approximate: FLASH with its defaults, made on the first such call.
        self._exact = self.client if name in ("FLASH", "REFERENCE") else None
        self._exact_lock = threading.Lock()

    def _exact_client(self):
        from .. import torch_adapter as ta

        with self._exact_lock:
            if self._exact is None:
                self._exact = ta.Client(f"comfyui:{self.backend}:exact", "FLASH", {})
            return self._exact

    @property
    def calls(self) -> int:
        """Calls dattn computed (those served exactly on FLASH for an approximate backend,
        :attr:`exact_calls`, included)."""
        exact = self._exact.calls if self._exact not in (None, self.client) else 0
        return self.client.calls + exact

    @property
    def exact_calls(self) -> int:
        """Calls of an approximate backend (SAGE, VIDEO_SPARSE) served on FLASH instead because
        ComfyUI passed ``low_precision_attention=False``."""
        return 0 if self._exact in (None, self.client) else self._exact.calls

    @property
    def fallbacks(self):
        return self.client.fallbacks

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __repr__(self) -> str:
        return (f"dattn.comfyui.Override(backend={self.backend!r}, "
                f"backend_kwargs={self.backend_kwargs!r}, calls={self.calls}, "
                f"exact_calls={self.exact_calls}, fallbacks={dict(self.fallbacks)})")

    def _fallback(self, reason, func, args, kwargs):
        from .. import torch_adapter as ta

        ta._count(self.client, reason, torch.compiler.is_compiling())
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        from .. import torch_adapter as ta

        args = _unwrapped(args)
        try:
            a = _SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return self._fallback("arguments", func, args, kwargs)
        a.apply_defaults()
        p = a.arguments
        q, k, v, mask = p["q"], p["k"], p["v"], p["mask"]
        heads = p["heads"]
        extra = p["kwargs"]
        unknown = sorted(set(extra) - IGNORED_KEYWORDS - HONOURED_KEYWORDS)
        if unknown:  # it may change the answer: ComfyUI's function knows what it means
            return self._fallback(f"keyword:{unknown[0]}", func, args, kwargs)
        scale = extra.get("scale")
        gqa = extra.get("enable_gqa", False)
        exact = extra.get("low_precision_attention", True)
        if (scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                   or not math.isfinite(scale))) \
                or not isinstance(gqa, bool) or not isinstance(exact, bool):
            return self._fallback("arguments", func, args, kwargs)
        exact = not exact
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not (
                mask is None or isinstance(mask, torch.Tensor)) or isinstance(heads, bool) \
                or not isinstance(heads, int) or heads <= 0:
            return self._fallback("arguments", func, args, kwargs)
        compiling = torch.compiler.is_compiling()
        graph = compiling
        if not compiling:
            route = ta.dispatch_route([t for t in (q, k, v, mask) if t is not None],
                                      trace_as_op=False)
            if route not in (None, "graph"):
                return self._fallback(route, func, args, kwargs)
            graph = route == "graph"
        try:
            q4, k4, v4, layout = self._views(q, k, v, heads, bool(p["skip_reshape"]), gqa)
        except (RuntimeError, ValueError):
            return self._fallback("shape", func, args, kwargs)
        out_dtype = q.dtype
        if _comfy_precision(p["attn_precision"], q.dtype) == torch.float32 and \
                q.dtype in (torch.float16, torch.bfloat16):
            q4, k4, v4 = (t.float() for t in (q4, k4, v4))
            if mask is not None and mask.dtype.is_floating_point:
                mask = mask.float()
        mask4 = None if mask is None else _comfy_mask(mask)
        bound = {"query": q4, "key": k4, "value": v4, "attn_mask": mask4, "dropout_p": 0.0,
                 "is_causal": False, "scale": scale, "enable_gqa": gqa}
        reason = ta._eager_reason(bound, layout, not compiling)
        if reason is not None:
            return self._fallback(reason, func, args, kwargs)
        if exact and self._exact is not self.client:
            out = ta._compute(self._exact_client(), bound, layout, ta.CAUSAL_NONE, graph)
        elif self.video is not None:
            if graph:
                raise _with_field(
                    Unsupported,
                    "torch.compile: dattn's VIDEO_SPARSE override decides its block selection "
                    "per call in Python; compile the model with dattn's FLASH or SAGE, or run "
                    "VIDEO_SPARSE uncompiled", "torch.compile")
            out = self.video.serve(self, p, bound, layout)
        else:
            out = ta._compute(self.client, bound, layout, ta.CAUSAL_NONE, graph)
        return _comfy_output(out.to(out_dtype), layout, heads,
                             bool(p["skip_output_reshape"]))

    @staticmethod
    def _views(q, k, v, heads, skip_reshape,
               gqa=False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """Q, K, V as 4-D views in the layout dattn reads them in: ``[B, H, S, D]`` as given
        (BHSD) with ``skip_reshape``, else ``[B, S, H, D]`` (BSHD) from ``[B, S, H*D]``. With
        ``gqa`` (``enable_gqa=True``), K's and V's heads are their inner sizes over the query's
        head size, as ComfyUI's ``_reshape_qkv_to_heads`` counts them (not the query's count);
        an inner size that is no multiple of it is ComfyUI's ValueError (its function raises)."""
        if skip_reshape:
            return q, k, v, "BHSD"
        b, dim_head = q.shape[0], q.shape[-1] // heads

        def split(t, name):
            n = heads
            if gqa and t is not q:
                if dim_head <= 0 or t.shape[-1] % dim_head:
                    raise ValueError(f"{name}: inner size {t.shape[-1]} is no multiple of the "
                                     f"head size {dim_head}")
                n = t.shape[-1] // dim_head
            return t.reshape(b, -1, n, dim_head)

        return split(q, "q"), split(k, "k"), split(v, "v"), "BSHD"


def _unwrapped(args: tuple) -> tuple:
    """``args`` with ComfyUI's ``AttentionTensorContainer`` q, k, v (its attention.py since
    2026) taken out, as its ``wrap_attn`` does before calling an override without a
    ``container_function``: for the callers that skip ``wrap_attn`` (a registered function
    called directly). dattn has no ``container_function``: docs/comfyui.md says why."""
    if len(args) >= 3 and all(type(a).__name__ == "AttentionTensorContainer" and
                              hasattr(a, "take") for a in args[:3]):
        return tuple(a.take() for a in args[:3]) + tuple(args[3:])
    return args


def _comfy_output(out: torch.Tensor, layout: str, heads: int, skip_output_reshape: bool):
    """dattn's output (``layout``) as ComfyUI's: ``[B, H, Sq, D]`` with ``skip_output_reshape``,
    else ``[B, Sq, H*D]``."""
    if layout == "BSHD":
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def override(backend: str = "FLASH", previous: Optional[Callable] = None,
             **backend_kwargs) -> Override:
    """The ``transformer_options["optimized_attention_override"]`` callable computing ComfyUI's
    attention on dattn's ``backend`` (FLASH, SAGE, REFERENCE, VIDEO_SPARSE) with its options
    (checked now: a misspelled one is :class:`dattn.InvalidArgument` naming it). ``previous``:
    an override the model carried before, which gets what dattn does not serve."""
    return Override(backend, backend_kwargs, previous)


def patch_model(model, backend: str = "FLASH", **backend_kwargs):
    """A clone of ComfyUI's ``ModelPatcher`` ``model`` whose attention runs on dattn: the
    override in its ``transformer_options`` (a previous one that is not dattn's is kept as the
    fallback; a previous dattn one is replaced, so the later options win) and, for
    VIDEO_SPARSE, the model wrapper that learns each forward's latent grid and step."""
    m = model.clone()
    options = m.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    if isinstance(previous, Override):
        previous = previous.previous
    ours = override(backend, previous=previous, **backend_kwargs)
    options["optimized_attention_override"] = ours
    if ours.video is not None:
        from .video import install_grid_wrapper

        install_grid_wrapper(m)
    install_cleanup_callbacks(m)
    return m


#: ComfyUI's ``CallbacksMP`` names (comfy/patcher_extension.py, 0.3.64 and later) of the
#: model's cleanup after a sampling run and of its unloading.
CLEANUP_CALLBACKS = ("on_cleanup", "on_detach_after")


def _give_memory_back(*_args) -> None:
    """A ``ModelPatcher`` callback: dattn's idle buffers back to the OS (``dattn.empty_cache``)."""
    from ..memory import empty_cache

    empty_cache()


def install_cleanup_callbacks(model) -> bool:
    """Has ComfyUI's ``ModelPatcher`` ``model`` return dattn's idle buffers to the OS
    (:func:`dattn.empty_cache`) when it cleans up after sampling (``CallbacksMP.ON_CLEANUP``)
    and when it is unloaded (``ON_DETACH``); once per model (keyed ``"dattn"``). False where
    the patcher has no callbacks (ComfyUI before them)."""
    add = getattr(model, "add_callback_with_key", None)
    if add is None:
        return False
    try:
        from comfy.patcher_extension import CallbacksMP

        names = (CallbacksMP.ON_CLEANUP, CallbacksMP.ON_DETACH)
    except Exception:
        names = CLEANUP_CALLBACKS
    for name in names:
        remove = getattr(model, "remove_callbacks_with_key", None)
        if remove is not None:
            remove(name, OPTIONS_KEY)
        add(name, OPTIONS_KEY, _give_memory_back)
    return True


def parse_options(text: str) -> Dict[str, Any]:
    """Backend options written as ``"key=value, key=value"`` (a node's text field; a value may
    hold commas, ``tile=1,2,2``): integers, floats, ``true``/``false`` and strings. A malformed item or a key given twice is
    :class:`dattn.InvalidArgument` naming ``options``."""
    import re

    options: Dict[str, Any] = {}
    # Items are separated by commas, semicolons or new lines before the next "key=" (a value may
    # hold commas itself: tile=1,2,2).
    for item in re.split(r"[,;\n]\s*(?=[A-Za-z_][A-Za-z0-9_]*\s*=)|[;\n]", text or ""):
        item = item.strip().strip(",")
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise _with_field(InvalidArgument,
                              f"options: {item[:60]!r} is not key=value (e.g. 'pv_dtype=int8, "
                              f"smooth_k=true')", "options")
        if key in options:
            raise _with_field(InvalidArgument, f"options: {key[:60]!r} is given twice",
                              "options")
        low = value.lower()
        if low in ("true", "false"):
            options[key] = low == "true"
            continue
        for convert in (int, float):
            try:
                options[key] = convert(value)
                break
            except ValueError:
                continue
        else:
            options[key] = value
    return options


_REGISTERED: Dict[str, Callable] = {}
_LOCK = threading.Lock()


def attention_function(backend: str = "FLASH", **backend_kwargs) -> Callable:
    """A plain ComfyUI attention function (``(q, k, v, heads, mask=None, attn_precision=None,
    skip_reshape=False, skip_output_reshape=False, **kwargs)``) on dattn, for ComfyUI's
    registry: what dattn does not serve goes to ComfyUI's ``attention_pytorch``."""
    ours = override(backend, **backend_kwargs)

    def attend(*args, **kwargs):
        from comfy.ldm.modules import attention as comfy_attention

        fallback = getattr(comfy_attention.attention_pytorch, "__wrapped__",
                           comfy_attention.attention_pytorch)
        kwargs.pop("transformer_options", None)
        kwargs.pop("_inside_attn_wrapper", None)
        kwargs.pop("preferred_attention", None)  # wrap_attn's, when called without it
        return ours(fallback, *_unwrapped(args), **kwargs)

    attend.override = ours
    attend.__name__ = f"attention_dattn_{backend.lower()}"
    return attend


def register() -> bool:
    """Registers ``"dattn"`` (FLASH) and ``"dattn_sage"`` (SAGE) with ComfyUI's
    ``register_attention_function`` where ComfyUI is importable; returns whether it is."""
    try:
        from comfy.ldm.modules import attention as comfy_attention
    except Exception:
        return False
    with _LOCK:
        for name, backend in (("dattn", "FLASH"), ("dattn_sage", "SAGE")):
            if name in getattr(comfy_attention, "REGISTERED_ATTENTION_FUNCTIONS", {}):
                continue
            fn = _REGISTERED.get(name) or attention_function(backend)
            _REGISTERED[name] = fn
            comfy_attention.register_attention_function(name, fn)
    return True


__all__ = ["BACKENDS", "HONOURED_KEYWORDS", "IGNORED_KEYWORDS", "Override",
           "attention_function", "install_cleanup_callbacks", "override", "parse_options",
           "patch_model", "register"]
