"""vllm.envs: only VLLM_PLUGINS (None = load every plugin), read by vllm_omni.plugins."""
import os

VLLM_PLUGINS = None if "VLLM_PLUGINS" not in os.environ else [
    p for p in os.environ["VLLM_PLUGINS"].split(",") if p
]
