#!/usr/bin/env python3
"""dattn against the pinned PyTorch's CPU scaled_dot_product_attention, on DiT shapes.

One run, from Python, in the project's environment (.venv: torch 2.13.0, dattn installed by
`make test`). Shapes follow tools/dattn/workloads.cpp, with --heads heads (default 2):

  flux-1024   512 text + 4096 image rows as one sequence of 4608, D 128
  sd35-1024   333 text + 4096 image rows as one sequence of 4429, D 64
  wan-480p    a 21x30x52 video grid, 32760 rows, D 128 (self-attention)
  small       300 rows, D 64 (only when named: a quick check of the script)

Both libraries get the same thread count: OMP_NUM_THREADS is set before either OpenMP runtime
starts (PyTorch's wheel brings its own libgomp copy; dattn uses the system's, and has no thread
option of its own) and torch.set_num_threads() too; the threads each ran are printed. The two
never run at once: rounds are interleaved (PyTorch, then dattn, per round, with a pause so
that one runtime's spinning workers have gone to sleep before the other starts), and each
figure is the best of --rounds, so load from other processes hits both alike.
GFLOP/s counts 4 * S * S * D * H.

OpenVINO's CPU ScaledDotProductAttention (opset 13, the pinned openvino of requirements.txt)
is timed in the same rounds when the package is installed (--no-openvino leaves it out): a
model of one SDPA node on f32 [1, H, S, D] inputs, compiled for the CPU with
INFERENCE_PRECISION_HINT f32 for the f32 rows and bf16 for the bf16 rows (it converts the f32
inputs itself) and INFERENCE_NUM_THREADS = --threads; its figures are columns of every row
(ov s, GFLOP/s, dattn/ov) and its error against PyTorch is printed once per row group.

--backend (repeatable, default FLASH) names the dattn backends timed in the same rounds, e.g.
`--backend FLASH --backend SAGE` for 8-bit attention beside FLASH; one row per backend, each
against the same PyTorch timings (dattn/torch) and, from the second on, against the first
(vs first). A backend may carry string options after a colon, `NAME:key=value,key=value`, e.g.
`--backend SAGE:pv_dtype=int8` (SAGE with P.V in 8 bits).

Usage: .venv/bin/python bench/torch_sdpa.py [--threads 2] [--heads 2] [--rounds 3]
           [--workload flux-1024 ...] [--dtype f32 --dtype bf16] [--backend FLASH ...]
           [--no-openvino] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

WORKLOADS = {
    "small": (300, 64),  # a quick check of the script itself (tests/python/test_bench.py)
    "flux-1024": (512 + 4096, 128),
    "sd35-1024": (333 + 4096, 64),
    "wan-480p": (21 * 30 * 52, 128),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (best of)")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS),
                    help="repeatable; default flux-1024, sd35-1024 and wan-480p")
    ap.add_argument("--dtype", action="append", choices=["f32", "bf16"])
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between the libraries")
    ap.add_argument("--backend", action="append",
                    help="dattn backend (repeatable; default FLASH), e.g. SAGE")
    ap.add_argument("--no-openvino", action="store_true",
                    help="do not time OpenVINO's SDPA even where openvino is installed")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    return ap.parse_args(argv)


def openvino_sdpa(threads: int):
    """A factory of OpenVINO SDPA runners, or None where openvino is not installed.

    make(shape, hint) compiles one ScaledDotProductAttention node (opset 13, not causal, default
    scale 1/sqrt(D)) over three f32 parameters of `shape` for the CPU with the precision hint
    (f32 or bf16) and `threads` inference threads, and returns run(q, k, v) -> numpy output."""
    try:
        import openvino as ov
        from openvino import opset13
    except ImportError:
        return None
    core = ov.Core()

    def make(shape, hint):
        params = [opset13.parameter(list(shape), ov.Type.f32, name=n) for n in ("q", "k", "v")]
        node = opset13.scaled_dot_product_attention(*params, causal=False)
        model = ov.Model([node], params, "sdpa")
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                     "INFERENCE_NUM_THREADS": threads})
        request = compiled.create_infer_request()

        def run(q, k, v):
            request.infer([q, k, v])
            return request.get_output_tensor(0).data

        return run

    make.version = ov.get_version()
    return make


def backend_spec(spec: str):
    """'NAME' or 'NAME:key=value,...' -> (NAME, {key: value})."""
    name, _, options = spec.partition(":")
    kwargs = {}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--backend {spec}: options are key=value, got {item!r}")
        kwargs[key] = value
    return name, kwargs


def main(argv=None):
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before either OpenMP runtime starts
    import torch

    import dattn

    torch.set_num_threads(args.threads)
    F = torch.nn.functional
    sdpa = F.scaled_dot_product_attention
    dattn_threads = dattn.measure_peak_gflops(0, 0.01)["threads"]
    cpu = dattn.cpu_info()
    ov_make = None if args.no_openvino else openvino_sdpa(args.threads)
    header = {
        "cpu": cpu["brand"], "logical_cpus": cpu["logical_cpus"],
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dattn": dattn.__version__, "dattn_threads": dattn_threads,
        "openvino": ov_make.version if ov_make else None,
        "heads": args.heads, "rounds": args.rounds,
    }
    if not args.json:
        print(f"CPU: {cpu['brand']} ({cpu['logical_cpus']} logical CPUs); threads: torch "
              f"{header['torch_threads']}, dattn {dattn_threads}; torch {torch.__version__} "
              f"(CPU capability {header['torch_cpu_capability']}); {args.heads} heads; best of "
              f"{args.rounds} interleaved rounds"
              + (f"; OpenVINO {ov_make.version}" if ov_make else "; OpenVINO not timed"))
        print(f"{'workload':<11}{'dtype':<6}{'backend':<8}{'torch s':>9}{'GFLOP/s':>9}"
              + (f"{'ov s':>9}{'GFLOP/s':>9}" if ov_make else "")
              + f"{'dattn s':>9}{'GFLOP/s':>9}  {'dattn/torch':>11}  "
              + (f"{'dattn/ov':>8}  " if ov_make else "")
              + f"{'vs first':>8}  engine       err vs torch")
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    with torch.no_grad():
        for name in args.workload or [w for w in WORKLOADS if w != "small"]:
            S, D = WORKLOADS[name]
            H = args.heads
            flops = 4.0 * S * S * D * H
            g = torch.Generator().manual_seed(1)
            base = [torch.randn(1, H, S, D, generator=g) for _ in range(3)]
            backends = args.backend or ["FLASH"]
            layers = {}
            for b in backends:
                backend, kwargs = backend_spec(b)
                layers[b] = dattn.Attention(H, D, qkv_layout="BHSD", prefix=f"bench.{name}",
                                            backend=backend, backend_kwargs=kwargs)
            for dt in args.dtype or ["f32", "bf16"]:
                q, k, v = (t.to(dtypes[dt]) for t in base)
                outs = {b: torch.empty_like(q) for b in backends}
                fns = {"torch": lambda: sdpa(q, k, v)}
                if ov_make:
                    ov_run = ov_make(q.shape, dt)
                    ov_in = [t.float().contiguous().numpy() for t in (q, k, v)]
                    fns["openvino"] = lambda: ov_run(*ov_in)
                for b in backends:
                    fns[b] = (lambda b=b: layers[b].forward(q, k, v, out=outs[b]))
                best = {lib: float("inf") for lib in fns}
                for lib, fn in fns.items():  # warm-up: plans, allocators, thread pools
                    fn()
                    time.sleep(args.pause)
                for _ in range(args.rounds):
                    for lib, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        best[lib] = min(best[lib], time.perf_counter() - t0)
                        time.sleep(args.pause)
                want = sdpa(q, k, v)
                ov_err = None
                if ov_make:
                    got = torch.from_numpy(fns["openvino"]().copy()).double()
                    ov_err = float((got - want.double()).norm() / want.double().norm())
                for b in backends:
                    out, layer = outs[b], layers[b]
                    err = float((out.double() - want.double()).norm() / want.double().norm())
                    row = {**header, "workload": name, "dtype": dt, "seq": S, "head_dim": D,
                           "flops": flops, "torch_s": best["torch"], "dattn_s": best[b],
                           "torch_gflops": flops / best["torch"] * 1e-9,
                           "dattn_gflops": flops / best[b] * 1e-9,
                           "dattn_over_torch": best["torch"] / best[b],
                           "over_first": best[backends[0]] / best[b],
                           "engine": layer.last_engine, "backend": layer.backend_name,
                           "rel_err_vs_torch": err}
                    if ov_make:
                        row.update({"openvino_s": best["openvino"],
                                    "openvino_gflops": flops / best["openvino"] * 1e-9,
                                    "dattn_over_openvino": best["openvino"] / best[b],
                                    "openvino_rel_err_vs_torch": ov_err})
                    rows.append(row)
                    if args.json:
                        print(json.dumps(row), flush=True)
                    else:
                        ov_cols = (f"{row['openvino_s']:>9.3f}{row['openvino_gflops']:>9.1f}"
                                   if ov_make else "")
                        ov_ratio = (f"{row['dattn_over_openvino']:>7.2f}x  " if ov_make else "")
                        print(f"{name:<11}{dt:<6}{b:<8}{row['torch_s']:>9.3f}"
                              f"{row['torch_gflops']:>9.1f}{ov_cols}{row['dattn_s']:>9.3f}"
                              f"{row['dattn_gflops']:>9.1f}  {row['dattn_over_torch']:>10.2f}x  "
                              f"{ov_ratio}{row['over_first']:>7.2f}x  {row['engine']:<12} "
                              f"{err:.1e}", flush=True)
                if ov_make and not args.json:
                    print(f"{'':<17}OpenVINO's error vs torch: {ov_err:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
