#!/usr/bin/env python3
"""Wan 2.1's transformer on dattn: dense (FLASH), SAGE, and VIDEO_SPARSE with the step policy.

A small random-weight WanTransformer3DModel (no download) runs a short flow-matching denoising
loop per setting; the script prints each setting's time per step and its distance from the
dense run, and VIDEO_SPARSE's per-step report (docs/video.md). With a real pipeline, pass
``pipe.transformer`` instead and call the pipeline.

Usage: .venv/bin/python examples/python/wan_video_sparse.py [--frames 4] [--height 16]
           [--width 32] [--steps 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import dattn.diffusers


def build(args):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4,
        out_channels=4, text_dim=64, freq_dim=32, ffn_dim=256, num_layers=2,
        rope_max_seq_len=64).eval()
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 4, args.frames, args.height, args.width, generator=g)
    text = torch.randn(1, 16, 64, generator=g)
    return model, latents, text


def denoise(model, latents, text, steps):
    """diffusers' flow-matching Euler loop (no guidance); returns (latents, seconds per step)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    start = time.perf_counter()
    with torch.no_grad():
        for t in scheduler.timesteps:
            noise = model(latents, timestep=t.reshape(1), encoder_hidden_states=text,
                          return_dict=False)[0]
            latents = scheduler.step(noise, t, latents, return_dict=False)[0]
    return latents, (time.perf_counter() - start) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--height", type=int, default=16)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, latents, text = build(args)

    results = {}
    model.set_attention_backend("dattn")  # FLASH: exact
    dense, results["dattn_seconds"] = denoise(model, latents, text, args.steps)
    model.set_attention_backend("dattn_sage")  # SAGE: 8-bit Q.K^T
    sage, results["dattn_sage_seconds"] = denoise(model, latents, text, args.steps)
    model.reset_attention_backend()

    # VIDEO_SPARSE: 75% of the video key blocks skipped (this grid is small), the first step and
    # the first layer dense, the selection kept for 2 steps.
    options = {"sparsity": 0.75, "tile": "1,4,4", "dense_steps": 1, "dense_layers": 1,
               "refresh_steps": 2}
    with dattn.diffusers.enable(model, backend="VIDEO_SPARSE", backend_kwargs=options) as handle:
        sparse, results["sparse_seconds"] = denoise(model, latents, text, args.steps)
        stats = handle.stats()

    def distance(x):
        return float((x - dense).norm() / dense.norm())

    results["dattn_sage_rel_err"] = distance(sage)
    results["sparse_rel_err"] = distance(sparse)
    results["stats"] = stats
    print(f"grid {args.frames}x{args.height // 2}x{args.width // 2}, {args.steps} steps, "
          f"{args.threads} threads (random weights: no locality, the sparse error is an upper "
          f"bound)")
    for name in ("dattn", "dattn_sage", "sparse"):
        err = results.get(f"{name}_rel_err")
        print(f"  {name:11} {results[f'{name}_seconds'] * 1e3:8.1f} ms/step"
              + ("" if err is None else f"   latents vs dense: {err:.2e}"))
    for s in stats:
        calls = ", ".join(f"layer {c['layer']} {c['mode']}"
                          + (f" {c['block_sparsity']:.2f}"
                             + (" (reused)" if c.get("reused") else "")
                             if c["mode"] == "sparse" else "")
                          for c in s["calls"])
        print(f"  step {s['step']} (t={s['timestep']:.0f}): {calls}")
    return results


if __name__ == "__main__":
    main()
