"""vllm.ir: imported by vllm_omni.diffusion.forward_context; used only with a VllmConfig."""
import contextlib


@contextlib.contextmanager
def enable_torch_wrap(enabled):  # pragma: no cover - the tests pass no VllmConfig
    yield
