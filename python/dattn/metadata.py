"""The seed's per-call metadata classes, with the seed's names and fields.

``AttentionMetadata``, ``QueryRange``, ``VideoTokenSpan``, ``VideoTokenLayout`` and
``PackedPaddingMetadata`` mirror ``vllm_omni.diffusion.attention.backends.abstract``; dattn
also reads the engine's own objects of these names field by field (see ``metadata_dict``), so
either may be passed to a call.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Tuple

from .errors import InvalidArgument, InvalidArgumentType, _with_field, as_float, as_int


@dataclass(frozen=True)
class QueryRange:
    local_start: int
    local_end: int
    global_start: int


@dataclass(frozen=True)
class VideoTokenSpan:
    """One physical video-grid slice in packed document 0."""

    start: int
    latent_grid: Tuple[int, int, int]
    role: Literal["reference", "target"]

    @property
    def length(self) -> int:
        return self.latent_grid[0] * self.latent_grid[1] * self.latent_grid[2]


@dataclass(frozen=True)
class VideoTokenLayout:
    """Video grids in a packed sequence: ``prefix_len`` + ``latent_grid`` (one tail), or
    ``used_len`` + ``video_spans``."""

    prefix_len: Optional[int] = None
    latent_grid: Optional[Tuple[int, int, int]] = None
    used_len: Optional[int] = None
    video_spans: Tuple[VideoTokenSpan, ...] = ()


@dataclass(frozen=True)
class PackedPaddingMetadata:
    """Mask-free view of structural padding in a [real, pad] packing."""

    q_length: int
    kv_length: int
    cu_seqlens_q: Any
    cu_seqlens_k: Any


@dataclass
class AttentionMetadata:
    attn_mask: Any = None
    joint_attn_mask: Any = None
    joint_query: Any = None
    joint_key: Any = None
    joint_value: Any = None
    joint_strategy: str = "front"
    # Well-known keys: kv_cache_dtype, cu_seqlens_q/k, max_seqlen_q/k, valid_kv_length,
    # attention_mask_mode, laser_input_scale; any other key goes to the backend, which ignores
    # what it does not know.
    extra: dict = field(default_factory=dict)
    full_attn_spans: Optional[list] = None
    query_ranges: Optional[tuple] = None
    video_layout: Optional[VideoTokenLayout] = None
    packed_padding: Optional[PackedPaddingMetadata] = None
    # dattn's own: global positions of query row 0 and key row 0 (default Skv - Sq and 0).
    q_global_start: Optional[int] = None
    k_global_start: Optional[int] = None


_INT_KEYS = ("max_seqlen_q", "max_seqlen_k", "valid_kv_length")
_TENSOR_FIELDS = ("attn_mask", "joint_attn_mask", "joint_query", "joint_key", "joint_value")


def _invalid(field_name, message, cls=InvalidArgument):
    return _with_field(cls, f"{field_name}: {message}", field_name)


def _opt_int(v, field_name):
    return None if v is None else as_int(v, field_name)


def _ints(seq, n, field_name, what):
    """``seq`` as a tuple of ``n`` ints (a tuple, list or other sequence; not a string)."""
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__") or len(seq) != n:
        raise _invalid(field_name, f"expected {what}, got {seq!r:.80}", InvalidArgumentType)
    return tuple(as_int(x, field_name) for x in seq)


def _sequence(v, field_name, what):
    if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__iter__"):
        raise _invalid(field_name, f"expected {what}, got {v!r:.80}", InvalidArgumentType)
    return list(v)


def _video_layout_dict(vl):
    if vl is None:
        return None
    spans = []
    for s in _sequence(
        getattr(vl, "video_spans", ()) or (), "video_layout.video_spans", "a sequence of spans"
    ):
        spans.append(
            {
                "start": as_int(getattr(s, "start"), "video_layout.video_spans.start"),
                "latent_grid": _ints(
                    getattr(s, "latent_grid"), 3, "video_layout.video_spans.latent_grid",
                    "a (t, h, w) triple",
                ),
                "role": str(getattr(s, "role")),
            }
        )
    grid = getattr(vl, "latent_grid", None)
    return {
        "prefix_len": _opt_int(getattr(vl, "prefix_len", None), "video_layout.prefix_len"),
        "latent_grid": None
        if grid is None
        else _ints(grid, 3, "video_layout.latent_grid", "a (t, h, w) triple"),
        "used_len": _opt_int(getattr(vl, "used_len", None), "video_layout.used_len"),
        "video_spans": spans,
    }


# The seed's AttentionMetadata fields: an object with any of them is metadata.
_SEED_FIELDS = tuple(f.name for f in fields(AttentionMetadata))


def metadata_dict(meta, tensor_arg):
    """The per-call dict dattn._core reads, from a dattn or engine AttentionMetadata (any object
    with the seed's field names; missing fields count as unset) or a mapping of those names.
    ``tensor_arg`` turns each tensor into what the core takes. Anything else (a list, a string,
    a number) is ``InvalidArgument`` naming ``attn_metadata``; so is a field of the wrong type."""
    if meta is None:
        return None
    if isinstance(meta, Mapping):
        get = meta.get
    elif isinstance(meta, (str, bytes, int, float, list, tuple)) or not any(
        hasattr(meta, name) for name in _SEED_FIELDS
    ):
        raise _invalid(
            "attn_metadata",
            f"expected None, an AttentionMetadata (or an object with its fields) or a mapping "
            f"of its field names, got {type(meta).__name__}",
            InvalidArgumentType,
        )
    else:

        def get(name, default=None):
            return getattr(meta, name, default)

    d = {}
    for name in _TENSOR_FIELDS:
        t = get(name)
        d[name] = None if t is None else tensor_arg(t, name)
    strategy = get("joint_strategy", "front")
    if strategy is not None and not isinstance(strategy, str):
        raise _invalid(
            "joint_strategy", f"expected 'front' or 'rear', got {strategy!r:.80}",
            InvalidArgumentType,
        )
    d["joint_strategy"] = strategy
    spans = get("full_attn_spans")
    if spans is not None:
        d["full_attn_spans"] = [
            [
                _ints(span, 2, "full_attn_spans", "(start, end) pairs")
                for span in _sequence(sample, "full_attn_spans", "a list of (start, end) pairs")
            ]
            for sample in _sequence(spans, "full_attn_spans", "a list per batch item")
        ]
    ranges = get("query_ranges")
    if ranges is not None:
        what = "(local_start, local_end, global_start) triples"
        d["query_ranges"] = [
            _ints(r, 3, "query_ranges", what)
            if isinstance(r, (tuple, list))
            else (
                as_int(getattr(r, "local_start", None), "query_ranges.local_start"),
                as_int(getattr(r, "local_end", None), "query_ranges.local_end"),
                as_int(getattr(r, "global_start", None), "query_ranges.global_start"),
            )
            for r in _sequence(ranges, "query_ranges", "a sequence of QueryRange")
        ]
    for name in ("q_global_start", "k_global_start"):
        if get(name) is not None:
            d[name] = as_int(get(name), name)
    d["video_layout"] = _video_layout_dict(get("video_layout"))
    pp = get("packed_padding")
    if pp is not None:
        pp_names = ("q_length", "kv_length", "cu_seqlens_q", "cu_seqlens_k")
        if isinstance(pp, Mapping) and all(f in pp for f in pp_names):
            pp_field = pp.__getitem__
        elif all(hasattr(pp, f) for f in pp_names):
            pp_field = lambda f, pp=pp: getattr(pp, f)  # noqa: E731
        else:
            raise _with_field(
                InvalidArgumentType,
                "packed_padding: expected a PackedPaddingMetadata (q_length, kv_length, "
                f"cu_seqlens_q, cu_seqlens_k), got {type(pp).__name__} {pp!r:.80}",
                "packed_padding")
        d["packed_padding"] = {
            "q_length": as_int(pp_field("q_length"), "packed_padding.q_length"),
            "kv_length": as_int(pp_field("kv_length"), "packed_padding.kv_length"),
            "cu_seqlens_q": tensor_arg(pp_field("cu_seqlens_q"), "packed_padding.cu_seqlens_q"),
            "cu_seqlens_k": tensor_arg(pp_field("cu_seqlens_k"), "packed_padding.cu_seqlens_k"),
        }
    extra = get("extra")
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise _invalid(
            "extra", f"expected a mapping, got {type(extra).__name__}", InvalidArgumentType
        )
    e = {}
    for k, v in extra.items():
        if not isinstance(k, str):
            raise _invalid("extra", f"keys must be strings, got {k!r:.80}", InvalidArgumentType)
        if k in _INT_KEYS and v is not None:
            v = as_int(v, k)  # numpy integer scalars too; int64 range
        elif k == "laser_input_scale" and v is not None:
            v = as_float(v, k)
        elif isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
            v = as_int(v, k)  # a numpy integer in the backend's slot is an int
        elif isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
            v = float(v)  # and a numpy float a float
        elif _is_tensor(v):
            v = tensor_arg(v, k)
        e[k] = v
    d["extra"] = e
    return d


def _is_tensor(x):
    return hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__")
