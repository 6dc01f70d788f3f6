"""Former name of :mod:`dattn.diffusers.backend` (diffusers' backend names "dattn" /
"dattn_sage" and context parallelism on the CPU), kept for the code that imports it: this module
*is* that one (the same object, so what is set on one is seen through the other)."""

import sys

from .diffusers import backend as _backend

sys.modules[__name__] = _backend
