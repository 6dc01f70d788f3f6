"""ComfyUI's own model classes (Flux, Wan, SD3, an SDXL UNet) at small random-weight configs, one
forward each, with dattn's override in ``transformer_options`` against ComfyUI's
``attention_pytorch`` and ``attention_sub_quad`` (its CPU default) on the same inputs; every
attention call of the model served by dattn (none handed back)."""

import pytest
import torch

import comfy.ldm.flux.model
import comfy.ldm.modules.attention as A
import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel
import comfy.ldm.wan.model
import comfy.ops

from dattn import comfyui

OPS = comfy.ops.disable_weight_init


def init_weights(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or name.endswith("scale")):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def flux(masked=False, dtype=torch.float32):
    m = init_weights(comfy.ldm.flux.model.Flux(
        in_channels=4, out_channels=4, vec_in_dim=8, context_in_dim=16, hidden_size=128,
        mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 24, 24],
        theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, dtype=torch.float32,
        operations=OPS)).to(dtype)
    b, h, w, text = 1, 16, 24, 7
    x, ctx, y = rand(b, 4, h, w, seed=1), rand(b, text, 16, seed=2), rand(b, 8, seed=3)
    kw = {}
    if masked:  # Flux's attention_mask cond: additive [B, L, L]
        n = text + (h // 2) * (w // 2)
        mask = torch.zeros(b, n, n)
        mask[:, :, 1:3] = -10000.0
        kw["attention_mask"] = mask.to(dtype)
    return lambda to: m(x.to(dtype), torch.tensor([0.7]), ctx.to(dtype), y=y.to(dtype),
                        guidance=torch.tensor([3.5]), transformer_options=to, **kw)


def wan():
    m = init_weights(comfy.ldm.wan.model.WanModel(
        model_type="t2v", patch_size=(1, 2, 2), text_len=8, in_dim=4, dim=128, ffn_dim=256,
        freq_dim=32, text_dim=16, out_dim=4, num_heads=2, num_layers=2, dtype=torch.float32,
        operations=OPS))
    x, ctx = rand(1, 4, 3, 12, 16, seed=1), rand(1, 8, 16, seed=2)
    return lambda to: m(x, torch.tensor([0.6]), ctx, transformer_options=to)


def sd3():
    m = init_weights(mmdit.OpenAISignatureMMDITWrapper(
        input_size=None, patch_size=2, in_channels=4, out_channels=4, depth=2, adm_in_channels=8,
        context_embedder_config={"target": "torch.nn.Linear",
                                 "params": {"in_features": 16, "out_features": 128}},
        pos_embed_max_size=16, num_patches=256, qk_norm="rms", x_block_self_attn_layers=[0],
        dtype=torch.float32, operations=OPS))
    x, ctx, y = rand(1, 4, 16, 24, seed=1), rand(1, 6, 16, seed=2), rand(1, 8, seed=3)
    return lambda to: m(x, torch.tensor([500.0]), context=ctx, y=y, transformer_options=to)


def sdxl():
    m = init_weights(openaimodel.UNetModel(
        image_size=32, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=[1, 1],
        channel_mult=[1, 2], num_head_channels=16, use_spatial_transformer=True, legacy=False,
        transformer_depth=[0, 1], transformer_depth_middle=1, transformer_depth_output=[0, 0, 1, 1],
        use_linear_in_transformer=True, context_dim=32, num_classes="sequential",
        adm_in_channels=16, use_temporal_attention=False, use_temporal_resblock=False,
        dtype=torch.float32, operations=OPS))
    x, ctx, y = rand(2, 4, 16, 16, seed=1), rand(2, 7, 32, seed=2), rand(2, 16, seed=3)
    return lambda to: m(x, torch.tensor([500.0, 500.0]), context=ctx, y=y, transformer_options=to)


def pytorch(func, *args, **kwargs):
    """ComfyUI's attention_pytorch for every call (the override convention)."""
    kwargs.pop("_inside_attn_wrapper", None)
    kwargs.pop("transformer_options", None)
    return A.attention_pytorch.__wrapped__(*args, **kwargs)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


MODELS = {"flux": flux, "flux-masked": lambda: flux(masked=True), "wan": wan, "sd3": sd3,
          "sdxl": sdxl}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_comfyuis_models_on_dattn_match_its_attention(name):
    run = MODELS[name]()
    with torch.no_grad():
        want = run({"optimized_attention_override": pytorch})
        sub_quad = run({})  # ComfyUI's CPU default
        flash = comfyui.override("FLASH")
        got = run({"optimized_attention_override": flash})
        sage = comfyui.override("SAGE")
        approx = run({"optimized_attention_override": sage})
    assert A.optimized_attention.__wrapped__ is A.attention_sub_quad.__wrapped__
    assert rel(sub_quad, want) < 1e-5  # ComfyUI's two CPU paths agree
    assert rel(got, want) < 1e-5 and rel(got, sub_quad) < 1e-5, (rel(got, want), rel(got, sub_quad))
    assert rel(approx, want) < 3e-2, rel(approx, want)
    assert flash.calls > 0 and not flash.fallbacks, flash
    assert sage.calls == flash.calls and not sage.fallbacks


def test_bf16_flux_on_dattn_matches_attention_pytorch():
    run = flux(masked=True, dtype=torch.bfloat16)
    with torch.no_grad():
        want = run({"optimized_attention_override": pytorch})
        ov = comfyui.override()
        got = run({"optimized_attention_override": ov})
    assert got.dtype == torch.bfloat16 and rel(got, want) < 2e-2 and ov.calls > 0
