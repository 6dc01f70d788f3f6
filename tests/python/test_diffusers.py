"""dattn.diffusers inside real diffusers models (the pinned diffusers, tiny random-weight
configs, no download): outputs against diffusers' default attention, the handle's counts
against the attention calls counted independently (a spy on PyTorch's SDPA during a run
without dattn), and the model exactly as it was after disable."""

import contextlib
import inspect
import os

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import dattn  # noqa: E402
import dattn.diffusers as dd
from dattn import torch_adapter as ta  # noqa: E402
from diffusers.models import attention_dispatch  # noqa: E402

F = torch.nn.functional


# --- tiny models and their inputs ------------------------------------------------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed))


def flux(seed=0):
    """Flux: 1 double-stream + 1 single-stream block, 2 heads of 128, a 16x16 latent (256 image
    tokens after the 2x2 patchify Flux's pipeline does) and 48 text tokens."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(16, 56, 56),
    ).eval()
    h = w = 16
    ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(-1, 3)
    inputs = dict(
        hidden_states=_randn(1, h * w, 16, seed=1), encoder_hidden_states=_randn(1, 48, 32, seed=2),
        pooled_projections=_randn(1, 32, seed=3), timestep=torch.tensor([0.5]),
        img_ids=img_ids, txt_ids=torch.zeros(48, 3),
    )
    return model, inputs


def sd3(seed=0):
    """SD3.5-style: 2 joint blocks (block 0 with the dual attention, QK RMSNorm), 2 heads of
    64, a 16x16 latent (64 tokens after the 2x2 patch) and 12 text tokens."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=64,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=128,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm",
    ).eval()
    inputs = dict(
        hidden_states=_randn(1, 4, 16, 16, seed=1), encoder_hidden_states=_randn(1, 12, 32, seed=2),
        pooled_projections=_randn(1, 32, seed=3), timestep=torch.tensor([500]),
    )
    return model, inputs


def wan(seed=0):
    """Wan: 2 blocks (self- and cross-attention each), 2 heads of 64, 2x8x8 latent (32 tokens
    after the 1x2x2 patch), 12 text tokens."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    ).eval()
    inputs = dict(
        hidden_states=_randn(1, 4, 2, 8, 8, seed=1), timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, 12, 32, seed=2),
    )
    return model, inputs


def wan_i2v(seed=0):
    """Wan image-to-video: the cross-attention also attends the image tokens (its second
    dispatcher call, counted separately): 1 block, 8 image tokens."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=32,
        image_dim=16, added_kv_proj_dim=128,
    ).eval()
    inputs = dict(
        hidden_states=_randn(1, 4, 2, 8, 8, seed=1), timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, 12, 32, seed=2),
        encoder_hidden_states_image=_randn(1, 8, 16, seed=3),
    )
    return model, inputs


def qwen(seed=0, padded=False):
    """Qwen-Image: 2 double-stream blocks, 2 heads of 64, an 8x8 token grid, 10 text tokens
    (the last 3 masked out with ``padded``)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=64,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(16, 24, 24),
    ).eval()
    mask = torch.ones(1, 10, dtype=torch.long)
    if padded:
        mask[:, 7:] = 0
    inputs = dict(
        hidden_states=_randn(1, 64, 16, seed=1), encoder_hidden_states=_randn(1, 10, 32, seed=2),
        encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5]), img_shapes=[(1, 8, 8)],
    )
    return model, inputs


def hunyuan_video(seed=0):
    """HunyuanVideo: 1 refiner layer (its token-refiner attention, with the text mask), 1
    dual-stream and 1 single-stream block, 2 heads of 64, a 1x8x8 latent (16 tokens after the
    2x2 patch), 10 text tokens with 2 masked out."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(16, 24, 24),
        guidance_embeds=True,
    ).eval()
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 8:] = 0
    inputs = dict(
        hidden_states=_randn(1, 4, 1, 8, 8, seed=1), timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(1, 10, 32, seed=2), encoder_attention_mask=mask,
        pooled_projections=_randn(1, 16, seed=3), guidance=torch.tensor([3500.0]),
    )
    return model, inputs


MODELS = {"flux": flux, "sd3": sd3, "wan": wan, "wan_i2v": wan_i2v, "qwen": qwen,
          "hunyuan_video": hunyuan_video}


def to_dtype(inputs, dtype):
    return {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in
            ("img_ids", "txt_ids", "timestep", "guidance") else v)
        for k, v in inputs.items()
    }


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@contextlib.contextmanager
def sdpa_spy():
    """Counts calls of PyTorch's SDPA (diffusers' native backend and the processors that call
    it directly both end there) in this block."""
    original = F.scaled_dot_product_attention
    seen = {"calls": 0}

    def spy(*args, **kwargs):
        seen["calls"] += 1
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield seen
    finally:
        F.scaled_dot_product_attention = original


def snapshot(model):
    """What enable/disable must leave as it was: each attention module's processor object,
    its diffusers backend setting, forward overrides and hooks; the process's functions."""
    state = {}
    for name, m in model.named_modules():
        proc = getattr(m, "processor", None)
        state[name] = (
            id(proc) if proc is not None else None,
            getattr(proc, "_attention_backend", None),
            "forward" in m.__dict__,
            len(m._forward_hooks), len(m._forward_pre_hooks),
        )
    modules = {type(p).__module__ for p in (getattr(m, "processor", None) for m in model.modules())
               if p is not None}
    funcs = {mod: getattr(__import__(mod, fromlist=["_"]), "dispatch_attention_fn", None)
             for mod in modules}
    return state, funcs, F.scaled_dot_product_attention, \
        attention_dispatch._AttentionBackendRegistry._active_backend


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --- the models ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_runs_on_dattn(name, dtype, tol):
    model, inputs = MODELS[name]()
    model = model.to(dtype)
    inputs = to_dtype(inputs, dtype)
    before = snapshot(model)
    with sdpa_spy() as spy:
        want = run(model, inputs)
    expected_calls = spy["calls"]
    assert expected_calls > 0

    with sdpa_spy() as spy:  # under dattn's wrappers: counts the calls reaching PyTorch's
        handle = dd.enable(model)
        assert dd.handle_of(model) is handle
        got = run(model, inputs)
        routes, modules = dict(handle.routes), list(handle.modules)
        handle.disable()
    assert spy["calls"] == 0, handle  # dattn served every call
    assert handle.calls == expected_calls, handle
    assert not handle.fallbacks, handle
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel(got, want) <= tol, rel(got, want)
    # Every attention module of the model is routed.
    assert routes and all(routes.values()), routes
    assert len(modules) == len(routes)

    handle.disable()
    assert dd.handle_of(model) is None
    assert snapshot(model) == before
    assert torch.equal(run(model, inputs), want)  # bit-identical to the default again
    handle.disable()  # harmless twice


def test_counts_per_model():
    """The counts of these configs, by hand: Flux 1 double + 1 single block = 2; SD3 2 joint
    blocks + 1 dual attention = 3; Wan 2 blocks x (self + cross) = 4; Wan I2V 1 block x (self +
    cross text + cross image) = 3; Qwen 2 double blocks = 2; HunyuanVideo 1 refiner + 1 double
    + 1 single = 3."""
    want = {"flux": 2, "sd3": 3, "wan": 4, "wan_i2v": 3, "qwen": 2, "hunyuan_video": 3}
    for name, build in MODELS.items():
        model, inputs = build()
        with dd.enable(model) as handle:
            run(model, inputs)
        assert handle.calls == want[name], (name, handle)


def test_routes_name_the_mechanism():
    model, _ = sd3()
    with dd.enable(model) as h:
        assert set(h.routes.values()) == {("scaled_dot_product_attention",)}
    model, _ = hunyuan_video()
    with dd.enable(model) as h:
        refiner = [n for n in h.routes if "token_refiner" in n]
        assert refiner and all(h.routes[n] == ("scaled_dot_product_attention",) for n in refiner)
        others = [n for n in h.routes if n not in refiner]
        assert others and all(h.routes[n] == ("dispatch_attention_fn",) for n in others)
    for build in (flux, wan, wan_i2v, qwen):
        model, _ = build()
        with dd.enable(model) as h:
            assert set(h.routes.values()) == {("dispatch_attention_fn",)}


def test_a_diffusers_backend_setting_is_kept(recwarn, monkeypatch):
    """A model set to one of diffusers' backends (per module, and the process-wide context
    manager): dattn serves it while enabled; the settings are untouched and work afterwards."""
    registry = attention_dispatch._AttentionBackendRegistry
    # diffusers' set_attention_backend also sets the process-wide backend: put it back after.
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)
    model, inputs = flux()
    want = run(model, inputs)
    model.set_attention_backend("_native_math")
    before = snapshot(model)
    assert {p._attention_backend for p in (m.processor for m in model.modules()
                                           if hasattr(m, "processor"))} == {"_native_math"}
    with attention_dispatch.attention_backend("_native_math"):
        with dd.enable(model) as handle:
            got = run(model, inputs)
        assert snapshot(model) == before
        assert handle.calls == 2 and rel(got, want) <= 1e-4
        with sdpa_spy() as spy:
            assert rel(run(model, inputs), want) <= 1e-5
        assert spy["calls"] == 2  # diffusers' math backend ends in PyTorch's SDPA again
    with torch.inference_mode(), dd.enable(model) as handle:  # inference tensors too
        assert rel(model(**inputs, return_dict=False)[0], want) <= 1e-4
    assert handle.calls == 2


def test_qwen_text_padding_mask():
    model, inputs = qwen(padded=True)
    want = run(model, inputs)
    with dd.enable(model) as handle:
        got = run(model, inputs)
    assert handle.calls == 2 and not handle.fallbacks
    assert rel(got, want) <= 1e-4


# --- scope: one model only, undo ------------------------------------------------------------


def test_two_models_one_disabled():
    a, ia = flux(seed=0)
    b, ib = flux(seed=1)
    want_a, want_b = run(a, ia), run(b, ib)
    ha, hb = dd.enable(a), dd.enable(b)
    assert rel(run(a, ia), want_a) <= 1e-4 and rel(run(b, ib), want_b) <= 1e-4
    dd.disable(a)
    assert torch.equal(run(a, ia), want_a)
    assert rel(run(b, ib), want_b) <= 1e-4
    assert (ha.calls, hb.calls) == (2, 4)
    hb.disable()
    assert torch.equal(run(b, ib), want_b)


def test_two_models_sharing_pytorchs_sdpa():
    """SD3 and HunyuanVideo's refiner both go through F.scaled_dot_product_attention: disabling
    one leaves the other served, disabling both restores PyTorch's function."""
    original = F.scaled_dot_product_attention
    a, ia = sd3()
    b, ib = hunyuan_video()
    want_a, want_b = run(a, ia), run(b, ib)
    ha, hb = dd.enable(a), dd.enable(b)
    hb.disable()
    assert F.scaled_dot_product_attention is not original
    assert torch.equal(run(b, ib), want_b) and hb.calls == 0
    assert rel(run(a, ia), want_a) <= 1e-4 and ha.calls == 3
    hb = dd.enable(b)
    ha.disable()
    assert rel(run(b, ib), want_b) <= 1e-4 and hb.calls == 3
    assert torch.equal(run(a, ia), want_a)
    hb.disable()
    assert F.scaled_dot_product_attention is original


def test_other_models_and_mha_keep_pytorch():
    model, inputs = flux()
    other, other_inputs = wan()  # not enabled; same dispatcher module? no: its own
    other_flux, of_inputs = flux(seed=3)  # same processor module as the enabled model
    mha = torch.nn.MultiheadAttention(32, 2, batch_first=True).eval()
    x = _randn(1, 9, 32, seed=4)
    with torch.no_grad():
        want_mha = mha(x, x, x, need_weights=False)[0]
    want_other, want_of = run(other, other_inputs), run(other_flux, of_inputs)
    with dd.enable(model) as handle:
        with sdpa_spy() as spy:
            assert torch.equal(run(other_flux, of_inputs), want_of)
            assert torch.equal(run(other, other_inputs), want_other)
            with torch.no_grad():
                assert torch.equal(mha(x, x, x, need_weights=False)[0], want_mha)
        assert spy["calls"] > 0  # they ran on PyTorch's SDPA
        assert handle.calls == 0 and not handle.fallbacks


def test_exception_inside_with_restores():
    model, inputs = flux()
    before = snapshot(model)
    want = run(model, inputs)
    with pytest.raises(RuntimeError, match="boom"):
        with dd.enable(model) as handle:
            run(model, inputs)
            raise RuntimeError("boom")
    assert handle.calls == 2 and not handle.active
    assert snapshot(model) == before and dd.handle_of(model) is None
    assert torch.equal(run(model, inputs), want)


def test_exception_inside_the_model_clears_the_mark():
    model, inputs = flux()
    with dd.enable(model) as handle:
        bad = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][..., :5])
        with pytest.raises(RuntimeError):
            run(model, bad)
        assert ta.marked_handle() is None
        other, other_inputs = wan()
        with sdpa_spy() as spy:
            run(other, other_inputs)
        assert spy["calls"] == 4 and handle.calls == 0


# --- fallbacks and errors --------------------------------------------------------------------


def test_float64_goes_to_pytorch_counted():
    model, inputs = flux()
    model = model.double()
    inputs = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in inputs.items()}
    want = run(model, inputs)
    with dd.enable(model) as handle:
        got = run(model, inputs)
    assert handle.calls == 0 and handle.fallbacks == {"dtype": 2}
    assert torch.equal(got, want)


def test_training_goes_to_pytorch_counted():
    model, inputs = flux()
    model.train()
    with dd.enable(model) as handle:
        out = model(**inputs, return_dict=False)[0]
        out.square().mean().backward()  # gradients flow: PyTorch computed the attention
    assert handle.fallbacks == {"grad": 2} and handle.calls == 0
    assert model.transformer_blocks[0].attn.to_q.weight.grad is not None


def test_direct_fallback_reasons():
    """The routed functions called under a model's mark with what dattn does not serve."""
    model, _ = flux()
    handle = dd.enable(model)
    dispatch = model.transformer_blocks[0].attn.processor.__class__.__call__.__globals__[
        "dispatch_attention_fn"]
    q = _randn(1, 8, 2, 16, seed=1)
    ta.push_mark(handle)
    try:
        want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, q, q)),
                                              dropout_p=0.0).transpose(1, 2)
        assert rel(dispatch(q, q, q), want) <= 1e-5
        torch.manual_seed(0)
        dispatch(q, q, q, dropout_p=0.5)
        dispatch(q, q, q, attention_kwargs={"return_lse": False})
        q4 = _randn(1, 8, 4, 16, seed=3)
        kv = _randn(1, 8, 2, 16, seed=2)
        with pytest.raises(RuntimeError):  # PyTorch's own refusal of GQA without enable_gqa
            dispatch(q4, kv, kv)
        gqa = dispatch(q4, kv, kv, enable_gqa=True)  # served
        want_gqa = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q4, kv, kv)), enable_gqa=True).transpose(1, 2)
        assert rel(gqa, want_gqa) <= 1e-5
        both = dict(attn_mask=torch.ones(1, 8, dtype=torch.bool), is_causal=True)
        got_both = dispatch(q, q, q, **both)  # PyTorch's answer (or error), whichever it gives
        want_both = attention_dispatch.dispatch_attention_fn(q, q, q, **both)
        assert torch.equal(got_both, want_both)
        causal = dispatch(q, q, q, is_causal=True)
        want_causal = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, q, q)), is_causal=True).transpose(1, 2)
        assert rel(causal, want_causal) <= 1e-5
        keep = torch.ones(1, 8, dtype=torch.bool)
        keep[0, 5:] = False
        masked = dispatch(q, q, q, attn_mask=keep)  # diffusers' [B, Skv] key mask
        want_masked = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, q, q)), attn_mask=keep[:, None, None, :]
        ).transpose(1, 2)
        assert rel(masked, want_masked) <= 1e-5
    finally:
        ta.pop_mark()
        handle.disable()
    assert handle.fallbacks == {"dropout": 1, "attention_kwargs": 1, "gqa": 1,
                                "mask_and_causal": 1}
    assert handle.calls == 4


def test_enable_refuses_what_it_cannot_take():
    model, inputs = flux()
    before = snapshot(model)
    with pytest.raises(dattn.InvalidArgument, match="model") as e:
        dd.enable(object())
    assert e.value.field == "model"
    with pytest.raises(dattn.InvalidArgument, match="no diffusers attention modules"):
        dd.enable(torch.nn.Linear(2, 2))
    with pytest.raises(dattn.InvalidArgument) as e:
        dd.enable(model, backend="NO_SUCH_BACKEND")
    assert e.value.field == "backend"
    with pytest.raises(dattn.InvalidArgument, match="did you mean 'pv_dtype'") as e:
        dd.enable(model, backend="SAGE", backend_kwargs={"pv_dtyp": "int8"})
    assert e.value.field == "pv_dtyp"
    assert snapshot(model) == before and dd.handle_of(model) is None
    with dd.enable(model):
        with pytest.raises(dattn.InvalidArgument, match="already runs on dattn"):
            dd.enable(model)
    assert snapshot(model) == before


def test_a_model_whose_processors_call_neither_function_is_refused():
    class MathProcessor:
        def __call__(self, attn, x):
            s = torch.softmax(x @ x.transpose(-1, -2), dim=-1)
            return s @ x

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.processor = MathProcessor()

        def forward(self, x):
            return self.processor(self, x)

    model = torch.nn.Sequential(Block(), Block())
    with pytest.raises(dattn.Unsupported, match="MathProcessor") as e:
        dd.enable(model)
    assert e.value.field == "model" and dd.handle_of(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_backend_choice_and_the_engines_variable(monkeypatch):
    model, inputs = flux()
    want = run(model, inputs)
    with dd.enable(model, backend="REFERENCE") as h:
        assert h.backend_name == "REFERENCE"
        assert rel(run(model, inputs), want) <= 1e-4
    for value in ("auto", "DATTN"):
        with dd.enable(model, backend=value) as h:
            assert h.backend_name == "FLASH"
    for value in ("DATTN", "TORCH_SDPA", "FLASH_ATTN", "auto"):  # the engine's / another's names
        monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", value)
        with dd.enable(model) as h:
            assert h.backend_name == "FLASH"
            assert rel(run(model, inputs), want) <= 1e-4 and h.calls == 2
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "reference")  # dattn's own name
    with dd.enable(model) as h:
        assert h.backend_name == "REFERENCE"
        run(model, inputs)
        assert h.calls == 2


# --- the private diffusers attributes dattn.diffusers relies on -----------------------------


def test_private_diffusers_attributes_are_where_dattn_expects_them():
    """Fails loudly when a diffusers upgrade moves what docs/python.md ("diffusers") names."""
    from diffusers.models import attention_processor
    from diffusers.models.transformers import (
        transformer_flux, transformer_hunyuan_video, transformer_qwenimage, transformer_wan)

    assert diffusers.__version__ == "0.42.1", "re-check docs/python.md's list on an upgrade"
    # 1. Processors that call the dispatcher read it as a global of their own module.
    for module, processor in [
        (transformer_flux, transformer_flux.FluxAttnProcessor),
        (transformer_wan, transformer_wan.WanAttnProcessor),
        (transformer_qwenimage, transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0),
        (transformer_hunyuan_video, transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0),
    ]:
        assert module.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn
        assert "dispatch_attention_fn" in processor.__call__.__code__.co_names, processor
        assert processor.__call__.__globals__ is module.__dict__
    # 2. ... with this signature, tensors [B, S, H, D].
    params = inspect.signature(attention_dispatch.dispatch_attention_fn).parameters
    assert list(params)[:9] == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                                "scale", "enable_gqa", "attention_kwargs"]
    assert {"backend", "parallel_config"} <= set(params)
    # 3. SD3's joint processor and the token refiner's processor call F.sdpa directly.
    for processor in (attention_processor.JointAttnProcessor2_0,
                      attention_processor.AttnProcessor2_0):
        names = processor.__call__.__code__.co_names
        assert "scaled_dot_product_attention" in names and "dispatch_attention_fn" not in names
    # 4. Attention modules carry `processor`; processors `_attention_backend`; the registry
    # its process-wide `_active_backend` (compared by the tests: left as it was).
    for build in MODELS.values():
        model, _ = build()
        procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
        assert procs
    assert hasattr(transformer_flux.FluxAttnProcessor, "_attention_backend")
    assert hasattr(attention_dispatch._AttentionBackendRegistry, "_active_backend")
    # 5. The native backend reaches PyTorch's SDPA by attribute lookup (the tests' spy).
    assert "scaled_dot_product_attention" in \
        attention_dispatch._native_attention.__code__.co_names


# --- SAGE: 8-bit attention end to end ---------------------------------------------------------


@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
def test_sage_end_to_end_within_twice_bf16_flashs_error(name):
    """A random-weight model in bf16 on dattn's SAGE (and with pv_dtype int8): its error against
    the f32 model's output (dattn FLASH, exact) within twice that of the same bf16 model on
    FLASH, the error bf16 inference already has. Also printed: the attention-only comparison (the f32 model on SAGE
    against FLASH computing attention in bf16, compute_dtype bf16)."""
    model, inputs = MODELS[name]()
    with dd.enable(model) as exact:
        want = run(model, inputs)
    assert exact.calls > 0 and not exact.fallbacks
    with dd.enable(model, backend="SAGE") as sage32:
        sage_f32 = run(model, inputs)
    # The bf16 dot where the CPU has none: its emulated twin (the same roundings).
    with dd.enable(model, backend_kwargs={"compute_dtype": "bf16",
                                          "isa": "avx512_bf16_emulated"}):
        flash_bf16_attention = run(model, inputs)
    model = model.to(torch.bfloat16)
    inputs = to_dtype(inputs, torch.bfloat16)
    with dd.enable(model) as flash16:
        flash_bf16 = run(model, inputs)
    with dd.enable(model, backend="SAGE") as sage16:
        sage_bf16 = run(model, inputs)
    with dd.enable(model, backend="SAGE", backend_kwargs={"pv_dtype": "int8"}) as pv8:
        sage_pv8 = run(model, inputs)  # P.V in 8 bits too
    for h in (sage32, sage16, flash16, pv8):
        assert h.calls == exact.calls and not h.fallbacks, h
    assert any("int8" in e or "vnni" in e for e in sage16.engines), sage16.engines
    err_flash, err_sage, err_pv8 = (rel(flash_bf16, want), rel(sage_bf16, want),
                                    rel(sage_pv8, want))
    print(f"{name}: bf16 model: SAGE {err_sage:.2e}, FLASH {err_flash:.2e} "
          f"({err_sage / err_flash:.2f}x), SAGE pv int8 {err_pv8:.2e} "
          f"({err_pv8 / err_flash:.2f}x); f32 model: SAGE {rel(sage_f32, want):.2e}, "
          f"FLASH with bf16 attention {rel(flash_bf16_attention, want):.2e}")
    assert err_sage <= 2 * err_flash, (err_sage, err_flash)
    assert err_pv8 <= 2 * err_flash, (err_pv8, err_flash)
