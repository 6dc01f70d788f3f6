#!/usr/bin/env python3
"""A Flux-shaped joint-attention transformer block on dattn and on PyTorch's math.

Flux's double-stream block keeps text and image tokens in two streams with their own weights
and lets them meet in one attention over the joint sequence [text | image]. This block has
random weights and the same structure (simplified: no timestep modulation, 1-D RoPE over the
joint sequence instead of Flux's 3-axis ids):

    per stream:  x -> LayerNorm -> Linear(C, 3C) -> q, k, v [B, S, H, D] (views, no copies)
                 q, k -> RMSNorm over D -> RoPE (optional)
    attention:   joint over [text | image]
    per stream:  + Linear(C, C) residual, + MLP (GELU) residual

The attention runs three ways and all must agree:

- ``dattn-joint``: dattn.Attention with the text tokens attached through
  AttentionMetadata(joint_query=..., joint_key=..., joint_value=..., joint_strategy="front"):
  nothing is concatenated; the output has the text rows first;
- ``dattn-concat``: the streams concatenated along S, then one dattn call;
- ``torch``: PyTorch's own ``scaled_dot_product_attention`` on the concatenation (what
  diffusers' processors run).

Run (in the project's environment, after ``make test`` installed dattn there):

    .venv/bin/python examples/python/flux_block.py
    ... --image-tokens 4096 --text-tokens 512 --heads 24 --head-dim 128   # Flux 1024x1024
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from typing import Callable, Dict, List, Optional

import torch

import dattn


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """cos/sin [S, 1, D/2] for rotary embedding at integer `positions`."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[2i], x[2i+1]) of x [B, S, H, D] by the angles of each row."""
    x2 = x.float().unflatten(-1, (-1, 2))
    a, b = x2[..., 0], x2[..., 1]
    cos, sin = cos.to(torch.float32), sin.to(torch.float32)
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Stream(torch.nn.Module):
    """One stream's weights (text or image): pre-norm, QKV, output projection, MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim),
            torch.nn.GELU(approximate="tanh"),
            torch.nn.Linear(4 * dim, dim),
        )

    def qkv_heads(self, x: torch.Tensor):
        """q, k, v [B, S, H, D]: v is a strided view into the fused projection (no copy)."""
        B, S, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, C // self.heads).unbind(2)
        return rms_norm(q), rms_norm(k), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(attn.flatten(2))
        return x + self.mlp(self.norm2(x))


# Attention functions on [B, S, H, D] tensors: (q, k, v of text, q, k, v of image) -> the
# joint output [B, M + N, H, D] with the text rows first.
AttnFn = Callable[..., torch.Tensor]


def torch_math_attention(tq, tk, tv, iq, ik, iv) -> torch.Tensor:
    q, k, v = (torch.cat(p, dim=1).transpose(1, 2) for p in ((tq, iq), (tk, ik), (tv, iv)))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def make_dattn_joint(layer: dattn.Attention) -> AttnFn:
    def attention(tq, tk, tv, iq, ik, iv):
        meta = dattn.AttentionMetadata(
            joint_query=tq, joint_key=tk, joint_value=tv, joint_strategy="front"
        )
        return layer.forward(iq, ik, iv, meta)

    return attention


def make_dattn_concat(layer: dattn.Attention) -> AttnFn:
    def attention(tq, tk, tv, iq, ik, iv):
        q, k, v = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
        return layer.forward(q, k, v)

    return attention


class JointBlock(torch.nn.Module):
    """Flux-like double-stream block; the attention function is a parameter of forward."""

    def __init__(self, dim: int, heads: int, rope: bool):
        super().__init__()
        self.txt = Stream(dim, heads)
        self.img = Stream(dim, heads)
        self.heads, self.rope = heads, rope

    def forward(self, txt: torch.Tensor, img: torch.Tensor, attention: AttnFn):
        M = txt.shape[1]
        tq, tk, tv = self.txt.qkv_heads(txt)
        iq, ik, iv = self.img.qkv_heads(img)
        if self.rope:
            cos, sin = rope_tables(torch.arange(M + img.shape[1]), tq.shape[-1])
            tq, tk = (apply_rope(t, cos[:M], sin[:M]) for t in (tq, tk))
            iq, ik = (apply_rope(t, cos[M:], sin[M:]) for t in (iq, ik))
        out = attention(tq, tk, tv, iq, ik, iv)
        return self.txt.finish(txt, out[:, :M]), self.img.finish(img, out[:, M:])


def torch_blas() -> str:
    """PyTorch's BLAS_INFO build setting (e.g. "mkl", "open", "generic")."""
    found = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def best_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: plans, allocator, thread pool
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image-tokens", type=int, default=512)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--rope", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default=None, help="dattn backend (default: automatic, FLASH)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dim = args.heads * args.head_dim
    block = JointBlock(dim, args.heads, args.rope).to(dtype).eval()
    txt = torch.randn(args.batch, args.text_tokens, dim).to(dtype)
    img = torch.randn(args.batch, args.image_tokens, dim).to(dtype)
    layer = dattn.Attention(args.heads, args.head_dim, backend=args.backend, prefix="flux.block")

    ways = {
        "dattn-joint": make_dattn_joint(layer),
        "dattn-concat": make_dattn_concat(layer),
        "torch": torch_math_attention,
    }
    results: Dict[str, object] = {"backend": layer.backend_name, "threads": args.threads}
    outputs = {}
    with torch.no_grad():
        # The attention alone, on the block's own q/k/v (best of --reps after a warm-up).
        tq, tk, tv = block.txt.qkv_heads(txt)
        iq, ik, iv = block.img.qkv_heads(img)
        for name, fn in ways.items():
            call = lambda: fn(tq, tk, tv, iq, ik, iv)  # noqa: E731
            results[f"{name}_attention_s"] = best_time(call, args.reps)
        # The whole block, once per way (its linear layers are PyTorch's and dominate).
        for name, fn in ways.items():
            t0 = time.perf_counter()
            outputs[name] = block(txt, img, fn)
            results[f"{name}_block_s"] = time.perf_counter() - t0

    ref_txt, ref_img = outputs["torch"]
    for name in ("dattn-joint", "dattn-concat"):
        got_txt, got_img = outputs[name]
        results[f"{name}_max_diff"] = max(
            float((got_txt.float() - ref_txt.float()).abs().max()),
            float((got_img.float() - ref_img.float()).abs().max()),
        )

    S = args.text_tokens + args.image_tokens
    print(
        f"Flux-like joint block: batch {args.batch}, {args.text_tokens} text + "
        f"{args.image_tokens} image tokens (S {S}), {args.heads} heads x {args.head_dim}, "
        f"{args.dtype}, RoPE {'on' if args.rope else 'off'}, {args.threads} threads, "
        f"dattn backend {layer.backend_name}"
    )
    blas = torch_blas()
    if blas == "generic":
        print(
            "note: this PyTorch multiplies with the generic BLAS (BLAS_INFO=generic), which "
            "makes its Linear layers and its attention math slow"
        )
    print(f"{'attention':<14}{'attention (s)':>15}{'block (s)':>12}{'max |diff| vs torch':>22}")
    for name in ways:
        diff = results.get(f"{name}_max_diff")
        print(
            f"{name:<14}{results[f'{name}_attention_s']:>15.4f}{results[f'{name}_block_s']:>12.4f}"
            f"{'' if diff is None else f'{diff:.2e}':>22}"
        )
    return results


if __name__ == "__main__":
    main()
