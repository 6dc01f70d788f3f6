"""The attention layer with the seed's constructor and call, on torch tensors or numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from . import _core
from .layer_registry import LAYERS_BY_ID
from .errors import InvalidArgument, InvalidArgumentType, _with_field, as_int
from .metadata import metadata_dict
from .tensors import empty_like_input, float32_like, is_torch, tensor_arg

_LAYOUTS = ("BSHD", "BHSD", "THD")
#: Other names of the layouts: vllm-omni's video models say BSND / BNSD (N: heads).
_LAYOUT_ALIASES = {"BSND": "BSHD", "BNSD": "BHSD"}


def _layout_name(qkv_layout) -> str:
    if qkv_layout is None:
        return "BSHD"
    name = str(qkv_layout).strip().upper()
    name = _LAYOUT_ALIASES.get(name, name)
    if name not in _LAYOUTS:
        raise _with_field(
            InvalidArgument,
            f"qkv_layout: '{str(qkv_layout):.40}' is not valid; valid: BSHD (or BSND), BHSD (or "
            f"BNSD), THD",
            "qkv_layout",
        )
    return name


def _backend_kwargs(kwargs) -> dict:
    """The layer's backend options as a dict of str keys; anything but None or a mapping is
    ``InvalidArgument`` naming ``backend_kwargs``."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise _with_field(
            InvalidArgumentType,
            f"backend_kwargs: expected a mapping of option names to values, got "
            f"{type(kwargs).__name__}",
            "backend_kwargs",
        )
    out = {}
    for k, v in kwargs.items():
        if not isinstance(k, str):
            raise _with_field(
                InvalidArgumentType,
                f"backend_kwargs: option names must be strings, got {k!r:.80}",
                "backend_kwargs",
            )
        if not isinstance(v, bool) and hasattr(v, "__index__") and not isinstance(v, int):
            v = as_int(v, f"backend_kwargs.{k}")  # numpy integers are integers
        out[k] = v
    return out


class Attention:
    """One attention layer (the seed's AttentionImpl arguments, plus dattn's choices).

    ``backend=None`` defers to ``DIFFUSION_ATTENTION_BACKEND`` and then to automatic choice
    (FLASH on the CPU). ``backend_kwargs`` go to the backend (e.g. ``{"isa": "avx2"}`` for
    FLASH, ``{"topk": 4}`` for VIDEO_SPARSE). ``role`` is "self" or "cross".
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        num_kv_heads: Optional[int] = None,
        prefix: str = "",
        qkv_layout: Optional[str] = None,
        backend: Optional[str] = None,
        backend_kwargs: Optional[dict] = None,
        role: str = "self",
        kv_cache_dtype: Optional[str] = None,
        allow_fallback: bool = False,
    ):
        self.layout = _layout_name(qkv_layout)
        self._layer = _core.Layer(
            {
                "num_heads": num_heads,
                "head_size": head_size,
                "softmax_scale": softmax_scale,
                "causal": bool(causal),
                "num_kv_heads": num_kv_heads,
                "prefix": prefix,
                "qkv_layout": self.layout,
                "backend": backend or "",
                "backend_kwargs": _backend_kwargs(backend_kwargs),
                "role": role,
                "kv_cache_dtype": kv_cache_dtype,
                "allow_fallback": bool(allow_fallback),
            }
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.causal = bool(causal)
        self.prefix = prefix
        LAYERS_BY_ID[id(self)] = self
        if self._layer.backend_name != "REFERENCE":
            from .slow_cpu import warn_explicit

            warn_explicit("dattn.Attention")

    @property
    def backend_name(self) -> str:
        """The backend the layer runs on (e.g. "FLASH")."""
        return self._layer.backend_name

    @property
    def last_engine(self) -> str:
        """The compute engine that ran the layer's latest call (FLASH's engine table, e.g.
        "avx512", "avx512_bf16", "amx"; see dattn.flash_engines()); "" before the first call and
        for backends without engines (REFERENCE)."""
        return self._layer.last_engine

    @property
    def selection(self) -> str:
        """How the backend was chosen and why others were skipped."""
        return self._layer.selection

    @property
    def num_kv_heads(self) -> int:
        return self._layer.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self._layer.softmax_scale

    def _shapes(self, query, value, joint_rows: int):
        q, v = tuple(query.shape), tuple(value.shape)
        if self.layout == "BSHD" and len(q) == 4 and len(v) == 4:
            return (q[0], joint_rows + q[1], q[2], v[3]), (q[0], q[2], joint_rows + q[1])
        if self.layout == "BHSD" and len(q) == 4 and len(v) == 4:
            return (q[0], q[1], joint_rows + q[2], v[3]), (q[0], q[1], joint_rows + q[2])
        if self.layout == "THD" and len(q) == 3 and len(v) == 3:
            return (joint_rows + q[0], q[1], v[2]), (q[1], joint_rows + q[0])
        return None, None  # the core names the tensor whose rank is wrong

    def _joint_rows(self, attn_metadata) -> int:
        if attn_metadata is None:
            return 0
        jq = (
            attn_metadata.get("joint_query")
            if isinstance(attn_metadata, dict)
            else getattr(attn_metadata, "joint_query", None)
        )
        return self._joint_rows_of(jq)

    def _joint_rows_of(self, joint_query) -> int:
        if joint_query is None or not hasattr(joint_query, "shape"):
            return 0
        dim = {"BSHD": 1, "BHSD": 2, "THD": 0}[self.layout]
        return int(joint_query.shape[dim]) if len(joint_query.shape) > dim else 0

    def forward(self, query, key, value, attn_metadata=None, return_lse: bool = False, out=None):
        """Attention of `query` over `key`/`value` with the call's metadata.

        Returns the output (joint rows included, in joint-strategy order), a torch.Tensor for
        torch inputs and a numpy array for numpy inputs, in the query's dtype; with
        ``return_lse=True`` also the f32 log-sum-exp ``[B, H, S]``. ``out=`` is written in place
        and returned; on any error nothing is written. On torch tensors the call runs on
        ``torch.get_num_threads()`` threads (:func:`dattn.set_num_threads` overrides it) and is
        recorded as the custom op ``dattn::forward`` where a graph is traced or compiled
        (``torch.compile``, ``torch.export``, ``torch.jit.trace``, fake tensors).
        """
        if is_torch(query):
            from .torch_layer import layer_forward

            return layer_forward(self, query, key, value, attn_metadata, return_lse, out)
        return self._forward_tensors(query, key, value, attn_metadata, return_lse, out, 0)

    def _forward_tensors(self, query, key, value, attn_metadata, return_lse, out, threads):
        """The call on concrete tensors, on `threads` OpenMP threads (0: OpenMP's count)."""
        q = tensor_arg(query, "query")
        k = tensor_arg(key, "key")
        v = tensor_arg(value, "value")
        meta = metadata_dict(attn_metadata, tensor_arg)
        out_shape, lse_shape = self._shapes(query, value, self._joint_rows(attn_metadata))
        target = out
        if is_torch(out) and (out.is_neg() or out.is_conj()):
            target = None  # a lazily negated view: computed apart, then copied in through it
        if target is None:
            target = empty_like_input(out_shape if out_shape else (0,), query)
        lse = None
        if return_lse:
            lse = empty_like_input(lse_shape if lse_shape else (0,), query, float32_like(query))
        self._layer.forward_into(
            q, k, v, meta, tensor_arg(target, "out"),
            None if lse is None else tensor_arg(lse, "lse"), int(threads),
        )
        if out is not None and target is not out:
            out.copy_(target)
            target = out
        return (target, lse) if return_lse else target

    __call__ = forward

    def forward_paged(self, call: "PagedCall"):
        """One paged-KV call: the rows' new K/V are written into the pool's pages, then their
        queries attend keys [0, seq_len) through their block tables. Returns the output
        [T, H, Dv] (and the LSE [H, T] with ``call.return_lse``)."""
        q = call.query
        t = int(q.shape[0]) if hasattr(q, "shape") and len(q.shape) == 3 else 0
        dv = int(call.value.shape[-1]) if hasattr(call.value, "shape") else 0
        heads = int(q.shape[1]) if hasattr(q, "shape") and len(q.shape) == 3 else 0
        out = call.out if call.out is not None else empty_like_input((t, heads, dv), q)
        lse = None
        if call.return_lse:
            lse = empty_like_input((heads, t), q, float32_like(q))
        threads = 0
        if is_torch(q):
            from .torch_layer import call_threads

            threads = call_threads()
        self._layer.forward_paged(
            {
                "query": tensor_arg(q, "query"),
                "key": tensor_arg(call.key, "key"),
                "value": tensor_arg(call.value, "value"),
                "out": tensor_arg(out, "out"),
                "lse": None if lse is None else tensor_arg(lse, "lse"),
                "layer": call.layer,
                "rows": [
                    {
                        "query_len": as_int(r.query_len, f"rows[{i}].query_len"),
                        "seq_len": as_int(r.seq_len, f"rows[{i}].seq_len"),
                        "kv_start_pos": as_int(r.kv_start_pos, f"rows[{i}].kv_start_pos"),
                        "block_table": [
                            as_int(x, f"rows[{i}].block_table") for x in r.block_table
                        ],
                    }
                    for i, r in enumerate(call.rows)
                ],
                "softmax_scale": call.softmax_scale,
                "causal": bool(call.causal),
                "full_attn_spans": [
                    (as_int(span[0], "full_attn_spans"), as_int(span[1], "full_attn_spans"))
                    if isinstance(span, (tuple, list)) and len(span) == 2
                    else as_int(None, "full_attn_spans")  # not a (start, end) pair
                    for span in (call.full_attn_spans or [])
                ],
                "threads": threads,
            },
            call.pool._pool,
        )
        return (out, lse) if call.return_lse else out


class PagePool:
    """K/V pages of every layer (f32, bf16, f16, int8 or fp8 pages; int8/fp8 with one f32 scale
    per page and KV head), with an allocator. Page ids are shared by all layers."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        kv_heads: int = 1,
        head_size: int = 64,
        value_head_size: int = 0,
        dtype: str = "f32",
        layers: int = 1,
        layout: str = "layer_outermost",
    ):
        self._pool = _core.PagePool(
            {
                "num_blocks": num_blocks,
                "block_size": block_size,
                "kv_heads": kv_heads,
                "head_size": head_size,
                "value_head_size": value_head_size,
                "dtype": dtype,
                "layers": layers,
                "layout": layout,
            }
        )
        self.block_size = block_size

    def allocate(self, pages: int) -> List[int]:
        return list(self._pool.allocate(pages))

    def free(self, pages: Sequence[int]) -> None:
        self._pool.free([as_int(p, "pages") for p in pages])

    @property
    def capacity(self) -> int:
        return self._pool.capacity

    @property
    def free_pages(self) -> int:
        return self._pool.free_pages

    @property
    def nbytes(self) -> int:
        return self._pool.nbytes

    def read(self, page: int, slot: int, head: int, value: bool = False, layer: int = 0):
        """The dequantized K (or V) row at (page, slot, head) of `layer`, as a list."""
        return list(self._pool.read(layer, value, page, slot, head))


@dataclass
class PagedRow:
    """One sequence of a paged call: rows [kv_start_pos, kv_start_pos + query_len) are new;
    its queries attend keys [0, seq_len) through ``block_table``."""

    query_len: int
    seq_len: int
    kv_start_pos: int = 0
    block_table: Sequence[int] = ()


@dataclass
class PagedCall:
    """A paged-KV call (the context the seed's forward_paged leaves opaque). query [T, Hq, D],
    key/value [T, Hkv, D] (the new rows), rows packed along T in order."""

    query: Any
    key: Any
    value: Any
    rows: List[PagedRow]
    pool: PagePool
    layer: int = 0
    causal: bool = False
    softmax_scale: Optional[float] = None
    full_attn_spans: Optional[List[Tuple[int, int]]] = None
    out: Any = None
    return_lse: bool = False
