"""dattn: attention backends for diffusion transformers, on torch tensors and numpy arrays.

    import torch, dattn
    layer = dattn.Attention(num_heads=24, head_size=128)
    out = layer.forward(q, k, v)                         # [B, S, H, D] torch tensors, no copies
    out, lse = layer.forward(q, k, v, dattn.AttentionMetadata(joint_query=tq, joint_key=tk,
                                                              joint_value=tv), return_lse=True)
    y = dattn.scaled_dot_product_attention(q, k, v, is_causal=True)   # PyTorch's semantics

Importing dattn imports neither torch nor any host framework; dattn.torch_layer (loaded on
the first call on torch tensors) and dattn.torch_adapter (the SDPA drop-in, dattn.diffusers) are
where dattn meets PyTorch.

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
from .memory import empty_cache, memory_stats
from .slow_cpu import FarBelowCpuWarning, far_below_cpu
from .sdpa import patch_torch_sdpa, scaled_dot_product_attention


def set_num_threads(threads):
    """The threads dattn's calls on torch tensors use: ``None`` (the default) follows
    ``torch.get_num_threads()`` (PyTorch's intra-op count, in every thread); an int >= 1 fixes
    it for dattn alone. Calls on numpy arrays use OpenMP's count (``OMP_NUM_THREADS``)."""
    from .torch_layer import set_num_threads as _set

    _set(threads)


__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionMetadata",
    "BackendInfo",
    "Error",
    "FarBelowCpuWarning",
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
    "empty_cache",
    "far_below_cpu",
    "flash_engines",
    "get_backend",
    "measure_peak_gflops",
    "memory_stats",
    "patch_torch_sdpa",
    "scaled_dot_product_attention",
    "set_num_threads",
]
