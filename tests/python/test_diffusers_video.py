"""VIDEO_SPARSE inside diffusers' video transformers (dattn.diffusers with backend
"VIDEO_SPARSE"): the layout of every grid call against a table of each model's true token order,
the sliding-tile selection against REFERENCE under the block mask of each token's true (t, h, w),
the step and layer policy (dense steps and layers bit-identical to FLASH, reuse of a refresh
step's selection, CFG branches), bad options and disable."""

import itertools
import os
import sys

import pytest
import torch

pytest.importorskip("diffusers")
sys.path.insert(0, os.path.dirname(__file__))

import dattn  # noqa: E402
import dattn.diffusers as dd  # noqa: E402
from dattn.diffusers import video as dv  # noqa: E402


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- small random-weight models; latent grids with unequal axes (a transposed grid is wrong) ---


def wan(seed=0, frames=2, height=8, width=16, layers=2):
    """Wan 2.1: attn1 over the grid (1x2x2 patch), attn2 cross-attention to 12 text tokens."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers,
        rope_max_seq_len=32,
    ).eval()
    inputs = dict(hidden_states=_randn(1, 4, frames, height, width, seed=seed + 1),
                  timestep=torch.tensor([900]),
                  encoder_hidden_states=_randn(1, 12, 32, seed=seed + 2))
    grid = (frames, height // 2, width // 2)
    return model, inputs, grid, {"text": "none", "text_rows": 0}


def hunyuan(seed=0):
    """HunyuanVideo: the grid (patch_t 1, patch 2) with 10 text tokens at the rear, the last 3
    masked out; a text-only refiner through F.scaled_dot_product_attention."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(8, 12, 12),
        guidance_embeds=True,
    ).eval()
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 7:] = 0
    inputs = dict(hidden_states=_randn(1, 4, 2, 8, 16, seed=1), timestep=torch.tensor([900]),
                  encoder_hidden_states=_randn(1, 10, 32, seed=2), encoder_attention_mask=mask,
                  pooled_projections=_randn(1, 16, seed=3), guidance=torch.tensor([3500.0]))
    return model, inputs, (2, 4, 8), {"text": "rear", "text_rows": 10}


def cogvideox(seed=0):
    """CogVideoX: 8 text tokens in front of the grid ([B, F, C, H, W] input, patch 2)."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
        time_embed_dim=32, text_embed_dim=32, num_layers=1, sample_width=16, sample_height=8,
        sample_frames=5, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8,
    ).eval()
    inputs = dict(hidden_states=_randn(1, 2, 4, 8, 16, seed=1),
                  encoder_hidden_states=_randn(1, 8, 32, seed=2), timestep=torch.tensor([900]))
    return model, inputs, (2, 4, 8), {"text": "front", "text_rows": 8}


def ltx(seed=0):
    """LTX-Video: a packed [B, S, C] input whose grid comes from num_frames / height / width."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=32, cross_attention_dim=64, num_layers=1, caption_channels=32,
    ).eval()
    f, h, w = 2, 4, 8
    inputs = dict(hidden_states=_randn(1, f * h * w, 8, seed=1),
                  encoder_hidden_states=_randn(1, 6, 32, seed=2), timestep=torch.tensor([900]),
                  encoder_attention_mask=torch.ones(1, 6, dtype=torch.long),
                  num_frames=f, height=h, width=w)
    return model, inputs, (f, h, w), {"text": "none", "text_rows": 0}


MODELS = {"wan": wan, "hunyuan": hunyuan, "cogvideox": cogvideox, "ltx": ltx}

#: The true token order of the attention over the grid, per model: the layout each call gets.
def expected_layout(name, grid):
    tokens = grid[0] * grid[1] * grid[2]
    if name == "hunyuan":
        return {"used_len": tokens + 10,
                "video_spans": [{"start": 0, "latent_grid": grid, "role": "target"}]}
    if name == "cogvideox":
        return {"prefix_len": 8, "latent_grid": grid}
    return {"prefix_len": 0, "latent_grid": grid}


GRID_CALLS = {"wan": 2, "hunyuan": 2, "cogvideox": 1, "ltx": 1}


def _forward(model, inputs, **override):
    with torch.no_grad():
        out = model(**dict(inputs, **override), return_dict=False)[0]
    return out


class Recorder:
    """Records each grid call's inputs and output (wrapping VideoSparsity.serve)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = dv.VideoSparsity.serve
        recorder = self

        def serve(self, q, k, v, mask, **kw):
            out = original(self, q, k, v, mask, **kw)
            recorder.calls.append(dict(q=q.clone(), k=k.clone(), v=v.clone(),
                                       mask=None if mask is None else mask.clone(),
                                       bhsd=kw["bhsd"], out=out.clone(), scale=kw["scale"]))
            return out

        monkeypatch.setattr(dv.VideoSparsity, "serve", serve)


# --- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_grid_call_gets_the_layout_of_the_models_token_order(name):
    model, inputs, grid, _ = MODELS[name]()
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"selection": "sliding_tile", "tile": "1,2,2"}) as handle:
        _forward(model, inputs)
        stats = handle.stats()
        assert handle.backend_name == "VIDEO_SPARSE"
    assert len(stats) == 1 and stats[0]["step"] == 0
    calls = stats[0]["calls"]
    assert len(calls) == GRID_CALLS[name]
    for i, call in enumerate(calls):
        assert call["layer"] == i and call["branch"] == 0
        assert call["layout"] == expected_layout(name, grid)
        assert call["mode"] == "sparse" and 0.0 < call["block_sparsity"] < 1.0
        assert call["selection_seconds"] > 0 and not call["reused"]
    # Every other call (cross-attention, the text refiner) ran on FLASH, served by dattn.
    assert handle.calls >= GRID_CALLS[name] and not handle.fallbacks


def _coords(name, grid, rows):
    """(t, h, w) of every row in the model's true order; None for text rows."""
    cells = list(itertools.product(range(grid[0]), range(grid[1]), range(grid[2])))
    text = [None] * (rows - len(cells))
    return text + cells if name == "cogvideox" else cells + text


def _sliding_tile_mask(coords, grid, tile, window):
    """The block mask of the sliding tile window from each row's (t, h, w): a video query sees
    the video keys whose tile lies in its window per axis; text rows see and are seen by all."""
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    n = len(coords)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, ci in enumerate(coords):
        for j, cj in enumerate(coords):
            if ci is None or cj is None:
                mask[i, j] = True
                continue
            ok = True
            for a in range(3):
                w = min(window[a], tiles[a])
                qa, ka = ci[a] // tile[a], cj[a] // tile[a]
                start = min(max(qa - w // 2, 0), tiles[a] - w)
                ok = ok and start <= ka < start + w
            mask[i, j] = ok
    return mask


def _reference(call, block_mask):
    q, k, v = call["q"], call["k"], call["v"]
    if not call["bhsd"]:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = block_mask[None, None]
    if call["mask"] is not None:
        m = call["mask"]
        m = m.reshape(m.shape[0], 1, 1, m.shape[-1]) if m.dim() == 2 else m
        mask = mask & (m if m.dtype == torch.bool else m == 0)
    scale = call["scale"]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, scale=scale)
    if call["mask"] is not None:
        # A key mask in self-attention pads its rows too (SPEC section 3): padded text rows
        # output zeros (their keys are hidden from every row, so nothing reads them).
        keep = call["mask"].reshape(call["mask"].shape[0], -1)
        keep = keep if keep.dtype == torch.bool else keep == 0
        out = out * keep[:, None, :, None]
    return out if call["bhsd"] else out.transpose(1, 2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sliding_tile_under_the_handle_equals_reference_under_the_true_block_mask(
        name, monkeypatch):
    model, inputs, grid, geo = MODELS[name]()
    tile, window = (1, 2, 2), (1, 1, 3)
    recorder = Recorder(monkeypatch)
    with dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs={
            "selection": "sliding_tile", "tile": "1,2,2", "window": "1,1,3"}):
        _forward(model, inputs)
    assert len(recorder.calls) == GRID_CALLS[name]
    rows = grid[0] * grid[1] * grid[2] + geo["text_rows"]
    true_mask = _sliding_tile_mask(_coords(name, grid, rows), grid, tile, window)
    transposed = (grid[0], grid[2], grid[1])  # the grid read with h and w swapped
    wrong_mask = _sliding_tile_mask(_coords(name, transposed, rows), transposed, tile, window)
    assert not torch.equal(true_mask, wrong_mask)
    for call in recorder.calls:
        got = call["out"].double()
        want = _reference(call, true_mask)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        wrong = _reference(call, wrong_mask)
        assert (got - wrong).abs().max() > 1e-3


# --- the step and layer policy -----------------------------------------------------------------


def test_dense_steps_and_layers_are_bit_identical_to_flash():
    model, inputs, _, _ = wan()
    later = dict(hidden_states=_randn(*inputs["hidden_states"].shape, seed=7),
                 timestep=torch.tensor([800]))
    with dd.enable(model):
        flash0 = _forward(model, inputs)
        flash1 = _forward(model, inputs, **later)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"dense_steps": 1, "sparsity": 0.75, "tile": "1,2,2"}) as h:
        assert torch.equal(_forward(model, inputs), flash0)        # step 0: dense
        sparse1 = _forward(model, inputs, **later)                 # step 1: sparse
        modes = [[c["mode"] for c in s["calls"]] for s in h.stats()]
    assert modes == [["dense", "dense"], ["sparse", "sparse"]]
    assert not torch.equal(sparse1, flash1)
    # dense_layers beyond the model's grid calls: accepted, every call dense.
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"dense_layers": 99, "sparsity": 0.75, "tile": "1,2,2"}):
        assert torch.equal(_forward(model, inputs), flash0)
        assert torch.equal(_forward(model, inputs, **later), flash1)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"dense_layers": 1, "sparsity": 0.75, "tile": "1,2,2"}) as h:
        _forward(model, inputs)
        assert [c["mode"] for c in h.stats()[0]["calls"]] == ["dense", "sparse"]


def _sparse_layer(q, k, v, kwargs, scale):
    return dattn.Attention(q.shape[2], q.shape[3], num_kv_heads=k.shape[2], softmax_scale=scale,
                           backend="VIDEO_SPARSE", backend_kwargs=kwargs)


def test_a_reuse_step_runs_the_selection_of_its_refresh_step(monkeypatch):
    model, inputs, grid, _ = wan()
    kwargs = {"sparsity": 0.75, "tile": "1,2,2"}
    recorder = Recorder(monkeypatch)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs=dict(kwargs, refresh_steps=2)) as h:
        _forward(model, inputs)                                    # step 0: selects
        kept = h.selection(0)
        assert kept is not None and kept.dtype == torch.bool
        assert h.selection_memory() > 0
        recorder.calls.clear()
        changed = _randn(*inputs["hidden_states"].shape, seed=11)
        _forward(model, inputs, hidden_states=changed, timestep=torch.tensor([800]))  # reuses
        step1 = h.stats()[1]
        _forward(model, inputs, hidden_states=changed, timestep=torch.tensor([700]))  # selects
        step2 = h.stats()[2]
    assert [c["reused"] for c in step1["calls"]] == [True, True]
    assert [c["selection_seconds"] for c in step1["calls"]] == [0.0, 0.0]
    assert [c["selection_step"] for c in step1["calls"]] == [0, 0]
    assert [c["reused"] for c in step2["calls"]] == [False, False]
    call = recorder.calls[0]
    meta = dattn.AttentionMetadata(video_layout=dattn.VideoTokenLayout(prefix_len=0,
                                                                       latent_grid=grid))
    layer = _sparse_layer(call["q"], call["k"], call["v"], kwargs, call["scale"])
    explicit = dattn.AttentionMetadata(video_layout=meta.video_layout,
                                       extra={"selection": "explicit", "block_map": kept})
    with torch.no_grad():
        want = layer.forward(call["q"], call["k"], call["v"], explicit)
        recomputed = layer.forward(call["q"], call["k"], call["v"], meta)
    assert torch.equal(call["out"], want)
    assert not torch.equal(call["out"], recomputed)


def test_cfg_branches_are_one_step_with_a_selection_each():
    model, inputs, _, _ = wan()
    uncond = _randn(1, 12, 32, seed=21)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"sparsity": 0.75, "tile": "1,2,2", "refresh_steps": 2}) as h:
        for t in (900, 800):
            _forward(model, inputs, timestep=torch.tensor([t]))
            _forward(model, inputs, timestep=torch.tensor([t]), encoder_hidden_states=uncond)
        stats = h.stats()
        maps = {(layer, branch): h.selection(layer, branch)
                for layer in (0, 1) for branch in (0, 1)}
    assert [s["step"] for s in stats] == [0, 1]
    for s, reused in zip(stats, (False, True)):
        assert [(c["layer"], c["branch"]) for c in s["calls"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert all(c["reused"] == reused for c in s["calls"])
    assert all(m is not None for m in maps.values())
    # Layer 1 sees the text through block 0's cross-attention: its branches select apart.
    assert not torch.equal(maps[(1, 0)], maps[(1, 1)])


def test_a_rising_timestep_or_reset_starts_a_new_generation():
    model, inputs, _, _ = wan(layers=1)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"sparsity": 0.75, "tile": "1,2,2", "dense_steps": 1}) as h:
        for t in (900, 800, 900, 800):
            _forward(model, inputs, timestep=torch.tensor([t]))
        h.reset()
        _forward(model, inputs, timestep=torch.tensor([100]))
        # A per-token [B, S] timestep counts as a whole.
        per_token = torch.full((1, 64), 50.0)
        _forward(model, inputs, timestep=per_token)
        stats = h.stats()
    assert [(s["generation"], s["step"]) for s in stats] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                             (2, 0), (2, 1)]
    assert [s["calls"][0]["mode"] for s in stats] == ["dense", "sparse"] * 3


def test_a_grid_that_changes_is_selected_anew():
    model, inputs, _, _ = wan(layers=1)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"sparsity": 0.75, "tile": "1,2,2", "refresh_steps": 4}) as h:
        _forward(model, inputs)
        bigger = _randn(1, 4, 2, 8, 24, seed=3)
        _forward(model, inputs, hidden_states=bigger, timestep=torch.tensor([800]))
        stats = h.stats()
    assert stats[1]["calls"][0]["layout"]["latent_grid"] == (2, 4, 12)
    assert not stats[1]["calls"][0]["reused"]


def test_int8_runs_the_selected_blocks_on_sages_engines():
    model, inputs, _, _ = wan(layers=1)
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"sparsity": 0.5, "tile": "1,2,2", "qk_dtype": "int8"}) as h:
        out8 = _forward(model, inputs)
        engines = {layer.last_engine for layer in h.video._layers.values()}
    with dd.enable(model, backend="VIDEO_SPARSE",
                   backend_kwargs={"sparsity": 0.5, "tile": "1,2,2"}):
        out32 = _forward(model, inputs)
    int8_engines = {e["name"] for e in dattn.flash_engines() if e["compute_dtype"] == "int8"}
    assert engines and engines <= int8_engines, (engines, int8_engines)
    assert not torch.equal(out8, out32)
    torch.testing.assert_close(out8, out32, atol=0.05, rtol=0.05)


# --- bad input, and what a handle leaves behind --------------------------------------------------


@pytest.mark.parametrize("option, value, error", [
    ("dense_steps", -1, dattn.InvalidArgument),
    ("dense_steps", 1.5, dattn.InvalidArgumentType),
    ("dense_layers", "2", dattn.InvalidArgumentType),
    ("refresh_steps", 0, dattn.InvalidArgument),
    ("refresh_steps", True, dattn.InvalidArgumentType),
    ("max_selection_mb", -5, dattn.InvalidArgument),
    ("dense_stepz", 2, dattn.InvalidArgument),
    ("sparsity", 1.5, dattn.InvalidArgument),
])
def test_bad_options_are_typed_errors_naming_the_option(option, value, error):
    model, _, _, _ = wan(layers=1)
    with pytest.raises(error) as e:
        dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs={option: value})
    assert option in str(e.value)
    assert dd.handle_of(model) is None and not model._forward_pre_hooks


def test_a_model_without_known_geometry_is_refused_naming_model():
    import test_diffusers as td

    model, _ = td.flux()
    with pytest.raises(dattn.InvalidArgument) as e:
        dd.enable(model, backend="VIDEO_SPARSE")
    assert e.value.field == "model" and "FluxTransformer2DModel" in str(e.value)


def test_calls_video_sparse_cannot_serve_raise_instead_of_falling_back():
    model, inputs, _, _ = wan(layers=1)
    with dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs={"tile": "1,2,2"}) as h:
        with pytest.raises(dattn.Unsupported) as e:  # gradients
            model(**inputs)
        assert e.value.field == "requires_grad"
        # An attention module called on its own: no forward, no grid.
        h.reset()
        attn = model.blocks[0].attn1
        with torch.no_grad(), pytest.raises(dattn.Unsupported) as e:
            attn(_randn(1, 64, 64))
        assert e.value.field == "video_layout"
    with dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs={"tile": "1,2,2"}) as h:
        with torch.no_grad(), pytest.raises(dattn.InvalidArgument) as e:
            model(**dict(inputs, hidden_states=_randn(1, 4, 2, 8)))
        assert e.value.field == "hidden_states"


def _steps_of(stats):
    return [(s["step"], [(c["layer"], c["branch"], c["mode"], c["reused"]) for c in s["calls"]])
            for s in stats]


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_model_is_served_with_its_steps_counted(fullgraph):
    """torch.compile of an enabled video model, with and without fullgraph: the grid calls are
    dattn::video_grid_attention in the graph, whose run-time body counts steps, CFG branches
    and layers as the eager handle does (dense steps and layers, refresh and reuse), and the
    outputs are the eager handle's."""
    model, inputs, _, _ = wan()
    uncond = _randn(1, 12, 32, seed=21)
    kwargs = {"sparsity": 0.75, "tile": "1,2,2", "dense_steps": 1, "dense_layers": 1,
              "refresh_steps": 2}
    plan = [(900, None), (900, uncond), (800, None), (800, uncond), (700, None), (600, None)]

    def generate(m):
        outs = []
        for t, text in plan:
            extra = {} if text is None else {"encoder_hidden_states": text}
            outs.append(_forward(m, inputs, timestep=torch.tensor([t]), **extra))
        return outs

    with dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs=kwargs) as h:
        want, want_steps = generate(model), _steps_of(h.stats())
    torch._dynamo.reset()
    with dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs=kwargs) as h:
        compiled = torch.compile(model, fullgraph=fullgraph)
        got, got_steps = generate(compiled), _steps_of(h.stats())
    torch._dynamo.reset()
    assert got_steps == want_steps
    assert [m for _, calls in got_steps for _, _, m, _ in calls].count("sparse") == 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_disable_restores_the_model_exactly():
    model, inputs, _, _ = wan()
    before = _forward(model, inputs)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    handle = dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs={"sparsity": 0.75})
    assert len(model._forward_pre_hooks) == 1
    _forward(model, inputs)
    handle.disable()
    assert not model._forward_pre_hooks
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards
    assert torch.equal(_forward(model, inputs), before)
    import copy

    with dd.enable(model, backend="VIDEO_SPARSE", backend_kwargs={"sparsity": 0.75}):
        twin = copy.deepcopy(model)  # a copy is a plain model
    assert torch.equal(_forward(twin, inputs), before)


# --- the same policy in vllm-omni's layer: the step from the forward context --------------------


def test_vllm_omni_layer_takes_the_step_from_the_forward_context(monkeypatch):
    import types

    import dattn.vllm_omni as vo

    context = types.SimpleNamespace(denoise_step_idx=None)
    stub = types.SimpleNamespace(is_forward_context_available=lambda: True,
                                 get_forward_context=lambda: context)
    monkeypatch.setitem(sys.modules, "vllm_omni.diffusion.forward_context", stub)
    grid = (2, 4, 8)
    options = {"backend": "VIDEO_SPARSE", "dense_steps": 1, "refresh_steps": 2,
               "sparsity": 0.75, "tile": "1,2,2"}
    impl = vo.DattnAttentionImpl(2, 32, None, prefix="transformer_blocks.3.attn1",
                                 backend_kwargs=options)
    meta = dattn.AttentionMetadata(video_layout=dattn.VideoTokenLayout(prefix_len=0,
                                                                       latent_grid=grid))
    flash = dattn.Attention(2, 32, backend="FLASH")
    inputs = [[_randn(1, 64, 2, 32, seed=10 * s + i) for i in range(3)] for s in range(3)]
    outs = []
    for step, (q, k, v) in enumerate(inputs):
        context.denoise_step_idx = step
        outs.append(impl.forward(q, k, v, meta))
    assert torch.equal(outs[0], flash.forward(*inputs[0], meta))  # a dense step
    kept = impl._steps.cache.get(3, 0)
    assert kept is not None and kept.step == 1
    sparse = dattn.Attention(2, 32, backend="VIDEO_SPARSE",
                             backend_kwargs={"sparsity": 0.75, "tile": "1,2,2"})
    explicit = dattn.AttentionMetadata(video_layout=meta.video_layout,
                                       extra={"selection": "explicit",
                                              "block_map": kept.block_map()})
    assert torch.equal(outs[1], sparse.forward(*inputs[1], meta))     # step 1 selects
    assert torch.equal(outs[2], sparse.forward(*inputs[2], explicit))  # step 2 reuses it
    assert not torch.equal(outs[2], sparse.forward(*inputs[2], meta))
    # A layer among the first dense_layers runs dense at every step.
    dense = vo.DattnAttentionImpl(2, 32, None, prefix="transformer_blocks.0.attn1",
                                  backend_kwargs=dict(options, dense_layers=1))
    assert torch.equal(dense.forward(*inputs[2], meta), flash.forward(*inputs[2], meta))
    with pytest.raises(dattn.InvalidArgument) as e:
        vo.DattnAttentionImpl(2, 32, None, backend_kwargs=dict(options, refresh_steps=0))
    assert e.value.field == "refresh_steps"


# --- garbage where a mask hides: no other row moves ------------------------------------------


@pytest.mark.parametrize("options", [
    {"selection": "sliding_tile", "tile": "1,2,2", "window": "1,1,3"},
    {"sparsity": 0.5, "tile": "1,2,2"},
    {"sparsity": 0.5, "tile": "1,2,2", "qk_dtype": "int8"},
], ids=["sliding", "topk", "topk-int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("text", ["rear", "front"])
def test_garbage_in_hidden_keys_and_padded_rows_moves_no_other_row(options, dtype, text):
    """The layouts the handle gives (text at the rear in the span form, in front as prefix_len)
    with a key mask: 0, 1e4, NaN and inf in the hidden rows' Q, K and V leave every kept row the
    same bits, and the padded rows output zeros."""
    grid, j = (2, 4, 8), 16
    s = 64 + j
    if text == "rear":
        layout = dattn.VideoTokenLayout(used_len=s,
                                        video_spans=(dattn.VideoTokenSpan(0, grid, "target"),))
        hidden = list(range(s - 5, s))           # padded text, as HunyuanVideo's
    else:
        layout = dattn.VideoTokenLayout(prefix_len=j, latent_grid=grid)
        hidden = [3, 7, 11, j + 5, j + 40]       # text and video keys inside tiles
    keep = torch.ones(1, s, dtype=torch.bool)
    keep[0, hidden] = False
    layer = dattn.Attention(2, 32, backend="VIDEO_SPARSE", backend_kwargs=options)
    base = [_randn(1, s, 2, 32, seed=i).to(dtype) for i in range(3)]
    outs = []
    for garbage in (0.0, 1e4, float("nan"), float("inf")):
        q, k, v = (t.clone() for t in base)
        for t in (q, k, v):
            t[:, hidden] = garbage
        outs.append(layer.forward(q, k, v, dattn.AttentionMetadata(attn_mask=keep,
                                                                   video_layout=layout)))
    for out in outs[1:]:
        assert torch.equal(out[:, keep[0]], outs[0][:, keep[0]])
        assert torch.equal(out[:, ~keep[0]], torch.zeros_like(out[:, ~keep[0]]))


def test_hunyuans_padded_text_moves_no_video_row_under_the_handle():
    """Huge values in HunyuanVideo's padded text (masked from every call) leave the video output
    the same bits. (NaN is not tried: diffusers' own token refiner pools the text as
    (x * mask).sum(), which a NaN poisons before any attention runs.)"""
    model, inputs, _, _ = hunyuan()
    outs = []
    for garbage in (0.0, 1e4, -1e4):
        text = inputs["encoder_hidden_states"].clone()
        text[:, 7:] = garbage  # the 3 tokens encoder_attention_mask hides
        with dd.enable(model, backend="VIDEO_SPARSE",
                       backend_kwargs={"sparsity": 0.5, "tile": "1,2,2"}):
            outs.append(_forward(model, inputs, encoder_hidden_states=text))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
