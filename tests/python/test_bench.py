"""bench/torch_sdpa.py runs end to end on a small shape, OpenVINO's SDPA (pinned in
requirements.txt) beside PyTorch's and dattn's in the same rounds, and every library's answer
is PyTorch's."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("torch_sdpa_bench", ROOT / "bench" / "torch_sdpa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_openvino_sdpa_matches_torch():
    pytest.importorskip("openvino")
    import numpy as np
    import torch

    bench = load_bench()
    make = bench.openvino_sdpa(1)
    assert make is not None and make.version
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 37, 24, generator=g) for _ in range(3))
    run = make(q.shape, "f32")
    got = run(*(t.numpy() for t in (q, k, v)))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v).numpy()
    assert np.abs(got - want).max() < 1e-5


def test_bench_rows_carry_every_library(capsys):
    bench = load_bench()
    rows = bench.main(["--workload", "small", "--rounds", "1", "--threads", "1", "--heads", "2",
                       "--dtype", "f32", "--backend", "FLASH", "--backend", "SAGE:pv_dtype=int16",
                       "--pause", "0", "--json"])
    assert [r["backend"] for r in rows] == ["FLASH", "SAGE"]
    for r in rows:
        assert r["workload"] == "small" and r["dattn_gflops"] > 0 and r["torch_gflops"] > 0
    assert rows[0]["rel_err_vs_torch"] < 1e-5
    assert rows[1]["rel_err_vs_torch"] < 3e-2
    if importlib.util.find_spec("openvino") is not None:
        assert rows[0]["openvino"] and rows[0]["openvino_gflops"] > 0
        assert rows[0]["openvino_rel_err_vs_torch"] < 1e-5
    no_ov = bench.main(["--workload", "small", "--rounds", "1", "--threads", "1", "--dtype", "f32",
                        "--pause", "0", "--no-openvino", "--json"])
    assert no_ov[0]["openvino"] is None and "openvino_s" not in no_ov[0]


def test_pipeline_bench_rows(tmp_path):
    """bench/pipeline.py end to end on its tiny Wan: every row's columns, in child processes."""
    pytest.importorskip("diffusers")
    import json
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    svg = tmp_path / "chart.svg"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pipeline.py"), "--model", "tiny-wan", "--mode",
         "both", "--steps", "3", "--threads", "1", "--backend", "native", "--backend", "dattn",
         "--backend", "sparse_policy", "--json", str(out), "--svg", str(svg)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["backend"]) for r in rows] == [
        ("forward", "native"), ("forward", "dattn"), ("loop", "native"), ("loop", "dattn"),
        ("loop", "sparse_policy")]
    for r in rows:
        assert r["seconds_per_step"] > 0 and 0 <= r["attention_share"] <= 1
        assert r["peak_mib"] > 0 and r["speedup_vs_native"] > 0
    assert rows[1]["rel_err"] < 0.05 and rows[1]["rel_err_against"] == "f32 native"
    policy = rows[-1]
    assert policy["grid_calls"] == {"dense": 2, "sparse": 1}  # dense_steps 2 of 3
    assert svg.read_text().startswith("<svg") and "whole benchmark" in proc.stdout
