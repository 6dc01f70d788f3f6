#!/usr/bin/env python3
"""SAGE's error budget on N(0, 1) inputs: what 8-bit P.V adds to 8-bit Q.K^T, by scale group.

A float64 simulation of SAGE's arithmetic (docs/semantics.md, "P.V"): Q and K as int8 codes per
row and key (K smoothed by its mean, the exact q . mean term added back), the softmax in float64,
and P.V with P as unsigned codes (top 255) scaled per (row, group of keys) by the group's largest
p, V as signed codes (top 127) scaled per (group of keys, column). The engines use 64-key groups
(one scale per tile); finer groups need one f32 multiply-add per (row, column, group) on top of
the integer dot, which at 4 keys (one vpdpbusd) is the f32 P.V's own cost.

Prints SAGE's mean relative L1 against exact attention (the 1% bound of docs/semantics.md) for
the 16-bit P.V that `pv_dtype=auto` takes (about exact, so Q.K^T's error alone) and for 8-bit
P.V at several group sizes. Usage: tools/sage_pv8_error_budget.py [--rows R] [--keys S] [--seed N]
"""

import argparse

import numpy as np


def quantize(x, axis, top):
    """Symmetric codes per slice along `axis` (absmax -> top), returned dequantized."""
    scale = np.abs(x).max(axis=axis, keepdims=True) / top
    scale[scale == 0] = 1.0
    return np.round(x / scale) * scale


def grouped(x, axis, group, top, signed):
    """quantize() per group of `group` entries along `axis`, the scale over the other axis."""
    out = np.empty_like(x)
    n = x.shape[axis]
    for j in range(0, n, group):
        part = [slice(None)] * x.ndim
        part[axis] = slice(j, min(n, j + group))
        block = x[tuple(part)]
        if signed:
            out[tuple(part)] = quantize(block, axis, top)
        else:  # probabilities: codes 0..top against the group's largest p per row
            scale = block.max(axis=axis, keepdims=True) / top
            scale[scale == 0] = 1.0
            out[tuple(part)] = np.round(block / scale) * scale
    return out


def error(rng, d, rows, keys, pv_group, p_bits, v_bits):
    q = rng.standard_normal((rows, d))
    k = rng.standard_normal((keys, d))
    v = rng.standard_normal((keys, d))
    scale = 1.0 / np.sqrt(d)
    exact_s = q @ k.T * scale
    p = np.exp(exact_s - exact_s.max(axis=1, keepdims=True))
    exact = (p @ v) / p.sum(axis=1, keepdims=True)

    mean_k = k.mean(axis=0)
    s = quantize(q, 1, 127) @ quantize(k - mean_k, 1, 127).T * scale
    s += (q @ mean_k)[:, None] * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    l = p.sum(axis=1, keepdims=True)
    if p_bits:
        p = grouped(p, 1, pv_group, 2**p_bits - 1, signed=False)
    if v_bits:
        v = grouped(v, 0, pv_group, 2 ** (v_bits - 1) - 1, signed=True)
    out = (p @ v) / l
    return 100.0 * np.abs(out - exact).sum() / np.abs(exact).sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("mean relative L1 (%) of SAGE on N(0, 1), the bound 1%")
    print(f"{'P.V':<34}{'D 64':>8}{'D 128':>8}")
    cases = [
        ("16-bit codes (auto), 64 keys", 64, 12, 13),
        ("8-bit codes (int8), 64 keys", 64, 8, 8),
        ("8-bit codes, 16 keys", 16, 8, 8),
        ("8-bit codes, 4 keys", 4, 8, 8),
        ("8-bit P, exact V, 16 keys", 16, 8, 0),
    ]
    for name, group, p_bits, v_bits in cases:
        figures = []
        for d in (64, 128):
            rng = np.random.default_rng(args.seed)
            figures.append(error(rng, d, args.rows, args.keys, group, p_bits, v_bits))
        print(f"{name:<34}{figures[0]:>7.3f}%{figures[1]:>7.3f}%")


if __name__ == "__main__":
    main()
