"""The seed's per-call metadata classes, with the seed's names and fields.

``AttentionMetadata``, ``QueryRange``, ``VideoTokenSpan``, ``VideoTokenLayout`` and
``PackedPaddingMetadata`` mirror ``vllm_omni.diffusion.attention.backends.abstract``; dattn
also reads the engine's own objects of these names field by field (see ``metadata_dict``), so
either may be passed to a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Tuple


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


def _video_layout_dict(vl):
    if vl is None:
        return None
    spans = []
    for s in getattr(vl, "video_spans", ()) or ():
        spans.append(
            {
                "start": int(getattr(s, "start")),
                "latent_grid": tuple(int(x) for x in getattr(s, "latent_grid")),
                "role": str(getattr(s, "role")),
            }
        )
    grid = getattr(vl, "latent_grid", None)
    return {
        "prefix_len": getattr(vl, "prefix_len", None),
        "latent_grid": None if grid is None else tuple(int(x) for x in grid),
        "used_len": getattr(vl, "used_len", None),
        "video_spans": spans,
    }


def metadata_dict(meta, tensor_arg):
    """The per-call dict dattn._core reads, from a dattn or engine AttentionMetadata (any object
    with the seed's field names; missing fields count as unset). ``tensor_arg`` turns each
    tensor into what the core takes."""
    if meta is None:
        return None
    if isinstance(meta, dict):
        get = meta.get
    else:

        def get(name, default=None):
            return getattr(meta, name, default)

    d = {}
    for name in _TENSOR_FIELDS:
        t = get(name)
        d[name] = None if t is None else tensor_arg(t, name)
    d["joint_strategy"] = get("joint_strategy", "front")
    spans = get("full_attn_spans")
    if spans is not None:
        d["full_attn_spans"] = [[(int(a), int(e)) for (a, e) in sample] for sample in spans]
    ranges = get("query_ranges")
    if ranges is not None:
        d["query_ranges"] = [
            (int(r.local_start), int(r.local_end), int(r.global_start))
            if not isinstance(r, (tuple, list))
            else tuple(int(x) for x in r)
            for r in ranges
        ]
    for name in ("q_global_start", "k_global_start"):
        if get(name) is not None:
            d[name] = get(name)
    d["video_layout"] = _video_layout_dict(get("video_layout"))
    pp = get("packed_padding")
    if pp is not None:
        d["packed_padding"] = {
            "q_length": int(pp.q_length),
            "kv_length": int(pp.kv_length),
            "cu_seqlens_q": tensor_arg(pp.cu_seqlens_q, "packed_padding.cu_seqlens_q"),
            "cu_seqlens_k": tensor_arg(pp.cu_seqlens_k, "packed_padding.cu_seqlens_k"),
        }
    extra = get("extra") or {}
    e = {}
    for k, v in dict(extra).items():
        if _is_tensor(v):
            v = tensor_arg(v, str(k))
        elif k in _INT_KEYS and v is not None and not isinstance(v, bool) and hasattr(v, "__index__"):
            v = int(v)  # numpy and torch integer scalars
        e[str(k)] = v
    d["extra"] = e
    return d


def _is_tensor(x):
    return hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__")
