"""dattn as a diffusers attention backend by name, and diffusers' context parallelism on the CPU.

    import dattn.diffusers                      # registers the names "dattn" and "dattn_sage"
    model.set_attention_backend("dattn")        # or: with attention_backend("dattn"): ...

    # one image across processes (the caller starts them and the gloo process group):
    from diffusers import ContextParallelConfig
    model.set_attention_backend("dattn")
    dattn.diffusers.enable_parallelism(model, ContextParallelConfig(ulysses_degree=2))

The public names live in :mod:`dattn.diffusers` (``register``, ``unregister``,
``registered``, ``backend_client``, ``enable_parallelism``); docs/python.md has the steps.

How a name is added. diffusers keys its backend registry (``_AttentionBackendRegistry``) by
``AttentionBackendName``, a closed ``str`` enum, and ``set_attention_backend`` /
``attention_backend`` accept only its members' values. Python's ``enum`` has no public way to
add a member, so :func:`register` adds ``DATTN = "dattn"`` (and ``DATTN_SAGE``) the way the
enum machinery itself records a member: the member object (a ``str`` subclass instance with
``_name_``/``_value_``) in ``_member_map_``, ``_value2member_map_`` and ``_member_names_`` and
as a class attribute; then it registers the backend function with diffusers' own
``_AttentionBackendRegistry.register`` (its constraints, ``supports_context_parallel=True``).
:func:`unregister` undoes both. The risk: these are CPython's enum internals (stable from 3.11
to 3.13, the versions checked by the tests) and diffusers' private registry; a later release of
either may change them, which the tests catch (they check that the name round-trips and that
diffusers' own members and backends are left as they were).
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from ..errors import InvalidArgument, NotAvailable, Unsupported, _with_field

#: The names dattn adds: diffusers' backend value -> (enum member name, dattn backend).
NAMES: Dict[str, tuple] = {
    "dattn": ("DATTN", None),  # dattn's automatic choice: FLASH, exact
    "dattn_sage": ("DATTN_SAGE", "SAGE"),  # 8-bit Q.K^T (docs/semantics.md, "SAGE")
}

_LOCK = threading.RLock()
# The attention processors a dattn name has served (held weakly): unregister() refuses while one
# of them still names dattn, which diffusers would otherwise fail on at the next forward with a
# bare KeyError.
_SERVED: "weakref.WeakSet" = weakref.WeakSet()


def _note_processor(frame) -> None:
    """Records the attention processor among the callers of a dattn backend function (the
    frame's ``self`` that carries ``_attention_backend``), weakly; not while compiling."""
    if torch.compiler.is_compiling():
        return
    for _ in range(4):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "_attention_backend"):
            try:
                _SERVED.add(owner)
            except TypeError:  # not weakly referable
                pass
            return
        frame = frame.f_back
_CLIENTS: Dict[str, Any] = {}


def backend_client(name: str = "dattn"):
    """The :class:`dattn.torch_adapter.Client` of the named backend: ``calls`` (served by
    dattn), ``fallbacks`` (handed to PyTorch's SDPA, by reason), ``engines()``."""
    from .. import torch_adapter as ta

    if name not in NAMES:
        raise _with_field(InvalidArgument,
                          f"name: {name!r} is not a dattn backend name; valid: "
                          + ", ".join(NAMES), "name")
    with _LOCK:
        client = _CLIENTS.get(name)
        if client is None:
            client = _CLIENTS[name] = ta.Client(f"diffusers:{name}", NAMES[name][1])
        return client


# --- the forward op (diffusers' layout: BSHD; lse [B, S, H] f32) ---------------------------------


def _key_mask_4d(attn_mask, query, key):
    """diffusers' native rule: a 2-D [B, Skv] mask masks keys."""
    if (attn_mask is not None and attn_mask.dim() == 2 and query.dim() == 4
            and attn_mask.shape[0] == query.shape[0] and attn_mask.shape[1] == key.shape[1]):
        return attn_mask[:, None, None, :]
    return attn_mask


def _waited(t):
    """The tensor under a functional collective's pending result (diffusers' ring hands K and V
    as views of an all-gather's AsyncCollectiveTensor), waited for; anything else as it is."""
    if t is None or type(t) is torch.Tensor:
        return t
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _attend(client, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            return_lse, lse_required=None):
    """(out [B, S, H, Dv], lse [B, S, H] f32 or None): dattn's answer, or PyTorch's where dattn
    does not serve the call (counted on ``client`` under the torch adapter's reasons).
    ``return_lse``: the LSE is wanted; ``lse_required`` (default: ``return_lse``): a call whose
    LSE PyTorch cannot give (dropout, grad, mask with causal) raises instead of returning
    None."""
    if lse_required is None:
        lse_required = return_lse
    from .. import torch_adapter as ta

    query, key, value, attn_mask = (_waited(t) for t in (query, key, value, attn_mask))
    mask = _key_mask_4d(attn_mask, query, key)
    compiling = torch.compiler.is_compiling()
    bound = {"query": query, "key": key, "value": value, "attn_mask": mask,
             "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
             "enable_gqa": enable_gqa}
    reason = None
    if not compiling:
        route = ta.dispatch_route([t for t in (query, key, value, mask) if t is not None],
                                  trace_as_op=False)
        reason = route if route not in (None, "graph") else None
        compiling = route == "graph"
    if reason is None:
        reason = ta._eager_reason(bound, "BSHD", not compiling)
    causal = ta.CAUSAL_TOP_LEFT if is_causal else ta.CAUSAL_NONE
    scale = None if scale is None else float(scale)
    if reason is not None:
        ta._count(client, reason, compiling)
        if dropout_p or (mask is not None and is_causal) or (
                torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))):
            # What the math LSE path cannot give: PyTorch's own function (and its errors).
            out = ta.PYTORCH_SDPA(*(t.transpose(1, 2) for t in (query, key, value)),
                                  attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa).transpose(1, 2)
            if lse_required:
                raise _with_field(
                    Unsupported,
                    f"return_lse: dattn's diffusers backend hands this call to PyTorch "
                    f"({reason}), whose SDPA returns no log-sum-exp",
                    "return_lse")
            return out, None
        out, lse = ta.pytorch_attention(query, key, value, mask, causal, scale, enable_gqa,
                                        "BSHD", return_lse)
    elif compiling:  # dynamo, or a graph-capturing mode: the custom op in the graph
        out, lse = ta.sdpa_op(query, key, value, mask, causal, scale, bool(enable_gqa), "BSHD",
                              client.config, bool(return_lse))
        lse = lse if return_lse else None
    else:
        out, lse = ta.attention(client, query, key, value, mask, causal, scale, enable_gqa,
                                "BSHD", return_lse)
    if lse is not None:
        lse = lse.float().transpose(1, 2).contiguous()  # [B, H, S] -> diffusers' [B, S, H]
    return out, lse


def _forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                _parallel_config=None, *, _client=None):
    """diffusers' forward-op contract (``_templated_context_parallel_attention``): BSHD
    tensors in, ``out`` [B, S, H, Dv] (and ``lse`` [B, S, H] f32 with ``return_lse``) out."""
    client = _client if _client is not None else backend_client()
    # The backward op wants the LSE; it recomputes it where PyTorch's answer has none.
    out, lse = _attend(client, query, key, value, attn_mask, dropout_p, is_causal, scale,
                       enable_gqa, return_lse or (_save_ctx and ctx is not None), return_lse)
    if _save_ctx and ctx is not None:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask = _key_mask_4d(attn_mask, query, key)
        ctx.scale = scale
    return (out, lse) if return_lse else out


def _backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None,
                 **kwargs):
    """The gradients of one forward op from its (possibly ring-reduced) ``out`` and ``lse``:
    FlashAttention's backward in f32 math (P = exp(S - lse), dS = P (dP - rowsum(dO O)))."""
    sq, sk, sv, so, sl = ctx.saved_tensors
    q = sq if query is None else query
    k = sk if key is None else key
    v = sv if value is None else value
    o = so if out is None else out
    l = sl if lse is None else lse
    if l is not None and l.dim() == 4:
        l = l.squeeze(-1)
    dtype = q.dtype
    qf, kf, vf, of, dof = (t.float().transpose(1, 2) for t in (q, k, v, o, grad_out))
    if kf.shape[1] != qf.shape[1]:  # GQA: K/V heads repeated, their gradients summed back
        rep = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    else:
        rep = 1
    scale = ctx.scale if ctx.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    mask = ctx.attn_mask
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    lse_bhs = torch.logsumexp(s, -1) if l is None else l.float().transpose(1, 2)
    p = torch.exp(s - lse_bhs[..., None]).nan_to_num(0.0)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = p * (dp - (dof * of).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    if rep > 1:
        b, h, s_, e = dk.shape
        dk = dk.reshape(b, h // rep, rep, s_, e).sum(2)
        dv = dv.reshape(b, h // rep, rep, s_, dv.shape[-1]).sum(2)
    return tuple(t.transpose(1, 2).to(dtype) for t in (dq, dk, dv))


def make_backend_function(client_of: Callable[[], Any]):
    """The function diffusers calls for the name (its registry reads the parameter names)."""

    def dattn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: Optional[float] = None,
                        enable_gqa: bool = False, return_lse: bool = False,
                        _parallel_config=None):
        _note_processor(sys._getframe(1))
        client = client_of()
        if _parallel_config is None:
            return _forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, return_lse, _save_ctx=False, _client=client)
        return context_parallel_attention(client, query, key, value, attn_mask, dropout_p,
                                          is_causal, scale, enable_gqa, return_lse,
                                          _parallel_config)

    return dattn_attention


def context_parallel_attention(client, query, key, value, attn_mask, dropout_p, is_causal,
                               scale, enable_gqa, return_lse, parallel_config):
    """diffusers' own ring / Ulysses machinery with dattn's forward op: each rank's partial
    (out, lse) computed by dattn, merged by diffusers."""
    import functools

    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=functools.partial(_forward_op, _client=client), backward_op=_backward_op,
        _parallel_config=parallel_config)


# --- the name in diffusers' registry -------------------------------------------------------------


def _check_dattn(query, key, value, attn_mask=None, **kwargs) -> None:
    """What dattn's backend really needs, in diffusers' manner (ValueError, checked when
    diffusers' DIFFUSERS_ATTN_CHECKS is on): CPU tensors of f32, bf16 or f16; a bool mask or
    a float one of the query's dtype or f32."""
    for name, t in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"dattn attention needs CPU tensors; {name} is on {t.device}.")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dattn attention computes float32, bfloat16 or float16; {name} is "
                             f"{t.dtype}.")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise ValueError(f"dattn attention takes a bool mask or a float mask of the query's "
                         f"dtype; attn_mask is {attn_mask.dtype}.")


def _constraints():
    from diffusers.models import attention_dispatch as ad

    return [ad._check_device, ad._check_qkv_dtype_match, ad._check_attn_mask_or_causal,
            ad._check_shape, _check_dattn]


def _add_member(enum_cls, name: str, value: str):
    member = enum_cls._value2member_map_.get(value)
    if member is not None:
        return member
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    if hasattr(enum_cls, "_add_member_"):  # Python 3.13+: the enum machinery's own step
        member._sort_order_ = len(enum_cls._member_names_)
        enum_cls._add_member_(name, member)
        enum_cls._value2member_map_[value] = member
        return member
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _remove_member(enum_cls, name: str) -> None:
    member = enum_cls._member_map_.pop(name, None)
    if member is None:
        return
    enum_cls._value2member_map_.pop(member._value_, None)
    if name in enum_cls._member_names_:
        enum_cls._member_names_.remove(name)
    if name in enum_cls.__dict__:
        type.__delattr__(enum_cls, name)


def register() -> list:
    """Adds dattn's names to diffusers' attention backends (idempotent); returns them.
    Raises :class:`dattn.NotAvailable` when diffusers is not installed."""
    try:
        from diffusers.models import attention_dispatch as ad
    except ImportError as e:
        raise _with_field(NotAvailable, f"dattn.diffusers.register needs diffusers ({e})",
                          "diffusers") from None
    with _LOCK:
        for value, (member_name, _backend) in NAMES.items():
            member = _add_member(ad.AttentionBackendName, member_name, value)
            if member in ad._AttentionBackendRegistry._backends:
                continue
            fn = make_backend_function(lambda v=value: backend_client(v))
            fn.__name__ = f"_{value}_attention"
            ad._AttentionBackendRegistry.register(
                member, constraints=_constraints(), supports_context_parallel=True)(fn)
    return list(NAMES)


def registered() -> bool:
    """Whether dattn's names are in diffusers' registry now."""
    try:
        from diffusers.models import attention_dispatch as ad
    except ImportError:
        return False
    return all(v in ad.AttentionBackendName._value2member_map_
               and ad.AttentionBackendName(v) in ad._AttentionBackendRegistry._backends
               for v in NAMES)


def _open_context(ad, members: dict) -> Optional[str]:
    """The dattn name of an ``attention_backend(...)`` block that is open now (its suspended
    generator found among the live objects), or None."""
    import gc
    import inspect

    wrapped = getattr(ad.attention_backend, "__wrapped__", None)
    code = getattr(wrapped, "__code__", None)
    if code is None:
        return None
    for obj in gc.get_objects():
        if inspect.isgenerator(obj) and obj.gi_code is code and obj.gi_frame is not None:
            backend = obj.gi_frame.f_locals.get("backend")
            if backend in members:
                return members[backend]
    return None


def unregister() -> None:
    """Removes dattn's names from diffusers (nothing if absent). Refused, with
    ``InvalidArgument`` naming the name and how to reset, while diffusers would still look one
    up (and fail with a bare ``KeyError`` at the next forward): inside an open
    ``attention_backend("dattn")`` block (leave it first), or while an attention processor dattn
    has served (held weakly) still names one (``model.reset_attention_backend()`` first). Where
    diffusers' process-wide active backend is one of them only because
    ``set_attention_backend`` set it (diffusers' ``reset_attention_backend`` leaves it),
    diffusers' default (``DIFFUSERS_ATTN_BACKEND``, else native) becomes active again."""
    try:
        from diffusers.models import attention_dispatch as ad
    except ImportError:
        return
    reg = ad._AttentionBackendRegistry
    with _LOCK:
        members = {ad.AttentionBackendName._member_map_.get(m): v for v, (m, _b) in NAMES.items()}
        members.pop(None, None)
        if not members:
            return
        if reg._active_backend in members and (name := _open_context(ad, members)) is not None:
            raise _with_field(
                InvalidArgument,
                f"dattn.diffusers.unregister: diffusers' active attention backend is '{name}' "
                f"(an open `attention_backend('{name}')` block); leave the block first",
                "backend")
        for processor in list(_SERVED):
            backend = getattr(processor, "_attention_backend", None)
            if backend in members:
                name = members[backend]
                raise _with_field(
                    InvalidArgument,
                    f"dattn.diffusers.unregister: an attention processor "
                    f"({type(processor).__name__}) still uses '{name}'; call "
                    "model.reset_attention_backend() (or set another backend) on its model first",
                    "backend")
        if reg._active_backend in members:
            default = ad.DIFFUSERS_ATTN_BACKEND
            reg._active_backend = (ad.AttentionBackendName(default)
                                   if default not in NAMES else ad.AttentionBackendName.NATIVE)
        for value, (member_name, _backend) in NAMES.items():
            member = ad.AttentionBackendName._member_map_.get(member_name)
            if member is None:
                continue
            for table in (reg._backends, reg._constraints, reg._supported_arg_names):
                table.pop(member, None)
            reg._supports_context_parallel.discard(value)
            _remove_member(ad.AttentionBackendName, member_name)


# --- context parallelism on the CPU --------------------------------------------------------------


def _cpu_resolver(model):
    """diffusers' ``ModelMixin._resolve_parallel_config`` for the CPU: the same steps with the
    device ``cpu`` and the mesh on ``cpu`` (gloo), where diffusers 0.42.1 takes
    ``rank % torch.accelerator.device_count()`` (ZeroDivisionError without an accelerator)."""
    from diffusers.models._modeling_parallel import (ContextParallelConfig, ParallelConfig,
                                                     TensorParallelConfig)

    def resolve(config):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed must be available and initialized before applying a "
                "`parallel_config`.")
        if isinstance(config, ContextParallelConfig):
            config = ParallelConfig(context_parallel_config=config)
        elif isinstance(config, TensorParallelConfig):
            config = ParallelConfig(tensor_parallel_config=config)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = torch.device("cpu")
        mesh = None
        if config.context_parallel_config is not None:
            cp = config.context_parallel_config
            mesh = cp.mesh or dist.device_mesh.init_device_mesh(
                device_type="cpu", mesh_shape=cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        elif config.tensor_parallel_config is not None:
            tp = config.tensor_parallel_config
            mesh = tp.mesh or dist.device_mesh.init_device_mesh(
                device_type="cpu", mesh_shape=(tp.tp_degree,), mesh_dim_names=("tp",))
        config.setup(rank, world_size, device, mesh=mesh)
        model._parallel_config = config
        return config

    return resolve


def _heads_of(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_heads"):
        h = getattr(cfg, name, None) if cfg is not None else None
        if isinstance(h, int):
            return h
    return None


def _dtype_guard(group):
    """A forward pre-hook that compares the ranks' input dtypes (one all-gather of a code per
    forward) and raises the same typed error on every rank where they differ, before the first
    collective of the attention could mix them."""
    import torch.distributed as dist

    codes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

    def hook(module, args, kwargs):
        t = next((x for x in list(args) + list(kwargs.values())
                  if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
        if t is None:
            return None
        mine = torch.tensor([codes.index(t.dtype) if t.dtype in codes else len(codes)],
                            dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        seen = [int(x) for x in every]
        if len(set(seen)) > 1:
            names = [str(codes[c]).replace("torch.", "") if c < len(codes) else "other"
                     for c in seen]
            raise _with_field(
                InvalidArgument,
                f"dtype: the ranks' inputs differ in dtype ({', '.join(names)} on ranks "
                f"0..{len(names) - 1}); every rank of a context-parallel model must run the "
                f"same dtype", "dtype")
        return None

    return hook


def _logger_warning_once() -> None:
    """diffusers 0.42.1's context-parallel hooks call ``logger.warning_once`` (a method of
    transformers' loggers, not of the ``logging.Logger`` diffusers' get_logger returns) where an
    input has other dims than the plan expects, e.g. Wan 2.1's 1-D timestep against the plan's
    2-D per-token one: an AttributeError on every CPU and GPU. This gives that one logger the
    method (each message once), as diffusers evidently meant."""
    from diffusers.hooks import context_parallel as cp_hooks

    log = cp_hooks.logger
    if hasattr(log, "warning_once"):
        return
    seen = set()

    def warning_once(msg, *args, **kwargs):
        if msg not in seen:
            seen.add(msg)
            log.warning(msg, *args, **kwargs)

    log.warning_once = warning_once


def enable_parallelism(model, config, cp_plan=None):
    """diffusers' ``model.enable_parallelism(config=config, cp_plan=cp_plan)`` on the CPU:
    torch.distributed must be initialised by the caller (gloo); ``config`` is diffusers'
    ``ContextParallelConfig`` (or ``ParallelConfig``). The mesh is built on ``cpu`` and then
    diffusers' own machinery applies the model's context-parallel plan (its sharding hooks, the
    templated ring / Ulysses attention calling the backend's forward op). Set the attention
    backend first (``model.set_attention_backend("dattn")``), as diffusers asks. Returns the
    model."""
    import torch.distributed as dist

    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "enable_parallelism"):
        raise _with_field(InvalidArgument,
                          f"model: expected a diffusers model (ModelMixin), got "
                          f"{type(model).__name__}", "model")
    if not isinstance(config, (ContextParallelConfig, ParallelConfig)):
        raise _with_field(InvalidArgument,
                          f"config: expected diffusers' ContextParallelConfig or ParallelConfig, "
                          f"got {type(config).__name__}", "config")
    if not dist.is_available() or not dist.is_initialized():
        raise _with_field(InvalidArgument,
                          "torch.distributed: initialise the process group first (e.g. "
                          "torch.distributed.init_process_group('gloo')), as diffusers asks",
                          "torch.distributed")
    cp = config if isinstance(config, ContextParallelConfig) else config.context_parallel_config
    world = dist.get_world_size()
    if cp is not None:
        if cp.mesh is None and cp.ring_degree * cp.ulysses_degree != world:
            raise _with_field(
                InvalidArgument,
                f"ring_degree x ulysses_degree = {cp.ring_degree} x {cp.ulysses_degree} must "
                f"equal the world size {world}", "ulysses_degree" if cp.ulysses_degree > 1
                else "ring_degree")
        heads = _heads_of(model)
        if heads is not None and cp.ulysses_degree > 1 and heads % cp.ulysses_degree:
            raise _with_field(
                InvalidArgument,
                f"ulysses_degree = {cp.ulysses_degree} does not divide the model's "
                f"{heads} attention heads", "ulysses_degree")
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise _with_field(InvalidArgument,
                          f"model: its parameters are on {sorted(devices)}; "
                          f"dattn.diffusers.enable_parallelism runs CPU models", "model")
    _logger_warning_once()
    model.__dict__["_resolve_parallel_config"] = _cpu_resolver(model)
    try:
        model.enable_parallelism(config=config, cp_plan=cp_plan)
    finally:
        model.__dict__.pop("_resolve_parallel_config", None)
    model.register_forward_pre_hook(_dtype_guard(None), with_kwargs=True)
    return model
