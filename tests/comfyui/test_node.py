"""dattn's node pack (integrations/comfyui) loaded by ComfyUI's own custom-node loader, on a Wan
model loaded by ComfyUI's own loader and sampled by its own sampler: the node's clone runs on
dattn (the original model untouched), two nodes in a row (the later wins), VIDEO_SPARSE's grid
and dense steps, and the names registered in ComfyUI's attention registry."""

import asyncio

import pytest
import torch

import comfy.ldm.flux.model
import comfy.ldm.modules.attention as A
import comfy.ldm.wan.model
import comfy.ops
import comfy.sample
import comfy.sd
import nodes
from conftest import NODE_PACK
from test_models import init_weights

import dattn.comfyui
import dattn.comfyui.video


@pytest.fixture(scope="module")
def node():
    assert asyncio.run(nodes.load_custom_node(NODE_PACK, module_parent="custom_nodes"))
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["DattnAttention"] == "Attention on dattn (CPU)"
    return nodes.NODE_CLASS_MAPPINGS["DattnAttention"]


@pytest.fixture(scope="module")
def wan_model():
    """A tiny Wan 2.1 through ComfyUI's loader (comfy.sd.load_diffusion_model_state_dict: the
    UNETLoader path; its detection wants 16 latent channels, heads = dim / 128)."""
    m = init_weights(comfy.ldm.wan.model.WanModel(
        model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=256, ffn_dim=512, freq_dim=256,
        text_dim=4096, out_dim=16, num_heads=2, num_layers=2, dtype=torch.float32,
        operations=comfy.ops.disable_weight_init))
    sd = {"model.diffusion_model." + k: v for k, v in m.state_dict().items()}
    return comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.float32})


def sample(model, steps=4, cfg=1.0):
    noise = torch.randn(1, 16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    pos = [[torch.randn(1, 8, 4096, generator=torch.Generator().manual_seed(1)), {}]]
    neg = [[torch.zeros(1, 8, 4096), {}]]
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg,
                               torch.zeros_like(noise), seed=0, disable_pbar=True)


def override_of(model):
    return model.model_options["transformer_options"]["optimized_attention_override"]


def test_the_node_runs_the_model_on_dattn(node, wan_model):
    base = sample(wan_model)
    (patched,) = node().patch(wan_model, "FLASH")
    got = sample(patched)
    ov = override_of(patched)
    assert isinstance(ov, dattn.comfyui.Override) and ov.calls > 0 and not ov.fallbacks
    # ComfyUI's cleanup after sampling (CallbacksMP.ON_CLEANUP) gave dattn's idle buffers back.
    from comfy.patcher_extension import CallbacksMP

    for name in (CallbacksMP.ON_CLEANUP, CallbacksMP.ON_DETACH):
        assert len(patched.get_callbacks(name, dattn.comfyui.OPTIONS_KEY)) == 1
    assert dattn.memory_stats()["idle_bytes"] == 0
    assert "optimized_attention_override" not in wan_model.model_options["transformer_options"]
    assert float((got - base).abs().max()) < 1e-3  # ComfyUI's sub_quad vs dattn, 4 steps
    (sage,) = node().patch(patched, "SAGE", "pv_dtype=int16")  # the later node wins
    assert override_of(sage).backend == "SAGE" and override_of(sage).previous is None
    with pytest.raises(dattn.InvalidArgument, match="pv_dtpye"):
        node().patch(wan_model, "SAGE", "pv_dtpye=int8")


def test_video_sparse_learns_wans_grid_and_keeps_its_dense_steps(node, wan_model):
    (patched,) = node().patch(wan_model, "VIDEO_SPARSE",
                              "sparsity=0.75, tile=1,2,2, dense_steps=2")
    ov = override_of(patched)
    out = sample(patched, steps=4, cfg=2.0)  # CFG: both branches in one batched call
    assert torch.isfinite(out).all()
    # 2 grid calls per forward (2 blocks) x 4 steps: the first 2 steps dense
    assert (ov.video.dense_calls, ov.video.sparse_calls) == (4, 4), ov.video.__dict__
    assert not ov.fallbacks
    # A model whose grid dattn does not know (Flux) is refused naming the model.

    class FluxPatcher:
        def get_model_object(self, name):
            return comfy.ldm.flux.model.Flux(
                in_channels=4, out_channels=4, vec_in_dim=8, context_in_dim=16, hidden_size=64,
                mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12],
                theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
                operations=comfy.ops.disable_weight_init)

    with pytest.raises(dattn.Unsupported, match="Flux") as e:
        dattn.comfyui.video.install_grid_wrapper(FluxPatcher())
    assert e.value.field == "model"


def test_the_names_are_in_comfyuis_registry(node):
    for name, backend in (("dattn", "FLASH"), ("dattn_sage", "SAGE")):
        fn = A.get_attention_function(name)
        assert fn.override.backend == backend
    q, k, v = (torch.randn(1, 40, 2 * 32) for _ in range(3))
    got = A.get_attention_function("dattn")(q, k, v, 2)
    want = A.attention_pytorch(q, k, v, 2)
    assert float((got - want).abs().max()) < 1e-5
