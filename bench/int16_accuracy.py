#!/usr/bin/env python3
"""How accurate attention on 16-bit integer lanes can be, before any kernel is written (issue 60,
item 1: measure the accuracy first, on hostile inputs).

Models, in float64, what an engine computing Q.K^T and P.V on int16 pairs (vpmaddwd / vpdpwssd:
int16 x int16 products summed in int32 lanes) would compute, under several scaling schemes, and
sets its error beside dattn's real engines on the same inputs: FLASH f32 (exact to the inputs),
FLASH's bf16 engine (bf16 products, P rounded to bf16) and SAGE (8-bit Q.K^T). A numpy model of
the bf16 engine semantics is run too, as the check that the modelling tracks a real engine.

Schemes (each adds to the one before):
  rows       Q and K as 13-bit codes per row, P as 12-bit codes (unsigned, of exp(s - max) in
             (0, 1]), V as 13-bit codes per channel over the visible keys; the row sum from P's
             codes; the output rounded to bf16 (the issue's idealised model)
  smooth     K less its per-channel mean over the visible keys (exact: a shift per query row,
             which softmax ignores), V less its per-channel mean (added back after the division)
  balance    channel balancing between Q and K: Q's channel c times a_c, K's divided by a_c,
             a_c = sqrt(max|K_c| / max|Q_c|) (exact in real arithmetic; SAGE's balance_qk)
  exact<T>   the T channels of largest max|Q_c| * max|K_c| as exact (f32) terms beside the codes
             of the others (an extra rank-T f32 update per tile: T/D of Q.K^T's multiply-adds)
  ..._tileP  P's 12-bit codes relative to each 64-key tile's own row maximum instead of the
             row's (the online softmax rescales each tile's int32 sums by exp(m_tile - m_row) in
             f32): small probabilities keep 12 bits where one key tile dominates a row

Int32 bounds: a 13-bit code is at most 4095, a product at most 4095^2 < 2^24, so D = 128 terms
sum to at most 128 * 4095^2 = 2,146,435,200 < 2^31 - 1: heads up to 128 wide accumulate Q.K^T in
one int32 lane, wider ones in chunks of 128 channels (converted to f32 between chunks). P.V:
4095 * 4095 per term, at most 128 keys per int32 accumulation before it is flushed to f32.

Input classes (bf16 values; the first ones as in tests/test_inputs.hpp's hostile classes):
  normal     N(0, 1) Q, K, V
  offset     mean +3, scale 4 (Q, K and V)
  outliers   N(0, 1) with channels x20 on 4 of D (Q and K: the same channels)
  two_pops   the first 256 tokens (text) from another projection: scale 3, offset -2
  garbage    N(0, 1) with the last 96 keys masked (key padding) holding 1e4 and NaN-free
             garbage in K and V, and the last 32 query rows padding (excluded from the error)

Usage: .venv/bin/python bench/int16_accuracy.py [--d 128 --d 64] [--sq 512] [--skv 2048]
           [--heads 2] [--seed 0] [--json]
Prints per (class, D) the mean relative L1 (sum |o - ref| / sum |ref| over the valid rows) and
the largest error over the largest |ref|, with each scheme's ratio to the bf16 engine's.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

CLASSES = ("normal", "offset", "outliers", "two_pops", "garbage")
PADDED_KEYS, PADDED_ROWS = 96, 32


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (round to nearest even), as float64."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def inputs(cls: str, h: int, sq: int, skv: int, d: int, rng: np.random.Generator):
    """Q [h, sq, d], K and V [h, skv, d] (bf16 values), the visible keys and valid rows."""
    q = rng.standard_normal((h, sq, d))
    k = rng.standard_normal((h, skv, d))
    v = rng.standard_normal((h, skv, d))
    keys = np.ones(skv, dtype=bool)
    rows = np.ones(sq, dtype=bool)
    if cls == "offset":
        q, k, v = (3.0 + 4.0 * t for t in (q, k, v))
    elif cls == "outliers":
        ch = rng.choice(d, size=4, replace=False)
        q[..., ch] *= 20.0
        k[..., ch] *= 20.0
    elif cls == "two_pops":
        t = 256
        q[:, :t], k[:, :t], v[:, :t] = (3.0 * x[:, :t] - 2.0 for x in (q, k, v))
    elif cls == "garbage":
        keys[-PADDED_KEYS:] = False
        rows[-PADDED_ROWS:] = False
        k[:, ~keys] = 1e4 * rng.standard_normal((h, PADDED_KEYS, d))
        v[:, ~keys] = 1e4
    return bf16(q), bf16(k), bf16(v), keys, rows


def reference(q, k, v, keys, scale):
    s = np.einsum("hqd,hkd->hqk", q, k) * scale
    s[..., ~keys] = -np.inf
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    return np.einsum("hqk,hkd->hqd", p, v) / p.sum(-1, keepdims=True)


def codes(x: np.ndarray, bits: int, axis: int):
    """Symmetric codes of `bits` bits (sign included) along `axis`'s maxima, and their scales."""
    top = 2 ** (bits - 1) - 1
    amax = np.abs(x).max(axis=axis, keepdims=True)
    sc = np.where(amax > 0, amax / top, 1.0)
    return np.rint(x / sc), sc


def bf16_engine(q, k, v, keys, scale):
    """The bf16 engine semantics: bf16 operands (exact), f32 logits, P rounded to bf16 for P.V,
    the row sum from P before rounding, the output rounded to bf16."""
    s = np.einsum("hqd,hkd->hqk", q, k).astype(np.float32).astype(np.float64) * scale
    s[..., ~keys] = -np.inf
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    return bf16(np.einsum("hqk,hkd->hqd", bf16(p), v) / p.sum(-1, keepdims=True))


def int16_model(q, k, v, keys, scale, scheme: str, exact_channels: int = 0, tile_p: int = 0):
    vis = keys
    kk, vv = k[:, vis], v[:, vis]
    qq = q.copy()
    mu_v = np.zeros((q.shape[0], 1, v.shape[2]))
    if scheme != "rows":
        kk = kk - kk.mean(axis=1, keepdims=True)       # exact: a per-row shift of the logits
        mu_v = vv.mean(axis=1, keepdims=True)
        vv = vv - mu_v
    if scheme in ("balance", "exact"):
        a = np.sqrt(np.abs(kk).max(axis=1, keepdims=True) /
                    np.maximum(np.abs(qq).max(axis=1, keepdims=True), 1e-30))
        a = np.where(np.isfinite(a) & (a > 0), a, 1.0)
        qq, kk = qq * a, kk / a
    exact_part = 0.0
    if scheme == "exact" and exact_channels:
        weight = np.abs(qq).max(axis=1) * np.abs(kk).max(axis=1)      # [h, d]
        top = np.argsort(-weight, axis=1)[:, :exact_channels]
        sel = np.zeros_like(weight, dtype=bool)
        np.put_along_axis(sel, top, True, axis=1)
        qe, ke = qq * sel[:, None, :], kk * sel[:, None, :]
        exact_part = np.einsum("hqd,hkd->hqk", qe, ke)
        qq, kk = qq * ~sel[:, None, :], kk * ~sel[:, None, :]
    cq, sq_ = codes(qq, 13, axis=2)
    ck, sk = codes(kk, 13, axis=2)
    s = (np.einsum("hqd,hkd->hqk", cq, ck) * sq_ * np.swapaxes(sk, 1, 2) + exact_part) * scale
    s -= s.max(-1, keepdims=True)
    cv, sv = codes(vv, 13, axis=1)                     # per channel over the visible keys
    if not tile_p:
        cp = np.rint(np.exp(s) * 4095.0)               # 12-bit P, unsigned (<= 4095)
        o = np.einsum("hqk,hkd->hqd", cp, cv) * sv / cp.sum(-1, keepdims=True) + mu_v
        return bf16(o)
    # P's codes relative to each key tile's own row maximum (the online softmax's per-tile
    # rescaling carries exp(m_tile - m_row) in f32): full 12-bit resolution in every tile.
    num = np.zeros(q.shape[:2] + (v.shape[2],))
    den = np.zeros(q.shape[:2] + (1,))
    for j in range(0, s.shape[2], tile_p):
        st = s[..., j:j + tile_p]
        mt = st.max(-1, keepdims=True)
        cp = np.rint(np.exp(st - mt) * 4095.0)
        w = np.exp(mt)
        num += np.einsum("hqk,hkd->hqd", cp, cv[:, j:j + tile_p]) * w
        den += cp.sum(-1, keepdims=True) * w
    return bf16(num * sv / den + mu_v)


def errors(o, ref, rows):
    o, ref = o[:, rows], ref[:, rows]
    return {"mean_rel_l1": float(np.abs(o - ref).sum() / np.abs(ref).sum()),
            "max_rel": float(np.abs(o - ref).max() / np.abs(ref).max())}


def dattn_errors(q, k, v, keys, rows, scale, ref):
    """dattn's real FLASH f32, bf16 engine and SAGE on the same bf16 inputs (None where dattn or
    an engine is not there)."""
    try:
        import torch

        import dattn
    except Exception:
        return {}
    out = {}
    engines = {e["name"]: e for e in dattn.flash_engines()}
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(t, 0, 1))).to(
        torch.bfloat16) for t in (q, k, v))  # [S, H, D] from bf16 values: exact
    tq, tk, tv = (t.unsqueeze(0) for t in (tq, tk, tv))
    mask = torch.from_numpy(keys).reshape(1, -1)
    meta = dattn.AttentionMetadata(attn_mask=mask) if not keys.all() else None
    h, _, d = q.shape
    f32_engine = next((n for n in ("avx512", "avx2", "portable") if n in engines and
                       engines[n]["unavailable_reason"] is None), "portable")
    runs = [("flash_f32", "FLASH", {"isa": f32_engine}),
            ("flash_bf16", "FLASH", {"isa": "avx512_bf16"}),
            ("sage", "SAGE", {})]
    bf16_engine_name = next((n for n in ("amx", "avx512_bf16") if n in engines and
                             engines[n]["unavailable_reason"] is None), None)
    for label, backend, kw in runs:
        if label == "flash_bf16":
            if bf16_engine_name is None:
                continue
            kw = {"isa": bf16_engine_name}
        layer = dattn.Attention(h, d, softmax_scale=scale, backend=backend, backend_kwargs=kw)
        o = layer.forward(tq, tk, tv, meta)
        o = np.swapaxes(o[0].float().numpy().astype(np.float64), 0, 1)
        out[label] = errors(o, ref, rows)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, action="append", help="head sizes (default 128, 64)")
    ap.add_argument("--sq", type=int, default=512)
    ap.add_argument("--skv", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows_out = []
    for d in args.d or [128, 64]:
        for cls in CLASSES:
            rng = np.random.default_rng(args.seed)
            q, k, v, keys, rows = inputs(cls, args.heads, args.sq, args.skv, d, rng)
            scale = d ** -0.5
            ref = reference(q, k, v, keys, scale)
            r = {"class": cls, "d": d,
                 "model_bf16_engine": errors(bf16_engine(q, k, v, keys, scale), ref, rows)}
            for scheme in ("rows", "smooth", "balance"):
                r[f"int16_{scheme}"] = errors(int16_model(q, k, v, keys, scale, scheme), ref, rows)
            for t in (4, 8):
                r[f"int16_exact{t}"] = errors(int16_model(q, k, v, keys, scale, "exact", t),
                                              ref, rows)
            r["int16_exact4_tileP"] = errors(int16_model(q, k, v, keys, scale, "exact", 4, 64),
                                             ref, rows)
            r["int16_balance_tileP"] = errors(int16_model(q, k, v, keys, scale, "balance", 0,
                                                          64), ref, rows)
            r.update(dattn_errors(q, k, v, keys, rows, scale, ref))
            rows_out.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
    if not args.json:
        base = "flash_bf16" if "flash_bf16" in rows_out[0] else "model_bf16_engine"
        cols = [c for c in rows_out[0] if c not in ("class", "d")]
        print(f"mean relative L1 (x1e-3) and, in brackets, the ratio to {base}; "
              f"max error / max |ref| (x1e-3) after the slash")
        print(f"{'class':9s} {'D':>3s} " + " ".join(f"{c:>22s}" for c in cols))
        for r in rows_out:
            b = r[base]["mean_rel_l1"]
            cells = []
            for c in cols:
                e = r[c]
                cells.append(f"{e['mean_rel_l1'] * 1e3:6.2f} ({e['mean_rel_l1'] / b:4.2f})"
                             f"/{e['max_rel'] * 1e3:6.2f}")
            print(f"{r['class']:9s} {r['d']:3d} " + " ".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
