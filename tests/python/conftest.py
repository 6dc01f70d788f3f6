"""Shared helpers of the Python suite: a float64 oracle for dattn.Attention's calls (BSHD, with
the LSE and features PyTorch's scaled_dot_product_attention lacks: causal offsets, key masks;
test_sdpa.py compares with PyTorch's function itself), input builders and comparisons."""

import math

import torch


def oracle(q, k, v, scale=None, bias=None, causal_offset=None, visible=None):
    """Attention in float64 on BSHD tensors: q [B, Sq, Hq, D], k [B, Skv, Hkv, D],
    v [B, Skv, Hkv, Dv]. `bias` (broadcast to [B, Hq, Sq, Skv]) is added to the scaled logits,
    `visible` (bool, same broadcast) hides keys where False, `causal_offset` = c hides key j
    from row i when j > i + c. Returns (out [B, Sq, Hq, Dv] f64, lse [B, Hq, Sq] f64); a row
    that sees no key is 0 with LSE -inf."""
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    keep = torch.ones(B, Hq, Sq, Skv, dtype=torch.bool)
    if bias is not None:
        s = s + bias.to(torch.float64)
    if visible is not None:
        keep = keep & visible.to(torch.bool).expand(B, Hq, Sq, Skv)
    if causal_offset is not None:
        i = torch.arange(Sq).view(Sq, 1)
        j = torch.arange(Skv).view(1, Skv)
        keep = keep & (j <= i + causal_offset)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    empty = torch.isinf(m) & (m < 0)
    m = torch.where(empty, torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    out = torch.where(empty, torch.zeros_like(p), p / torch.where(empty, torch.ones_like(l), l))
    out = torch.einsum("bhqk,bkhd->bqhd", out, v)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(l)).squeeze(-1)
    return out, lse


def tolerance(dtype):
    return {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]


def assert_close(got, want, dtype=torch.float32, what="out"):
    got = got.detach().to(torch.float64)
    want = want.to(torch.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite) or what == "out", what
    diff = (got[finite] - want[finite]).norm()
    ref = want[finite].norm().clamp_min(1e-30)
    assert float(diff / ref) <= tolerance(dtype), (what, float(diff / ref))


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
