#!/usr/bin/env python3
"""Seconds per denoising step inside vllm-omni's real engine on the CPU (dattn's platform), per
attention backend: the engine as a user runs it (``Omni(model=...).generate(...)``), on
random-weight pipelines at real widths and reduced depth (tests/vllm_omni/pipelines.py, --widths
real), one engine process per (model, backend), all in one run.

  models      flux   Flux-dev widths (24 heads x 128), 1 double + 1 single block, 1024x1024
                     (4,096 image + 512 text tokens), no CFG
              wan    Wan 2.1 1.3B widths (12 x 128), 1 block, 480x832 x 81 frames (21x30x52 =
                     32,760 tokens; 512 text tokens), guidance 1 (no CFG)
  backends    TORCH_SDPA    the engine's own SDPA (PyTorch's CPU kernel)
              DATTN         dattn's default (FLASH)
              SAGE_ATTN     dattn's SAGE
              VIDEO_SPARSE  (wan) dattn's VIDEO_SPARSE through the engine's attention config,
                            block_sparse {sparsity: --sparsity, start_step: 0}: every step and
                            layer sparse

A step's time is the difference of a 2-step and a 3-step request on the same engine (after its
warm-up; the fastest of --repeats of each: by default 3 for Flux, whose requests' other work
varies by about a step's time, 1 for Wan, whose steps take tens of seconds): the text encoders, the VAE and the
engine's per-request work cancel out. Each row
also reports the engine's start (model load and its compulsory 512x512 warm-up) and the
3-step request's seconds.

Usage: .venv-vllm-omni/bin/python bench/vllm_omni.py [--model flux wan] [--backend ...]
           [--sparsity 0.9] [--repeats N] [--models-dir DIR] [--json FILE]
(make vllm-omni-env builds that environment.) The pipelines are built once into --models-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests" / "vllm_omni"
sys.path.insert(0, str(TESTS))

BACKENDS = ("TORCH_SDPA", "DATTN", "SAGE_ATTN", "VIDEO_SPARSE")
REPEATS = {"flux": 3, "wan": 1}
REQUEST = {
    "flux": {"height": 1024, "width": 1024, "seed": 0},
    "wan": {"height": 480, "width": 832, "frames": 81, "seed": 0, "guidance": 1.0},
}


def run_engine(model_dir, backend, request, sparsity, out_dir, timeout, repeats):
    from process_group import run_process

    spec = {"model": model_dir, "out": str(out_dir),
            "requests": [dict(request, steps=steps) for _ in range(repeats) for steps in (2, 3)]}
    if backend == "VIDEO_SPARSE":
        spec["attention_config"] = {"default": {
            "backend": "VIDEO_SPARSE", "block_sparse": {"sparsity": sparsity, "start_step": 0}}}
    else:
        spec["backend"] = backend
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "request.json").write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("DIFFUSION_ATTENTION_BACKEND", None)
    code, log = run_process([sys.executable, str(TESTS / "engine_run.py"),
                             str(out_dir / "request.json")], env, timeout, out_dir / "log.txt")
    result = json.loads((out_dir / "result.json").read_text()) if code == 0 else None
    if result is None or any(r["error"] for r in result["requests"]):
        raise RuntimeError(f"{backend}: the engine failed ({code}):\n{log[-4000:]}")
    seconds = [r["seconds"] for r in result["requests"]]
    two, three = min(seconds[0::2]), min(seconds[1::2])  # the fastest of the repeats
    return {"step_seconds": three - two, "request_3_steps_seconds": three,
            "engine_start_seconds": result["init_seconds"], "repeats": repeats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["flux", "wan"], choices=sorted(REQUEST))
    ap.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--models-dir", default=str(HERE.parent / "build" / "vllm-omni-bench"))
    ap.add_argument("--repeats", type=int, default=None,
                    help="2- and 3-step request pairs per engine, the fastest of each counting "
                         "(default: 3 for flux, whose requests vary by a step's time; 1 for wan)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine")
    ap.add_argument("--json", help="also write the rows here (one JSON object per line)")
    a = ap.parse_args()

    import pipelines

    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.model:
            model_dir = pipelines.build(model, os.path.join(a.models_dir, f"{model}-real-bf16"),
                                        "real", "bfloat16")
            base = None
            for backend in a.backend:
                if backend == "VIDEO_SPARSE" and model != "wan":
                    continue
                row = {"model": model, "backend": backend,
                       **run_engine(model_dir, backend, REQUEST[model], a.sparsity,
                                    Path(tmp) / f"{model}-{backend}", a.timeout,
                                    a.repeats or REPEATS[model])}
                if backend == "TORCH_SDPA":
                    base = row["step_seconds"]
                row["vs_torch_sdpa"] = base / row["step_seconds"] if base else None
                rows.append(row)
                print(f"{model:5} {backend:13} {row['step_seconds']:8.2f} s/step  "
                      + (f"{row['vs_torch_sdpa']:.2f}x TORCH_SDPA" if base else "")
                      + f"  (start {row['engine_start_seconds']:.1f} s, 3-step request "
                        f"{row['request_3_steps_seconds']:.1f} s)", flush=True)
    total = time.perf_counter() - start
    print(f"whole run: {total:.0f} s ({total / 60:.1f} minutes)")
    if a.json:
        with open(a.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
