"""vllm's CpuPlatform: the attributes dattn's CPU platform takes from it (vllm/platforms/cpu.py)."""

from vllm.platforms.interface import Platform, PlatformEnum


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var = "CPU_VISIBLE_MEMORY_NODES"

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return 0.0
