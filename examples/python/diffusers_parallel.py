#!/usr/bin/env python3
"""One image (or video) across processes: diffusers' context parallelism on the CPU, with dattn.

diffusers' own Flux or Wan transformer (random weights, nothing downloaded) at flux-1024 or
wan-480p token counts, a few heads, one block of each kind, split across processes with
diffusers' ``ContextParallelConfig`` (ring and/or Ulysses) over torch.distributed's gloo, one
thread per process; or (degrees 1) in one process with ``--threads`` threads. Each process:

    torch.distributed.init_process_group("gloo", ...)        # the caller's part, as in diffusers
    model.set_attention_backend("dattn")                     # or "native", "dattn_sage"
    dattn.diffusers.enable_parallelism(model, ContextParallelConfig(ring_degree=2))
    model(**inputs)

It prints the forward's time (median of --reps after one warm-up) and where the attention's
time goes on rank 0: the backend's forward op (the attention itself), gloo's all-to-all
(Ulysses) and all-gather (ring), and the rest of diffusers' templated attention (the ring's
merge of the ranks' (out, lse), the reshapes).

    python examples/python/diffusers_parallel.py --model flux --ulysses 2
    python examples/python/diffusers_parallel.py --model wan --ring 2 --backend native   # fails:
        # diffusers' native forward op has no LSE, which the ring needs
    python examples/python/diffusers_parallel.py --model flux --threads 2     # one process
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch


def build(args, dtype):
    """The model and its inputs (the same on every rank: seeded)."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if args.model == "flux":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
            attention_head_dim=args.head_dim, num_attention_heads=args.heads,
            joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
            axes_dims_rope=_rope_axes(args.head_dim)).eval()
        side = int(round(args.image_tokens ** 0.5))
        h, w = side, args.image_tokens // side
        ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        inputs = dict(
            hidden_states=torch.randn(1, h * w, 64, generator=g),
            encoder_hidden_states=torch.randn(1, args.text_tokens, 64, generator=g),
            pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([0.5]),
            img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3),
            txt_ids=torch.zeros(args.text_tokens, 3))
    else:
        from diffusers import WanTransformer3DModel

        frames, h, w = args.video
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=args.head_dim,
            in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=256, num_layers=1,
            rope_max_seq_len=1024).eval()
        inputs = dict(
            hidden_states=torch.randn(1, 16, frames, 2 * h, 2 * w, generator=g),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, args.text_tokens, 64, generator=g))
    if dtype != torch.float32:
        model = model.to(dtype)
        inputs = {k: (v.to(dtype) if v.is_floating_point() and k not in ("img_ids", "txt_ids")
                      else v) for k, v in inputs.items()}
    return model, inputs


def _rope_axes(head_dim: int):
    if head_dim == 128:
        return (16, 56, 56)
    t = max(2, head_dim // 8 // 2 * 2)
    rest = (head_dim - t) // 2 // 2 * 2
    return (head_dim - 2 * rest, rest, rest)


class Timers:
    """Seconds spent in the wrapped functions (rank 0 reports its own)."""

    # What a wrapped function is when it runs outside diffusers' templated attention: the
    # model's own gathering hook, or an attention call the plan does not split (Wan's
    # cross-attention).
    outside = {"all_gather": "output_all_gather", "forward_op": "attention_not_split"}

    def __init__(self):
        self.undo = []
        self.inside = False
        self.seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}

    def wrap(self, owner, attr: str, name: str, wait: bool = False):
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            # A collective outside the attention is the model's own sharding / gathering hooks.
            key = name if self.inside or name in ("attention", "single_attention") else \
                self.outside.get(name, f"outside_attention_{name}")
            outer, self.inside = self.inside, self.inside or name == "attention"
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if wait and hasattr(out, "wait"):
                    out = out.wait()  # funcol's collectives return a pending tensor
            finally:
                self.inside = outer
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
            self.calls[key] = self.calls.get(key, 0) + 1
            return out

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, fn))
        return fn

    def restore(self):
        """Puts the wrapped functions back (a one-process run shares the caller's modules)."""
        while self.undo:
            owner, attr, fn = self.undo.pop()
            setattr(owner, attr, fn)

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


def instrument(timers: Timers, world: int):
    from diffusers.models import attention_dispatch as ad

    from dattn import diffusers_backend as db

    if world == 1:  # one process: the attention calls themselves
        timers.wrap(db, "_attend", "single_attention")
        timers.wrap(torch.nn.functional, "scaled_dot_product_attention", "single_attention")
        return
    timers.wrap(ad, "_templated_context_parallel_attention", "attention")
    timers.wrap(ad, "_all_to_all_single", "all_to_all")
    timers.wrap(ad.funcol, "all_gather_tensor", "all_gather", wait=True)
    timers.wrap(db, "_forward_op", "forward_op")
    timers.wrap(ad, "_native_attention_forward_op", "forward_op")


def run_rank(rank: int, world: int, init: Optional[str], args, out_path: str) -> None:
    torch.set_num_threads(1 if world > 1 else args.threads)
    import dattn.diffusers

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, inputs = build(args, dtype)
    if args.backend != "native":
        model.set_attention_backend(args.backend)
    if world > 1:
        from diffusers import ContextParallelConfig

        dattn.diffusers.enable_parallelism(
            model, ContextParallelConfig(ring_degree=args.ring, ulysses_degree=args.ulysses))
    timers = Timers()
    instrument(timers, world)
    result = {"rank": rank, "world": world}
    try:
        times = []
        for rep in range(args.reps + 1):
            timers.reset()
            t = time.perf_counter()
            with torch.no_grad():
                out = model(**inputs, return_dict=False)[0]
            if hasattr(out, "wait"):
                out = out.wait()
            if rep > 0:
                times.append(time.perf_counter() - t)
        result.update(forward_s=statistics.median(times), seconds=dict(timers.seconds),
                      calls=dict(timers.calls), shape=list(out.shape))
    except Exception as e:  # noqa: BLE001 - reported
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        timers.restore()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if world > 1:
        import torch.distributed as dist

        if "error" not in result:
            dist.barrier()
        dist.destroy_process_group()


def parse(argv: Optional[List[str]]):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["flux", "wan"], default="flux")
    p.add_argument("--backend", default="dattn", help="dattn, dattn_sage or native")
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="threads of the single process")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--image-tokens", type=int, default=4096, help="flux: 4096 = flux-1024")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--video", type=int, nargs=3, default=[21, 30, 52],
                   metavar=("FRAMES", "H", "W"), help="wan: token grid (21 30 52 = wan-480p)")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a started rank
    p.add_argument("--init", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse(argv)
    world = args.ring * args.ulysses
    if args.rank is not None:  # one rank of a run main() started
        run_rank(args.rank, world, args.init, args, args.out)
        # Without the interpreter's finalization: a gloo worker thread may still be dropping a
        # finished collective's work (whose tensors hold Python objects) then, and its taking the
        # GIL during finalization aborts the process ("terminate called without an active
        # exception"; PyTorch's race, docs/python.md).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        if world == 1:
            run_rank(0, 1, None, args, out_path)
        else:
            # One process per rank, as torchrun would start them: this file with the rank.
            import subprocess

            init = f"file://{tmp}/rendezvous"
            procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                       *(argv if argv is not None else sys.argv[1:]),
                                       "--rank", str(r), "--init", init, "--out", out_path])
                     for r in range(world)]
            try:
                for p in procs:
                    p.wait(args.timeout + 60)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
        with open(out_path) as f:
            result = json.load(f)
    result.update(model=args.model, backend=args.backend, ring=args.ring, ulysses=args.ulysses,
                  dtype=args.dtype, heads=args.heads, threads=1 if world > 1 else args.threads)
    s = result.get("seconds", {})
    if world > 1 and "attention" in s:
        collectives = s.get("all_to_all", 0.0) + s.get("all_gather", 0.0)
        s["merge_and_reshapes"] = max(0.0, s["attention"] - s.get("forward_op", 0.0) - collectives)
    if args.json:
        print(json.dumps(result))
    elif "error" in result:
        print(f"{args.model} {args.backend} ring {args.ring} ulysses {args.ulysses}: "
              f"{result['error']}")
    else:
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in sorted(s.items()))
        print(f"{args.model} {args.backend} {args.dtype} ring {args.ring} ulysses {args.ulysses} "
              f"({world} process(es) x {result['threads']} thread(s)): forward "
              f"{result['forward_s']:.3f} s; rank 0: {parts}")
    return result


if __name__ == "__main__":
    sys.exit(0 if "error" not in main() else 1)
