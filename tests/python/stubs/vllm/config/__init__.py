import contextlib
import enum


class CUDAGraphMode(enum.Enum):
    NONE = 0


class VllmConfig:
    pass


@contextlib.contextmanager
def set_current_vllm_config(config):  # pragma: no cover - not reached by the tests
    yield
