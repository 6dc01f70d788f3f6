"""A stand-in for ``vllm_omni.diffusion.data``, registered under that name by
tests/python/test_vllm_omni_engine.py only.

The real module imports pydantic, PIL, diffusers, huggingface_hub and vllm's config,
quantization, LoRA and transformers-utils machinery (it defines the whole serving config).
vllm-omni's attention layer, forward context and parallel state read only the fields below of
its ``OmniDiffusionConfig``, ``DiffusionParallelConfig``, ``AttentionConfig`` and
``AttentionSpec``; each keeps the real class's name, defaults and the lookup rules the layer
relies on (``AttentionConfig.resolve_with_source``, ``DIFFUSION_ATTENTION_BACKEND`` read as
``build_attention_config`` reads it, ``sequence_parallel_size`` derived from the degrees).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode


@dataclass
class AttentionSpec:
    backend: str

    def backend_kwargs(self) -> dict[str, Any] | None:
        return None


@dataclass
class AttentionConfig:
    default: AttentionSpec | None = None
    per_role: dict[str, AttentionSpec] = field(default_factory=dict)

    def resolve_with_source(self, role: str = "self", role_category: str | None = None):
        spec = self.per_role.get(role)
        if spec is not None:
            return spec, f"attention_config.per_role[{role!r}]"
        if role_category is not None and role_category in self.per_role:
            return self.per_role[role_category], f"attention_config.per_role[{role_category!r}]"
        if self.default is not None:
            return self.default, "attention_config.default"
        return None, None


def build_attention_config(attention_config: AttentionConfig | None = None) -> AttentionConfig:
    """The real function's env-var rule: DIFFUSION_ATTENTION_BACKEND (unless "auto") is the
    default spec when the config names none."""
    config = attention_config or AttentionConfig()
    env = os.environ.get("DIFFUSION_ATTENTION_BACKEND")
    if config.default is None and env is not None and env.lower() != "auto":
        config.default = AttentionSpec(backend=env)
    return config


@dataclass
class DiffusionParallelConfig:
    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    sequence_parallel_size: int | None = None
    ulysses_degree: int = 1
    ring_degree: int = 1
    allgather_degree: int = 1
    ulysses_mode: str = "strict"
    ulysses_a2a_permute: bool = False
    cfg_parallel_size: int = 1
    use_hsdp: bool = False
    mask_sp_padding: bool = False

    def __post_init__(self) -> None:
        expected = (self.allgather_degree if self.allgather_degree > 1
                    else self.ulysses_degree * self.ring_degree)
        if self.sequence_parallel_size is None:
            self.sequence_parallel_size = expected
        assert self.sequence_parallel_size == expected, (
            f"Sequence parallel size must be {expected}, but got {self.sequence_parallel_size}"
        )


@dataclass
class OmniDiffusionConfig:
    model: str | None = None
    model_class_name: str | None = None
    dtype: Any = None
    parallel_config: DiffusionParallelConfig = field(default_factory=DiffusionParallelConfig)
    diffusion_attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    diffusion_kv_mode: DiffusionKVCacheMode = DiffusionKVCacheMode.DENSE_LEGACY
    diffusion_kv_cache_dtype: str | None = None
    is_moe: bool = False

    def __post_init__(self) -> None:
        self.diffusion_attention_config = build_attention_config(self.diffusion_attention_config)

    @classmethod
    def from_kwargs(cls, diffusion_attention_backend: str | None = None,
                    **kwargs) -> "OmniDiffusionConfig":
        if diffusion_attention_backend is not None:
            kwargs["diffusion_attention_config"] = AttentionConfig(
                default=AttentionSpec(backend=diffusion_attention_backend))
        return cls(**kwargs)
