#!/usr/bin/env python3
"""The memory a model's attention layers keep between calls, and what one call adds while it
runs: N layers called once each at a DiT's shapes, as one denoising step calls them.

Every (model, backend) runs in a fresh process: bf16 Q, K and V of the model's shape (BSHD),
then one block of --pre-free MiB allocated, touched and freed, as any pipeline's own tensors
are (glibc then raises its mmap threshold to that size, so later blocks of up to that size come
from its heap), then N layers made and called once each (a new `dattn.Attention` per layer, as
vllm-omni's engine makes one impl per attention layer; for PyTorch the same
`scaled_dot_product_attention` call per layer), each layer kept and each output dropped. After
each layer the process's RSS is read; during each call its peak (VmHWM, reset before the call
through /proc/self/clear_refs) less the RSS before the call is what the call added while it ran.
The one-time costs come first and are reported apart: a tiny call on a throwaway layer (imports,
OpenMP's threads, PyTorch's first call).

  flux   Flux-dev at 1024x1024: 57 layers of [1, 4608, 24, 128] (512 text + 4096 image tokens)
  wan    Wan 2.1 1.3B at 480p x 81 frames: 30 self-attention layers of [1, 32760, 12, 128]
  sd35   SD3.5 Large at 1024x1024: 38 layers of [1, 4429, 38, 64] (333 text + 4096 image)
  small  [1, 2048, 8, 128], 12 layers (a quick check; the test of tests/python uses it)

Usage: .venv/bin/python bench/memory.py [--model flux ...] [--backend FLASH --backend SAGE
           --backend torch] [--layers N] [--threads 2] [--pre-free 30] [--empty-cache]
           [--json]

Prints per (model, backend): RSS after the first layer and after the last (MiB above the
inputs), the growth per layer from layer 2 on, and the largest transient a call added.
`--empty-cache` calls dattn.empty_cache() at the end and reports the RSS after it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = {
    "flux": (57, 4608, 24, 128),
    "wan": (30, 32760, 12, 128),
    "sd35": (38, 4429, 38, 64),
    "small": (12, 2048, 8, 128),
}
MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux 4.0+); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(model: str, backend: str, layers: int, threads: int, pre_free_mib: int,
          empty_cache: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    _, s, h, d = MODELS[model]
    q, k, v = (torch.randn(1, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    if pre_free_mib > 0:
        block = torch.ones(pre_free_mib * MIB, dtype=torch.uint8)
        del block
    if backend == "torch":
        import torch.nn.functional as F

        def make(i):
            def call(q, k, v):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
            return call
    else:
        import dattn

        def make(i):
            return dattn.Attention(h, d, backend=backend, prefix=f"layer{i}")
    # One-time costs first (imports, OpenMP's threads, torch's first call), measured apart: a
    # tiny call on a throwaway layer.
    start = rss_bytes()
    warm = make(-1)
    out = warm(q[:, :64], k[:, :64], v[:, :64])
    del out, warm
    base = rss_bytes()
    kept, after, transient = [], [], []
    for i in range(layers):
        layer = make(i)
        kept.append(layer)
        before = rss_bytes()
        have_peak = reset_peak()
        out = layer(q, k, v)
        del out
        transient.append(peak_bytes() - before if have_peak else None)
        after.append(rss_bytes() - base)
    result = {"model": model, "backend": backend, "layers": layers, "shape": [1, s, h, d],
              "threads": threads, "pre_free_mib": pre_free_mib,
              "one_time_mib": round((base - start) / MIB, 1),
              "rss_after_mib": [round(a / MIB, 1) for a in after],
              "first_mib": round(after[0] / MIB, 1), "last_mib": round(after[-1] / MIB, 1),
              "growth_per_layer_mib": round((after[-1] - after[0]) / max(1, layers - 1) / MIB, 2),
              "transient_max_mib": (round(max(t for t in transient if t is not None) / MIB, 1)
                                    if any(t is not None for t in transient) else None)}
    if empty_cache and backend != "torch":
        import dattn

        del kept
        dattn.empty_cache()
        result["after_empty_cache_mib"] = round((rss_bytes() - base) / MIB, 1)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=list(MODELS),
                    help="repeatable; default flux, wan, sd35")
    ap.add_argument("--backend", action="append",
                    help="a dattn backend name or 'torch' (repeatable; default FLASH, SAGE, torch)")
    ap.add_argument("--layers", type=int, help="layers per model (default: the model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pre-free", type=int, default=30, metavar="MIB",
                    help="a block freed before the layers, as a pipeline's tensors are (0: none)")
    ap.add_argument("--empty-cache", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, backend = args.child
        layers = args.layers or MODELS[model][0]
        print(json.dumps(child(model, backend, layers, args.threads, args.pre_free,
                               args.empty_cache)))
        return 0
    rows = []
    for model in args.model or ["flux", "wan", "sd35"]:
        for backend in args.backend or ["FLASH", "SAGE", "torch"]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", model, backend,
                   "--threads", str(args.threads), "--pre-free", str(args.pre_free)]
            if args.layers:
                cmd += ["--layers", str(args.layers)]
            if args.empty_cache:
                cmd.append("--empty-cache")
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                sys.stderr.write(r.stderr)
                return r.returncode
            row = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                extra = (f", {row['after_empty_cache_mib']:.0f} after empty_cache"
                         if "after_empty_cache_mib" in row else "")
                print(f"{model:6s} {backend:8s} {row['layers']:3d} layers {row['shape']}: "
                      f"one-time {row['one_time_mib']:.0f} MiB; "
                      f"+{row['first_mib']:.0f} MiB after layer 1, +{row['last_mib']:.0f} after "
                      f"layer {row['layers']} ({row['growth_per_layer_mib']:+.2f} per layer), "
                      f"a call's transient up to {row['transient_max_mib']} MiB{extra}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
