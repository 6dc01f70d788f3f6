"""`python -m dattn info` prints what the CLI's `dattn info` prints (less the CLI's workloads
line); the measured peaks differ between runs, so their figures are masked."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

CLI = Path(__file__).resolve().parents[2] / "build" / "release" / "tools" / "dattn" / "dattn"


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout


def masked(text):
    lines = [ln for ln in text.splitlines() if not ln.startswith("workloads")]
    return [re.sub(r"^(peak GFLOP/s|\s{14})\s*[0-9.]+ ", r"\1 N ", ln) for ln in lines]


def test_python_m_dattn_info_runs():
    out = run(sys.executable, "-m", "dattn", "info", "--threads", "1")
    assert out.startswith("platform      cpu\n") and "FLASH" in out and "peak GFLOP/s" in out
    data = json.loads(run(sys.executable, "-m", "dattn", "info", "--json", "--threads", "1"))
    assert data["threads"] == 1 and data["backends"] and data["engines"]


@pytest.mark.skipif(not CLI.exists(), reason=f"no CLI at {CLI} (make build)")
def test_python_m_dattn_info_matches_the_cli():
    ours = json.loads(run(sys.executable, "-m", "dattn", "info", "--json", "--threads", "1"))
    theirs = json.loads(run(str(CLI), "info", "--json", "--threads", "1"))
    for key in ("platform", "cpu", "far_below_cpu", "threads", "engines", "backends"):
        assert ours[key] == theirs[key], key
    assert set(ours["peak_gflops"]) == set(theirs["peak_gflops"])
    text = masked(run(sys.executable, "-m", "dattn", "info", "--threads", "1"))
    assert text == masked(run(str(CLI), "info", "--threads", "1"))


def test_bad_threads_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "dattn", "info", "--threads", "0x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--threads" in r.stderr


@pytest.mark.parametrize("mask", ["avx2", "portable"])
def test_info_under_a_cpu_feature_mask(mask):
    """DATTN_CPU_FEATURES masks what dattn sees of the CPU in Python too: no AVX-512 feature, no
    engine above the class available, the detected features and the mask reported."""
    import os

    env = dict(os.environ, DATTN_CPU_FEATURES=mask)
    out = subprocess.run([sys.executable, "-m", "dattn", "info", "--json", "--threads", "1"],
                         check=True, capture_output=True, text=True, timeout=120, env=env).stdout
    data = json.loads(out)
    features = data["cpu"]["features"]
    assert data["cpu"]["feature_mask"] == mask
    assert not [f for f in features if f.startswith(("avx512", "amx"))]
    assert set(features) <= set(data["cpu"]["detected_features"])
    available = {e["name"] for e in data["engines"] if e["available"]}
    real = {e["name"] for e in data["engines"] if e["available"] and not e["emulated"]}
    allowed = {"portable", "portable_int8"} | (
        {"avx2", "avx2_int8", "avx2_int16"} if mask == "avx2" else set())
    assert real <= allowed, available
    assert data["peak_gflops"]["bf16_dot"] is None and data["peak_gflops"]["amx_bf16"] is None
    assert data["peak_gflops"]["amx_int8"] is None and data["peak_gflops"]["amx_int8_unavailable"]


def test_a_bad_cpu_feature_mask_is_a_typed_error():
    import os

    env = dict(os.environ, DATTN_CPU_FEATURES="avx3")
    r = subprocess.run([sys.executable, "-c", "import dattn; dattn.cpu_info()"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "DATTN_CPU_FEATURES" in r.stderr and "InvalidArgument" in r.stderr
