"""vllm.v1.kv_cache_interface: the names vllm-omni's attention layer and KV layout import.
Stand-ins: the tests build no KV cache (Scheduler-paged KV needs vllm's worker)."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: torch.dtype = torch.float32
    non_causal: bool = False


@dataclass
class KVCacheTensor:
    size: int = 0
    shared_by: list = None


def compute_layout_strides(*args, **kwargs):  # pragma: no cover - no KV cache in the tests
    raise NotImplementedError("vllm stub: compute_layout_strides")
