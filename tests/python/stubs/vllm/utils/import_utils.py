import importlib

#: How many NVIDIA GPUs the stand-in pynvml reports (tests set it to pretend a CUDA host).
NVML_DEVICE_COUNT = None  # None: pynvml is not importable, as on a machine without the driver


def resolve_obj_by_qualname(qualname: str):
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


class _FakeNvml:
    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return NVML_DEVICE_COUNT


def import_pynvml():
    if NVML_DEVICE_COUNT is None:
        raise ImportError("vllm stub: no pynvml (no NVIDIA driver)")
    return _FakeNvml()
