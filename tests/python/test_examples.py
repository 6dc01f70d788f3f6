"""The Python examples run (tiny sizes) and agree with PyTorch's math. No timing assertions."""

import importlib.util
from pathlib import Path

import pytest

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


TINY = ["--image-tokens", "40", "--text-tokens", "9", "--heads", "2", "--head-dim", "16",
        "--reps", "1", "--threads", "1"]


@pytest.mark.parametrize(
    "extra,tolerance",
    [([], 1e-5), (["--no-rope", "--batch", "2"], 1e-5), (["--backend", "REFERENCE"], 1e-5),
     (["--dtype", "bf16"], 0.1)],
    ids=["f32-rope", "f32-batch2", "reference", "bf16"],
)
def test_flux_block(extra, tolerance, keep_torch_threads, capsys):
    results = load("flux_block").main(TINY + extra)
    for way in ("dattn-joint", "dattn-concat"):
        assert results[f"{way}_max_diff"] <= tolerance, (way, results)
        assert results[f"{way}_attention_s"] > 0 and results[f"{way}_block_s"] > 0
    assert results["backend"] == ("REFERENCE" if "--backend" in extra else "FLASH")
    assert "max |diff| vs torch" in capsys.readouterr().out


def test_diffusers_flux(keep_torch_threads, capsys):
    pytest.importorskip("diffusers")
    tiny = ["--image-tokens", "64", "--text-tokens", "16", "--heads", "2", "--head-dim", "64",
            "--double", "1", "--single", "1", "--text-dim", "32", "--reps", "1", "--threads", "1"]
    results = load("diffusers_flux").main(tiny)
    assert results["f32"]["rel_diff"] <= 1e-4 and results["bf16"]["rel_diff"] <= 3e-2
    for dtype in ("f32", "bf16"):
        r = results[dtype]
        assert r["attention_calls"] == 2 and r["backend"] == "FLASH"
        assert r["forward_default_s"] > 0 and r["attention_dattn_s"] > 0
    assert "attention (2 calls)" in capsys.readouterr().out


@pytest.mark.parametrize("degrees", [["--ulysses", "2"], ["--ring", "2"], ["--threads", "1"]],
                         ids=["ulysses", "ring", "one-process"])
def test_diffusers_parallel(degrees, keep_torch_threads, capsys):
    pytest.importorskip("diffusers")
    tiny = ["--model", "flux", "--image-tokens", "64", "--text-tokens", "16", "--heads", "2",
            "--head-dim", "32", "--reps", "1"]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    results = load("diffusers_parallel").main(tiny + degrees)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # nothing left wrapped
    assert "error" not in results, results
    assert results["shape"] == [1, 64, 64] and results["forward_s"] > 0
    s = results["seconds"]
    if "--threads" in degrees:
        assert s["single_attention"] > 0
    else:
        assert s["forward_op"] > 0 and s["attention"] >= s["forward_op"]
        assert "single_attention" not in s
        assert s["all_to_all" if "--ulysses" in degrees else "all_gather"] > 0
    assert "forward" in capsys.readouterr().out


def test_diffusers_parallel_native_ring_is_diffusers_own_error(capsys):
    pytest.importorskip("diffusers")
    results = load("diffusers_parallel").main(
        ["--model", "wan", "--video", "2", "4", "4", "--text-tokens", "8", "--heads", "2",
         "--head-dim", "32", "--reps", "1", "--ring", "2", "--backend", "native"])
    assert "return_lse" in results["error"]


def test_wan_video_sparse(keep_torch_threads, capsys):
    pytest.importorskip("diffusers")
    results = load("wan_video_sparse").main(["--frames", "2", "--height", "8", "--width", "16",
                                             "--steps", "3", "--threads", "1"])
    modes = [[c["mode"] for c in s["calls"]] for s in results["stats"]]
    assert modes == [["dense", "dense"], ["dense", "sparse"], ["dense", "sparse"]]
    reused = [c.get("reused") for s in results["stats"] for c in s["calls"] if c["layer"] == 1]
    assert reused == [False, False, True]
    assert 0 < results["sparse_rel_err"] < 0.5 and results["dattn_sage_rel_err"] < 0.05
    assert "step 2" in capsys.readouterr().out
