"""The ranks of test_diffusers_parallel.py: each process joins a gloo group, runs the asked
cases (a model of test_diffusers.py under diffusers' context parallelism on dattn) and rank 0
saves what came out (outputs, or the typed error each rank raised) for the test to compare."""

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _plain(out):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(out, AsyncCollectiveTensor):
        out = out.wait()
    return out.detach().clone()


def _error(e):
    return {"type": type(e).__name__, "field": getattr(e, "field", None), "message": str(e),
            "bases": [c.__name__ for c in type(e).__mro__]}


def run_case(case, rank):
    """One case: {"model", "ring", "ulysses", "dtype", "backend", ...}; returns the output."""
    import test_diffusers as td
    from diffusers import ContextParallelConfig

    import dattn.diffusers as dd

    if case["model"] == "flux_3_heads":  # a head count that 2 ranks of Ulysses cannot split
        from diffusers import FluxTransformer2DModel

        _, inputs = td.flux()
        torch.manual_seed(0)
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
            attention_head_dim=64, num_attention_heads=3, joint_attention_dim=32,
            pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(16, 24, 24)).eval()
    else:
        model, inputs = getattr(td, case["model"])(**case.get("model_kwargs", {}))
    if case.get("text_tokens") is not None:  # Flux's text cut to a length the ranks cannot split
        n = case["text_tokens"]
        inputs = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, :n],
                      txt_ids=inputs["txt_ids"][:n])
    dtype = getattr(torch, case.get("dtype", "float32"))
    if dtype != torch.float32:
        model, inputs = model.to(dtype), td.to_dtype(inputs, dtype)
    if case.get("rank_dtype") is not None and rank == 1:
        inputs = td.to_dtype(inputs, getattr(torch, case["rank_dtype"]))
    route = case.get("route", "name")
    handle = None
    if route == "name":
        model.set_attention_backend(case.get("backend", "dattn"))
    elif route == "enable":
        handle = dd.enable(model)
    config = ContextParallelConfig(ring_degree=case["ring"], ulysses_degree=case["ulysses"])
    dd.enable_parallelism(model, config)
    before = dd.backend_client().calls
    with torch.no_grad():
        out = _plain(td.run(model, inputs))
    served = (handle.calls if handle is not None
              else dd.backend_client(case.get("backend", "dattn")).calls - before
              if case.get("backend", "dattn").startswith("dattn") else 0)
    return out, served


def main(rank, world, init, cases, out_path, die_rank=None):
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    if die_rank == rank:
        os._exit(3)  # a rank that dies: the others must fail, not hang
    results = []
    for case in cases:
        try:
            out, served = run_case(case, rank)
            results.append({"out": out, "served": served})
        except Exception as e:  # noqa: BLE001 - reported to the test, per rank
            results.append({"error": _error(e)})
    # Each rank's errors, so that the test sees that every rank raised.
    if die_rank is None:
        every = [None] * world
        dist.all_gather_object(every, [r.get("error") for r in results])
        if rank == 0:
            torch.save({"results": results, "errors_by_rank": every}, out_path)
        dist.barrier()
        dist.destroy_process_group()
    else:
        torch.save({"results": results}, f"{out_path}.{rank}")
    exit_now(0)


def exit_now(code):
    """Ends the process without the interpreter's finalization. A gloo worker thread may still
    drop the last reference to a finished collective's work (diffusers' output all-gather) when
    the main thread finalizes; the work's tensors hold Python objects, the thread then takes the
    GIL during finalization, Python ends the thread with pthread_exit, and its unwinding
    through a noexcept frame calls std::terminate: "terminate called without an active
    exception", SIGABRT, in about 1 run in 10-20 (a core dump's backtrace: ProcessGroupGloo::
    runLoop -> ~AsyncAllgatherWork -> decref_pyobject -> gil_scoped_acquire -> take_gil ->
    PyThread_exit_thread -> std::terminate). PyTorch's, not dattn's (docs/python.md)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
