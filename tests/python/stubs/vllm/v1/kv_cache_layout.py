"""vllm.v1.kv_cache_layout: KVCacheLayout, the physical layouts vllm-omni names."""
import enum


class KVCacheLayout(enum.Enum):
    LBNHC = "LBNHC"  # layer-outermost
    BLNHC = "BLNHC"  # block-outermost

    @property
    def is_block_outermost(self) -> bool:
        return self is KVCacheLayout.BLNHC
