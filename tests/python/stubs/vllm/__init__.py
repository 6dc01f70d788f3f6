"""A minimal stand-in for vllm, for loading the real, pinned vllm-omni modules in dattn's tests.

vllm's PyPI build is a CUDA stack; vllm-omni (installed with --no-deps) imports it throughout.
This package holds only the names the vllm-omni modules under test import (platform
resolution, plugin loading, the attention registry, selector and backends, and the diffusion
``Attention`` layer with its parallel strategies, ring kernels, forward context and distributed
parallel state), with trivial bodies: stand-ins, no attention and no communication of their
own (the engine's sequence parallelism runs on torch.distributed itself). It is put on sys.path
only by tests/python/test_vllm_omni_engine.py (and the SP worker processes it starts).
"""

__version__ = "0.0.0+dattn-test-stub"
