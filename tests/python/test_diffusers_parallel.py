"""diffusers' context parallelism on the CPU with dattn's backend (enable_parallelism):
random-weight Flux, Wan and Qwen-Image split across 2 gloo processes (ring degree 2, Ulysses
degree 2) and 4 (both), against the single-process dattn output; the faults (a degree that does
not divide the heads or match the world, a sequence the ranks cannot split, differing dtypes
between ranks, a rank that dies) raise on every rank instead of hanging. Each group of ranks is
one spawn (its start-up, torch and diffusers imported per process, is most of the time), bounded
by a timeout."""

import os
import sys
import time

import pytest
import torch

pytest.importorskip("diffusers")

import test_diffusers as td  # noqa: E402

import dattn.diffusers as dd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 100  # seconds for one group of ranks, far above what a run takes (~10-25 s)


def _spawn(world, cases, tmp_path, die_rank=None):
    """Runs the cases on `world` gloo ranks (one thread each); returns (rank 0's saved results,
    seconds). Fails the test if the ranks do not finish within TIMEOUT."""
    import multiprocessing

    sys.path.insert(0, HERE)
    import diffusers_cp_worker as worker

    init = f"file://{tmp_path}/rendezvous"
    out = str(tmp_path / "results.pt")
    t0 = time.monotonic()
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=worker.main, args=(rank, world, init, cases, out, die_rank))
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=max(0.1, t0 + TIMEOUT - time.monotonic()))
        if any(p.is_alive() for p in procs):
            pytest.fail(f"{world} ranks did not finish within {TIMEOUT} s (a hang)")
        codes = [p.exitcode for p in procs]
        want = [3 if rank == die_rank else 0 for rank in range(world)]
        assert codes == want, f"exit codes {codes}, expected {want}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    seconds = time.monotonic() - t0
    if die_rank is not None:
        survivor = 1 - die_rank
        return torch.load(f"{out}.{survivor}", weights_only=False), seconds
    return torch.load(out, weights_only=False), seconds


def _single(model_name, dtype=torch.float32, backend="dattn"):
    """The single-process output of the model on dattn's backend (by name)."""
    model, inputs = getattr(td, model_name)()
    if dtype != torch.float32:
        model, inputs = model.to(dtype), td.to_dtype(inputs, dtype)
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    active = registry._active_backend  # set_attention_backend sets the process-wide one too
    model.set_attention_backend(backend)
    try:
        return td.run(model, inputs)
    finally:
        model.reset_attention_backend()
        registry._active_backend = active


def _rel_to_max(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


CASES_2 = [
    {"model": "flux", "ring": 1, "ulysses": 2},
    {"model": "flux", "ring": 2, "ulysses": 1},
    {"model": "wan", "ring": 1, "ulysses": 2},
    {"model": "wan", "ring": 2, "ulysses": 1},
    {"model": "qwen", "ring": 1, "ulysses": 2},
    {"model": "qwen", "ring": 2, "ulysses": 1},
    {"model": "flux", "ring": 1, "ulysses": 2, "dtype": "bfloat16"},
    {"model": "flux", "ring": 2, "ulysses": 1, "dtype": "bfloat16"},
    # dattn.diffusers.enable(model): the model-scoped path over the same forward op
    {"model": "flux", "ring": 2, "ulysses": 1, "route": "enable"},
    # diffusers' native backend under the same machinery (Ulysses only: its forward op has no LSE)
    {"model": "flux", "ring": 1, "ulysses": 2, "route": "name", "backend": "native"},
    # the faults, each raised on every rank before any collective could hang
    {"model": "flux_3_heads", "ring": 1, "ulysses": 2},
    {"model": "flux", "ring": 2, "ulysses": 2},
    {"model": "flux", "ring": 1, "ulysses": 2, "text_tokens": 47},
    {"model": "flux", "ring": 1, "ulysses": 2, "rank_dtype": "bfloat16"},
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(2, CASES_2, tmp_path_factory.mktemp("cp2"))


@pytest.mark.parametrize("index", range(6))
def test_f32_models_match_one_process(two_ranks, index):
    saved, _ = two_ranks
    case, result = CASES_2[index], saved["results"][index]
    assert "error" not in result, result.get("error")
    want = _single(case["model"])
    assert result["out"].shape == want.shape
    assert _rel_to_max(result["out"], want) <= 1e-5, case
    # every attention call of the model ran on dattn on each rank (per ring step for ring)
    assert result["served"] > 0


@pytest.mark.parametrize("index", [6, 7])
def test_bf16_within_bf16s_tolerance(two_ranks, index):
    saved, _ = two_ranks
    case, result = CASES_2[index], saved["results"][index]
    assert "error" not in result, result.get("error")
    want = _single(case["model"], torch.bfloat16)
    assert result["out"].dtype == torch.bfloat16
    assert _rel_to_max(result["out"], want) <= 2e-2, case


def test_enable_routes_parallel_calls_through_the_same_op(two_ranks):
    saved, _ = two_ranks
    result = saved["results"][8]
    assert "error" not in result, result.get("error")
    assert result["served"] > 0  # the handle's own counters: calls computed by dattn
    assert _rel_to_max(result["out"], _single("flux")) <= 1e-5


def test_native_backend_under_the_same_parallelism(two_ranks):
    saved, _ = two_ranks
    result = saved["results"][9]
    assert "error" not in result, result.get("error")
    assert _rel_to_max(result["out"], _single("flux", backend="native")) <= 1e-5


def _every_rank_raised(saved, index):
    errors = [rank_errors[index] for rank_errors in saved["errors_by_rank"]]
    assert all(e is not None for e in errors), errors
    return errors


def test_a_degree_that_does_not_divide_the_heads(two_ranks):
    saved, _ = two_ranks
    for e in _every_rank_raised(saved, 10):
        assert e["type"] == "InvalidArgument" and e["field"] == "ulysses_degree", e
        assert "3 attention heads" in e["message"]


def test_degrees_that_do_not_match_the_world(two_ranks):
    saved, _ = two_ranks
    for e in _every_rank_raised(saved, 11):
        assert e["type"] == "InvalidArgument" and "world size 2" in e["message"], e


def test_a_sequence_the_ranks_cannot_split(two_ranks):
    saved, _ = two_ranks
    for e in _every_rank_raised(saved, 12):
        assert e["type"] == "AssertionError" and "divisible" in e["message"], e  # diffusers' own


def test_differing_dtypes_between_ranks(two_ranks):
    saved, _ = two_ranks
    for e in _every_rank_raised(saved, 13):
        assert e["type"] == "InvalidArgument" and e["field"] == "dtype", e
        assert "float32, bfloat16" in e["message"]


def test_ring_and_ulysses_together_on_four_ranks(tmp_path):
    saved, _ = _spawn(4, [{"model": "flux", "ring": 2, "ulysses": 2}], tmp_path)
    result = saved["results"][0]
    assert "error" not in result, result.get("error")
    assert _rel_to_max(result["out"], _single("flux")) <= 1e-5


def test_a_rank_that_dies_is_an_error_not_a_hang(tmp_path):
    saved, seconds = _spawn(2, [{"model": "flux", "ring": 1, "ulysses": 2}], tmp_path,
                            die_rank=1)
    result = saved["results"][0]
    assert "error" in result and result["error"] is not None
    assert seconds < TIMEOUT
