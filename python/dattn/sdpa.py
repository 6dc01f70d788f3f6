"""PyTorch's ``scaled_dot_product_attention`` on dattn, and a patch that installs it.

``dattn.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
is_causal=False, scale=None)`` follows ``torch.nn.functional.scaled_dot_product_attention``
(PyTorch 2.x) where its rules differ from dattn's own:

- tensors are ``[..., H, L, E]`` (heads before rows, read in place through dattn's BHSD
  layout, no copy); 4-D ``[B, H, L, E]`` and 3-D ``[N, L, E]`` (``N`` read as heads of one
  batch item), 2-D ``[L, E]``, and more leading dims (flattened into dattn's batch, a view
  where the dims merge);
- ``attn_mask`` is a bool keep-mask (True takes part) or an additive float mask of any shape
  that broadcasts to ``[..., H, L, S]``; a 2-D mask is an ``(L, S)`` matrix (not dattn's
  ``[B, S]`` key mask). It is mapped to dattn's 4-D mask with ``expand`` (stride-0 views);
  ``torch.nn.attention.bias.causal_upper_left`` / ``causal_lower_right`` are dattn's causal
  attention, top-left or bottom-right aligned;
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
dtypes and a float mask of another float dtype are read (PyTorch refuses them); non-finite
inputs follow dattn's rules (docs/semantics.md), not PyTorch's kernel.

Both run inside PyTorch's machinery as docs/python.md describes (``torch.compile``, export,
tracing, fake tensors, autocast, ``__torch_function__``): see :mod:`dattn.torch_adapter`.
Importing this module does not import torch.
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

from .errors import (
    InvalidArgument,
    Unsupported,
    UnsupportedTensor,
    _with_field,
    as_float,
)


class SdpaError(InvalidArgument, RuntimeError):
    """A call PyTorch's scaled_dot_product_attention also rejects (mask with is_causal,
    inconsistent ranks or shapes) or one dattn refuses where PyTorch would compute (dropout).
    It is a :class:`dattn.InvalidArgument` (a ``ValueError``) and a ``RuntimeError``, the class
    PyTorch raises, so either ``except`` clause catches it."""


def _error(message: str, field: str) -> SdpaError:
    return _with_field(SdpaError, message, field)


_COMPUTED = ("float32", "bfloat16", "float16")


def _torch():
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: F811 - a torch tensor cannot exist before torch is imported
    return torch


def _check_torch(torch, x, name: str):
    """`x` must be a torch.Tensor of a dtype dattn computes (bool too for the mask)."""
    if not isinstance(x, torch.Tensor):
        raise _with_field(
            InvalidArgument, f"{name}: expected a torch.Tensor, got {type(x).__name__}", name
        )
    dtype = str(x.dtype).replace("torch.", "")
    if dtype in _COMPUTED or (name == "attn_mask" and dtype == "bool"):
        return
    if name == "attn_mask":
        valid = "bool, float32, bfloat16 or float16"
    else:
        valid = "float32, bfloat16 or float16"
    if x.dtype.is_floating_point:  # float64: PyTorch computes it, dattn does not
        raise _with_field(
            UnsupportedTensor, f"{name}: dtype {dtype} is not computed by dattn; valid: {valid}",
            name,
        )
    raise _error(f"{name}: dtype {dtype} is not valid; valid: {valid}", name)


def _check_broadcast(mask, full):
    if mask.dim() > len(full):
        raise _error(
            f"attn_mask: shape {tuple(mask.shape)} has more dims than {full}, the shape it "
            f"must broadcast to",
            "attn_mask",
        )
    m = (1,) * (len(full) - mask.dim()) + tuple(mask.shape)
    if any(have not in (1, want) for have, want in zip(m, full)):
        raise _error(
            f"attn_mask: shape {tuple(mask.shape)} does not broadcast to {full} "
            f"([..., H, L, S])",
            "attn_mask",
        )


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
    always serves GQA, the patched one only with ``enable_gqa=True``, as PyTorch). Leading dims
    of key and value may be 1 where the query's are not (broadcast). Returns ``[..., H, L, Ev]``
    in the query's dtype, not requiring grad. See the module docstring for the mask, causal and
    scale rules and the differences from PyTorch. Errors: :class:`SdpaError` (``RuntimeError``
    and ``dattn.InvalidArgument``) for calls PyTorch rejects too, and for dropout; dattn's own
    errors otherwise.
    """
    del enable_gqa  # GQA is always served
    torch = _torch()
    from . import torch_adapter as ta
    from .slow_cpu import warn_explicit

    warn_explicit("dattn.scaled_dot_product_attention")
    causal = ta.CAUSAL_NONE
    bias = ta._causal_bias_mode(attn_mask)
    if bias is not None:
        if is_causal:
            raise _error("attn_mask: a CausalBias cannot be combined with is_causal=True "
                         "(PyTorch's rule)", "attn_mask")
        causal, attn_mask = bias, None
    relevant = tuple(t for t in (query, key, value, attn_mask) if isinstance(t, torch.Tensor))
    if not torch.compiler.is_compiling() and ta.torch_function_active(relevant):
        # Subclasses, biases and TorchFunctionModes: PyTorch's function, through them.
        ta.OWN.fell_back("torch_function")
        target = ta.torch_function_target(torch.nn.functional.scaled_dot_product_attention,
                                          relevant)
        return torch.overrides.handle_torch_function(
            target, relevant, query, key, value,
            attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=True,
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_torch(torch, t, name)
    if dropout_p:
        raise _error(
            f"dropout_p: {dropout_p} is not supported; dattn computes inference only "
            f"(pass dropout_p=0.0, e.g. dropout_p=p if self.training else 0.0)",
            "dropout_p",
        )
    if not isinstance(is_causal, bool):
        raise _with_field(
            InvalidArgument, f"is_causal: expected a bool, got {is_causal!r:.80}", "is_causal"
        )
    if attn_mask is not None and is_causal:
        raise _error(
            "attn_mask: an explicit attn_mask cannot be combined with is_causal=True "
            "(PyTorch's rule); fold the causal triangle into the mask",
            "attn_mask",
        )
    if is_causal:
        causal = ta.CAUSAL_TOP_LEFT
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
            raise _error(f"{name}: batch dims {t_lead} do not broadcast to the query's {lead}", name)
    if attn_mask is not None:
        _check_torch(torch, attn_mask, "attn_mask")
        _check_broadcast(attn_mask, tuple(query.shape[:-1]) + (int(key.shape[-2]),))
    scale = None if scale is None else as_float(scale, "scale")
    heads, kv_heads = (int(query.shape[-3]), int(key.shape[-3])) if rank >= 3 else (1, 1)
    if kv_heads == 0 or heads % kv_heads != 0:
        raise _error(
            f"key: {kv_heads} heads do not divide the query's {heads} heads (GQA needs "
            f"H % Hkv == 0)",
            "key",
        )
    if (int(query.shape[-1]) != int(key.shape[-1]) or int(key.shape[-2]) != int(value.shape[-2])
            or (rank >= 3 and int(value.shape[-3]) != kv_heads)):
        raise _error(
            f"query/key/value: shapes {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)} do not match ([..., H, L, E], [..., Hkv, S, E], "
            f"[..., Hkv, S, Ev])",
            "key",
        )
    q4, k4, v4, m4, out_shape = ta._as_4d(query, key, value, attn_mask)
    return ta.own_sdpa(q4, k4, v4, m4, causal, scale).reshape(out_shape)


class SdpaPatch:
    """An active ``patch_torch_sdpa()``: ``undo()`` (or calling it, or leaving its ``with``
    block) gives up this handle; when the last handle is given up, the function PyTorch had
    before the first patch is restored. Giving up a handle twice is harmless. ``calls`` and
    ``fallbacks`` (a Counter by reason) count what this handle's configuration served and
    handed to PyTorch; ``backend_name`` is the dattn backend its calls run on."""

    def __init__(self, backend: Optional[str], backend_kwargs: Optional[dict]):
        from . import torch_adapter as ta

        self.client = ta.Client("patch_torch_sdpa", backend, backend_kwargs)
        self.active = True
        with _LOCK:
            self._hook = ta.acquire_sdpa(self)
            ta.SdpaPatchState.handles.append(self)

    @property
    def backend_name(self) -> str:
        return self.client.backend

    @property
    def calls(self) -> int:
        return self.client.calls

    @property
    def fallbacks(self):
        return self.client.fallbacks

    def undo(self) -> None:
        from . import torch_adapter as ta

        with _LOCK:
            if not self.active:
                return
            self.active = False
            ta.SdpaPatchState.handles.remove(self)
            self._hook.release(self)

    __call__ = undo

    def __enter__(self) -> "SdpaPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return (f"SdpaPatch(active={self.active}, backend={self.backend_name!r}, "
                f"calls={self.calls}, fallbacks={dict(self.fallbacks)})")


_LOCK = threading.RLock()


def patch_torch_sdpa(backend: Optional[str] = None,
                     backend_kwargs: Optional[dict] = None) -> SdpaPatch:
    """Install dattn's ``scaled_dot_product_attention`` as
    ``torch.nn.functional.scaled_dot_product_attention``.

    ``backend``: the dattn backend the calls run on (default: dattn's automatic choice, FLASH;
    e.g. ``"SAGE"`` for 8-bit attention), ``backend_kwargs`` its options. The patched function
    behaves as PyTorch's: what dattn serves it computes with PyTorch's semantics (and PyTorch's
    answer on non-finite inputs); everything else goes to the function it replaced, counted in
    the handle's ``fallbacks`` by reason: tensors not on the CPU, dtypes dattn does not compute,
    inputs that require grad while grad mode is on, dropout, arguments PyTorch refuses or
    dattn does not know, ``__torch_function__`` objects and modes (handled through the patched
    function, so they see it), vmap / grad / jvp / forward-mode AD, nested tensors and other
    dispatch subclasses, TorchScript tracing, ``sdpa_kernel`` restrictions that exclude PyTorch's
    flash kernel. ``torch.compile`` / ``torch.export`` / fake tensors record the custom op
    ``dattn::sdpa``; TorchScript's ``script`` sees PyTorch's builtin. Needs PyTorch 2.0 or
    later. Code that looks the function up at call time (``F.scaled_dot_product_attention``)
    uses it without edits; a name imported before the patch keeps the old function.

    Returns an :class:`SdpaPatch`: a context manager and an undo function. Patching twice is
    harmless (the newest active handle's backend serves); the original comes back when every
    handle is undone."""
    torch = _torch()
    if getattr(torch.nn.functional, "scaled_dot_product_attention", None) is None:
        raise _with_field(
            Unsupported,
            f"patch_torch_sdpa: torch {torch.__version__} has no "
            f"torch.nn.functional.scaled_dot_product_attention (PyTorch 2.0 or later)",
            "torch",
        )
    return SdpaPatch(backend, backend_kwargs)
