"""VIDEO_SPARSE in ComfyUI's video models (dattn.comfyui.video, backend "VIDEO_SPARSE"): the latent
grid and the step, which ComfyUI's models keep as locals of their forward, learnt by a model
wrapper, and the grid calls served on VIDEO_SPARSE with dattn's step and layer policy
(docs/semantics.md, "VIDEO_SPARSE in diffusers' video models": ``dense_steps``,
``dense_layers``, ``refresh_steps``, ``max_selection_mb``).

Covered: ComfyUI's Wan (``comfy.ldm.wan.model.WanModel`` and its subclasses: text-to-video and
image-to-video; a reference latent's tokens in front of the grid count as dense prefix rows):
a self-attention call whose query and key rows are the forward's grid (patch (1, 2, 2), the
input padded up to it as the model pads it) is a grid call; cross-attention runs dense on
FLASH. Not covered (the node refuses them): other models, HunyuanVideo included, whose joint
text comes with a finite additive padding mask VIDEO_SPARSE cannot take as a key mask.

The step is the index of the forward's sigma in the sampler's ``sample_sigmas`` (a sigma between
two scheduled ones, as second-order samplers evaluate, belongs to the step it starts after);
outside a sampler the step is unknown and never makes a call dense. ComfyUI batches the CFG
branches of a step into one forward, so a layer has one selection per step.
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Tuple

import torch

from ..errors import InvalidArgument, Unsupported, _with_field

#: The diffusion models the grid is known for (by class name, their subclasses too).
GRID_MODELS = ("WanModel",)

KEY = "dattn"


def grid_model(diffusion_model) -> bool:
    return any(cls.__name__ in GRID_MODELS for cls in type(diffusion_model).__mro__)


def grid_of(x: torch.Tensor, patch_size) -> Tuple[int, int, int]:
    """(t, h, w) of a ``[B, C, T, H, W]`` latent, each ceil-divided by its patch size."""
    p = tuple(patch_size) if isinstance(patch_size, (tuple, list)) else (1, patch_size, patch_size)
    if x.dim() != 5:
        raise _with_field(InvalidArgument,
                          f"x: VIDEO_SPARSE reads the grid of a 5-D [B, C, T, H, W] latent, got "
                          f"{tuple(x.shape)}", "x")
    return tuple(-(-int(s) // int(q)) for s, q in zip(x.shape[2:], p))


def step_of(sigma, sample_sigmas) -> Optional[int]:
    """The sampler's step of ``sigma``: how many of the (descending) ``sample_sigmas`` lie above
    it, or None outside a sampler."""
    if sample_sigmas is None or sigma is None:
        return None
    s = torch.as_tensor(sample_sigmas, dtype=torch.float64).flatten()
    t = float(torch.as_tensor(sigma, dtype=torch.float64).flatten()[0])
    return int((s > t * (1 + 1e-6) + 1e-12).sum())


def install_grid_wrapper(model_patcher) -> None:
    """The APPLY_MODEL wrapper that notes each forward's grid and step in its
    ``transformer_options`` (the dict every attention call of that forward receives)."""
    import comfy.patcher_extension as pe

    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if not grid_model(diffusion_model):
        raise _with_field(
            Unsupported,
            f"model: VIDEO_SPARSE needs the video grid of the model's tokens, and dattn knows it "
            f"for {', '.join(GRID_MODELS)}; {type(diffusion_model).__name__} is not one (use "
            f"FLASH or SAGE)", "model")
    patch = getattr(diffusion_model, "patch_size", (1, 2, 2))

    def apply_model(executor, x, t, c_concat, c_crossattn, control, transformer_options,
                    **kwargs):
        transformer_options = dict(transformer_options or {})
        transformer_options[KEY] = {
            "grid": grid_of(x, patch),
            "step": step_of(t, transformer_options.get("sample_sigmas")),
            "layer": 0,
        }
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    model_patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, apply_model)


class VideoPolicy:
    """The grid calls of one override: the step and layer policy and the kept selections."""

    def __init__(self, policy: dict, sparse_kwargs: dict):
        from ..attention import Attention
        from ..sparse_steps import SelectionCache

        self.policy = policy
        self.sparse_kwargs = sparse_kwargs
        Attention(1, 64, backend="VIDEO_SPARSE", backend_kwargs=sparse_kwargs)  # checked now
        self.cache = SelectionCache(policy)
        self._layers = {}
        self._lock = threading.Lock()
        #: Grid calls served sparse and dense (the step and layer policy's), for reports.
        self.sparse_calls = 0
        self.dense_calls = 0

    def _layer(self, heads, kv_heads, head_size, scale):
        from ..attention import Attention

        key = (heads, kv_heads, head_size, scale)
        with self._lock:
            layer = self._layers.get(key)
            if layer is None:
                layer = self._layers[key] = Attention(
                    heads, head_size, softmax_scale=scale, num_kv_heads=kv_heads,
                    prefix="dattn.comfyui:VIDEO_SPARSE", backend="VIDEO_SPARSE",
                    backend_kwargs=self.sparse_kwargs)
        return layer

    def serve(self, override, p, bound, layout):
        """One call of a model patched for VIDEO_SPARSE (``bound``: the call as SDPA's
        arguments, its scale and GQA included): a grid call sparse (or dense by the policy),
        any other call dense on FLASH."""
        from .. import torch_adapter as ta
        from ..metadata import AttentionMetadata, VideoTokenLayout
        from ..sparse_steps import is_dense
        from ..torch_layer import call_threads

        q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]

        def dense():
            return ta._compute(override.client, bound, layout, ta.CAUSAL_NONE, False)

        options = p["kwargs"].get("transformer_options") or {}
        state = options.get(KEY)
        if state is None:
            return dense()  # a call outside a forward of the patched model
        grid = state["grid"]
        tokens = math.prod(grid)
        qs, ks = (q, k) if layout == "BSHD" else (q.transpose(1, 2), k.transpose(1, 2))
        rows = qs.shape[1]
        if mask is not None or ks.shape[1] != rows or rows < tokens:
            return dense()  # cross-attention, or a masked call: not over the grid
        layer_index = state["layer"]
        state["layer"] = layer_index + 1
        step = state["step"]
        if is_dense(self.policy, step, layer_index):
            self.dense_calls += 1
            return dense()
        vs = v if layout == "BSHD" else v.transpose(1, 2)
        scale = bound["scale"]
        layer = self._layer(qs.shape[2], ks.shape[2], qs.shape[3],
                            None if scale is None else float(scale))
        meta = AttentionMetadata(video_layout=VideoTokenLayout(prefix_len=rows - tokens,
                                                               latent_grid=tuple(grid)))
        out, _ = self.cache.sparse_call(layer, qs, ks, vs, meta, step=step,
                                        layer_index=layer_index, branch=0,
                                        threads=call_threads())
        self.sparse_calls += 1
        override.client.served()
        return out if layout == "BSHD" else out.transpose(1, 2)
