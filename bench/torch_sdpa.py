#!/usr/bin/env python3
"""PyTorch's CPU attention on dattn's workload shapes, for comparison.

Uses F.scaled_dot_product_attention where the PyTorch has it (2.0 and later) and otherwise
what diffusers' attention processors run without it: matmul, softmax, matmul.
Optional: needs Debian's python3-torch (not a dattn dependency); run it with /usr/bin/python3. Prints one JSON object per
line with the keys of `dattn bench --json` that apply. Shapes follow tools/dattn/workloads.cpp:

  flux-1024   512 text + 4096 image rows, joint (one sequence of 4608), D 128
  sd35-1024   333 text + 4096 image rows, joint (one sequence of 4429), D 64

Usage: /usr/bin/python3 bench/torch_sdpa.py [--heads 2] [--threads 1] [--reps 5] [--dtype f32|bf16]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

WORKLOADS = {
    "flux-1024": (512 + 4096, 128),
    "sd35-1024": (333 + 4096, 64),
}


def attend(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    return torch.matmul(scores.softmax(dim=-1), v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--workload", action="append")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    for name in args.workload or list(WORKLOADS):
        rows, d = WORKLOADS[name]
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, args.heads, rows, d, generator=g).to(dtype) for _ in range(3))
        attend(q, k, v)  # warm-up
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            attend(q, k, v)
            best = min(best, time.perf_counter() - t0)
        flops = 4.0 * rows * rows * d * args.heads
        path = "sdpa" if hasattr(F, "scaled_dot_product_attention") else "matmul-softmax-matmul"
        print(json.dumps({"backend": f"torch-{torch.__version__}-{path}", "workload": name,
                          "dtype": args.dtype, "threads": args.threads, "seconds": best,
                          "gflops": flops / best * 1e-9}))


if __name__ == "__main__":
    main()
