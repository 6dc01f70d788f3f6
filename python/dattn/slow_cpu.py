"""Never silently slow (docs/architecture.md, "Never silently slow").

dattn is "far below the CPU" when the engine its automatic choice runs on has no SIMD (the
portable engines) while the CPU as detected, before ``DATTN_CPU_FEATURES`` masks it, has SIMD:
a feature an engine uses but the mask hides (the mask is a testing tool, not an opt-in), or one
this build has no engine for (e.g. SSE2 alone on an x86-64 CPU without AVX2, FMA and F16C).
``dattn.far_below_cpu()`` says why, or None; ``dattn info`` prints it. Then:

- automatic choices keep the host's own attention (vllm-omni's platform makes the engine's
  TORCH_SDPA its default backend) and warn once saying why (:func:`keep_host_attention`);
- explicit choices run dattn and warn once (:func:`warn_explicit`): ``dattn.Attention``,
  ``dattn.scaled_dot_product_attention``, the SDPA patch, ``dattn.diffusers.enable`` and
  diffusers' registry, the ComfyUI override and node, ``DIFFUSION_ATTENTION_BACKEND=DATTN``.

One warning per process in all (:class:`FarBelowCpuWarning`, also logged on the ``dattn``
logger), whichever comes first.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Optional

from . import _core

logger = logging.getLogger("dattn")


class FarBelowCpuWarning(RuntimeWarning):
    """dattn's attention runs on an engine without SIMD on a CPU that has SIMD."""


_lock = threading.Lock()
_warned = False
_UNKNOWN = object()
_why = _UNKNOWN


def far_below_cpu() -> Optional[str]:
    """Why dattn's automatic engine runs far below this CPU (naming the CPU, the engine and the
    SIMD left unused), or None when an engine with SIMD serves. Fixed for the process (the CPU
    features are read once)."""
    global _why
    if _why is _UNKNOWN:
        _why = _core.cpu_info()["far_below_cpu"]
    return _why


def _warn_once(text: str, stacklevel: int) -> bool:
    global _warned
    with _lock:
        if _warned:
            return False
        _warned = True
    warnings.warn(text, FarBelowCpuWarning, stacklevel=stacklevel + 1)
    logger.warning(text)
    return True


def warn_explicit(who: str) -> None:
    """An explicit choice of dattn (``who`` names it): dattn runs, with one warning per process
    when it is far below the CPU."""
    if _warned:
        return
    why = far_below_cpu()
    if why is not None:
        _warn_once(f"{why}. {who} runs on dattn as chosen; expect it to be slower than the "
                   f"host's own attention.", stacklevel=3)


def keep_host_attention(host: str, instead: str) -> bool:
    """An automatic choice between dattn and ``host``'s own attention (``instead`` names it):
    True, with one warning per process saying why, when dattn is far below the CPU (the host
    should keep its own); False otherwise."""
    why = far_below_cpu()
    if why is None:
        return False
    if not _warned:
        _warn_once(f"{why}. {host} keeps its own attention ({instead}) by default; choose dattn "
                   f"explicitly to run it anyway.", stacklevel=3)
    return True
