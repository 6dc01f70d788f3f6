"""Where dattn's own layers meet PyTorch: :meth:`dattn.Attention.forward` on torch tensors
(recorded as the custom op ``dattn::forward`` where a graph is traced or compiled), the thread
count of calls on torch tensors, and the reading of PyTorch's dispatch state that decides
whether a call computes here, goes into a graph or is refused. :mod:`dattn.attention` calls
:func:`layer_forward` on its first torch call; :mod:`dattn.torch_adapter` (the SDPA drop-in and
dattn.diffusers) builds on this module. Importing it imports torch.
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.overrides import has_torch_function

from .errors import InvalidArgument, Unsupported, _with_field
from .layer_registry import LAYERS_BY_ID

#: causal modes of the ops: none, PyTorch's top-left (``is_causal``, CausalBias upper-left) and
#: bottom-right (CausalBias lower-right, dattn's own default alignment).
CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2

# The dispatch keys a plain dense CPU tensor may carry (inference-mode tensors carry fewer).
_PLAIN_KEYS = torch._C._dispatch_keys(torch.empty(0, device="cpu")).raw_repr()
_LAZY_KEYS = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.Negative)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate)
).raw_repr()


# --- threads ---------------------------------------------------------------------------------

_THREADS: Dict[str, Optional[int]] = {"override": None}


def set_num_threads(threads: Optional[int]) -> None:
    """The threads every dattn call on torch tensors uses: ``None`` (the default) follows
    ``torch.get_num_threads()``, PyTorch's intra-op count, which ``torch.set_num_threads`` sets
    for every thread; an int >= 1 fixes it for dattn alone."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise _with_field(
            InvalidArgument, f"threads: expected None or an int >= 1, got {threads!r:.80}",
            "threads",
        )
    _THREADS["override"] = threads


def call_threads() -> int:
    """The thread count of the next call (see :func:`set_num_threads`)."""
    override = _THREADS["override"]
    return override if override is not None else torch.get_num_threads()


# --- tensors ---------------------------------------------------------------------------------


def _plain_type(t) -> bool:
    tf = getattr(type(t), "__torch_function__", None)
    return type(t) in (torch.Tensor, torch.nn.Parameter) or tf is torch._C._disabled_torch_function_impl


def torch_function_active(tensors) -> bool:
    """Whether a call on ``tensors`` belongs to ``__torch_function__``: an argument's class
    overrides it (a tensor subclass, an attention bias, a nested tensor) or a
    ``TorchFunctionMode`` is active. ``torch.set_default_device``'s mode (DeviceContext) does not
    count: it concerns factory functions only, and dattn allocates on its inputs' device."""
    if not has_torch_function(tensors):
        return False
    if any(not _plain_type(t) for t in tensors):
        return True
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return any(not isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def plain_keys(t: torch.Tensor) -> bool:
    """Whether ``t`` dispatches as a plain dense CPU tensor (no subclass, wrapper, lazy bit)."""
    return torch._C._dispatch_keys(t).raw_repr() & ~_PLAIN_KEYS == 0


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with PyTorch's lazy negation / conjugation applied (a copy only where one is set)."""
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_conj():
        t = t.resolve_conj()
    return t


def empty(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A new tensor on ``like``'s device (never the default device)."""
    return torch.empty(tuple(shape), dtype=like.dtype if dtype is None else dtype,
                       device=like.device)


def _graph_modes_only() -> bool:
    """Whether every active ``__torch_dispatch__`` mode is one of PyTorch's graph-capturing
    ones (fake tensors, functionalization, proxy tracing for make_fx / export)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    try:
        from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
    except ImportError:  # pragma: no cover
        ProxyTorchDispatchMode = FakeTensorMode
    graph = (FakeTensorMode, FunctionalTensorMode, ProxyTorchDispatchMode)
    return all(isinstance(m, graph) for m in _get_current_dispatch_mode_stack())


def _is_graph_tensor(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def _has_tangent(tensors) -> bool:
    import torch.autograd.forward_ad as fwAD

    if getattr(fwAD, "_current_level", -1) < 0:
        return False
    return any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


def dispatch_route(tensors: Sequence[torch.Tensor], trace_as_op: bool) -> Optional[str]:
    """What PyTorch's dispatch state makes of a call on ``tensors`` (after the
    ``__torch_function__`` check): None = dattn computes it here; ``"graph"`` = record the
    custom op (fake tensors, a graph-capturing dispatch mode; TorchScript's tracer when
    ``trace_as_op``); any other string = the reason it goes to PyTorch."""
    if torch._C._get_tracing_state() is not None:
        return "graph" if trace_as_op else "jit_trace"
    if torch._C._len_torch_dispatch_stack() > 0:
        return "graph" if _graph_modes_only() else "dispatch_mode"
    if torch._C._functorch.maybe_current_level() is not None:
        return "functorch"
    graph = False
    for t in tensors:
        keys = torch._C._dispatch_keys(t).raw_repr()
        if keys & ~_PLAIN_KEYS == 0:
            continue
        if _is_graph_tensor(t):
            graph = True
            continue
        if t.is_nested:
            return "nested"
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return "functorch"
        if t.device.type != "cpu":
            return "device"
        if t.layout != torch.strided:
            return "layout"
        if keys & ~(_PLAIN_KEYS | _LAZY_KEYS) == 0:
            continue  # lazy negation / conjugation: resolved before dattn reads it
        return "dispatch_keys"
    if _has_tangent(tensors):
        return "forward_ad"
    return "graph" if graph else None


def _op_layer(layer: int):
    attn = LAYERS_BY_ID.get(layer)
    if attn is None:
        raise _with_field(
            Unsupported,
            f"dattn::forward: layer {layer} is not alive in this process (a dattn.Attention "
            f"call recorded in a graph runs while its layer lives)",
            "layer",
        )
    return attn



@torch.library.custom_op("dattn::forward", mutates_args=(), device_types="cpu")
def forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tensors: List[torch.Tensor],
    layer: int,
    call: str,
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A :class:`dattn.Attention` call (the layer by its op id, the metadata as JSON with its
    tensors in ``tensors``). Returns (out, lse): lse empty unless ``return_lse``."""
    attn = _op_layer(layer)
    meta = _meta_from_json(call, tensors)
    result = attn._forward_tensors(query, key, value, meta, return_lse, None, call_threads())
    out, lse = result if return_lse else (result, None)
    if lse is None:
        lse = query.new_empty((0,), dtype=torch.float32)
    return out, lse


@forward_op.register_fake
def _forward_fake(query, key, value, tensors, layer, call, return_lse):
    attn = _op_layer(layer)
    data = json.loads(call) or {}
    jq = data.get("joint_query")
    joint = tensors[jq["__tensor__"]] if isinstance(jq, dict) else None
    out_shape, lse_shape = attn._shapes(query, value, attn._joint_rows_of(joint))
    out = query.new_empty(out_shape if out_shape else (0,))
    lse = query.new_empty(lse_shape if (return_lse and lse_shape) else (0,), dtype=torch.float32)
    return out, lse


def _meta_to_json(meta, tensors: List[torch.Tensor]) -> str:
    """``meta`` (any AttentionMetadata-like object or mapping) as JSON, its tensors appended to
    ``tensors`` and named by index. Raises Unsupported for a value JSON cannot carry."""
    from .metadata import metadata_dict

    def collect(t, name):
        tensors.append(t)
        return {"__tensor__": len(tensors) - 1}

    d = metadata_dict(meta, collect)
    try:
        return _dumps(d)
    except TypeError as e:
        raise _with_field(
            Unsupported,
            f"attn_metadata: a value of it cannot be recorded in a graph ({e}); pass plain "
            f"ints, floats, strings and tensors",
            "attn_metadata",
        ) from None


def _dumps(d) -> str:
    """JSON of constants; dynamo evaluates it while tracing (the result is a constant)."""
    return json.dumps(d)


# Marked as torch._dynamo.assume_constant_result marks a function (an attribute of it) without
# importing torch._dynamo where nothing has yet: that import alone costs 2.6 s and about 70 MiB
# of RSS, paid by every user of dattn on torch tensors who never compiles. A process that compiles
# imports it before it traces; tests/python/test_compile.py checks that the decorator sets this
# same mark.
if "torch._dynamo" in sys.modules:
    _dumps = torch._dynamo.assume_constant_result(_dumps)
else:
    _dumps._dynamo_marked_constant = True


def _meta_from_json(call: str, tensors) -> Optional[dict]:
    from .tensors import tensor_arg

    def restore(x, name=""):
        if isinstance(x, dict):
            if set(x) == {"__tensor__"}:
                return tensor_arg(tensors[x["__tensor__"]], name)
            return {k: restore(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [restore(v, name) for v in x]
        return x

    data = json.loads(call)
    return None if data is None else restore(data)


def layer_forward(attn, query, key, value, attn_metadata, return_lse: bool, out):
    """:meth:`dattn.Attention.forward` on torch tensors: computed here, or as ``dattn::forward``
    where a graph is being traced or compiled. dattn's own API has no PyTorch function to hand
    back to: vmap, forward-mode AD, nested tensors and other dispatch subclasses are refused
    with :class:`dattn.Unsupported` naming the feature."""
    tensors = [t for t in (query, key, value, out) if isinstance(t, torch.Tensor)]
    graph = torch.compiler.is_compiling()
    if not graph:
        route = dispatch_route(tensors, trace_as_op=True)
        if route in ("device", "layout"):
            route = None  # the core names the tensor and its device or layout
        if route not in (None, "graph"):
            raise _with_field(
                Unsupported,
                f"query: dattn.Attention does not compute under {route} (it has no PyTorch "
                f"function to hand the call to); use torch.nn.functional."
                f"scaled_dot_product_attention there",
                "query",
            )
        graph = route == "graph"
    if not graph:
        return attn._forward_tensors(query, key, value, attn_metadata, return_lse, out,
                                     call_threads())
    if out is not None:
        raise _with_field(
            Unsupported, "out: an output buffer cannot be recorded in a graph; drop out=", "out"
        )
    meta_tensors: List[torch.Tensor] = []
    call = "null" if attn_metadata is None else _meta_to_json(attn_metadata, meta_tensors)
    o, lse = forward_op(query, key, value, meta_tensors, id(attn), call, return_lse)
    return (o, lse) if return_lse else o


