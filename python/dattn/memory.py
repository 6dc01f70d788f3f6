"""The memory dattn keeps between calls (docs/architecture.md, "Memory"): what it holds, and
giving it back to the operating system."""

from . import _core


def empty_cache() -> int:
    """Returns the memory dattn keeps between calls to the operating system and the number of
    bytes returned: the large buffers calls have finished with, which dattn keeps for the next
    calls of any layer (at most as many as the calls in flight have held at once; layers keep
    plans, never buffers). Buffers in use are untouched. Also done when the process's last
    layer is destroyed. vllm-omni's platform (``empty_cache``) and dattn's ComfyUI node (on the
    model's cleanup) call it."""
    return int(_core.empty_cache())


def memory_stats() -> dict:
    """What dattn holds now: ``idle_bytes`` / ``idle_buffers`` (kept for the next calls; what
    :func:`empty_cache` returns), ``idle_limit``, ``in_use_bytes`` (leased to calls in flight,
    or outputs dattn allocated that are still alive), ``calls_in_flight``, ``live_layers``."""
    return dict(_core.memory_stats())
