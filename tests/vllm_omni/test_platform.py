"""dattn's platform and backends in the real engine's process, without running a request: what
the engine asks of its platform answered truly for a CPU host, the engine's names for layouts
and video layouts, the import order, the patches' switches."""

import os
import subprocess
import sys

import pytest
import torch


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=180, cwd="/")


def test_importing_dattns_platform_before_the_engine_is_no_cycle():
    """The engine imports its platform (dattn's) while it imports itself: dattn's modules,
    imported first under either path, must not be half-imported then."""
    code = (
        "import dattn.vllm_omni_platform, dattn.vllm_omni_plugin\n"
        "from dattn.vllm_omni.platform import DattnCpuOmniPlatform\n"
        "from vllm_omni.platforms import current_omni_platform\n"
        "import dattn.vllm_omni.platform as p\n"
        "assert dattn.vllm_omni_platform is p and isinstance(current_omni_platform, "
        "DattnCpuOmniPlatform)\n"
        "from dattn.vllm_omni import DattnAttentionBackend\n"
        "import vllm_omni.diffusion.attention.backends.abstract as a\n"
        "assert issubclass(DattnAttentionBackend, a.AttentionBackend)\n"
        "print('ok')\n")
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.fixture
def platform():
    from vllm_omni.platforms import current_omni_platform

    from dattn.vllm_omni.platform import DattnCpuOmniPlatform

    assert isinstance(current_omni_platform, DattnCpuOmniPlatform)
    return current_omni_platform


def test_the_platforms_memory_figures_are_the_processs(platform):
    free, total = platform.mem_get_info()
    assert 0 < free <= total == platform.get_device_total_memory()
    assert platform.get_device_memory() == (pytest.approx(free, rel=0.2), total)
    before = platform.memory_allocated()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert platform.memory_allocated() >= before + (48 << 20)
    assert platform.max_memory_allocated() >= platform.memory_allocated()
    del block
    platform.reset_peak_memory_stats()
    assert platform.max_memory_reserved() <= platform.memory_reserved() + (16 << 20)
    assert platform.synchronize() is None
    # empty_cache gives dattn's idle buffers back (a call leaves its panels and scratch idle).
    import dattn

    layer = dattn.Attention(2, 64)
    x = torch.randn(1, 512, 2, 64)
    layer(x, x, x)
    assert dattn.memory_stats()["idle_bytes"] > 0
    assert platform.empty_cache() is None
    assert dattn.memory_stats()["idle_bytes"] == 0
    assert platform.get_device_name() and platform.get_torch_device(3) == torch.device("cpu")


def test_ranks_are_processes_restricted_by_the_variable_and_share_the_cores(platform, monkeypatch):
    from dattn.vllm_omni import platform as module

    monkeypatch.delenv(module.VISIBLE_DEVICES_ENV, raising=False)
    assert platform.get_device_count() == module.MAX_RANKS
    monkeypatch.setenv(module.VISIBLE_DEVICES_ENV, "0,1")
    assert platform.get_device_count() == 2
    # The engine's stage-device narrowing (GPU pinning of its deploy files) is not applied.
    platform.set_device_control_env_var("0")
    assert os.environ[module.VISIBLE_DEVICES_ENV] == "0,1"
    assert module.rank_threads(2, 8) == 4 and module.rank_threads(4, 2) == 1
    assert module.rank_threads(3, 8) == 2

    class Config:
        num_gpus = 4

        class parallel_config:
            world_size = 4

    saved = torch.get_num_threads()
    try:
        platform.init_diffusion_model_runner_runtime(None, Config, torch.device("cpu"))
        assert torch.get_num_threads() == module.rank_threads(4)
    finally:
        torch.set_num_threads(saved)


def test_the_engines_layout_names_and_its_one_tail_video_layout():
    """Wan's ``qkv_layout="BSND"`` is BSHD; the layout it publishes, prefix_len + latent_grid
    with ``used_len = t*h*w``, is the one-tail form; a used_len that disagrees names both."""
    from vllm_omni.diffusion.attention.backends.abstract import (AttentionMetadata,
                                                                 VideoTokenLayout)

    import dattn
    from dattn.vllm_omni import DattnAttentionImpl

    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    for layout, (a, b, c) in (("BSND", (q, k, v)),
                              ("BNSD", (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))):
        impl = DattnAttentionImpl(num_heads=2, head_size=16, softmax_scale=None,
                                  qkv_layout=layout, role="self")
        want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2)
                                                                  for t in (q, k, v)))
        got = impl.forward(a, b, c)
        got = got if layout == "BNSD" else got.transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    impl = DattnAttentionImpl(num_heads=2, head_size=16, softmax_scale=None, qkv_layout="BSND",
                              role="self", backend_kwargs={"backend": "VIDEO_SPARSE"})
    meta = AttentionMetadata(video_layout=VideoTokenLayout(prefix_len=0, latent_grid=(2, 4, 4),
                                                           used_len=32))
    assert impl.forward(q, k, v, meta).shape == q.shape
    bad = AttentionMetadata(video_layout=VideoTokenLayout(prefix_len=0, latent_grid=(2, 4, 4),
                                                          used_len=30))
    with pytest.raises(dattn.InvalidArgument, match="used_len = 30.*prefix_len = 0"):
        impl.forward(q, k, v, bad)


def test_the_patches_and_their_switch():
    from dattn.vllm_omni import patches

    assert patches.applies("output_loop", (0, 30)) and not patches.applies("output_loop", (0, 31))
    assert patches.applies("ring", (9, 9))
    r = _python("from dattn.vllm_omni import patches; patches.applies('ring')",
                DATTN_VLLM_OMNI_SKIP_PATCHES="rign")
    assert r.returncode != 0 and "rign is not a patch" in r.stderr and "output_loop" in r.stderr
    r = _python("from dattn.vllm_omni import patches; print(patches.applies('ring'))",
                DATTN_VLLM_OMNI_SKIP_PATCHES="ring")
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_far_below_the_cpu_the_default_is_the_engines_sdpa_with_one_warning():
    """Never silently slow: where dattn runs far below the CPU (provoked here with
    DATTN_CPU_FEATURES=portable), the platform still activates, but its default backend (no
    DIFFUSION_ATTENTION_BACKEND) is the engine's TORCH_SDPA, with one warning saying why; the
    explicit DATTN still runs dattn. On the real CPU the default is dattn, without a warning."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import dattn\n"
        "    from vllm_omni.platforms import current_omni_platform as p\n"
        "    from dattn.vllm_omni.platform import DattnCpuOmniPlatform\n"
        "    assert isinstance(p, DattnCpuOmniPlatform)\n"
        "    default = p.get_diffusion_attn_backend_cls(None, 128)\n"
        "    again = p.get_diffusion_attn_backend_cls(None, 64)\n"
        "    named = p.get_diffusion_attn_backend_cls('DATTN', 128)\n"
        "n = sum(issubclass(w.category, dattn.FarBelowCpuWarning) for w in seen)\n"
        "print(default, again, named, n, sep='|')\n")
    r = _python(code, DATTN_CPU_FEATURES="portable")
    assert r.returncode == 0, r.stderr[-3000:]
    default, again, named, warned = r.stdout.strip().splitlines()[-1].split("|")
    assert "sdpa" in default.lower() and again == default, default
    assert named == "dattn.vllm_omni.DattnAttentionBackend"
    assert warned == "1", r.stdout
    assert "far below" in r.stderr and "TORCH_SDPA" in r.stderr, r.stderr[-3000:]
    r = _python(code, DATTN_CPU_FEATURES="")
    assert r.returncode == 0, r.stderr[-3000:]
    default, again, named, warned = r.stdout.strip().splitlines()[-1].split("|")
    assert default == named == "dattn.vllm_omni.DattnAttentionBackend" and warned == "0"
