"""A minimal stand-in for vllm, for loading the real, pinned vllm-omni modules in dattn's tests.

vllm's PyPI build is a CUDA stack; vllm-omni (installed with --no-deps) imports it throughout.
This package holds only the names the vllm-omni modules under test import at load time
(platform resolution, plugin loading, the attention registry, selector and backends), with
trivial bodies. It is put on sys.path only inside tests/python/test_vllm_omni_engine.py.
"""

__version__ = "0.0.0+dattn-test-stub"
