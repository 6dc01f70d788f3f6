#!/usr/bin/env python3
"""One forward of ComfyUI's own diffusion models at real widths, reduced depth, random weights,
per attention path, in one run (a ComfyUI checkout: COMFYUI_DIR; make comfyui-check installs
what it imports into .venv):

  models    flux   ComfyUI's Flux at Flux-dev's widths (24 heads x 128), 1 double + 1 single
                   block, 1024x1024 (4,096 image + 512 text tokens)
            wan    ComfyUI's WanModel at Wan 2.1 1.3B's widths (12 x 128), 1 block, 480x832 x
                   --frames frames (81: 21x30x52 = 32,760 tokens; 33: 9x30x52 = 14,040)
  paths     sub_quad  ComfyUI's CPU default (attention_sub_quad)
            pytorch   ComfyUI's attention_pytorch (--use-pytorch-cross-attention)
            FLASH     dattn.comfyui.override("FLASH")
            SAGE      dattn.comfyui.override("SAGE")

Seconds of the fastest of --repeats forwards (after one warm-up forward per path), the ratio to
sub_quad and to pytorch, and each output's normwise error against pytorch's.

Usage: COMFYUI_DIR=... .venv/bin/python bench/comfyui.py [--model flux wan] [--frames 81]
           [--dtype bf16] [--repeats 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATHS = ("sub_quad", "pytorch", "FLASH", "SAGE")


def setup(comfy_dir):
    sys.path.insert(0, str(HERE.parent / "tests" / "comfyui"))
    os.environ["COMFYUI_DIR"] = comfy_dir
    import conftest  # noqa: F401  (ComfyUI on sys.path, --cpu, the torchvision stand-ins)


def build(name, frames, dtype):
    import torch

    import comfy.ldm.flux.model
    import comfy.ldm.wan.model
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    g = torch.Generator().manual_seed(0)

    def init(m):
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_((1.0 if p.ndim == 1 and "norm" in n else 0.0)
                        + 0.02 * torch.randn(p.shape, generator=g))
        return m.eval()

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "flux":
        m = init(comfy.ldm.flux.model.Flux(
            in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
            hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=1, depth_single_blocks=1,
            axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
            guidance_embed=True, dtype=dtype, operations=ops))
        x, ctx, y = rand(1, 16, 128, 128), rand(1, 512, 4096), rand(1, 768)
        return lambda to: m(x, torch.tensor([0.7]), ctx, y=y, guidance=torch.tensor([3.5]),
                            transformer_options=to)
    m = init(comfy.ldm.wan.model.WanModel(
        model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=1536, ffn_dim=8960,
        freq_dim=256, text_dim=4096, out_dim=16, num_heads=12, num_layers=1,
        dtype=dtype, operations=ops))
    latent_frames = (frames - 1) // 4 + 1
    x, ctx = rand(1, 16, latent_frames, 60, 104), rand(1, 512, 4096)
    return lambda to: m(x, torch.tensor([0.6]), ctx, transformer_options=to)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["flux", "wan"], choices=("flux", "wan"))
    ap.add_argument("--path", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    comfy_dir = os.environ.get("COMFYUI_DIR")
    if not comfy_dir:
        ap.error("set COMFYUI_DIR to a ComfyUI checkout")
    setup(comfy_dir)
    import torch

    import comfy.ldm.modules.attention as A

    from dattn import comfyui

    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    def pytorch(func, *args, **kwargs):
        kwargs.pop("_inside_attn_wrapper", None)
        kwargs.pop("transformer_options", None)
        return A.attention_pytorch.__wrapped__(*args, **kwargs)

    start = time.perf_counter()
    print(f"ComfyUI {comfy_dir}, {a.dtype}, {torch.get_num_threads()} threads")
    for name in a.model:
        run = build(name, a.frames, dtype)
        results = {}
        for path in a.path:
            options = {} if path == "sub_quad" else {
                "optimized_attention_override": pytorch if path == "pytorch"
                else comfyui.override(path)}
            with torch.no_grad():
                out = run(dict(options))  # warm-up
                best = float("inf")
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    out = run(dict(options))
                    best = min(best, time.perf_counter() - t)
            results[path] = (best, out.float())
        ref = results.get("pytorch", results[a.path[0]])[1]
        for path, (seconds, out) in results.items():
            err = float((out - ref).norm() / ref.norm())
            vs_sq = results["sub_quad"][0] / seconds if "sub_quad" in results else float("nan")
            vs_pt = results["pytorch"][0] / seconds if "pytorch" in results else float("nan")
            what = name if name == "flux" else f"wan {a.frames} frames"
            print(f"{what:14} {path:9} {seconds:8.2f} s  {vs_sq:5.2f}x sub_quad  "
                  f"{vs_pt:5.2f}x pytorch  rel. error {err:.2e}", flush=True)
    total = time.perf_counter() - start
    print(f"whole run: {total:.0f} s ({total / 60:.1f} minutes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
