"""dattn on numpy arrays alone, without torch: what a user of a machine without PyTorch (an ARM
server first of all) calls. Nothing here imports torch or conftest's helpers, so `make
test-aarch64` runs this file under qemu-user with the cross-built extension and Debian's arm64
interpreter (`pytest --noconftest`), and `make test` runs it natively like the rest.

Every engine this CPU runs (FLASH's f32, bf16 and integer-lane engines, SAGE's int8 ones) against
a float64 oracle, with GQA, a key mask whose hidden keys hold NaN and huge values, causal rows,
the LSE, f16 inputs; the automatic choice and the info the package reports."""

from __future__ import annotations

import json
import math
import os
import platform

import numpy as np
import pytest

import dattn
from dattn.__main__ import main as dattn_main

ARM = platform.machine().lower() in ("aarch64", "arm64")

# Under DATTN_CPU_FEATURES=portable the explicit calls below warn once that dattn runs far below
# the CPU (the rule test_automatic_calls_run_on_simd_where_the_cpu_has_it checks).
pytestmark = pytest.mark.filterwarnings("ignore::dattn.FarBelowCpuWarning")


def oracle(q, k, v, scale, keep=None, causal=False):
    """Attention in float64 on BSHD arrays; `keep` [B, Skv] hides keys where False, `causal`
    hides key j from row i when j > i + Skv - Sq. Returns (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]);
    a row that sees no key is 0 with LSE -inf."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    b, sq, hq, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, hq // hkv, axis=2)
    v = np.repeat(v, hq // hkv, axis=2)
    visible = np.ones((b, hq, sq, skv), dtype=bool)
    if keep is not None:
        visible &= np.asarray(keep, dtype=bool)[:, None, None, :]
    if causal:
        visible &= np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
    # Hidden keys may hold garbage: zero them before the products, so that NaN cannot leak.
    s = np.einsum("bqhd,bkhd->bhqk", q, np.where(np.isfinite(k), k, 0.0)) * scale
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(m)
    p = np.exp(s - np.where(empty, 0.0, m))
    p = np.where(visible, p, 0.0)
    l = p.sum(axis=-1, keepdims=True)
    probs = p / np.where(empty, 1.0, l)
    out = np.einsum("bhqk,bkhd->bqhd", probs, np.where(np.isfinite(v), v, 0.0))
    with np.errstate(divide="ignore"):
        lse = np.where(empty[..., 0], -np.inf, (m + np.log(np.where(empty, 1.0, l)))[..., 0])
    return out, lse


def normwise(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def engines(*kinds):
    """The engines this CPU runs whose compute dtype is one of `kinds`; the emulated twins left
    out where DATTN_TEST_TWINS=0 (make test-aarch64: they are portable C++, run natively by
    make test)."""
    twins = os.environ.get("DATTN_TEST_TWINS") != "0"
    return [e["name"] for e in dattn.flash_engines()
            if e["compute_dtype"] in kinds and e["unavailable_reason"] is None
            and (twins or not e["emulated"])]


# Normwise on the output, and absolute on the LSE: f32 engines exact to f32 rounding; the 16-bit
# integer lanes and the bf16 products at theirs.
TOLERANCE = {"f32": (1e-5, 1e-4), "int16": (5e-3, 2e-3), "bf16": (1e-2, 2e-2)}


def inputs(seed, b=2, sq=37, skv=45, hq=4, hkv=2, d=72, dv=40):
    """BSHD arrays with an offset and outlier channels in K (as real models' keys have), and a key
    mask hiding every fifth key of batch item 1, whose K and V hold NaN and huge values."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = (rng.standard_normal((b, skv, hkv, d)) + 0.5).astype(np.float32)
    k[..., 3] *= 8.0
    v = rng.standard_normal((b, skv, hkv, dv)).astype(np.float32)
    keep = np.ones((b, skv), dtype=bool)
    keep[1, 2::5] = False
    k[1, 2::5] = np.nan
    v[1, 2::5, 0] = 3e38
    v[1, 2::5, 1:] = np.nan
    return q, k, v, keep


@pytest.mark.parametrize("name", engines("f32", "bf16", "int16"))
@pytest.mark.parametrize("causal", [False, True])
def test_every_flash_engine_matches_the_oracle(name, causal):
    q, k, v, keep = inputs(1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    kind = next(e["compute_dtype"] for e in dattn.flash_engines() if e["name"] == name)
    # A bf16 engine computes f32 inputs in bf16 only where asked (else the best f32 engine).
    options = {"isa": name, **({"compute_dtype": "bf16"} if kind == "bf16" else {})}
    layer = dattn.Attention(4, 72, softmax_scale=scale, causal=causal, num_kv_heads=2,
                            backend="FLASH", backend_kwargs=options)
    out, lse = layer.forward(q, k, v, {"attn_mask": keep}, return_lse=True)
    assert layer.last_engine == name
    want, want_lse = oracle(q, k, v, scale, keep, causal)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (2, 37, 4, 40)
    assert np.isfinite(out).all() and np.isfinite(lse).all(), name
    assert normwise(out, want) <= TOLERANCE[kind][0], (name, normwise(out, want))
    assert np.max(np.abs(lse - want_lse)) <= TOLERANCE[kind][1], name


@pytest.mark.parametrize("name", engines("int8"))
def test_every_sage_engine_stays_within_its_bound(name):
    # SAGE's 8-bit Q.K^T: its documented bound on DiT-like keys is 1% per head (docs/semantics.md);
    # the whole output here, GQA and the garbage-holding key mask included.
    q, k, v, keep = inputs(2, sq=130, skv=150, d=64)
    scale = 0.125
    layer = dattn.Attention(4, 64, softmax_scale=scale, num_kv_heads=2, backend="SAGE",
                            backend_kwargs={"isa": name})
    out = layer.forward(q, k, v, {"attn_mask": keep})
    assert layer.last_engine == name
    want, _ = oracle(q, k, v, scale, keep)
    assert np.isfinite(out).all(), name
    assert normwise(out, want) <= 2e-2, (name, normwise(out, want))


def test_f16_inputs_return_f16_within_their_rounding():
    q, k, v, keep = inputs(3)
    with np.errstate(over="ignore"):  # the hidden keys' huge values become inf: garbage still
        q, k, v = (t.astype(np.float16) for t in (q, k, v))
    layer = dattn.Attention(4, 72, num_kv_heads=2)
    out = layer.forward(q, k, v, {"attn_mask": keep})
    assert out.dtype == np.float16 and np.isfinite(out).all()
    want, _ = oracle(q, k, v, 1.0 / math.sqrt(72), keep)
    assert normwise(out, want) <= 2e-3


def test_automatic_calls_run_on_simd_where_the_cpu_has_it():
    info = dattn.cpu_info()
    layer = dattn.Attention(4, 64, num_kv_heads=2)
    q, k, v, _ = inputs(4, d=64, dv=64)
    layer.forward(q, np.nan_to_num(k), np.nan_to_num(v))
    engine = layer.last_engine
    if ARM:
        assert "neon" in info["detected_features"]
        assert (info["sve_bits"] > 0) == ("sve" in info["features"])  # after the mask
    masked = os.environ.get("DATTN_CPU_FEATURES", "") not in ("", "native")
    simd = any(f in info["detected_features"] for f in ("neon", "avx2"))
    if simd and not masked:
        assert engine not in ("portable",), engine
        assert dattn.far_below_cpu() is None
    if ARM and not masked:
        assert engine in ("neon", "sve"), engine
    if simd and engine == "portable":  # masked: the rule fires, naming what is left unused
        assert dattn.far_below_cpu() and "portable" in dattn.far_below_cpu()


def test_info_lists_this_cpus_engines(capsys):
    assert dattn_main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = {e["name"] for e in dattn.flash_engines() if e["unavailable_reason"] is None}
    assert names <= {e["name"] for e in report["engines"]}
    assert report["cpu"]["sve_bits"] == dattn.cpu_info()["sve_bits"]
