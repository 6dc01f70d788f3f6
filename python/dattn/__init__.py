"""dattn: attention backends for diffusion transformers, on torch tensors and numpy arrays.

    import torch, dattn
    layer = dattn.Attention(num_heads=24, head_size=128)
    out = layer.forward(q, k, v)                         # [B, S, H, D] torch tensors, no copies
    out, lse = layer.forward(q, k, v, dattn.AttentionMetadata(joint_query=tq, joint_key=tk,
                                                              joint_value=tv), return_lse=True)
    y = dattn.scaled_dot_product_attention(q, k, v, is_causal=True)   # PyTorch's semantics

The compiled core (dattn._core) binds the C++ library; the rest is this pure-Python layer.
"""

from .errors import (
    Error,
    InvalidArgument,
    InvalidArgumentType,
    NotAvailable,
    Unsupported,
    UnsupportedTensor,
)
from .metadata import (
    AttentionMetadata,
    PackedPaddingMetadata,
    QueryRange,
    VideoTokenLayout,
    VideoTokenSpan,
)
from .attention import Attention, PagedCall, PagedRow, PagePool
from .backends import (
    BackendInfo,
    backends,
    cpu_info,
    flash_engines,
    get_backend,
    measure_peak_gflops,
)
from .sdpa import patch_torch_sdpa, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionMetadata",
    "BackendInfo",
    "Error",
    "InvalidArgument",
    "InvalidArgumentType",
    "NotAvailable",
    "PackedPaddingMetadata",
    "PagePool",
    "PagedCall",
    "PagedRow",
    "QueryRange",
    "Unsupported",
    "UnsupportedTensor",
    "VideoTokenLayout",
    "VideoTokenSpan",
    "backends",
    "cpu_info",
    "flash_engines",
    "get_backend",
    "measure_peak_gflops",
    "patch_torch_sdpa",
    "scaled_dot_product_attention",
]
