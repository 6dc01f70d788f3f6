"""Where dattn meets PyTorch: one module for the SDPA drop-in, dattn.diffusers and dattn's own
functions on torch tensors.

What lives here, once:

- **The decision** (``route``): whether a call is served by dattn, recorded as dattn's custom
  op (a graph being traced or compiled), handed to an object's ``__torch_function__`` or a
  ``TorchFunctionMode``, or handed to PyTorch's own function (a *fallback*, counted with its
  reason). It is read off PyTorch's own dispatch state: ``__torch_function__`` overrides and
  modes (``torch.overrides.has_torch_function``), dynamo (``torch.compiler.is_compiling``),
  TorchScript's tracer, the ``__torch_dispatch__`` mode stack (fake tensors, export and make_fx
  tracing), functorch levels (vmap, grad, jvp), forward-mode AD levels, each tensor's dispatch
  keys (device, layout, nested, lazy negation/conjugation, other subclasses), grad mode,
  autocast and ``torch.nn.attention.sdpa_kernel``'s enabled backends. What depends on the
  values (PyTorch's argument rules, empty dims, non-finite inputs) is decided inside the
  computation, so eager calls and compiled graphs decide alike.
- **The custom ops** ``dattn::sdpa`` (PyTorch's SDPA semantics on 4-D views, BHSD or BSHD, with
  an optional LSE) and ``dattn::forward`` (a :class:`dattn.Attention` call with its metadata),
  each with a fake implementation, so ``torch.compile`` (any backend, static, dynamic and
  unbacked sizes), ``torch.export``, ``make_fx``, ``FakeTensorMode`` and ``torch.jit.trace`` of
  dattn's own functions record dattn inside the graph.
- **The layers** (one bounded cache of :class:`dattn.Attention` per configuration), the mask
  broadcast and the causal mapping (PyTorch's top-left ``is_causal``, ``CausalBias``
  upper-left / lower-right onto dattn's global starts).
- **The hooks** (:class:`Hook`): dattn's function installed over an attribute
  (``torch.nn.functional.scaled_dot_product_attention``, a diffusers module's
  ``dispatch_attention_fn``), reference-counted by its users (patch handles, diffusers
  handles), inert once the last user leaves (so a stale copy that someone restores calls what
  it replaced), known to TorchScript as PyTorch's builtin while installed.
- **Threads**: every call runs on ``torch.get_num_threads()`` threads (PyTorch's intra-op
  count, the same in every thread), unless :func:`set_num_threads` says otherwise.

Importing this module imports torch; ``import dattn`` does not import it.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.overrides import handle_torch_function

from .backends import adapter_backend
from .errors import NotAvailable, Unsupported, _with_field
from .torch_layer import (  # noqa: F401 (re-exported: the adapter's users read them here)
    CAUSAL_BOTTOM_RIGHT,
    CAUSAL_NONE,
    CAUSAL_TOP_LEFT,
    _has_tangent,
    _is_graph_tensor,
    _plain_type,
    call_threads,
    dispatch_route,
    empty,
    forward_op,
    layer_forward,
    plain_keys,
    resolved,
    set_num_threads,
    torch_function_active,
)

#: PyTorch's own kernel, whatever ``torch.nn.functional.scaled_dot_product_attention`` is now.
PYTORCH_SDPA = torch._C._nn.scaled_dot_product_attention

SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --- counters --------------------------------------------------------------------------------


def check_backend_kwargs(backend: Optional[str], backend_kwargs: dict) -> None:
    """Checks ``backend_kwargs`` for ``backend`` now, as a layer would (an unknown or misspelled
    key, or a value of the wrong type or outside the valid set: ``InvalidArgument`` naming it),
    so that patch_torch_sdpa and dattn.diffusers.enable refuse them when called, not at the first
    call inside the model: a probe layer of one head of size 64 is built and dropped."""
    from .attention import Attention

    Attention(1, 64, backend=backend, backend_kwargs=backend_kwargs)


class Client:
    """Who a call is served for: the backend configuration its layers are built with and its
    counters (``calls``: calls dattn computed; ``fallbacks``: calls handed to PyTorch, by
    reason). The SDPA patch, each dattn.diffusers handle and dattn's own functions each have
    one."""

    def __init__(self, name: str, backend: Optional[str] = None,
                 backend_kwargs: Optional[dict] = None, explicit: bool = True):
        self.name = name
        self.backend, self.allow_fallback = adapter_backend(backend)
        self.backend_kwargs = dict(backend_kwargs or {})
        if self.backend_kwargs:
            check_backend_kwargs(self.backend, self.backend_kwargs)
        if explicit and self.backend != "REFERENCE":  # a user chose dattn for `name`
            from .slow_cpu import warn_explicit

            warn_explicit(name)
        self.config = json.dumps(
            {"backend": self.backend, "allow_fallback": self.allow_fallback,
             "backend_kwargs": self.backend_kwargs},
            sort_keys=True, default=str,
        )
        _CONFIGS[self.config] = self
        self.calls = 0
        self.fallbacks: Counter = Counter()
        self._lock = threading.Lock()

    def served(self) -> None:
        with self._lock:
            self.calls += 1

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def engines(self) -> List[str]:
        """The compute engines this client's layers ran on (e.g. ["avx512_bf16"])."""
        with _LAYERS_LOCK:
            layers = [layer for key, layer in _LAYERS.items() if key[0] == self.config]
        return sorted({layer.last_engine for layer in layers} - {""})

    def __repr__(self) -> str:
        return (f"Client({self.name!r}, backend={self.backend!r}, calls={self.calls}, "
                f"fallbacks={dict(self.fallbacks)})")


#: Clients by configuration string (what the ops carry), so an op call finds its layers.
_CONFIGS: Dict[str, Client] = {}

#: The client of calls inside compiled or traced graphs (their decisions at run time).
GRAPHS = Client("graphs", explicit=False)

#: The client of dattn.scaled_dot_product_attention and dattn.Attention.
OWN = Client("dattn", explicit=False)


def _client_of(config: str) -> Client:
    client = _CONFIGS.get(config)
    if client is None:  # a graph made in another process: rebuild the configuration
        data = json.loads(config) if config else {}
        client = Client("graph", data.get("backend"), data.get("backend_kwargs"),
                        explicit=False)
    return client


# --- layers ----------------------------------------------------------------------------------

_LAYERS: "OrderedDict[tuple, Any]" = OrderedDict()
_LAYERS_MAX = 128
_LAYERS_LOCK = threading.Lock()


def _layer(client: Client, layout: str, heads: int, kv_heads: int, head_size: int,
           causal: bool, scale: Optional[float]):
    from .attention import Attention

    key = (client.config, layout, heads, kv_heads, head_size, causal, scale)
    with _LAYERS_LOCK:
        layer = _LAYERS.get(key)
        if layer is not None:
            _LAYERS.move_to_end(key)
            return layer
    layer = Attention(
        heads, head_size, softmax_scale=scale, causal=causal, num_kv_heads=kv_heads,
        qkv_layout=layout, prefix=f"dattn.torch:{client.name}", backend=client.backend,
        backend_kwargs=client.backend_kwargs, allow_fallback=client.allow_fallback,
    )
    with _LAYERS_LOCK:
        _LAYERS[key] = layer
        while len(_LAYERS) > _LAYERS_MAX:
            _LAYERS.popitem(last=False)
    return layer


# --- PyTorch's answer, for what dattn hands back inside a computation ---------------------------


def _bottom_right_mask(sq: int, skv: int, device) -> torch.Tensor:
    """CausalBias lower-right as a bool keep-mask: key j visible to row i iff j <= i + skv - sq."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).tril(skv - sq)


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "BSHD" else t


def pytorch_attention(q, k, v, mask, causal: int, scale, enable_gqa: bool, layout: str,
                      return_lse: bool):
    """PyTorch's own answer for a ``dattn::sdpa`` call (its kernel, its errors)."""
    q, k, v = (_to_bhsd(t, layout) for t in (q, k, v))
    is_causal = causal == CAUSAL_TOP_LEFT
    if causal == CAUSAL_BOTTOM_RIGHT:
        mask = _bottom_right_mask(q.shape[-2], k.shape[-2], q.device)
    if not return_lse:
        out = PYTORCH_SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                           enable_gqa=enable_gqa)
        return _to_bhsd(out, layout), None
    if enable_gqa and k.shape[1] != q.shape[1] and k.shape[1] > 0:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    # The LSE is what PyTorch's CPU flash kernel returns beside the output; the math answer
    # for what that kernel does not take (empty dims, masks of another dtype).
    s = torch.matmul(q.float(), k.float().transpose(-1, -2))
    s = s * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    hidden = torch.isneginf(lse)[..., None]
    out = torch.matmul(p.masked_fill(hidden, 0.0), v.float()).to(q.dtype)
    return _to_bhsd(out, layout), lse


def _pytorch_rules(q, k, v, mask, enable_gqa: bool, layout: str) -> Optional[str]:
    """The reason PyTorch's rules, not dattn's, decide this call (PyTorch raises or computes
    something dattn's mapping does not take), else None."""
    h_dim, s_dim = (2, 1) if layout == "BSHD" else (1, 2)
    if not (q.dtype == k.dtype == v.dtype):
        return "dtype"
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return "dtype"
    b, h, e = q.shape[0], q.shape[h_dim], q.shape[3]
    hk, skv = k.shape[h_dim], k.shape[s_dim]
    if k.shape[0] != b or v.shape[0] != b or k.shape[3] != e:
        return "shape"
    if v.shape[h_dim] != hk or v.shape[s_dim] != skv:
        return "shape"
    if hk != h and (not enable_gqa or hk == 0 or h % hk):
        return "gqa"
    if mask is not None:
        if mask.dim() > 4:
            return "shape"
        full = (b, h, q.shape[s_dim], skv)
        m = mask.shape[-4:] if mask.dim() == 4 else (1,) * (4 - mask.dim()) + tuple(mask.shape)
        if any(have not in (1, want) for have, want in zip(m, full)):
            return "shape"
    if 0 in (h, e, hk, v.shape[3]):
        return "empty"  # PyTorch returns an empty tensor; dattn's layers need heads and sizes
    return None


def _finite(*tensors) -> bool:
    """Whether every input element is finite: dattn's scan of the exponent bits (a pass at
    memory speed; torch.isfinite(t).all() builds a bool tensor, 30 ms for a bf16 Flux Q)."""
    from . import _core
    from .tensors import tensor_arg

    return all(t.numel() == 0 or _core.all_finite(tensor_arg(t, "tensor")) for t in tensors)


def _mask_4d(mask, b: int, h: int, sq: int, skv: int):
    """A mask that broadcasts to [B, H, Sq, Skv] as dattn's 4-D mask view [B|1, H|1, Sq, Skv]
    (stride-0 expands, never a copy)."""
    m = mask[(None,) * (4 - mask.dim())] if mask.dim() < 4 else mask
    return m.expand(m.shape[0], m.shape[1], sq, skv)


def _empty_dims(q, k, v, layout: str) -> bool:
    h_dim, s_dim = (2, 1) if layout == "BSHD" else (1, 2)
    del s_dim  # no rows, no keys or no batch: dattn's answer (zeros where no key is seen)
    return 0 in (q.shape[h_dim], q.shape[3], k.shape[h_dim], v.shape[3])


def attention(client: Client, q, k, v, mask, causal: int, scale, enable_gqa: bool,
              layout: str, return_lse: bool, pytorch_rules: bool = True):
    """One ``dattn::sdpa`` call on real CPU tensors: dattn's answer where PyTorch's rules and the
    values allow it, else PyTorch's (counted on ``client``). 4-D ``layout`` ("BHSD" or "BSHD")
    views; returns (out, lse or None). ``pytorch_rules=False`` (dattn's own
    scaled_dot_product_attention, which validated the call itself): dattn's rules (any GQA,
    mixed dtypes read, non-finite inputs as docs/semantics.md says); only empty dims go to
    PyTorch."""
    if pytorch_rules:
        reason = _pytorch_rules(q, k, v, mask, enable_gqa, layout)
        if reason is None and scale is not None and not math.isfinite(scale):
            reason = "scale"
    else:
        reason = "empty" if _empty_dims(q, k, v, layout) else None
        enable_gqa = True
    q, k, v = resolved(q), resolved(k), resolved(v)
    if mask is not None:
        mask = resolved(mask)
    if reason is None and pytorch_rules and not _finite(q, k, v):
        reason = "non_finite"  # PyTorch's answer for inf/NaN inputs, row for row
    if reason is not None:
        client.fell_back(reason)
        if not pytorch_rules:
            k, v = k.to(q.dtype), v.to(q.dtype)
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.to(q.dtype)
        return pytorch_attention(q, k, v, mask, causal, scale, enable_gqa, layout, return_lse)
    if layout == "BSHD":
        (b, sq, h, d), hkv, skv = q.shape, k.shape[2], k.shape[1]
    else:
        (b, h, sq, d), hkv, skv = q.shape, k.shape[1], k.shape[2]
    layer = _layer(client, layout, h, hkv, d, causal != CAUSAL_NONE, scale)
    from .metadata import AttentionMetadata

    meta = None
    if causal == CAUSAL_TOP_LEFT:
        meta = AttentionMetadata(q_global_start=0, k_global_start=0)
    elif mask is not None:
        meta = AttentionMetadata(attn_mask=_mask_4d(mask, b, h, sq, skv))
    try:
        result = layer._forward_tensors(q, k, v, meta, return_lse, None, call_threads())
    except (Unsupported, NotAvailable) as e:
        client.fell_back(f"unsupported:{getattr(e, 'field', '') or 'call'}")
        return pytorch_attention(q, k, v, mask, causal, scale, enable_gqa, layout, return_lse)
    client.served()
    return result if return_lse else (result, None)


# --- the custom ops --------------------------------------------------------------------------


@torch.library.custom_op("dattn::sdpa", mutates_args=(), device_types="cpu")
def sdpa_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    causal: int,
    scale: Optional[float],
    enable_gqa: bool,
    layout: str,
    config: str,
    return_lse: bool,
    pytorch_rules: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's SDPA semantics on 4-D views (``layout`` BHSD or BSHD) computed by dattn (or by
    PyTorch where its rules or the values decide); ``config`` names the backend configuration.
    Returns (out, lse): lse [B, H, L] f32 when ``return_lse``, else an empty tensor.
    ``pytorch_rules=False``: dattn's own function's rules (:func:`attention`)."""
    out, lse = attention(_client_of(config) if config else GRAPHS, query, key, value, attn_mask,
                         causal, scale, enable_gqa, layout, return_lse, pytorch_rules)
    if lse is None:
        lse = query.new_empty((0,), dtype=torch.float32)
    return out, lse.float()


@sdpa_op.register_fake
def _sdpa_fake(query, key, value, attn_mask, causal, scale, enable_gqa, layout, config,
               return_lse, pytorch_rules=True):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    if not return_lse:
        return out, query.new_empty((0,), dtype=torch.float32)
    if layout == "BSHD":
        lse_shape = (query.shape[0], query.shape[2], query.shape[1])
    else:
        lse_shape = tuple(query.shape[:-1])
    return out, query.new_empty(lse_shape, dtype=torch.float32)


# --- PyTorch's SDPA signature ---------------------------------------------------------------

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
SDPA_KWARGS = frozenset(SDPA_ARGS) | {"enable_gqa"}


def bind_sdpa(args, kwargs) -> Optional[dict]:
    """The call's arguments by name, or None where they are not PyTorch's signature (PyTorch
    then raises its own TypeError)."""
    if len(args) > len(SDPA_ARGS) or any(k not in SDPA_KWARGS for k in kwargs):
        return None
    named = dict(zip(SDPA_ARGS, args))
    if any(k in named for k in kwargs):
        return None
    named.update(kwargs)
    if not all(n in named for n in ("query", "key", "value")):
        return None
    return named


def _causal_bias_mode(mask) -> Optional[int]:
    """The causal mode a ``torch.nn.attention.bias.CausalBias`` stands for, else None. Read
    from the module where it is loaded (a CausalBias exists only then): importing it imports
    torch._dynamo (2.6 s, about 70 MiB), which no call should pay for nothing."""
    bias = sys.modules.get("torch.nn.attention.bias")
    if bias is None or type(mask) is not getattr(bias, "CausalBias", None):
        return None
    CausalVariant = bias.CausalVariant
    if type(mask) is not bias.CausalBias:
        return None
    if mask.variant == CausalVariant.UPPER_LEFT or mask.seq_len_q == mask.seq_len_kv:
        return CAUSAL_TOP_LEFT
    if mask.variant == CausalVariant.LOWER_RIGHT:
        return CAUSAL_BOTTOM_RIGHT
    return None


def _sdpa_flash_enabled() -> bool:
    """Whether ``torch.nn.attention.sdpa_kernel`` (or torch.backends' switches) leaves
    PyTorch's flash kernel enabled: dattn stands in for that kernel; a call restricted to other
    kernels (MATH, EFFICIENT_ATTENTION, ...) gets PyTorch's choice, or its error."""
    return bool(torch._C._get_flash_sdp_enabled())


def _autocast_dtype() -> Optional[torch.dtype]:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def _autocast(t, dtype):
    """What CPU autocast does to a tensor argument of a lower-precision op: floating tensors
    other than float64 are cast to the autocast dtype."""
    if t is not None and t.is_floating_point() and t.dtype not in (torch.float64, dtype):
        return t.to(dtype)
    return t


def _as_4d(q, k, v, mask):
    """SDPA's [..., H, L, E] tensors as 4-D [B, H, L, E] views (or reshapes where leading dims
    do not merge), key/value broadcast over the query's leading dims; the mask as a 4-D (or
    lower-rank) tensor broadcasting to the result. Returns (q4, k4, v4, mask4, out_shape)."""
    rank = q.dim()
    out_shape = (*q.shape[:-1], v.shape[-1])
    if rank < 4:
        q4, k4, v4 = (t[(None,) * (4 - rank)] for t in (q, k, v))
        m = mask
        if m is not None and m.dim() > 2:
            m = m[(None,) * (4 - m.dim())] if m.dim() < 4 else m
        return q4, k4, v4, m, out_shape
    lead = tuple(q.shape[:-3])
    k = k.expand(*lead, *k.shape[-3:])  # PyTorch broadcasts key/value batch dims
    v = v.expand(*lead, *v.shape[-3:])
    if rank == 4:
        return q, k, v, mask, out_shape
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    m = mask
    if m is not None and m.dim() > 3:
        m = m[(None,) * (rank - m.dim())]
        if all(d == 1 for d in m.shape[:-3]):
            m = m.reshape(1, *m.shape[-3:])
        else:
            m = m.expand(*lead, *m.shape[-3:]).reshape(-1, *m.shape[-3:])
    return q4, k4, v4, m, out_shape


def _eager_reason(bound: dict, layout: str, sizes: bool) -> Optional[str]:
    """Why a bound call on tensors (dispatch state already decided) goes to PyTorch, by what it
    asks for: argument types, dropout, devices, grad, ranks, dtypes, ``sdpa_kernel``, and with
    ``sizes`` (not while dynamo traces: sizes may be symbolic there, and the op decides them)
    PyTorch's shape rules. None to serve it."""
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    is_causal = bound.get("is_causal", False)
    if not isinstance(is_causal, bool):
        return "arguments"  # PyTorch's TypeError for 1, "yes", tensor(True)
    if not isinstance(bound.get("enable_gqa", False), bool):
        return "arguments"
    dropout = bound.get("dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool):
        return "arguments"
    scale = bound.get("scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return "arguments"
    if dropout:
        return "dropout"
    tensors = [q, k, v] + ([mask] if mask is not None else [])
    if any(t.device.type != "cpu" for t in tensors):
        return "device"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "grad"
    if layout == "BSHD" and q.dim() != 4:
        return "shape"
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        return "shape"
    if mask is not None and (mask.dim() < 2 or mask.dim() > (4 if layout == "BSHD" else q.dim())):
        return "shape"  # a 1-D (S,) mask: PyTorch's own error
    if mask is not None and is_causal:
        return "mask_and_causal"  # PyTorch raises for it
    dtype = _autocast_dtype()
    if dtype is not None:
        q, k, v, mask = (_autocast(t, dtype) for t in (q, k, v, mask))
    if q.dtype not in SERVED_DTYPES or k.dtype not in SERVED_DTYPES or v.dtype not in SERVED_DTYPES:
        return "dtype"
    if not (q.dtype == k.dtype == v.dtype):
        return "dtype"  # PyTorch's error
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return "dtype"  # PyTorch's error
    if not _sdpa_flash_enabled():
        return "sdpa_kernel"
    if sizes:
        if layout == "BHSD":
            q, k, v, mask, _ = _as_4d(q, k, v, mask)
        return _pytorch_rules(q, k, v, mask, bool(bound.get("enable_gqa", False)), layout)
    return None


def _compute(client: Client, bound: dict, layout: str, causal: int, graph: bool):
    """The served call: autocast's casts, SDPA's ranks as 4-D views (layout BHSD), then dattn
    here or (``graph``) the ``dattn::sdpa`` op."""
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    dtype = _autocast_dtype()
    if dtype is not None:
        q, k, v, mask = (_autocast(t, dtype) for t in (q, k, v, mask))
    out_shape = None
    if layout == "BHSD":
        q, k, v, mask, out_shape = _as_4d(q, k, v, mask)
    scale = bound.get("scale")
    scale = None if scale is None else float(scale)
    gqa = bool(bound.get("enable_gqa", False))
    if graph:
        out, _ = sdpa_op(q, k, v, mask, causal, scale, gqa, layout, client.config, False)
    else:
        out, _ = attention(client, q, k, v, mask, causal, scale, gqa, layout, False)
    return out if out_shape is None else out.reshape(out_shape)


def _count(client: Client, reason: str, compiling: bool) -> None:
    if not compiling:  # dynamo records no bookkeeping; graphs count inside the op
        client.fell_back(reason)


def serve_sdpa(client: Client, public: Callable, original: Callable, args, kwargs):
    """``torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)`` for ``client``:
    ``public`` is the function the call was made through (what ``__torch_function__`` handlers
    see), ``original`` what it replaced (PyTorch's function, or what was installed before).
    While dynamo traces, the decisions are the ones static in a trace and the call becomes
    ``dattn::sdpa`` in the graph."""
    compiling = torch.compiler.is_compiling()
    bound = bind_sdpa(args, kwargs)
    if bound is None:
        _count(client, "arguments", compiling)
        return original(*args, **kwargs)
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not (
        mask is None or isinstance(mask, torch.Tensor)
    ):
        _count(client, "arguments", compiling)
        return original(*args, **kwargs)
    causal = CAUSAL_TOP_LEFT if bound.get("is_causal") is True else CAUSAL_NONE
    relevant = (q, k, v) if mask is None else (q, k, v, mask)
    mode = _causal_bias_mode(mask)
    if not compiling and torch_function_active(relevant):
        if mode is None or torch_function_active((q, k, v)):
            # Tensor subclasses, attention biases and TorchFunctionModes handle the call
            # themselves (torch_function_target says through which function).
            client.fell_back("torch_function")
            return handle_torch_function(torch_function_target(public, relevant), relevant,
                                         *args, **kwargs)
    if mode is not None:
        if bound.get("is_causal"):
            _count(client, "mask_and_causal", compiling)
            return handle_torch_function(public, relevant, *args, **kwargs)  # its ValueError
        causal = mode  # CausalBias: dattn's causal with its alignment
        bound = dict(bound, attn_mask=None)
        relevant = (q, k, v)
    route = "graph" if compiling else dispatch_route(relevant, trace_as_op=False)
    reason = route if route not in (None, "graph") else _eager_reason(bound, "BHSD", not compiling)
    if reason is not None:
        _count(client, reason, compiling)
        if mode is not None:
            return pytorch_causal_bias(original, bound, causal)
        return original(*args, **kwargs)
    return _compute(client, bound, "BHSD", causal, route == "graph")


def torch_function_target(public: Callable, tensors) -> Callable:
    """The function ``__torch_function__`` handlers are given for an SDPA call: ``public``
    (``torch.nn.functional.scaled_dot_product_attention`` as bound now, what a user's override
    or mode compares ``func`` with, and what an attention bias's handler expects), except where
    an argument is one of PyTorch's own classes outside ``torch.nn.attention`` (nested
    tensors): PyTorch's tables key those on its builtin, which they then get."""
    for t in tensors:
        module = type(t).__module__
        if (module.startswith("torch.") and not module.startswith("torch.nn.attention")
                and not _plain_type(t)):
            return PYTORCH_SDPA
    return public


def pytorch_causal_bias(original: Callable, bound: dict, causal: int):
    """PyTorch's answer for a call whose CausalBias dattn mapped onto ``causal`` (what
    ``CausalBias._dispatch`` computes on the CPU: ``is_causal`` for upper-left, the
    materialised lower-right mask otherwise)."""
    q, k = bound["query"], bound["key"]
    mask = None
    if causal == CAUSAL_BOTTOM_RIGHT:
        mask = _bottom_right_mask(q.shape[-2], k.shape[-2], q.device)
    return original(
        q, k, bound["value"], attn_mask=mask, dropout_p=bound.get("dropout_p", 0.0),
        is_causal=causal == CAUSAL_TOP_LEFT, scale=bound.get("scale"),
        enable_gqa=bound.get("enable_gqa", False),
    )


def own_sdpa(q4, k4, v4, m4, causal: int, scale):
    """dattn.scaled_dot_product_attention on 4-D BHSD tensors it has validated: computed here,
    recorded as ``dattn::sdpa`` in a graph, or (vmap, forward-mode AD, nested tensors, other
    dispatch subclasses, TorchScript tracing: no dattn computation there) PyTorch's answer."""
    tensors = [t for t in (q4, k4, v4, m4) if t is not None]
    if torch.compiler.is_compiling():
        route = "graph"
    else:
        route = dispatch_route(tensors, trace_as_op=True)
    if route == "device":
        bad = next(t for t in tensors if t.device.type != "cpu")
        raise _with_field(
            Unsupported,
            f"query: lives on device {bad.device}; dattn's Python package computes on CPU "
            f"tensors only (move it with .cpu())",
            "query",
        )
    if route == "graph":
        out, _ = sdpa_op(q4, k4, v4, m4, causal, scale, True, "BHSD", OWN.config, False, False)
        return out
    if route is not None:
        OWN.fell_back(route)
        out, _ = pytorch_attention(q4, k4.to(q4.dtype), v4.to(q4.dtype), m4, causal, scale,
                                   True, "BHSD", False)
        return out
    q4, k4, v4 = (t.detach() for t in (q4, k4, v4))
    out, _ = attention(OWN, q4, k4, v4, None if m4 is None else m4.detach(), causal, scale,
                       True, "BHSD", False, pytorch_rules=False)
    return out


# --- hooks -----------------------------------------------------------------------------------


class Hook:
    """dattn's function installed over ``owner.<attr>``. While it has users, a call goes to
    ``serve(hook, *args, **kwargs)``; once the last user has left it is inert (a call goes to
    the function it replaced), which is also what a stale copy restored by someone else does.
    While installed it is known to TorchScript as ``builtin`` (e.g.
    ``aten::scaled_dot_product_attention``), so scripted code sees PyTorch's function."""

    _sites: Dict[Tuple[int, str], "Hook"] = {}
    _lock = threading.RLock()

    def __init__(self, owner, attr: str, serve: Callable, builtin: Optional[str]):
        self.owner, self.attr, self.builtin = owner, attr, builtin
        current = getattr(owner, attr)
        while (hook_of(current) is not None) and not hook_of(current).users:
            current = hook_of(current).original  # an inert hook of ours: skip it
        self.original = current
        self.users: Dict[int, Any] = {}
        hook = self

        @functools.wraps(current)
        def wrapper(*args, **kwargs):
            if not hook.users:
                return hook.original(*args, **kwargs)
            return serve(hook, *args, **kwargs)

        wrapper._dattn_hook = self
        self.wrapper = wrapper

    @classmethod
    def acquire(cls, owner, attr: str, serve: Callable, user, builtin: Optional[str] = None):
        """Adds ``user`` to the live hook at ``owner.attr`` (installing one if there is none)."""
        with cls._lock:
            site = (id(owner), attr)
            hook = cls._sites.get(site)
            if hook is None or not hook.users or getattr(owner, attr) is not hook.wrapper:
                # None yet, or the last one's users are gone, or someone replaced it since:
                # a new hook over what is there now.
                hook = Hook(owner, attr, serve, builtin)
                cls._sites[site] = hook
                setattr(owner, attr, hook.wrapper)
                if builtin is not None:
                    torch.jit._builtins._register_builtin(hook.wrapper, builtin)
            hook.users[id(user)] = user
            return hook

    def release(self, user) -> None:
        """Removes ``user``; the last one out puts back what the hook replaced (if the hook is
        still what ``owner.attr`` holds: a function someone installed over it stays, and ours,
        inside it, is inert)."""
        with Hook._lock:
            if self.users.pop(id(user), None) is None or self.users:
                return
            if getattr(self.owner, self.attr, None) is self.wrapper:
                setattr(self.owner, self.attr, self.original)
            if self.builtin is not None:
                torch.jit._builtins._get_builtin_table().pop(id(self.wrapper), None)
            if Hook._sites.get((id(self.owner), self.attr)) is self:
                del Hook._sites[(id(self.owner), self.attr)]


def hook_of(fn) -> Optional[Hook]:
    """The Hook whose wrapper ``fn`` is (by identity: functools.wraps copies attributes onto
    other people's wrappers of ours), else None."""
    hook = getattr(fn, "_dattn_hook", None)
    return hook if isinstance(hook, Hook) and hook.wrapper is fn else None


# --- F.scaled_dot_product_attention's hook: the SDPA patch and dattn.diffusers -----------------

#: Per thread, the dattn.diffusers handles whose attention modules are running (innermost
#: last). A thread-local list rather than a ContextVar: dynamo traces it.
_MARKS = threading.local()


def marked_handle():
    stack = getattr(_MARKS, "stack", None)
    return stack[-1] if stack else None


def push_mark(handle) -> None:
    stack = getattr(_MARKS, "stack", None)
    if stack is None:
        stack = _MARKS.stack = []
    stack.append(handle)


def pop_mark() -> None:
    _MARKS.stack.pop()


class SdpaPatchState:
    """The SDPA patch's active handles (innermost last): the newest one's client serves."""

    handles: List[Any] = []


def _serve_sdpa_hook(hook: Hook, *args, **kwargs):
    handle = marked_handle()
    if handle is not None and handle.active:
        # A dattn.diffusers handle decides per call (its grid calls, FLASH for the rest).
        return handle.serve_sdpa(hook.wrapper, hook.original, args, kwargs)
    patches = SdpaPatchState.handles
    if patches:
        return serve_sdpa(patches[-1].client, hook.wrapper, hook.original, args, kwargs)
    return hook.original(*args, **kwargs)


def acquire_sdpa(user) -> Hook:
    """``user`` (a patch handle or a diffusers handle) starts using dattn's hook over
    ``torch.nn.functional.scaled_dot_product_attention``."""
    return Hook.acquire(torch.nn.functional, "scaled_dot_product_attention", _serve_sdpa_hook,
                        user, builtin="aten::scaled_dot_product_attention")
