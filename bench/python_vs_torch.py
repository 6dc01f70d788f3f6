#!/usr/bin/env python3
"""dattn called from Python against PyTorch's CPU attention math, on flux-1024 shapes.

Workload (defaults): one joint sequence of S = 4608 rows (512 text + 4096 image, Flux at
1024x1024), head size D = 128, 2 heads, 2 threads (torch.set_num_threads and OMP_NUM_THREADS,
set before dattn's OpenMP runtime starts). Q, K, V are the same [1, H, S, D] tensors for both
sides; dattn reads them in place (qkv_layout="BHSD"). PyTorch computes matmul - softmax -
matmul (what diffusers' processors run without scaled_dot_product_attention); where the
PyTorch has F.scaled_dot_product_attention (2.x) it is measured too. Each figure is the best of
--reps runs after one warm-up; GFLOP/s counts 4 * S * S * D * H flops.

It also measures the cost of the Python layer on a tiny call (B 1, S 64, H 2, D 64; one
thread; medians of interleaved calls): the wall time per call of ``dattn.Attention.forward``
(argument conversion, metadata, output allocation, the C++ call) against
``layer._layer.forward_into`` with pre-converted arguments and a pre-allocated output (the
C++ call alone, through pybind11).

Usage (in the project's environment, after ``make test`` installed dattn there):

    .venv/bin/python bench/python_vs_torch.py
        [--heads 2] [--seq 4608] [--head-dim 128] [--threads 2] [--reps 3]
        [--dtypes f32,bf16] [--json]

The script prints the BLAS PyTorch was built with (MKL for the pinned 2.13.0 CPU wheel).
bench/torch_sdpa.py is the comparison with PyTorch's SDPA on several workloads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4608, help="rows of the joint sequence (S)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16, f16")
    ap.add_argument("--overhead-calls", type=int, default=1000)
    ap.add_argument("--skip-torch", action="store_true", help="measure dattn only")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return ap.parse_args(argv)


def best_of(fn, reps: int) -> float:
    fn()  # warm-up: dattn's plan, PyTorch's allocator and thread pool
    best = math.inf
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved(fns, calls: int):
    """Median and minimum seconds per call of each of `fns`, called in turn `calls` times (so
    that load from other processes hits all of them alike)."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(calls):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [(statistics.median(ts), min(ts)) for ts in times]


def main(argv=None) -> dict:
    args = parse_args(argv)
    # Before torch and dattn load their OpenMP runtimes.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    import dattn
    from dattn.tensors import tensor_arg

    torch.set_num_threads(args.threads)
    F = torch.nn.functional
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    H, S, D = args.heads, args.seq, args.head_dim
    flops = 4.0 * S * S * D * H
    blas = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    report = {
        "workload": {"heads": H, "seq": S, "head_dim": D, "threads": args.threads,
                     "reps": args.reps, "flops": flops},
        "torch": {"version": torch.__version__, "blas": blas.group(1) if blas else "unknown",
                  "has_sdpa": hasattr(F, "scaled_dot_product_attention")},
        "results": [],
    }

    def math_attention(q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        return torch.matmul(scores.softmax(dim=-1), v)

    layer = dattn.Attention(H, D, qkv_layout="BHSD", prefix="bench")
    report["dattn_backend"] = layer.backend_name
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(1, H, S, D, generator=g) for _ in range(3)]
    with torch.no_grad():
        for name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            q, k, v = (t.to(dtypes[name]) for t in base)
            row = {"dtype": name}
            out = torch.empty_like(q)
            row["dattn_s"] = best_of(lambda: layer.forward(q, k, v, out=out), args.reps)
            if not args.skip_torch:
                want = math_attention(q.double(), k.double(), v.double()) if S <= 8192 else None
                row["torch_math_s"] = best_of(lambda: math_attention(q, k, v), args.reps)
                if report["torch"]["has_sdpa"]:
                    row["torch_sdpa_s"] = best_of(
                        lambda: F.scaled_dot_product_attention(q, k, v), args.reps
                    )
                if want is not None:
                    err = (out.double() - want).norm() / want.norm()
                    row["dattn_rel_err_vs_f64"] = float(err)
            for key in [k for k in row if k.endswith("_s")]:
                row[key.replace("_s", "_gflops")] = flops / row[key] / 1e9
            if "torch_math_s" in row:
                row["speedup_vs_torch_math"] = row["torch_math_s"] / row["dattn_s"]
            if "torch_sdpa_s" in row:
                row["speedup_vs_torch_sdpa"] = row["torch_sdpa_s"] / row["dattn_s"]
            report["results"].append(row)

        # The Python layer's cost on a tiny call, on one thread: the Python work does not
        # depend on the thread count, and one thread keeps OpenMP's barriers (slow on a loaded
        # machine) out of the figure. PyTorch's wheel has its own libgomp copy: this sets
        # PyTorch's count only; dattn keeps OMP_NUM_THREADS (its call is tiny either way).
        torch.set_num_threads(1)
        tiny = dattn.Attention(2, 64, prefix="bench.tiny")
        tq, tk, tv = (torch.randn(1, 64, 2, 64, generator=g) for _ in range(3))
        tout = torch.empty_like(tq)
        args_cpp = (tensor_arg(tq, "query"), tensor_arg(tk, "key"), tensor_arg(tv, "value"))
        out_cpp = tensor_arg(tout, "out")
        (py, py_min), (py_out, py_out_min), (cpp, cpp_min) = interleaved(
            [
                lambda: tiny.forward(tq, tk, tv),
                lambda: tiny.forward(tq, tk, tv, out=tout),
                lambda: tiny._layer.forward_into(*args_cpp, None, out_cpp, None),
            ],
            args.overhead_calls,
        )
        torch.set_num_threads(args.threads)
        report["overhead"] = {
            "shape": [1, 64, 2, 64],
            "threads": 1,
            "python_forward_s": py,
            "python_forward_out_s": py_out,
            "core_forward_into_s": cpp,
            "python_layer_s": py - cpp,
            "min_python_forward_s": py_min,
            "min_core_forward_into_s": cpp_min,
        }

    if args.json:
        print(json.dumps(report))
        return report
    w = report["workload"]
    print(
        f"attention S {w['seq']}, H {w['heads']}, D {w['head_dim']}, {w['threads']} threads, "
        f"best of {w['reps']} (4*S*S*D*H = {flops / 1e9:.1f} GFLOP); dattn backend "
        f"{report['dattn_backend']}; torch {report['torch']['version']} "
        f"(BLAS {report['torch']['blas']})"
    )
    print(f"{'dtype':<6}{'impl':<14}{'seconds':>10}{'GFLOP/s':>10}{'dattn speedup':>15}")
    for row in report["results"]:
        for impl, key in (("dattn", "dattn"), ("torch math", "torch_math"),
                          ("torch sdpa", "torch_sdpa")):
            if f"{key}_s" not in row:
                continue
            speedup = row.get(f"speedup_vs_{key}")
            print(
                f"{row['dtype']:<6}{impl:<14}{row[f'{key}_s']:>10.4f}"
                f"{row[f'{key}_gflops']:>10.2f}"
                f"{'' if speedup is None else f'{speedup:.2f}x':>15}"
            )
        if "dattn_rel_err_vs_f64" in row:
            err = row["dattn_rel_err_vs_f64"]
            print(f"{'':<6}dattn error vs float64 math (normwise): {err:.2e}")
    o = report["overhead"]
    print(
        f"tiny call {tuple(o['shape'])} (BSHD, 1 thread, medians): Attention.forward "
        f"{o['python_forward_s'] * 1e6:.1f} us, "
        f"with out= {o['python_forward_out_s'] * 1e6:.1f} us, _core forward_into "
        f"{o['core_forward_into_s'] * 1e6:.1f} us -> Python layer "
        f"{o['python_layer_s'] * 1e6:.1f} us per call"
    )
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
