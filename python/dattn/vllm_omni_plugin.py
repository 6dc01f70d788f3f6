"""The old path of :mod:`dattn.vllm_omni.plugin` (earlier entry points name it): the same
module object."""

import sys

from .vllm_omni import plugin as _plugin

sys.modules[__name__] = _plugin
