"""The old path of :mod:`dattn.vllm_omni.platform` (configs and earlier entry points name it):
the same module object."""

import sys

from .vllm_omni import platform as _platform

sys.modules[__name__] = _platform
