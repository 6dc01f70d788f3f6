from vllm.platforms.interface import Platform, PlatformEnum  # noqa: F401
