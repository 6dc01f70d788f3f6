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
    for key in ("platform", "cpu", "threads", "engines", "backends"):
        assert ours[key] == theirs[key], key
    assert set(ours["peak_gflops"]) == set(theirs["peak_gflops"])
    text = masked(run(sys.executable, "-m", "dattn", "info", "--threads", "1"))
    assert text == masked(run(str(CLI), "info", "--threads", "1"))


def test_bad_threads_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "dattn", "info", "--threads", "0x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--threads" in r.stderr
