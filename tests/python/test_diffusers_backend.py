"""dattn as diffusers' own attention backend by name ("dattn", "dattn_sage"): registration on
diffusers' closed enum and registry (idempotent, undone by unregister, diffusers' own backends
untouched), set_attention_backend / attention_backend on the models, the constraints diffusers
checks, the forward op's (out, lse) layout and its backward, and the fallbacks."""

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")

import test_diffusers as td  # noqa: E402
from diffusers.models import attention_dispatch as ad  # noqa: E402

import dattn  # noqa: E402
import dattn.diffusers as dd  # noqa: E402
from dattn import diffusers_backend as db  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _registered():
    dd.register()
    yield
    dd.register()
    ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE


def _diffusers_own():
    """diffusers' members and registry entries other than dattn's."""
    names = {n: m.value for n, m in ad.AttentionBackendName.__members__.items()
             if not m.value.startswith("dattn")}
    reg = ad._AttentionBackendRegistry
    backends = {k.value: v for k, v in reg._backends.items() if not k.value.startswith("dattn")}
    cp = {v for v in reg._supports_context_parallel if not v.startswith("dattn")}
    return names, backends, cp


def test_importing_dattn_imports_neither_torch_nor_diffusers():
    code = ("import sys, dattn; assert 'torch' not in sys.modules, 'torch';"
            "assert 'diffusers' not in sys.modules, 'diffusers'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_dattn_diffusers_registers_the_names():
    code = ("import dattn.diffusers as dd; from diffusers.models import attention_dispatch as ad;"
            "assert dd.registered();"
            "assert ad.AttentionBackendName('dattn') is ad.AttentionBackendName.DATTN;"
            "assert 'dattn_sage' in {m.value for m in ad.AttentionBackendName.__members__.values()}")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_is_idempotent_and_unregister_removes_only_dattn():
    before = _diffusers_own()
    count = len(ad.AttentionBackendName.__members__)
    assert dd.register() == ["dattn", "dattn_sage"]
    assert dd.register() == ["dattn", "dattn_sage"]
    assert len(ad.AttentionBackendName.__members__) == count
    fn = ad._AttentionBackendRegistry._backends[ad.AttentionBackendName.DATTN]
    dd.register()
    assert ad._AttentionBackendRegistry._backends[ad.AttentionBackendName.DATTN] is fn
    assert "dattn" in ad._AttentionBackendRegistry._supports_context_parallel

    dd.unregister()
    assert not dd.registered()
    assert "dattn" not in {m.value for m in ad.AttentionBackendName.__members__.values()}
    assert not hasattr(ad.AttentionBackendName, "DATTN")
    with pytest.raises(ValueError):
        ad.AttentionBackendName("dattn")
    assert len(ad.AttentionBackendName.__members__) == count - 2
    assert "dattn" not in ad._AttentionBackendRegistry._supports_context_parallel
    assert _diffusers_own() == before
    model, _ = td.flux()
    with pytest.raises(ValueError, match="must be one of"):
        model.set_attention_backend("dattn")
    with pytest.raises(ValueError, match="not registered"):
        with ad.attention_backend("dattn"):
            pass
    dd.unregister()  # nothing to remove: no error

    dd.register()
    assert dd.registered() and _diffusers_own() == before
    assert list(ad.AttentionBackendName)[-2:] == [ad.AttentionBackendName.DATTN,
                                                  ad.AttentionBackendName.DATTN_SAGE]


def test_unregister_while_in_use_is_refused_naming_the_name():
    with ad.attention_backend("dattn"):
        with pytest.raises(dattn.InvalidArgument, match="active attention backend is 'dattn'"):
            dd.unregister()
    assert dd.registered()
    registry = ad._AttentionBackendRegistry
    active = registry._active_backend
    model, inputs = td.flux()
    model.set_attention_backend("dattn_sage")  # diffusers sets it process-wide too
    try:
        td.run(model, inputs)
        with pytest.raises(dattn.InvalidArgument, match="reset_attention_backend") as e:
            dd.unregister()
        assert "dattn_sage" in str(e.value) and e.value.field == "backend"
        assert dd.registered()
    finally:
        model.reset_attention_backend()
    dd.unregister()  # nothing names dattn now; the process-wide default is diffusers' again
    assert not dd.registered()
    assert registry._active_backend == ad.AttentionBackendName.NATIVE
    td.run(model, inputs)  # the reset model runs on diffusers' default
    dd.register()
    registry._active_backend = active


@pytest.mark.parametrize("name", ["flux", "wan", "qwen"])
def test_set_attention_backend_serves_the_model(name):
    model, inputs = getattr(td, name)()
    want = td.run(model, inputs)  # diffusers' native backend
    client = dd.backend_client()
    calls = client.calls
    model.set_attention_backend("dattn")
    try:
        with td.sdpa_spy() as spy:
            got = td.run(model, inputs)
    finally:
        model.reset_attention_backend()
    assert client.calls > calls
    assert spy["calls"] == 0  # PyTorch's SDPA not called: every attention ran on dattn
    assert td.rel(got, want) <= 1e-5


def test_attention_backend_context_and_sage_name():
    model, inputs = td.flux()
    want = td.run(model, inputs)
    sage = dd.backend_client("dattn_sage")
    calls = sage.calls
    with ad.attention_backend("dattn_sage"):
        got = td.run(model, inputs)
    assert sage.calls > calls
    assert any("int8" in e or "vnni" in e or e.startswith("amx") for e in sage.engines())
    assert td.rel(got, want) <= 2e-2
    # leaving the block restores diffusers' native backend
    assert ad._AttentionBackendRegistry._active_backend == ad.AttentionBackendName.NATIVE


def test_diffusers_checks_refuse_what_dattn_cannot_do(monkeypatch):
    monkeypatch.setattr(ad._AttentionBackendRegistry, "_checks_enabled", True)
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ad.dispatch_attention_fn(q, q, q, backend=ad.AttentionBackendName.DATTN)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="is_causal"):  # diffusers' own message
        ad.dispatch_attention_fn(q, q, q, attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool),
                                 is_causal=True, backend=ad.AttentionBackendName.DATTN)
    with pytest.raises(ValueError):  # diffusers' _check_qkv_dtype_match
        ad.dispatch_attention_fn(q, q.bfloat16(), q, backend=ad.AttentionBackendName.DATTN)
    out = ad.dispatch_attention_fn(q, q, q, backend=ad.AttentionBackendName.DATTN)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, q, q))).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5)


def test_without_checks_what_dattn_does_not_serve_goes_to_pytorch_counted():
    client = dd.backend_client()
    before = client.fallbacks["dtype"]
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    out = ad.dispatch_attention_fn(q, q, q, backend=ad.AttentionBackendName.DATTN)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, q, q))).transpose(1, 2)
    assert torch.allclose(out, ref)
    assert client.fallbacks["dtype"] == before + 1


def _math_bshd(q, k, v, mask=None, scale=None):
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    if kf.shape[1] != qf.shape[1]:
        r = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(r, 1), vf.repeat_interleave(r, 1)
    s = qf @ kf.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), lse.transpose(1, 2)


@pytest.mark.parametrize("gqa", [False, True])
def test_return_lse_layout_is_diffusers(gqa):
    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 24)
    k = torch.randn(2, 45, 2 if gqa else 4, 24)
    v = torch.randn(2, 45, 2 if gqa else 4, 24)
    mask = torch.rand(2, 45) > 0.3  # diffusers' [B, Skv] key mask
    out, lse = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=gqa,
                                        attention_kwargs={"return_lse": True},
                                        backend=ad.AttentionBackendName.DATTN)
    want, want_lse = _math_bshd(q, k, v, mask[:, None, None, :])
    assert lse.shape == (2, 37, 4) and lse.dtype == torch.float32  # [B, S, H]
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)


class _Op(torch.autograd.Function):
    """diffusers' use of a backend's forward / backward ops (as in its templated attention)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        return db._forward_op(ctx, q, k, v, mask, 0.0, False, None, False, False, _save_ctx=True)

    @staticmethod
    def backward(ctx, grad):
        return (*db._backward_op(ctx, grad), None)


@pytest.mark.parametrize("masked", [False, True])
def test_backward_op_matches_pytorch(masked):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    mask = (torch.rand(1, 1, 20, 20) > 0.2) if masked else None
    if masked:
        mask[..., 0] = True  # every row sees a key
    grad = torch.randn(1, 20, 2, 16)
    out = _Op.apply(q, k, v, mask)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         attn_mask=mask).transpose(1, 2)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()


def test_enable_parallelism_refuses_without_a_process_group():
    from diffusers import ContextParallelConfig

    model, _ = td.flux()
    with pytest.raises(dattn.InvalidArgument, match="init_process_group") as e:
        dd.enable_parallelism(model, ContextParallelConfig(ulysses_degree=2))
    assert e.value.field == "torch.distributed"
    with pytest.raises(dattn.InvalidArgument) as e:
        dd.enable_parallelism(model, {"ulysses_degree": 2})
    assert e.value.field == "config"
    assert model._parallel_config is None  # nothing changed
