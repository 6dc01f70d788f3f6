"""dattn.scaled_dot_product_attention and patch_torch_sdpa() against the pinned PyTorch's own
torch.nn.functional.scaled_dot_product_attention (2.13, requirements.txt).

The oracle is PyTorch's function itself, computing in float64 (its CPU kernels take float64);
in bf16/f16 dattn's error against it is also held to PyTorch's own error in that dtype.
"""

import pytest
import torch

import dattn
from dattn import sdpa  # noqa: F401
from dattn import torch_adapter as ta
from dattn.sdpa import SdpaError
from conftest import assert_close, rand

F = torch.nn.functional
_NAME = "scaled_dot_product_attention"
TORCH_SDPA = F.scaled_dot_product_attention  # PyTorch's, looked up before any patch


def torch_f64(q, k, v, attn_mask=None, **kw):
    """PyTorch's SDPA in float64 on the same inputs (a float mask converted, a bool kept; the
    mask broadcast to [..., H, L, S] first: 2.13's float64 path refuses a 1-D mask)."""
    if attn_mask is not None:
        attn_mask = torch.broadcast_to(attn_mask, (*q.shape[:-1], k.shape[-2]))
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.double()
    q, k, v = (t.detach().double() for t in (q, k, v))
    return TORCH_SDPA(q, k, v, attn_mask=attn_mask, **kw)


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check(q, k, v, dtype=torch.float32, **kw):
    """dattn's function against PyTorch's (float64); in bf16/f16 also against PyTorch's own
    error in that dtype. Returns dattn's output."""
    out = dattn.scaled_dot_product_attention(q, k, v, **kw)
    want = torch_f64(q, k, v, **kw)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert_close(out, want, dtype)
    if dtype != torch.float32:
        torch_err = rel_err(TORCH_SDPA(q, k, v, **kw), want)
        assert rel_err(out, want) <= 2 * torch_err + 1e-3, (rel_err(out, want), torch_err)
    return out


def qkv(B=2, H=4, Hkv=4, L=24, S=24, E=16, Ev=16, dtype=torch.float32, seed=0):
    return (
        rand(B, H, L, E, dtype=dtype, seed=seed),
        rand(B, Hkv, S, E, dtype=dtype, seed=seed + 1),
        rand(B, Hkv, S, Ev, dtype=dtype, seed=seed + 2),
    )


def bool_mask(*shape, p=0.3, seed=7):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > p


def float_mask(*shape, seed=7):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(*shape, generator=g) * 2
    return m.masked_fill(torch.rand(*shape, generator=g) < 0.2, float("-inf"))


# --- dattn.scaled_dot_product_attention against PyTorch's -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,Ev", [(64, 64), (80, 80), (128, 128), (64, 32)])
def test_dtypes_and_head_dims(dtype, E, Ev):
    q, k, v = qkv(B=1, H=2, Hkv=2, L=37, S=53, E=E, Ev=Ev, dtype=dtype)
    check(q, k, v, dtype)
    check(q, k, v, dtype, attn_mask=bool_mask(1, 1, 37, 53))
    check(q, k, v, dtype, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_mask_in_the_query_dtype_and_in_float32(dtype):
    q, k, v = qkv(B=1, H=2, Hkv=2, L=20, S=31, E=64, Ev=64, dtype=dtype)
    mask = float_mask(20, 31)
    check(q, k, v, dtype, attn_mask=mask)
    check(q, k, v, dtype, attn_mask=mask.to(dtype))


MASK_SHAPES = [
    lambda B, H, L, S: (L, S),
    lambda B, H, L, S: (1, 1, L, S),
    lambda B, H, L, S: (B, 1, 1, S),
    lambda B, H, L, S: (B, H, L, S),
    lambda B, H, L, S: (H, L, S),
    lambda B, H, L, S: (S,),
    lambda B, H, L, S: (1, H, 1, S),
    lambda B, H, L, S: (L, 1),
]


@pytest.mark.parametrize("shape_of", MASK_SHAPES, ids=lambda f: str(f(2, 4, "L", "S")))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_masks(shape_of, kind):
    B, H, L, S = 2, 4, 19, 27
    q, k, v = qkv(B=B, H=H, Hkv=H, L=L, S=S)
    shape = shape_of(B, H, L, S)
    mask = bool_mask(*shape) if kind == "bool" else float_mask(*shape)
    if shape == (L, 1) and kind == "bool":
        mask[0] = True  # keep some rows alive; others are fully masked (zeros in both)
    check(q, k, v, attn_mask=mask)


def test_mask_given_as_a_stride_0_view():
    q, k, v = qkv(L=16, S=16)
    check(q, k, v, attn_mask=bool_mask(16, 16, p=0.4).expand(2, 4, 16, 16))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_are_zeros_as_in_pytorch(kind):
    """PyTorch 2.5+ returns zeros for a row that sees no key (2.13 does, in every dtype); so
    does dattn. The docstring of dattn.sdpa says so."""
    q, k, v = qkv(L=8, S=8)
    if kind == "bool":
        mask = torch.ones(8, 8, dtype=torch.bool)
        mask[3] = False
    else:
        mask = torch.zeros(8, 8)
        mask[3] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        theirs = TORCH_SDPA(qd, kd, vd, attn_mask=mask)
        assert torch.all(theirs[:, :, 3] == 0)  # what PyTorch does, checked
        out = dattn.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
        assert torch.all(out[:, :, 3] == 0) and torch.isfinite(out).all()
        assert_close(out, torch_f64(q, k, v, attn_mask=mask), dtype)


@pytest.mark.parametrize("L,S", [(24, 24), (10, 31), (31, 10)])
def test_is_causal_is_top_left(L, S):
    q, k, v = qkv(L=L, S=S)
    out = check(q, k, v, is_causal=True)
    assert torch.allclose(out[:, :, 0], v[:, :, 0], atol=1e-6)  # row 0 sees key 0 only


def test_scale():
    q, k, v = qkv()
    check(q, k, v, scale=0.37)
    check(q, k, v, attn_mask=bool_mask(24, 24, p=0.5), scale=1.5)
    check(q, k, v, is_causal=True, scale=0.05)


@pytest.mark.parametrize("Hkv", [1, 2])
def test_gqa(Hkv):
    q, k, v = qkv(H=8, Hkv=Hkv, L=20, S=28)
    check(q, k, v, is_causal=True, enable_gqa=True)
    check(q, k, v, attn_mask=bool_mask(2, 8, 20, 28), enable_gqa=True)
    # dattn's own function serves GQA without the flag too (docs/python.md)
    assert torch.equal(
        dattn.scaled_dot_product_attention(q, k, v),
        dattn.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    )


def test_2d_and_3d_inputs():
    q, k, v = rand(7, 16, seed=1), rand(12, 16, seed=2), rand(12, 8, seed=3)
    check(q, k, v, attn_mask=bool_mask(7, 12, p=0.2))
    check(q, k, v, is_causal=True)
    q, k, v = rand(6, 17, 32, seed=1), rand(6, 21, 32, seed=2), rand(6, 21, 32, seed=3)
    check(q, k, v)
    check(q, k, v, attn_mask=bool_mask(6, 17, 21))
    check(q, k, v, attn_mask=float_mask(17, 21))


@pytest.mark.parametrize(
    "mask_shape",
    [None, (9, 11), (3, 1, 9, 11), (2, 3, 2, 9, 11)],
    ids=["no-mask", "LS", "per-middle-dim", "full"],
)
def test_5d_inputs(mask_shape):
    """Leading dims flatten into dattn's batch when that is a view; a mask broadcast over only
    some of them cannot, and runs one call per leading index instead."""
    q = rand(2, 3, 2, 9, 16, seed=1)
    k, v = rand(2, 3, 2, 11, 16, seed=2), rand(2, 3, 2, 11, 8, seed=3)
    mask = None if mask_shape is None else bool_mask(*mask_shape, p=0.2)
    check(q, k, v, attn_mask=mask)
    check(q, k[:1, :, :1], v[:1, :, :1], is_causal=True)  # key/value broadcast over batch dims


def test_6d_inputs():
    q = rand(2, 1, 3, 2, 5, 16, seed=1)
    k, v = rand(2, 1, 3, 2, 7, 16, seed=2), rand(2, 1, 3, 2, 7, 16, seed=3)
    check(q, k, v)
    check(q, k, v, attn_mask=float_mask(3, 1, 5, 7))


def test_key_value_batch_of_one_broadcasts():
    q, k, v = qkv(B=3, L=9, S=12)
    check(q, k[:1], v[:1])


def test_non_contiguous_inputs_from_bshd():
    """The usual model code: [B, S, H, E] projections transposed to [B, H, S, E] views."""
    B, L, S, H, E = 2, 21, 30, 4, 64
    q = rand(B, L, H, E, seed=1).transpose(1, 2)
    k = rand(B, S, H, E, seed=2).transpose(1, 2)
    v = rand(B, S, H, E, seed=3).transpose(1, 2)
    assert not q.is_contiguous()
    mask = float_mask(B, 1, S, L).transpose(2, 3)  # a transposed float mask too
    check(q, k, v, attn_mask=mask)
    check(q, k, v, is_causal=True)
    check(q[:, :, ::2], k[:, :, 1::2], v[:, :, 1::2])  # strided rows


def test_fused_qkv_views():
    B, S, H, E = 2, 18, 4, 16
    qkv_proj = rand(B, S, 3, H, E, seed=9)
    q, k, v = (qkv_proj[:, :, i].transpose(1, 2) for i in range(3))
    check(q, k, v)


def test_requires_grad_inputs_are_read():
    q, k, v = qkv()
    q.requires_grad_(True)
    out = dattn.scaled_dot_product_attention(q, k, v)
    assert not out.requires_grad
    assert_close(out, torch_f64(q, k, v))


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
    ids=["mask+is_causal", "dropout", "5d-with-4d", "1d", "mask-shape", "heads-3-of-4"],
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
    # More permissive than PyTorch (docs/python.md): a mask of another float dtype is read.
    half_mask = torch.randn(24, 24).to(torch.float16)
    assert_close(
        dattn.scaled_dot_product_attention(q, k, v, attn_mask=half_mask),
        torch_f64(q, k, v, attn_mask=half_mask),
    )


def test_the_error_class_is_both():
    assert issubclass(SdpaError, RuntimeError) and issubclass(SdpaError, ValueError)
    assert issubclass(SdpaError, dattn.InvalidArgument) and issubclass(SdpaError, dattn.Error)


def test_meta_tensors_are_refused_naming_the_device():
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(dattn.Unsupported, match="meta"):
        dattn.scaled_dot_product_attention(q, q, q)


def test_layers_are_cached():
    q, k, v = qkv()
    dattn.scaled_dot_product_attention(q, k, v, scale=0.25)
    key = (ta.OWN.config, "BHSD", 4, 4, 16, False, 0.25)
    layer = ta._LAYERS[key]
    dattn.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert ta._LAYERS[key] is layer


# --- patch_torch_sdpa: behaves as PyTorch's function -------------------------------------------


def _state():
    return getattr(F, _NAME)


def _served(fn):
    """Runs fn() under a patch and says whether dattn computed it (the newest patch handle's
    count of served calls went up)."""
    handle = ta.SdpaPatchState.handles[-1]
    before = handle.calls
    result = fn()
    return result, handle.calls > before


REFUSED = [  # (name, kwargs builder over q, k, v): calls PyTorch 2.13 refuses
    ("gqa-without-enable_gqa", lambda q, k, v: dict(query=q, key=k[:, :2], value=v[:, :2])),
    ("gqa-heads-3-of-4", lambda q, k, v: dict(query=q, key=k[:, :3], value=v[:, :3], enable_gqa=True)),
    ("mixed-key-dtype", lambda q, k, v: dict(query=q, key=k.bfloat16(), value=v)),
    ("mixed-value-dtype", lambda q, k, v: dict(query=q, key=k, value=v.half())),
    ("mixed-bf16-f16", lambda q, k, v: dict(query=q.bfloat16(), key=k.bfloat16(), value=v.half())),
    ("f16-mask-f32-query", lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.zeros(24, 24).half())),
    ("bf16-mask-f16-query", lambda q, k, v: dict(query=q.half(), key=k.half(), value=v.half(), attn_mask=torch.zeros(24, 24).bfloat16())),
    ("uint8-mask", lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.ones(24, 24, dtype=torch.uint8))),
    ("mask-shape", lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.ones(1, 1, 24, 5, dtype=torch.bool))),
    ("1d", lambda q, k, v: dict(query=q[0, 0, 0], key=k[0, 0, 0], value=v[0, 0, 0])),
    ("head-dim-mismatch", lambda q, k, v: dict(query=q, key=torch.cat([k, k], -1), value=v)),
    ("numpy-key", lambda q, k, v: dict(query=q, key=k.numpy(), value=v)),
    ("unknown-keyword", lambda q, k, v: dict(query=q, key=k, value=v, some_future_flag=True)),
]


@pytest.mark.parametrize("build", [b for _, b in REFUSED], ids=[n for n, _ in REFUSED])
def test_patch_refuses_what_pytorch_refuses_with_the_same_exception(build):
    q, k, v = qkv()
    kwargs = build(q, k, v)
    with pytest.raises(Exception) as theirs:
        TORCH_SDPA(**kwargs)
    with dattn.patch_torch_sdpa():
        with pytest.raises(Exception) as ours:
            F.scaled_dot_product_attention(**kwargs)
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
    # and positionally, as model code calls it
    if "some_future_flag" not in kwargs:
        args = [kwargs.pop(n) for n in ("query", "key", "value")]
        with dattn.patch_torch_sdpa(), pytest.raises(type(theirs.value)):
            F.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_serves_what_dattn_computes(dtype):
    q, k, v = qkv(L=33, S=40, E=64, Ev=64, dtype=dtype)
    calls = [
        dict(),
        dict(is_causal=True),
        dict(attn_mask=bool_mask(33, 40)),
        dict(attn_mask=float_mask(2, 1, 33, 40)),  # float32 mask with bf16 q: PyTorch reads it
        dict(scale=0.2),
    ]
    with torch.no_grad(), dattn.patch_torch_sdpa():
        for kw in calls:
            out, served = _served(lambda: F.scaled_dot_product_attention(q, k, v, **kw))
            assert served, kw
            assert_close(out, torch_f64(q, k, v, **kw), dtype)
        qg, kg, vg = q[:, :4], k[:, :2], v[:, :2]  # GQA with the flag
        out, served = _served(lambda: F.scaled_dot_product_attention(qg, kg, vg, enable_gqa=True))
        assert served
        assert_close(out, torch_f64(qg, kg, vg, enable_gqa=True), dtype)


def test_patch_gives_pytorch_what_pytorch_computes_and_dattn_does_not():
    """mask with is_causal (PyTorch's CPU kernels apply both), ranks that differ (PyTorch
    broadcasts), dropout, float64: PyTorch's own answer, bit for bit."""
    q, k, v = qkv()
    mask = bool_mask(24, 24)
    cases = [
        (lambda f: f(q, k, v, attn_mask=mask, is_causal=True)),
        (lambda f: f(q[None], k, v)),
        (lambda f: f(q.double(), k.double(), v.double(), is_causal=True)),
    ]
    with torch.no_grad():
        for case in cases:
            want = case(TORCH_SDPA)
            with dattn.patch_torch_sdpa():
                got, served = _served(lambda: case(F.scaled_dot_product_attention))
            assert not served and torch.equal(got, want)
        torch.manual_seed(3)
        want = TORCH_SDPA(q, k, v, dropout_p=0.5)
        with dattn.patch_torch_sdpa():
            torch.manual_seed(3)
            got, served = _served(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
        assert not served and torch.equal(got, want)


def test_patch_sends_meta_and_non_cpu_tensors_to_pytorch(monkeypatch):
    meta = torch.empty(1, 2, 4, 8, device="meta")
    with dattn.patch_torch_sdpa():
        out = F.scaled_dot_product_attention(meta, meta, meta)
    assert out.device.type == "meta" and out.shape == (1, 2, 4, 8)
    # A tensor claiming another device (no accelerator here): the original gets it.
    calls = []
    monkeypatch.setattr(F, _NAME, lambda *a, **kw: calls.append(a) or "original")
    q, k, v = qkv()

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    with dattn.patch_torch_sdpa():
        assert F.scaled_dot_product_attention(q.as_subclass(OnCuda), k, v) == "original"
    assert len(calls) == 1


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
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=0.1 if self.training else 0.0,
        )
        return self.proj(y.transpose(1, 2).reshape(B, S, C))


def _train(steps=5):
    torch.manual_seed(0)
    m = TinyAttention()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, target = rand(2, 12, 32, seed=3), rand(2, 12, 32, seed=4)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(m(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return m, losses


def test_training_under_the_patch_is_pytorch_training():
    """Training (grad mode on, dropout in train mode) goes to PyTorch: the same losses and
    weights as without the patch; evaluation under no_grad runs on dattn."""
    m_plain, plain = _train()
    with dattn.patch_torch_sdpa():
        m_patched, patched = _train()
        m_patched.eval()
        x = rand(2, 12, 32, seed=5)
        with torch.no_grad():
            got, served = _served(lambda: m_patched(x))
    assert served
    assert patched == plain and plain[-1] < plain[0]
    for a, b in zip(m_plain.parameters(), m_patched.parameters()):
        assert torch.equal(a, b)
    m_plain.eval()
    with torch.no_grad():
        assert_close(got, m_plain(x).double())


def test_inference_mode_is_served():
    m = TinyAttention().eval()
    x = rand(2, 12, 32, seed=3)
    with torch.inference_mode(), dattn.patch_torch_sdpa():
        got, served = _served(lambda: m(x))
    assert served
    with torch.no_grad():
        assert_close(got, m(x).double())


# --- patch_torch_sdpa: installing and undoing --------------------------------------------------


def test_patch_as_a_context_manager_restores_the_previous_state():
    before = _state()
    with dattn.patch_torch_sdpa() as handle:
        assert getattr(F, _NAME) is not before
        assert handle.active
        q, k, v = qkv()
        assert_close(F.scaled_dot_product_attention(q, k, v), torch_f64(q, k, v))
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


def test_patch_restores_after_an_exception():
    before = _state()
    with pytest.raises(KeyError):
        with dattn.patch_torch_sdpa():
            raise KeyError("inside")
    assert _state() is before


def test_patch_needs_pytorch_2(monkeypatch):
    monkeypatch.delattr(F, _NAME)
    with pytest.raises(dattn.Unsupported, match="scaled_dot_product_attention"):
        dattn.patch_torch_sdpa()


def test_patch_over_someone_elses_patch(monkeypatch):
    """Someone replaces dattn's function while a handle is active: undoing that handle leaves
    their function alone; a new patch wraps theirs and restores it."""
    before = _state()
    old = dattn.patch_torch_sdpa()

    def theirs(*args, **kwargs):
        return "theirs"

    monkeypatch.setattr(F, _NAME, theirs)
    new = dattn.patch_torch_sdpa()
    assert getattr(F, _NAME) is not theirs
    old.undo()  # an earlier installation: changes nothing now
    assert getattr(F, _NAME) is not theirs
    new.undo()
    assert getattr(F, _NAME) is theirs
    monkeypatch.undo()  # their undo puts back dattn's first wrapper, whose handle is gone
    assert ta.hook_of(getattr(F, _NAME)) is not None  # dattn's, inert
    with dattn.patch_torch_sdpa():  # a new patch wraps what that wrapper wrapped ...
        pass
    assert _state() is before  # ... and restores it


def test_patch_sends_what_dattn_cannot_serve_to_the_original(monkeypatch):
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "original"

    monkeypatch.setattr(F, _NAME, original)
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
        assert_close(out, torch_f64(q, k, v, is_causal=True))
        with torch.no_grad():
            qg = q.clone().requires_grad_(True)
            assert_close(F.scaled_dot_product_attention(qg, k, v), torch_f64(q, k, v))
    assert len(calls) == 5
    assert getattr(F, _NAME) is original


def test_patch_with_sage_serves_8bit_attention():
    """patch_torch_sdpa(backend="SAGE"): PyTorch's SDPA calls on dattn's SAGE (8-bit Q.K^T),
    counted as served, within SAGE's documented accuracy of PyTorch's math."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, 4, 150, 64, generator=torch.Generator().manual_seed(s))
               for s in (1, 2, 3))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
    patch = dattn.patch_torch_sdpa(backend="SAGE")
    try:
        got = F.scaled_dot_product_attention(q, k, v)
        got_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        patch.undo()
    assert patch.calls == 2 and not patch.fallbacks, patch
    assert patch.backend_name == "SAGE"
    want_causal = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                 is_causal=True).float()
    for g, w in ((got, want), (got_causal, want_causal)):
        cos = F.cosine_similarity(g.flatten(2), w.flatten(2), dim=-1)
        assert float(cos.min()) >= 0.9995, float(cos.min())


def test_patch_refuses_bad_backend_kwargs_when_called():
    """A misspelled option or a bad value fails at patch_torch_sdpa, not at the first call
    inside the model; nothing is patched."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    with pytest.raises(dattn.InvalidArgument, match="pv_dtype"):
        dattn.patch_torch_sdpa(backend="SAGE", backend_kwargs={"pv_dtype": "bogus"})
    with pytest.raises(dattn.InvalidArgument, match="pv_dtyp"):
        dattn.patch_torch_sdpa(backend="SAGE", backend_kwargs={"pv_dtyp": "int8"})
    assert F.scaled_dot_product_attention is original


def test_sage_through_the_patch_ignores_masked_keys():
    """SAGE through the SDPA drop-in with a 4-D bool mask: what the masked keys hold (100, 1e4,
    -1e4) changes no kept row, bit for bit (NaN inputs go to PyTorch: the drop-in's
    non_finite rule)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 96, 64, generator=g)
    k = torch.randn(1, 2, 160, 64, generator=g) + 4.0
    v = torch.randn(1, 2, 160, 64, generator=g)
    mask = torch.ones(1, 1, 1, 160, dtype=torch.bool)
    mask[..., 130:] = False
    outs = []
    patch = dattn.patch_torch_sdpa(backend="SAGE")
    try:
        for garbage in (0.0, 100.0, 1e4, -1e4):
            kk, vv = k.clone(), v.clone()
            kk[:, :, 130:] = garbage
            vv[:, :, 130:] = garbage
            outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask))
    finally:
        patch.undo()
    assert patch.calls == 4 and not patch.fallbacks, patch
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
