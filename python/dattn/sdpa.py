"""PyTorch's ``scaled_dot_product_attention`` on dattn, and a patch that installs it.

``dattn.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
is_causal=False, scale=None)`` follows ``torch.nn.functional.scaled_dot_product_attention``
(PyTorch 2.x) where its rules differ from dattn's own:

- tensors are ``[..., H, L, E]`` (heads before rows, read in place through dattn's BHSD
  layout, no copy); 4-D ``[B, H, L, E]`` and 3-D ``[N, L, E]`` (``N`` read as heads of one
  batch item), 2-D ``[L, E]``, and more leading dims (flattened into dattn's batch where that
  is a view, else one call per leading index);
- ``attn_mask`` is a bool keep-mask (True takes part) or an additive float mask of any shape
  that broadcasts to ``[..., H, L, S]``; a 2-D mask is an ``(L, S)`` matrix (not dattn's
  ``[B, S]`` key mask). It is mapped to dattn's 4-D mask with ``expand`` (stride-0 views);
- ``is_causal`` is top-left aligned (key ``j`` is visible to query ``i`` iff ``j <= i``,
  ``tril(ones(L, S))``), mapped to dattn's causal layer with both global starts at 0;
- ``scale`` defaults to ``1/sqrt(E)``; key/value may have fewer heads than the query when
  their count divides the query's (GQA, as ``enable_gqa=True``; a size-1 batch dim of key
  and value broadcasts).

A query row that sees no key (fully masked by a bool or ``-inf`` mask) is zeros, as in
PyTorch 2.5 and later (checked on 2.13, whose CPU kernels return zeros there too); with
``is_causal`` (top-left) no row is empty.

Differences, on purpose (this function; ``patch_torch_sdpa()`` behaves as PyTorch, see there):
``dropout_p != 0`` is refused (dattn computes inference only); the output never requires grad;
GQA is served whether or not ``enable_gqa`` is passed; ``attn_mask`` with ``is_causal`` is
refused (PyTorch's documented rule; its CPU kernels combine the two); q/k/v of different
dtypes and a float mask of another float dtype are read (PyTorch refuses them).
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, Optional, Tuple

from .attention import Attention
from .backends import adapter_backend
from .errors import (
    InvalidArgument,
    InvalidArgumentType,
    Unsupported,
    UnsupportedTensor,
    _with_field,
    as_float,
)
from .metadata import AttentionMetadata

try:
    import torch
except ImportError:  # pragma: no cover - the SDPA drop-in needs torch
    torch = None


class SdpaError(InvalidArgument, RuntimeError):
    """A call PyTorch's scaled_dot_product_attention also rejects (mask with is_causal,
    inconsistent ranks or shapes) or one dattn refuses where PyTorch would compute (dropout).
    It is a :class:`dattn.InvalidArgument` (a ``ValueError``) and a ``RuntimeError``, the class
    PyTorch raises, so either ``except`` clause catches it."""


def _error(message: str, field: str) -> SdpaError:
    return _with_field(SdpaError, message, field)


# dattn layers by (heads, kv_heads, head_size, causal, scale); each keeps its plan cache.
_LAYERS: Dict[Tuple[int, int, int, bool, Optional[float]], Attention] = {}
_MAX_LAYERS = 64


def _layer(heads: int, kv_heads: int, head_size: int, causal: bool, scale) -> Attention:
    key = (heads, kv_heads, head_size, causal, scale)
    layer = _LAYERS.get(key)
    if layer is None:
        # The backend is passed explicitly (adapter_backend): a DIFFUSION_ATTENTION_BACKEND
        # meant for the vllm-omni engine (DATTN, TORCH_SDPA, ...) never reaches the registry.
        backend, _ = adapter_backend()
        if len(_LAYERS) >= _MAX_LAYERS:  # a bounded cache: drop the oldest entry
            _LAYERS.pop(next(iter(_LAYERS)))
        # allow_fallback: if DIFFUSION_ATTENTION_BACKEND names a backend that cannot serve a
        # call (e.g. causal on VIDEO_SPARSE), the call runs on the best exact backend.
        layer = Attention(
            heads,
            head_size,
            softmax_scale=scale,
            causal=causal,
            num_kv_heads=kv_heads,
            qkv_layout="BHSD",
            prefix="dattn.scaled_dot_product_attention",
            backend=backend,
            allow_fallback=True,
        )
        _LAYERS[key] = layer
    return layer


_COMPUTED = ("float32", "bfloat16", "float16")


def _check_torch(x, name: str):
    """`x` must be a torch.Tensor of a dtype dattn computes (bool too for the mask)."""
    if torch is None or not isinstance(x, torch.Tensor):
        raise _with_field(
            InvalidArgument, f"{name}: expected a torch.Tensor, got {type(x).__name__}", name
        )
    dtype = str(x.dtype).replace("torch.", "")
    if dtype in _COMPUTED or (name == "attn_mask" and dtype == "bool"):
        return
    if x.dtype.is_floating_point:  # float64: PyTorch computes it, dattn does not
        raise _with_field(
            UnsupportedTensor,
            f"{name}: dtype {dtype} is not computed by dattn; valid: float32, bfloat16, float16"
            + (" (or bool)" if name == "attn_mask" else ""),
            name,
        )
    valid = "bool or float32, bfloat16, float16" if name == "attn_mask" else "a float dtype"
    raise _error(f"{name}: dtype {dtype} is not valid; expected {valid}", name)


def _to_4d(x):
    """A 2-, 3- or 4-D tensor as a 4-D view (size-1 dims in front)."""
    return x[(None,) * (4 - x.dim())] if x.dim() < 4 else x


def _flatten(x):
    """``x`` ([*lead, a, b, c]) as a view [N, a, b, c], or None where that needs a copy."""
    try:
        return x.view(-1, *x.shape[-3:])
    except RuntimeError:
        return None


def _broadcast_mask(mask, full: Tuple[int, ...]):
    """PyTorch's ``attn_mask`` as a view of rank ``len(full)`` ([..., H, L, S]): size-1 dims in
    front, rows and keys expanded (stride 0) where they broadcast; batch dims and heads stay
    size 1 where they broadcast (dattn broadcasts those itself). Never a copy."""
    if mask.dim() > len(full):
        raise _error(
            f"attn_mask: shape {tuple(mask.shape)} has more dims than {full}, the shape it "
            f"must broadcast to",
            "attn_mask",
        )
    m = mask[(None,) * (len(full) - mask.dim())]
    for have, want in zip(m.shape, full):
        if have not in (1, want):
            raise _error(
                f"attn_mask: shape {tuple(mask.shape)} does not broadcast to {full} "
                f"([..., H, L, S])",
                "attn_mask",
            )
    return m.expand(*m.shape[:-2], *full[-2:])


def _attend(q, k, v, mask, is_causal: bool, scale, out=None):
    """One dattn call on 4-D [B, H, L, E] views (BHSD, no copies); ``mask`` a 4-D view."""
    heads, head_size, kv_heads = int(q.shape[1]), int(q.shape[3]), int(k.shape[1])
    if kv_heads == 0 or heads % kv_heads != 0:
        raise _error(
            f"key: {kv_heads} heads do not divide the query's {heads} heads (GQA needs "
            f"H % Hkv == 0)",
            "key",
        )
    meta = None
    if is_causal:
        # PyTorch's causal is top-left, tril(ones(L, S)): key j is visible to query i iff
        # j <= i. dattn's default is bottom-right; both global starts at 0 give top-left.
        meta = AttentionMetadata(q_global_start=0, k_global_start=0)
    elif mask is not None:
        meta = AttentionMetadata(attn_mask=mask)
    layer = _layer(heads, kv_heads, head_size, bool(is_causal), scale)
    return layer.forward(q, k, v, meta, out=out)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    enable_gqa: bool = False,
):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by dattn (CPU tensors).

    query ``[..., H, L, E]``, key ``[..., Hkv, S, E]``, value ``[..., Hkv, S, Ev]`` with
    ``H % Hkv == 0`` (``enable_gqa`` is accepted for PyTorch 2.5's signature; this function
    always serves GQA, the patched one only with ``enable_gqa=True``, as PyTorch). Leading dims of key and value may be 1 where the query's are not
    (broadcast). Returns ``[..., H, L, Ev]`` in the query's dtype, not requiring grad. See the
    module docstring for the mask, causal and scale rules and the differences from PyTorch.
    Errors: :class:`SdpaError` (``RuntimeError`` and ``dattn.InvalidArgument``) for calls
    PyTorch rejects too, and for dropout; dattn's own errors otherwise.
    """
    del enable_gqa  # GQA is always served
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_torch(t, name)
    if dropout_p:
        raise _error(
            f"dropout_p: {dropout_p} is not supported; dattn computes inference only "
            f"(pass dropout_p=0.0, e.g. dropout_p=p if self.training else 0.0)",
            "dropout_p",
        )
    if attn_mask is not None and is_causal:
        raise _error(
            "attn_mask: an explicit attn_mask cannot be combined with is_causal=True "
            "(PyTorch's rule); fold the causal triangle into the mask",
            "attn_mask",
        )
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        raise _error(
            f"query/key/value: ranks {query.dim()}, {key.dim()}, {value.dim()}; expected "
            f"equal ranks of at least 2 ([..., L, E], [..., S, E], [..., S, Ev])",
            "query",
        )
    lead = tuple(query.shape[:-3])
    for name, t in (("key", key), ("value", value)):
        t_lead = tuple(t.shape[:-3])
        if any(have not in (1, want) for have, want in zip(t_lead, lead)):
            raise _error(
                f"{name}: batch dims {t_lead} do not broadcast to the query's {lead}", name
            )
    key = key.expand(*lead, *key.shape[-3:]) if rank >= 4 else key
    value = value.expand(*lead, *value.shape[-3:]) if rank >= 4 else value
    mask = None
    if attn_mask is not None:
        _check_torch(attn_mask, "attn_mask")
        mask = _broadcast_mask(attn_mask, tuple(query.shape[:-1]) + (int(key.shape[-2]),))
    scale = None if scale is None else as_float(scale, "scale")
    out_shape = (*query.shape[:-1], int(value.shape[-1]))

    if rank <= 4:
        out = _attend(
            _to_4d(query), _to_4d(key), _to_4d(value),
            None if mask is None else _to_4d(mask), is_causal, scale,
        )
        return out.view(out_shape)

    # More than one leading dim: flatten them into the batch where that is a view.
    if mask is not None:
        mask = (
            mask.reshape(1, *mask.shape[-3:])
            if all(d == 1 for d in mask.shape[:-3])
            else mask.expand(*lead, *mask.shape[-3:])
        )
    flat = [_flatten(t) for t in (query, key, value)]
    flat_mask = mask if mask is None or mask.dim() == 4 else _flatten(mask)
    if all(t is not None for t in flat) and (mask is None or flat_mask is not None):
        return _attend(*flat, flat_mask, is_causal, scale).view(out_shape)
    # Some leading dims do not merge without a copy (e.g. a mask broadcast over some of
    # them): one call per leading index, each on views, into the output's slices.
    out = torch.empty(out_shape, dtype=query.dtype)
    for idx in itertools.product(*(range(d) for d in lead)):
        m = None
        if mask is not None:
            m = mask[0][None] if mask.dim() == 4 else mask[idx][None]
        _attend(
            query[idx][None], key[idx][None], value[idx][None], m, is_causal, scale,
            out=out[idx][None],
        )
    return out


_MISSING = object()


class _PatchState:
    """The patch's shared state: how many handles of the current installation are active,
    what the installation replaced, and which installation is current (handles of an earlier
    one, replaced by another patch since, no longer restore anything)."""

    depth = 0
    saved = _MISSING
    generation = 0


_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_SERVED_KWARGS = set(_ARG_NAMES) | {"enable_gqa"}
_SERVED_DTYPES = ("float32", "bfloat16", "float16")


def _needs_original(args, kwargs) -> bool:
    """Whether a call must go to PyTorch's own implementation: tensors not on the CPU, dtypes
    dattn does not compute, inputs that need a gradient, dropout, arguments dattn does not know
    or that are not tensors (PyTorch's TypeError), ranks that differ (PyTorch broadcasts them),
    and ``attn_mask`` with ``is_causal`` (PyTorch's CPU kernels apply both)."""
    if len(args) > len(_ARG_NAMES) or any(k not in _SERVED_KWARGS for k in kwargs):
        return True
    bound = dict(zip(_ARG_NAMES, args), **kwargs)
    qkv = [bound.get(n) for n in ("query", "key", "value")]
    mask = bound.get("attn_mask")
    if not all(isinstance(t, torch.Tensor) for t in qkv):
        return True
    if mask is not None and not isinstance(mask, torch.Tensor):
        return True
    tensors = qkv + ([mask] if mask is not None else [])
    if any(t.device.type != "cpu" for t in tensors):
        return True
    if any(str(t.dtype).replace("torch.", "") not in _SERVED_DTYPES for t in qkv):
        return True
    if len({t.dim() for t in qkv}) != 1:
        return True
    if mask is not None and bound.get("is_causal", False):
        return True
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True  # training: dattn's output carries no gradient
    return bool(bound.get("dropout_p", 0.0))


def _refuse_as_pytorch(args, kwargs) -> None:
    """Raises what PyTorch's function raises (a RuntimeError: SdpaError) for calls it refuses
    but dattn's own function serves: q/k/v of different dtypes, a mask that is neither bool nor
    float32 nor the query's dtype, and key/value heads other than the query's without
    ``enable_gqa=True``."""
    bound = dict(zip(_ARG_NAMES, args), **kwargs)
    q, k, v = (bound[n] for n in ("query", "key", "value"))
    if not (q.dtype == k.dtype == v.dtype):
        raise _error(
            f"query/key/value: dtypes {q.dtype}, {k.dtype}, {v.dtype}; PyTorch's "
            f"scaled_dot_product_attention expects one dtype",
            "key" if k.dtype != q.dtype else "value",
        )
    mask = bound.get("attn_mask")
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise _error(
            f"attn_mask: dtype {mask.dtype} is neither bool, float32 nor the query's "
            f"{q.dtype} (PyTorch's rule)",
            "attn_mask",
        )
    if (
        q.dim() >= 3
        and not bound.get("enable_gqa", False)
        and (k.shape[-3] != q.shape[-3] or v.shape[-3] != q.shape[-3])
    ):
        raise _error(
            f"key: {k.shape[-3]} heads for the query's {q.shape[-3]}; pass enable_gqa=True "
            f"for grouped-query attention (PyTorch's rule)",
            "key",
        )


def _make_wrapper(original: Callable) -> Callable:
    def sdpa(*args, **kwargs):
        if _needs_original(args, kwargs):
            return original(*args, **kwargs)
        _refuse_as_pytorch(args, kwargs)
        try:
            return scaled_dot_product_attention(*args, **kwargs)
        except (SdpaError, InvalidArgumentType):
            raise  # a value of the wrong type is PyTorch's TypeError too (scale="x")
        except InvalidArgument as e:  # e.g. head sizes that differ: PyTorch's RuntimeError
            raise _error(str(e), getattr(e, "field", None)) from e

    sdpa.__name__ = "scaled_dot_product_attention"
    sdpa.__qualname__ = "scaled_dot_product_attention"
    sdpa.__doc__ = (
        "dattn's scaled_dot_product_attention installed by dattn.patch_torch_sdpa(); calls "
        "dattn cannot serve go to PyTorch's own implementation."
    )
    sdpa._dattn_original = original
    sdpa._dattn_patch = True
    return sdpa


class SdpaPatch:
    """An active ``patch_torch_sdpa()``: ``undo()`` (or calling it, or leaving its ``with``
    block) gives up this handle; when the last handle is given up, the function PyTorch had
    before the first patch is restored (or the attribute deleted, if there was none).
    Giving up a handle twice is harmless."""

    def __init__(self):
        self.active = True
        self._generation = _PatchState.generation

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._generation != _PatchState.generation:
            return  # an earlier installation, replaced since: nothing of it is left to restore
        _PatchState.depth -= 1
        if _PatchState.depth > 0:
            return
        functional = torch.nn.functional
        current = getattr(functional, "scaled_dot_product_attention", None)
        saved, _PatchState.saved = _PatchState.saved, _MISSING
        if not getattr(current, "_dattn_patch", False):
            return  # someone patched over dattn since: leave their function in place
        if saved is _MISSING:
            delattr(functional, "scaled_dot_product_attention")
        else:
            functional.scaled_dot_product_attention = saved

    __call__ = undo

    def __enter__(self) -> "SdpaPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"SdpaPatch(active={self.active})"


def patch_torch_sdpa() -> SdpaPatch:
    """Install dattn's ``scaled_dot_product_attention`` as
    ``torch.nn.functional.scaled_dot_product_attention``.

    Calls dattn cannot serve, or where PyTorch computes something dattn's function does not,
    go to PyTorch's own: tensors not on the CPU, float64 and other dtypes, ``dropout_p != 0``,
    inputs that require grad while grad mode is on (training keeps working), keyword
    arguments dattn does not know, non-tensor arguments, q/k/v of different ranks, and
    ``attn_mask`` with ``is_causal``. What PyTorch refuses, the patched function refuses with a
    RuntimeError too (mixed q/k/v dtypes, a mask of another float dtype, GQA without
    ``enable_gqa=True``, shapes that do not broadcast). Needs PyTorch 2.0 or later. Code that looks the function up at call time (``F.scaled_dot_product_attention``)
    uses it without edits; a name imported before the patch keeps the old function.

    Returns an :class:`SdpaPatch`: a context manager and an undo function. Patching twice is
    harmless; the original comes back when every handle is undone."""
    if torch is None:  # pragma: no cover
        raise _with_field(Unsupported, "patch_torch_sdpa: torch is not importable", "torch")
    functional = torch.nn.functional
    current = getattr(functional, "scaled_dot_product_attention", _MISSING)
    if current is _MISSING:
        raise _with_field(
            Unsupported,
            f"patch_torch_sdpa: torch {torch.__version__} has no "
            f"torch.nn.functional.scaled_dot_product_attention (PyTorch 2.0 or later)",
            "torch",
        )
    if _PatchState.depth == 0 or not getattr(current, "_dattn_patch", False):
        # A new installation (none active, or someone replaced dattn's since).
        if getattr(current, "_dattn_patch", False):  # a stale dattn patch: wrap what it wrapped
            current = current._dattn_original or _MISSING
        _PatchState.generation += 1
        _PatchState.saved = current
        _PatchState.depth = 0
        functional.scaled_dot_product_attention = _make_wrapper(current)
    _PatchState.depth += 1
    return SdpaPatch()

