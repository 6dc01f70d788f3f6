"""dattn.scaled_dot_product_attention against PyTorch's definition, and patch_torch_sdpa.

The oracle below is written from the documentation of
torch.nn.functional.scaled_dot_product_attention (PyTorch 2.x), in float64:
softmax(q k^T * scale + bias) v, a bool mask hides keys where False (-inf), is_causal is
tril(ones(L, S)) (top-left), batch dims broadcast, key/value heads repeat_interleave'd (GQA).
Rows that see no key are zeros here (dattn's rule; PyTorch's math gives NaN).
"""

import math

import pytest

torch = pytest.importorskip("torch")

import dattn  # noqa: E402
from dattn.sdpa import SdpaError  # noqa: E402
from conftest import assert_close, rand  # noqa: E402


def sdpa_oracle(q, k, v, attn_mask=None, is_causal=False, scale=None):
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    keep = torch.ones_like(s, dtype=torch.bool)
    if is_causal:
        keep = keep & torch.ones(L, S, dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(torch.float64)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    empty = torch.isinf(m) & (m < 0)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    return torch.matmul(torch.where(empty, torch.zeros_like(p), p), v)


def qkv(B=2, H=4, Hkv=4, L=24, S=24, E=16, Ev=16, dtype=torch.float32, seed=0):
    return (
        rand(B, H, L, E, dtype=dtype, seed=seed),
        rand(B, Hkv, S, E, dtype=dtype, seed=seed + 1),
        rand(B, Hkv, S, Ev, dtype=dtype, seed=seed + 2),
    )


def test_plain_4d_matches_the_oracle():
    q, k, v = qkv(L=33, S=40, Ev=8)
    out = dattn.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 4, 33, 8) and out.dtype == torch.float32
    assert_close(out, sdpa_oracle(q, k, v))


def test_3d_inputs():
    q, k, v = rand(6, 17, 32, seed=1), rand(6, 21, 32, seed=2), rand(6, 21, 32, seed=3)
    out = dattn.scaled_dot_product_attention(q, k, v)
    assert out.shape == (6, 17, 32)
    assert_close(out, sdpa_oracle(q, k, v))
    mask = torch.rand(6, 17, 21, generator=torch.Generator().manual_seed(4)) > 0.3
    assert_close(
        dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        sdpa_oracle(q, k, v, attn_mask=mask),
    )


@pytest.mark.parametrize(
    "mask_shape",
    [None, (9, 11), (3, 1, 9, 11), (2, 3, 2, 9, 11)],
    ids=["no-mask", "LS", "per-middle-dim", "full"],
)
def test_5d_inputs(mask_shape):
    """Leading dims flatten into dattn's batch when that is a view; a mask broadcast over only
    some of them cannot, and runs one call per leading index instead (still no copies)."""
    q = rand(2, 3, 2, 9, 16, seed=1)
    k, v = rand(2, 3, 2, 11, 16, seed=2), rand(2, 3, 2, 11, 8, seed=3)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, generator=torch.Generator().manual_seed(5)) > 0.2
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == (2, 3, 2, 9, 8)
    assert_close(out, sdpa_oracle(q, k, v, attn_mask=mask))
    out = dattn.scaled_dot_product_attention(q, k[:1, :, :1], v[:1, :, :1], is_causal=True)
    kb, vb = k[:1, :, :1].expand(2, 3, 2, 11, 16), v[:1, :, :1].expand(2, 3, 2, 11, 8)
    assert_close(out, sdpa_oracle(q, kb, vb, is_causal=True))


def test_2d_inputs():
    q, k, v = rand(7, 16, seed=1), rand(12, 16, seed=2), rand(12, 16, seed=3)
    mask = torch.rand(7, 12, generator=torch.Generator().manual_seed(5)) > 0.2
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == (7, 16)
    assert_close(out, sdpa_oracle(q, k, v, attn_mask=mask))


MASK_SHAPES = [
    lambda B, H, L, S: (L, S),
    lambda B, H, L, S: (1, 1, L, S),
    lambda B, H, L, S: (B, 1, 1, S),
    lambda B, H, L, S: (B, H, L, S),
    lambda B, H, L, S: (H, L, S),
    lambda B, H, L, S: (S,),
    lambda B, H, L, S: (1, H, 1, S),
]


@pytest.mark.parametrize("shape_of", MASK_SHAPES, ids=lambda f: str(f(2, 4, "L", "S")))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_masks(shape_of, kind):
    B, H, L, S = 2, 4, 19, 27
    q, k, v = qkv(B=B, H=H, Hkv=H, L=L, S=S)
    g = torch.Generator().manual_seed(7)
    shape = shape_of(B, H, L, S)
    if kind == "bool":
        mask = torch.rand(*shape, generator=g) > 0.3
    else:
        mask = torch.randn(*shape, generator=g) * 2
        mask = mask.masked_fill(torch.rand(*shape, generator=g) < 0.2, float("-inf"))
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(out, sdpa_oracle(q, k, v, attn_mask=mask))


def test_mask_given_as_a_stride_0_view_is_not_copied():
    q, k, v = qkv(L=16, S=16)
    base = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.4
    mask = base.expand(2, 4, 16, 16)  # stride 0 in B and H
    assert_close(
        dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        sdpa_oracle(q, k, v, attn_mask=mask),
    )


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = qkv(L=8, S=8)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 3] == 0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("L,S", [(24, 24), (10, 31), (31, 10)])
def test_is_causal_is_top_left(L, S):
    q, k, v = qkv(L=L, S=S)
    out = dattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, sdpa_oracle(q, k, v, is_causal=True))
    # Row 0 sees exactly key 0 whatever L and S are (top-left), so it is v[..., 0, :].
    assert torch.allclose(out[:, :, 0], v[:, :, 0], atol=1e-6)


def test_scale():
    q, k, v = qkv()
    out = dattn.scaled_dot_product_attention(q, k, v, scale=0.37)
    assert_close(out, sdpa_oracle(q, k, v, scale=0.37))
    mask = torch.rand(24, 24, generator=torch.Generator().manual_seed(2)) > 0.5
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.5)
    assert_close(out, sdpa_oracle(q, k, v, attn_mask=mask, scale=1.5))


@pytest.mark.parametrize("Hkv", [1, 2])
def test_gqa(Hkv):
    q, k, v = qkv(H=8, Hkv=Hkv, L=20, S=28)
    out = dattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, sdpa_oracle(q, k, v, is_causal=True))
    out = dattn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_close(out, sdpa_oracle(q, k, v))


def test_key_value_batch_of_one_broadcasts():
    q, k, v = qkv(B=3, L=9, S=12)
    out = dattn.scaled_dot_product_attention(q, k[:1], v[:1])
    assert_close(out, sdpa_oracle(q, k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    q, k, v = qkv(L=40, S=52, E=64, Ev=64, dtype=dtype)
    mask = torch.rand(2, 1, 40, 52, generator=torch.Generator().manual_seed(3)) > 0.25
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == dtype
    assert_close(out, sdpa_oracle(q, k, v, attn_mask=mask), dtype)
    out = dattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, sdpa_oracle(q, k, v, is_causal=True), dtype)


def test_non_contiguous_inputs_from_bshd():
    """The usual model code: [B, S, H, E] projections transposed to [B, H, S, E] views."""
    B, L, S, H, E = 2, 21, 30, 4, 16
    q = rand(B, L, H, E, seed=1).transpose(1, 2)
    k = rand(B, S, H, E, seed=2).transpose(1, 2)
    v = rand(B, S, H, E, seed=3).transpose(1, 2)
    assert not q.is_contiguous()
    mask = torch.randn(B, 1, L, S, generator=torch.Generator().manual_seed(4)).transpose(2, 3)
    mask = mask.contiguous().transpose(2, 3)  # a transposed float mask too
    out = dattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(out, sdpa_oracle(q, k, v, attn_mask=mask))
    out = dattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, sdpa_oracle(q, k, v, is_causal=True))


def test_fused_qkv_views():
    B, S, H, E = 2, 18, 4, 16
    qkv_proj = rand(B, S, 3, H, E, seed=9)
    q, k, v = (qkv_proj[:, :, i].transpose(1, 2) for i in range(3))
    assert_close(dattn.scaled_dot_product_attention(q, k, v), sdpa_oracle(q, k, v))


def test_requires_grad_inputs_are_read():
    q, k, v = qkv()
    q.requires_grad_(True)
    out = dattn.scaled_dot_product_attention(q, k, v)
    assert not out.requires_grad
    assert_close(out, sdpa_oracle(q, k, v))


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v: dattn.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(24, 24, dtype=torch.bool), is_causal=True
        ),
        lambda q, k, v: dattn.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
        lambda q, k, v: dattn.scaled_dot_product_attention(q[None], k, v),  # 5-D with 4-D
        lambda q, k, v: dattn.scaled_dot_product_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]),
        lambda q, k, v: dattn.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(2, 1, 24, 5, dtype=torch.bool)
        ),
        lambda q, k, v: dattn.scaled_dot_product_attention(q, k[:, :3], v[:, :3]),
    ],
    ids=["mask+is_causal", "dropout", "5d-nonsense", "1d", "mask-shape", "heads-3-of-4"],
)
def test_errors_are_runtime_errors_and_invalid_arguments(call):
    q, k, v = qkv()
    with pytest.raises(RuntimeError) as info:
        call(q, k, v)
    assert isinstance(info.value, dattn.InvalidArgument)
    assert isinstance(info.value, SdpaError)
    assert str(info.value)


def test_dtypes_dattn_does_not_compute_are_named():
    q, k, v = qkv()
    with pytest.raises(dattn.Unsupported, match="query: dtype float64"):
        dattn.scaled_dot_product_attention(q.double(), k.double(), v.double())
    with pytest.raises(dattn.Unsupported, match="attn_mask: dtype float64"):
        dattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(24, 24).double())
    with pytest.raises(RuntimeError, match="attn_mask: dtype uint8"):
        dattn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(24, 24).to(torch.uint8))
    with pytest.raises(dattn.InvalidArgument, match="key: expected a torch.Tensor"):
        dattn.scaled_dot_product_attention(q, k.numpy(), v)
    half_mask = torch.randn(24, 24).to(torch.float16)  # a mask of another float dtype is read
    assert_close(
        dattn.scaled_dot_product_attention(q, k, v, attn_mask=half_mask),
        sdpa_oracle(q, k, v, attn_mask=half_mask),
    )


def test_the_error_class_is_both():
    assert issubclass(SdpaError, RuntimeError) and issubclass(SdpaError, ValueError)
    assert issubclass(SdpaError, dattn.InvalidArgument) and issubclass(SdpaError, dattn.Error)
    e = SdpaError("x")
    assert isinstance(e, RuntimeError) and isinstance(e, dattn.InvalidArgument)


def test_meta_tensors_are_refused_naming_the_device():
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(dattn.Unsupported, match="meta"):
        dattn.scaled_dot_product_attention(q, q, q)


def test_layers_are_cached():
    q, k, v = qkv()
    dattn.scaled_dot_product_attention(q, k, v, scale=0.25)
    from dattn import sdpa

    layer = sdpa._LAYERS[(4, 4, 16, False, 0.25)]
    dattn.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert sdpa._LAYERS[(4, 4, 16, False, 0.25)] is layer


# --- patch_torch_sdpa ---------------------------------------------------------------------

F = torch.nn.functional
_NAME = "scaled_dot_product_attention"


def _state():
    return getattr(F, _NAME, "absent")


class TinyAttention(torch.nn.Module):
    """Model code as written for PyTorch 2.x, unedited: it looks the function up on F."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(B, S, C))


def _module_by_hand(m, x):
    B, S, C = x.shape
    q, k, v = m.qkv(x).view(B, S, 3, m.heads, C // m.heads).unbind(2)
    y = sdpa_oracle(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return m.proj(y.to(x.dtype).transpose(1, 2).reshape(B, S, C))


def test_patch_as_a_context_manager_restores_the_previous_state():
    before = _state()
    with dattn.patch_torch_sdpa() as handle:
        assert getattr(F, _NAME) is not before
        assert handle.active
        q, k, v = qkv()
        assert_close(F.scaled_dot_product_attention(q, k, v), sdpa_oracle(q, k, v))
    assert _state() is before
    assert not handle.active


def test_patch_undo_and_patching_twice():
    before = _state()
    first = dattn.patch_torch_sdpa()
    installed = getattr(F, _NAME)
    second = dattn.patch_torch_sdpa()
    assert getattr(F, _NAME) is installed  # the second patch changes nothing
    first()  # undo in any order: the patch stays until the last handle goes
    assert getattr(F, _NAME) is installed
    first.undo()  # undoing twice is harmless
    second.undo()
    assert _state() is before
    with dattn.patch_torch_sdpa():
        pass
    assert _state() is before


def test_patch_deletes_the_attribute_where_there_was_none(monkeypatch):
    if hasattr(F, _NAME):
        monkeypatch.delattr(F, _NAME)
    with dattn.patch_torch_sdpa():
        assert hasattr(F, _NAME)
    assert not hasattr(F, _NAME)


def test_patch_over_someone_elses_patch(monkeypatch):
    """Someone replaces dattn's function while a handle is active: undoing that handle leaves
    their function alone; a new patch wraps theirs and restores it."""
    before = _state()
    old = dattn.patch_torch_sdpa()

    def theirs(*args, **kwargs):
        return "theirs"

    monkeypatch.setattr(F, _NAME, theirs, raising=False)
    new = dattn.patch_torch_sdpa()
    assert getattr(F, _NAME) is not theirs
    old.undo()  # an earlier installation: changes nothing now
    assert getattr(F, _NAME) is not theirs
    new.undo()
    assert getattr(F, _NAME) is theirs
    monkeypatch.undo()  # their undo puts back dattn's first wrapper, whose handle is gone
    assert getattr(getattr(F, _NAME), "_dattn_patch", False)
    with dattn.patch_torch_sdpa():  # a new patch wraps what that wrapper wrapped ...
        pass
    assert _state() is before  # ... and restores it


def test_patch_sends_what_dattn_cannot_serve_to_the_original(monkeypatch):
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "original"

    monkeypatch.setattr(F, _NAME, original, raising=False)
    q, k, v = qkv()
    with dattn.patch_torch_sdpa():
        assert F.scaled_dot_product_attention(q, k, v, dropout_p=0.2) == "original"
        assert F.scaled_dot_product_attention(q.double(), k.double(), v.double()) == "original"
        assert F.scaled_dot_product_attention(q, k, v, some_future_flag=True) == "original"
        with torch.enable_grad():
            qg = q.clone().requires_grad_(True)
            assert F.scaled_dot_product_attention(qg, k, v) == "original"
        meta = torch.empty(1, 2, 4, 8, device="meta")
        assert F.scaled_dot_product_attention(meta, meta, meta) == "original"
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_close(out, sdpa_oracle(q, k, v, is_causal=True))
        with torch.no_grad():
            qg = q.clone().requires_grad_(True)
            assert_close(F.scaled_dot_product_attention(qg, k, v), sdpa_oracle(q, k, v))
    assert len(calls) == 5
    assert getattr(F, _NAME) is original


def test_an_unedited_module_uses_the_patch():
    torch.manual_seed(0)
    m = TinyAttention()
    x = rand(2, 12, 32, seed=3)
    with torch.no_grad(), dattn.patch_torch_sdpa():
        from dattn import sdpa

        sdpa._LAYERS.clear()
        got = m(x)
        assert (4, 4, 8, True, None) in sdpa._LAYERS  # dattn ran the call
        want = _module_by_hand(m, x)
    assert_close(got, want)
