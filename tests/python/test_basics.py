"""The package imports from the build tree, finds its backends and runs a call."""

import torch

import dattn
from conftest import assert_close, oracle, rand


def test_backends_have_the_seeds_flags():
    names = [b.name for b in dattn.backends()]
    assert "FLASH" in names and "REFERENCE" in names
    flash = dattn.get_backend("flash")
    assert flash.supports_paged_kv and flash.accept_output_buffer
    assert flash.supports_attention_mask() and flash.supports_head_size(59)
    assert flash.supports_kv_cache_dtype("fp8", "cpu")
    assert not flash.supports_kv_cache_dtype("fp8", "cuda")
    assert flash.supported_platforms == ("cpu",)


def test_forward_matches_the_oracle():
    q, k, v = rand(2, 33, 4, 16, seed=1), rand(2, 40, 2, 16, seed=2), rand(2, 40, 2, 16, seed=3)
    out, lse = dattn.Attention(4, 16, num_kv_heads=2).forward(q, k, v, return_lse=True)
    want, want_lse = oracle(q, k, v)
    assert out.dtype == torch.float32 and out.shape == (2, 33, 4, 16)
    assert_close(out, want)
    assert_close(lse, want_lse, what="lse")


def test_cpu_info_and_thread_limit():
    info = dattn.cpu_info()
    assert info["logical_cpus"] >= 1 and info["max_threads"] == 1024
    assert isinstance(info["l2_bytes"], int) and info["l2_bytes"] >= 0
    assert isinstance(info["features"], list)
    import pytest

    with pytest.raises(dattn.InvalidArgument, match="1024"):
        dattn.measure_peak_gflops(100000)


def test_measured_peaks_name_every_kind():
    peak = dattn.measure_peak_gflops(1, 0.02)
    assert peak["f32_fma"] > 0 and peak["threads"] == 1
    has_bf16 = "avx512_bf16" in dattn.cpu_info()["features"]
    assert (peak["bf16_dot"] is not None) == has_bf16
    # AMX needs the CPU's tiles and Linux's permission; absent (None) otherwise, never an error.
    assert "amx_bf16" in peak
    assert peak["amx_bf16"] is None or peak["amx_bf16"] > 0
    assert peak["amx_int8"] is None or peak["amx_int8"] > 0
    if peak["amx_bf16"] is None:
        assert peak["amx_int8"] is None
    for kind in ("bf16_dot", "amx_bf16", "int8_dot", "int16_dot", "amx_int8"):
        assert (peak[kind] is None) == bool(peak[kind + "_unavailable"]), kind
    # The 16-bit integer lanes: wherever AVX2 is (vpmaddwd), named by the instruction measured.
    has_avx2 = "avx2" in dattn.cpu_info()["features"]
    assert (peak["int16_dot"] is not None) == has_avx2
    if has_avx2:
        assert peak["int16_dot"] > 0
        assert any(i in peak["int16_dot_isa"] for i in ("vpmaddwd", "vpdpwssd"))
