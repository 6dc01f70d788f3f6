"""The memory dattn keeps between calls (docs/architecture.md, "Memory"): a model's layers called
once each, as a denoising step calls them, keep no memory per layer; the outputs dattn
allocates are its result memory (mappings, never blocks of the C heap); dattn.empty_cache()
gives the idle buffers back. Each case runs in a fresh process: what glibc's heap holds
depends on everything the process did before."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import numpy as np  # noqa: E402

import dattn  # noqa: E402

# A step's worth of layers, each new and called once, each output dropped, after one 30 MiB
# block was allocated and freed as a pipeline's own tensors are (glibc's mmap threshold then
# rises to that size, so blocks up to it come from its heap): the RSS after each layer, in MiB
# above what it was after the first.
_LAYERS = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import torch
    import dattn

    backend, kind, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(2)
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    # outputs of 8 MiB (bf16) / 16 MiB (f32), few keys: little compute
    sq, skv, h, d = 2048, 64, 32, 64
    g = torch.Generator().manual_seed(0)
    if kind == "numpy":
        q = np.random.default_rng(0).standard_normal((1, sq, h, d), dtype=np.float32)
        k = np.random.default_rng(1).standard_normal((1, skv, h, d), dtype=np.float32)
        v = np.random.default_rng(2).standard_normal((1, skv, h, d), dtype=np.float32)
    else:
        q = torch.randn(1, sq, h, d, generator=g).to(torch.bfloat16)
        k = torch.randn(1, skv, h, d, generator=g).to(torch.bfloat16)
        v = torch.randn(1, skv, h, d, generator=g).to(torch.bfloat16)
    block = torch.ones(30 << 20, dtype=torch.uint8)
    del block
    kept, seen = [], []
    for n in range(layers):
        layer = dattn.Attention(h, d, backend=backend, role="cross")
        kept.append(layer)
        out = layer(q, k, v)
        assert out.shape == (1, sq, h, d)
        del out
        seen.append(rss())
    stats = dattn.memory_stats()
    released = dattn.empty_cache()
    print(json.dumps({"rss": [s - seen[0] for s in seen], "stats": stats,
                      "released": released, "after": dattn.memory_stats()}))
    """
)


def _run(backend, kind, layers=12):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", _LAYERS, backend, kind, str(layers)],
                       capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend,kind", [("FLASH", "torch"), ("SAGE", "torch"),
                                          ("FLASH", "numpy")])
def test_layers_called_once_each_keep_no_memory_per_layer(backend, kind):
    """12 layers (today's main: +8-16 MiB per layer, one output's size, pinned in glibc's heap
    by the small objects each new layer keeps): the RSS grows by less than 32 MiB from layer 2
    to layer 12; empty_cache() then gives back what dattn kept idle, and nothing stays idle."""
    got = _run(backend, kind)
    assert got["rss"][-1] < 32, got["rss"]
    assert got["stats"]["idle_buffers"] <= got["stats"]["idle_limit"], got["stats"]
    assert got["stats"]["live_layers"] == 12
    assert got["released"] > 0 and got["after"]["idle_bytes"] == 0, got


def test_outputs_are_result_memory_and_free_with_their_tensor():
    """A large output is dattn's result memory (counted in use while it lives, through DLPack for
    torch and the buffer protocol for numpy) and goes back when the tensor dies; small ones are
    the framework's own. The outputs behave as any tensor (writable, contiguous, the dtype)."""
    layer = dattn.Attention(4, 64)
    for make in (lambda *s: torch.randn(*s).to(torch.bfloat16),
                 lambda *s: np.random.default_rng(0).standard_normal(s, dtype=np.float32)):
        q = make(1, 1024, 4, 64)  # outputs of 512 KiB / 1 MiB
        before = dattn.memory_stats()["in_use_bytes"]
        out, lse = layer.forward(q, q, q, return_lse=True)
        assert dattn.memory_stats()["in_use_bytes"] >= before + out.nbytes
        if isinstance(out, torch.Tensor):
            assert out.dtype == torch.bfloat16 and out.is_contiguous() and lse.dtype == torch.float32
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2).float() for t in (q, q, q))).transpose(1, 2)
            assert (out.float() - ref).abs().max() < 2e-2
        else:
            assert out.dtype == np.float32 and out.flags.writeable and out.flags.c_contiguous
        out[...] = 0  # writable
        del out, lse
        assert dattn.memory_stats()["in_use_bytes"] <= before
    small = dattn.Attention(1, 8)(torch.ones(1, 4, 1, 8), torch.ones(1, 4, 1, 8),
                                  torch.ones(1, 4, 1, 8))
    assert small.shape == (1, 4, 1, 8) and torch.allclose(small, torch.ones(1, 4, 1, 8))


def test_empty_cache_and_memory_stats():
    layer = dattn.Attention(2, 64)
    x = torch.randn(1, 512, 2, 64)
    layer(x, x, x)
    stats = dattn.memory_stats()
    assert set(stats) == {"idle_bytes", "idle_buffers", "idle_limit", "in_use_bytes",
                          "calls_in_flight", "live_layers"}
    assert stats["idle_bytes"] > 0 and stats["calls_in_flight"] == 0 and stats["live_layers"] >= 1
    assert dattn.empty_cache() == stats["idle_bytes"]
    assert dattn.memory_stats()["idle_bytes"] == 0
    assert dattn.empty_cache() == 0
    layer(x, x, x)  # calls after it map what they need anew
