#!/usr/bin/env python3
"""One diffusers FluxTransformer2DModel forward with diffusers' default attention and on dattn.

The model is diffusers' own Flux transformer at Flux's width (24 heads of 128) with random
weights (nothing is downloaded) and fewer blocks (2 double-stream, 2 single-stream; Flux.1 has
19 and 38), at flux-1024 token counts: 4096 image tokens (a 1024x1024 image: 128x128 latent,
2x2 patches) and 512 text tokens. For each dtype it times the forward with the default
attention (PyTorch's CPU scaled_dot_product_attention, reached through diffusers' native
dispatcher) and with ``dattn.diffusers.enable(model)``, both on the same thread count, and
prints the time spent inside the attention calls, the whole forward, and the largest
difference between the two outputs.

    python examples/python/diffusers_flux.py                     # f32 and bf16, 2 threads
    python examples/python/diffusers_flux.py --dtypes bf16 --reps 1 --heads 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Dict, List, Optional

import torch

import dattn
import dattn.diffusers


def build(args, dtype):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=args.head_dim, num_attention_heads=args.heads,
        joint_attention_dim=args.text_dim, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=_rope_axes(args.head_dim),
    ).eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    side = int(round(args.image_tokens ** 0.5))
    h, w = side, args.image_tokens // side
    ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, h * w, 64, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, args.text_tokens, args.text_dim, generator=g).to(dtype),
        pooled_projections=torch.randn(1, 768, generator=g).to(dtype),
        timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
        img_ids=torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3),
        txt_ids=torch.zeros(args.text_tokens, 3),
    )
    return model, inputs


def _rope_axes(head_dim: int):
    """Flux's (16, 56, 56) at head dim 128; scaled (even sizes) for other head dims."""
    if head_dim == 128:
        return (16, 56, 56)
    a = max(2, (head_dim // 8) // 2 * 2)
    b = (head_dim - a) // 2 // 2 * 2
    return (head_dim - 2 * b, b, b)


@contextlib.contextmanager
def attention_timer(seconds: List[float]):
    """Adds the time spent in each call of transformer_flux's dispatch_attention_fn (diffusers'
    attention function as the Flux processor calls it: the default or dattn's route)."""
    from diffusers.models.transformers import transformer_flux as tf

    inner = tf.dispatch_attention_fn

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            seconds.append(time.perf_counter() - t0)

    tf.dispatch_attention_fn = timed
    try:
        yield
    finally:
        tf.dispatch_attention_fn = inner


def forward(model, inputs, reps: int):
    """Best-of-``reps`` forward time and the attention time of that forward, and the output."""
    best = None
    with torch.no_grad():
        for _ in range(reps):
            spent: List[float] = []
            with attention_timer(spent):
                t0 = time.perf_counter()
                out = model(**inputs, return_dict=False)[0]
                total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, sum(spent), len(spent))
    return best, out


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image-tokens", type=int, default=4096)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--double", type=int, default=2, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=2, help="single-stream blocks")
    ap.add_argument("--text-dim", type=int, default=4096, help="T5 width (context embedder)")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backend", default=None, help="dattn backend (default: automatic, FLASH)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    results: Dict[str, object] = {"threads": args.threads, "torch": torch.__version__}
    print(f"Flux transformer, {args.double} double + {args.single} single blocks, "
          f"{args.heads} heads of {args.head_dim}, {args.image_tokens} image + {args.text_tokens} "
          f"text tokens, {args.threads} threads, torch {torch.__version__}, best of {args.reps}")
    for name in args.dtypes.split(","):
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[name]
        model, inputs = build(args, dtype)
        (t_ref, a_ref, n_ref), ref = forward(model, inputs, args.reps)
        with dattn.diffusers.enable(model, backend=args.backend) as handle:
            (t_dattn, a_dattn, n_dattn), out = forward(model, inputs, args.reps)
            engines = handle.engines
        assert n_ref == n_dattn == args.double + args.single
        assert handle.calls == args.reps * n_ref and not handle.fallbacks, handle
        diff = float((out.double() - ref.double()).abs().max())
        rel = float((out.double() - ref.double()).norm() / ref.double().norm())
        results[name] = dict(
            forward_default_s=t_ref, forward_dattn_s=t_dattn, attention_default_s=a_ref,
            attention_dattn_s=a_dattn, attention_calls=n_ref, max_abs_diff=diff, rel_diff=rel,
            backend=handle.backend_name, engines=engines,
        )
        print(f"{name:5s} attention ({n_ref} calls): default {a_ref:8.3f} s  dattn {a_dattn:8.3f} s"
              f"  ({a_ref / a_dattn:5.2f}x)   forward: default {t_ref:8.3f} s  dattn "
              f"{t_dattn:8.3f} s  ({t_ref / t_dattn:5.2f}x)   max |diff| {diff:.2e}, "
              f"rel {rel:.2e}  [{handle.backend_name}: {', '.join(engines) or '-'}]")
        del model, ref, out
    return results


if __name__ == "__main__":
    main()
