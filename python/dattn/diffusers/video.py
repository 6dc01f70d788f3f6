"""VIDEO_SPARSE inside diffusers' video transformers: the per-model geometry and the step- and
layer-aware block selection of one :class:`dattn.diffusers.DiffusersHandle`.

diffusers' attention functions receive Q, K and V only; where a video's tokens lie is known to
the model's ``forward``. So, for ``dattn.diffusers.enable(model, backend="VIDEO_SPARSE")``:

- a forward pre-hook on the model reads each forward's latent grid from its arguments
  (:data:`GEOMETRY`: the input's shape and the patch sizes, or LTX's ``num_frames`` /
  ``height`` / ``width`` / ``video_coords``) and its ``timestep`` (the denoising step);
- the attention calls made inside the model's self-attention modules over the grid (Wan's and
  LTX's ``attn1``, HunyuanVideo's dual and single blocks' ``attn``, CogVideoX's ``attn1``) are
  *grid calls*: they get the :class:`dattn.VideoTokenLayout` of the model's token order (text
  in front or at the rear where the model joins it) and run on VIDEO_SPARSE, or densely on
  FLASH where the step policy says so; every other call (cross-attention, text refiners) runs on
  FLASH as under ``backend="FLASH"``;
- the policy (docs/semantics.md, "VIDEO_SPARSE in diffusers' video models"): ``dense_steps``
  (the first N denoising steps dense), ``dense_layers`` (the first M grid calls of every forward
  dense), ``refresh_steps`` (a sparse step recomputes its block selection every K steps and
  reuses it in between, per (layer, classifier-free-guidance branch)), ``max_selection_mb``
  (the bound of the kept selections).

A step is a change of the whole ``timestep`` argument; forwards with the same timestep are the
same step's CFG branches in call order (branch 0, 1, ...); a timestep that rises, or
``handle.reset()``, starts a new generation.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import InvalidArgument, Unsupported, _with_field
from ..metadata import AttentionMetadata, VideoTokenLayout, VideoTokenSpan
from ..sparse_steps import POLICY_DEFAULTS, SelectionCache, is_dense, split_options  # noqa: F401

_SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- geometry ----------------------------------------------------------------------------------


def _patches(model) -> Tuple[int, int, int]:
    """(p_t, p_h, p_w) of the model's config: a 3-tuple ``patch_size`` (Wan) or an int
    ``patch_size`` with ``patch_size_t`` (None: 1)."""
    cfg = model.config
    p = cfg.patch_size
    if isinstance(p, (tuple, list)):
        return int(p[0]), int(p[1]), int(p[2])
    pt = getattr(cfg, "patch_size_t", None)
    return int(pt or 1), int(p), int(p)


def _five_dims(a, order: str) -> Tuple[int, int, int]:
    """(frames, height, width) of ``hidden_states`` laid out as ``order`` ("BCFHW" or "BFCHW")."""
    x = a.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise _with_field(
            InvalidArgument,
            f"hidden_states: the video grid is read from a 5-D [{', '.join(order)}] input; got "
            f"{shape}", "hidden_states")
    dims = dict(zip(order, x.shape))
    return int(dims["F"]), int(dims["H"]), int(dims["W"])


def _grid_of_5d(order: str):
    def grid(model, a) -> Tuple[int, int, int]:
        f, h, w = _five_dims(a, order)
        pt, ph, pw = _patches(model)
        return f // pt, h // ph, w // pw

    return grid


def _grid_ltx(model, a) -> Tuple[int, int, int]:
    """LTX packs its latents before the transformer: the grid is the forward's ``num_frames`` /
    ``height`` / ``width`` (latent, after the pipeline's patching), else ``video_coords``."""
    nf, h, w = a.get("num_frames"), a.get("height"), a.get("width")
    if nf is not None and h is not None and w is not None:
        return int(nf), int(h), int(w)
    coords = a.get("video_coords")
    if isinstance(coords, torch.Tensor) and coords.dim() == 3 and coords.shape[1] == 3:
        c = coords[0].detach().to("cpu", torch.float64)  # [3, S]: (frame, h, w) per token
        inverse, extents = [], []
        for axis in range(3):
            values, inv = torch.unique(c[axis], return_inverse=True)
            inverse.append(inv)
            extents.append(int(values.numel()))
        t_, h_, w_ = extents
        index = (inverse[0] * h_ + inverse[1]) * w_ + inverse[2]
        if t_ * h_ * w_ == c.shape[1] and torch.equal(index, torch.arange(c.shape[1])):
            return t_, h_, w_
        raise _with_field(
            Unsupported,
            "video_coords: the tokens are not one (frame, height, width) grid in row-major "
            "order, which VIDEO_SPARSE's layout needs", "video_coords")
    raise _with_field(
        InvalidArgument,
        "num_frames: LTXVideoTransformer3DModel's forward needs num_frames, height and width "
        "(or video_coords) for VIDEO_SPARSE to know its grid", "num_frames")


@dataclass(frozen=True)
class ModelGeometry:
    """Where one diffusers video transformer's tokens lie. ``text``: where the attention over
    the grid carries other rows ("none", "front": before the grid, "rear": after it);
    ``grid_module(name)``: whether the attention module of that name attends over the grid;
    ``grid_of(model, arguments)``: the latent grid (t, h, w) of a forward."""

    text: str
    grid_module: Callable[[str], bool]
    grid_of: Callable[[Any, Dict[str, Any]], Tuple[int, int, int]]
    order: str  # in words, for docs and errors


def _suffix(*suffixes: str, prefixes: Tuple[str, ...] = ()):
    def match(name: str) -> bool:
        return name.endswith(suffixes) and (not prefixes or name.startswith(prefixes))

    return match


#: The video transformers of diffusers 0.42.1 the handle knows (by class name).
GEOMETRY: Dict[str, ModelGeometry] = {
    "WanTransformer3DModel": ModelGeometry(
        "none", _suffix(".attn1"), _grid_of_5d("BCFHW"),
        "grid (t, h, w) row-major from [B, C, F, H, W] with patch (1, 2, 2); attn1 only"),
    "HunyuanVideoTransformer3DModel": ModelGeometry(
        "rear", _suffix(".attn", prefixes=("transformer_blocks.", "single_transformer_blocks.")),
        _grid_of_5d("BCFHW"),
        "grid (t, h, w) row-major from [B, C, F, H, W] (patch_t, patch, patch), then the text"),
    "CogVideoXTransformer3DModel": ModelGeometry(
        "front", _suffix(".attn1"), _grid_of_5d("BFCHW"),
        "the text, then the grid (t, h, w) row-major from [B, F, C, H, W] (patch_t or 1, "
        "patch, patch)"),
    "LTXVideoTransformer3DModel": ModelGeometry(
        "none", _suffix(".attn1"), _grid_ltx,
        "grid (num_frames, height, width) row-major of the packed [B, S, C] input"),
}


def geometry_of(model) -> ModelGeometry:
    """The model's geometry, or :class:`dattn.InvalidArgument` naming ``model``."""
    geometry = GEOMETRY.get(type(model).__name__)
    if geometry is None:
        raise _with_field(
            InvalidArgument,
            f"model: VIDEO_SPARSE needs the video layout of the model's tokens, and "
            f"{type(model).__name__}'s is not known to dattn.diffusers; known: "
            f"{', '.join(sorted(GEOMETRY))} (other models: backend FLASH or SAGE, or "
            f"dattn.Attention with a VideoTokenLayout)", "model")
    return geometry


def layout_for(geometry: ModelGeometry, grid: Tuple[int, int, int], rows: int) -> VideoTokenLayout:
    """The layout of a grid call of ``rows`` rows in the model's token order."""
    tokens = grid[0] * grid[1] * grid[2]
    extra = rows - tokens
    if extra < 0 or (geometry.text == "none" and extra != 0):
        raise _with_field(
            InvalidArgument,
            f"video_layout: an attention call over the grid has {rows} rows, but this "
            f"forward's grid {tuple(grid)} has {tokens} tokens"
            + ("" if geometry.text == "none" else f" (and {geometry.text} text rows)"),
            "video_layout")
    if geometry.text == "front" or extra == 0:
        return VideoTokenLayout(prefix_len=extra, latent_grid=tuple(grid))
    # Text at the rear: the span form (in the one-tail form rows after the grid are padding).
    return VideoTokenLayout(used_len=rows,
                            video_spans=(VideoTokenSpan(0, tuple(grid), "target"),))


def _layout_dict(layout: VideoTokenLayout) -> dict:
    if layout.video_spans:
        return {"used_len": layout.used_len,
                "video_spans": [{"start": s.start, "latent_grid": tuple(s.latent_grid),
                                 "role": s.role} for s in layout.video_spans]}
    return {"prefix_len": layout.prefix_len, "latent_grid": tuple(layout.latent_grid)}


# --- the policy and its state ---------------------------------------------------------------------


class VideoSparsity:
    """The VIDEO_SPARSE side of one handle: the geometry, the policy, the step / branch / layer
    counters, the kept selections and the per-step report."""

    MAX_STEPS_REPORTED = 512

    def __init__(self, model, backend_kwargs: Optional[dict]):
        from .. import torch_adapter as ta
        from ..attention import Attention

        self.model_name = type(model).__name__
        self.geometry = geometry_of(model)
        self.policy, self.sparse_kwargs, self.flash_kwargs = split_options(backend_kwargs)
        # VIDEO_SPARSE's own options, checked now (a misspelled one is an error at enable).
        Attention(1, 64, backend="VIDEO_SPARSE", backend_kwargs=self.sparse_kwargs)
        self.flash = ta.Client("dattn.diffusers:FLASH", "FLASH", self.flash_kwargs)
        self._signature = inspect.signature(type(model).forward)
        self._layers: "OrderedDict[tuple, Any]" = OrderedDict()
        self._lock = threading.RLock()
        self._local = threading.local()
        # Under torch.compile: what the pre-hook saw while the forward was traced (its grid and
        # its timestep), and the grid calls traced since; the compiled graph's grid calls are
        # dattn::video_grid_attention, whose run-time body (serve_compiled_call) finds this
        # object by its key and counts the steps as an eager forward does.
        self._key = next(_KEYS)
        _VIDEOS[self._key] = self
        self._traced_grid: Optional[Tuple[int, int, int]] = None
        self._traced_timestep = None
        self._traced_calls = 0
        self.reset()

    # -- counters --

    def reset(self) -> None:
        """Forget the generation: the next forward is step 0 and every selection is recomputed."""
        with self._lock:
            self.generation = getattr(self, "generation", -1) + 1
            self.step = -1
            self.branch = 0
            self.layer = 0
            self.grid: Optional[Tuple[int, int, int]] = None
            self._timestep: Optional[torch.Tensor] = None
            self._cache = SelectionCache(self.policy)
            if not hasattr(self, "_steps"):
                self._steps: deque = deque(maxlen=self.MAX_STEPS_REPORTED)

    def before_forward(self, module, args, kwargs) -> None:
        """The model's forward pre-hook: this forward's grid and step (while torch.compile
        traces the forward: its grid and timestep for the traced grid calls, the step being
        counted when the compiled forward runs)."""
        try:
            a = self._signature.bind(module, *args, **kwargs).arguments
        except TypeError:
            return  # the forward raises its own TypeError
        grid = self.geometry.grid_of(module, a)
        if min(grid) < 1:
            raise _with_field(InvalidArgument,
                              f"hidden_states: the latent grid {grid} of this forward is empty",
                              "hidden_states")
        if torch.compiler.is_compiling():
            timestep = a.get("timestep")
            if timestep is not None and not isinstance(timestep, torch.Tensor):
                timestep = torch.as_tensor(timestep)
            self._traced_grid = tuple(grid)
            self._traced_timestep = timestep
            self._traced_calls = 0
            return
        with self._lock:
            self._advance(a.get("timestep"))
            self.grid = tuple(int(x) for x in grid)
            self.layer = 0

    def _advance(self, timestep) -> None:
        t = None
        if timestep is not None:
            t = torch.as_tensor(timestep).detach().to("cpu", torch.float64).reshape(-1).clone()
        previous = self._timestep
        if t is not None and previous is not None and t.shape == previous.shape and \
                torch.equal(t, previous):
            self.branch += 1  # the same step: its next CFG branch
        elif t is not None and previous is not None and t.numel() and previous.numel() and \
                float(t.max()) > float(previous.max()):
            self.reset()  # a timestep that rises: a new generation
            self.step, self.branch = 0, 0
        else:
            self.step += 1
            self.branch = 0
        self._timestep = t
        if self.branch == 0:
            self._steps.append({"generation": self.generation, "step": self.step,
                                "timestep": None if t is None or not t.numel()
                                else float(t.max()), "calls": []})

    # -- the grid calls --

    def enter_module(self, grid: bool) -> None:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(grid)

    def leave_module(self) -> None:
        self._local.stack.pop()

    def in_grid_module(self) -> bool:
        stack = getattr(self._local, "stack", None)
        return bool(stack) and stack[-1]

    def _layer(self, heads: int, kv_heads: int, head_size: int, scale: Optional[float]):
        from ..attention import Attention

        key = (heads, kv_heads, head_size, scale)
        layer = self._layers.get(key)
        if layer is None:
            layer = Attention(heads, head_size, softmax_scale=scale, num_kv_heads=kv_heads,
                              prefix="dattn.diffusers:VIDEO_SPARSE", backend="VIDEO_SPARSE",
                              backend_kwargs=self.sparse_kwargs)
            self._layers[key] = layer
            while len(self._layers) > 16:
                self._layers.popitem(last=False)
        return layer

    def serve(self, q, k, v, mask, *, scale, is_causal, dropout_p, enable_gqa, bhsd: bool,
              dense: Callable[[], torch.Tensor]):
        """One grid call (BSHD tensors, or BHSD with ``bhsd``): dense on FLASH (``dense()``,
        the call as FLASH serves it) or sparse on VIDEO_SPARSE; raises what it cannot serve.
        While torch.compile traces it: the custom op dattn::video_grid_attention, which does
        the same when the compiled graph runs."""
        compiling = torch.compiler.is_compiling()
        _refuse_unservable(q, k, v, mask, is_causal, dropout_p, enable_gqa, bhsd, compiling)
        if compiling:
            if self._traced_grid is None:
                raise _outside_forward(self.model_name)
            first = self._traced_calls == 0
            self._traced_calls += 1
            return video_grid_attention(q, k, v, mask, self._traced_timestep, self._key, first,
                                        list(self._traced_grid), scale, bool(enable_gqa), bhsd)
        return self._serve(q, k, v, mask, scale, bhsd, dense)

    def serve_compiled_call(self, q, k, v, mask, timestep, first: bool, grid, scale,
                            enable_gqa: bool, bhsd: bool) -> torch.Tensor:
        """A grid call of a compiled forward, run (dattn::video_grid_attention's body): the
        forward's first one takes its step from ``timestep``, as the pre-hook does in eager
        mode; dense calls run on FLASH."""
        from .. import torch_adapter as ta

        if first:
            with self._lock:
                self._advance(timestep)
                self.grid = tuple(int(x) for x in grid)
                self.layer = 0
        layout = "BHSD" if bhsd else "BSHD"

        def dense():
            key_mask = _key_mask(mask, q.shape[0], q.shape[2] if bhsd else q.shape[1])
            m = None if key_mask is None else key_mask[:, None, None, :]
            out, _ = ta.attention(self.flash, q, k, v, m, ta.CAUSAL_NONE, scale, enable_gqa,
                                  layout, False)
            return out

        return self._serve(q, k, v, mask, scale, bhsd, dense).contiguous()

    def _serve(self, q, k, v, mask, scale, bhsd: bool, dense: Callable[[], torch.Tensor]):
        if bhsd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        b, rows, heads, head_size = q.shape
        kv_heads = k.shape[2]
        if k.shape[1] != rows:
            raise _with_field(
                Unsupported,
                f"key: an attention module over the grid made a call with {rows} query rows "
                f"and {k.shape[1]} keys; VIDEO_SPARSE's grid calls are self-attention", "key")
        key_mask = _key_mask(mask, b, rows)
        with self._lock:
            if self.grid is None:
                raise _outside_forward(self.model_name)
            layout = layout_for(self.geometry, self.grid, rows)
            layer_index, self.layer = self.layer, self.layer + 1
            step, branch = self.step, self.branch
            record = {"layer": layer_index, "branch": branch, "layout": _layout_dict(layout),
                      "rows": rows, "heads": heads}
            calls = self._steps[-1]["calls"] if self._steps else []
        start = time.perf_counter()
        if is_dense(self.policy, step, layer_index):
            out = dense()
            record.update(mode="dense", block_sparsity=0.0, selection_seconds=0.0,
                          reused=False, seconds=time.perf_counter() - start)
        else:
            from ..torch_layer import call_threads

            layer = self._layer(heads, kv_heads, head_size, scale)
            meta = AttentionMetadata(attn_mask=key_mask, video_layout=layout)
            out, report = self._cache.sparse_call(layer, q, k, v, meta, step=step,
                                                  layer_index=layer_index, branch=branch,
                                                  threads=call_threads())
            self.flash.served()  # the handle's counter: every call dattn computed
            out = out.transpose(1, 2) if bhsd else out
            record.update(report, seconds=time.perf_counter() - start)
        with self._lock:
            calls.append(record)
        return out

    # -- reports --

    def stats(self) -> List[dict]:
        with self._lock:
            return [dict(s, calls=[dict(c) for c in s["calls"]]) for s in self._steps]

    def selection_memory(self) -> int:
        return self._cache.memory()

    def selection(self, layer: int, branch: int = 0) -> Optional[torch.Tensor]:
        kept = self._cache.get(layer, branch)
        return None if kept is None else kept.block_map()


def _outside_forward(model_name: str):
    return _with_field(
        Unsupported,
        f"video_layout: an attention call over the grid came outside a forward of "
        f"{model_name}, so its grid is unknown; call the model, not its attention modules",
        "video_layout")


def _refuse_unservable(q, k, v, mask, is_causal, dropout_p, enable_gqa, bhsd,
                       compiling: bool) -> None:
    from .. import torch_adapter as ta

    def refuse(field: str, why: str):
        raise _with_field(Unsupported, f"{field}: {why}; VIDEO_SPARSE cannot serve this call "
                                       f"over the video grid (dattn.diffusers does not hand "
                                       f"grid calls to another backend)", field)

    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        refuse("query", "query, key and value must be tensors")
    if not compiling:  # traced: the graph holds dattn::video_grid_attention
        tensors = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
        route = ta.dispatch_route(tensors, trace_as_op=False)
        if route is not None:
            refuse(route, f"the tensors run under {route}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        refuse("requires_grad", "gradients are not computed by VIDEO_SPARSE")
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dtype not in _SERVED_DTYPES:
            refuse(name, f"dtype {t.dtype} (served: float32, bfloat16, float16)")
        if t.dim() != 4:
            refuse(name, f"a {t.dim()}-D tensor (4-D expected)")
    if is_causal:
        refuse("is_causal", "causal attention")
    if dropout_p:
        refuse("dropout_p", f"dropout {dropout_p}")
    hq, hkv = (q.shape[1], k.shape[1]) if bhsd else (q.shape[2], k.shape[2])
    if hq != hkv and not enable_gqa:
        refuse("enable_gqa", f"{hq} query heads and {hkv} key heads without enable_gqa")


def _key_mask(mask, b: int, rows: int) -> Optional[torch.Tensor]:
    """A key-only mask (``[B|1, 1, 1, S]`` or ``[B, S]``; bool, or float 0 / -inf) as VIDEO_SPARSE's
    2-D bool key mask ``[B, S]``; anything else is refused (naming ``attn_mask``)."""
    if mask is None:
        return None
    m = mask
    if m.dim() == 4 and m.shape[1] == 1 and m.shape[2] == 1:
        m = m[:, 0, 0, :]
    if m.dim() != 2 or m.shape[1] != rows or m.shape[0] not in (1, b):
        raise _with_field(
            Unsupported,
            f"attn_mask: VIDEO_SPARSE takes a key-only mask ([B, 1, 1, S] or [B, S]) over the "
            f"grid, got {tuple(mask.shape)}", "attn_mask")
    if m.dtype != torch.bool:
        finite_zero = m == 0
        if not bool(torch.all(finite_zero | (m == float("-inf")))):
            raise _with_field(
                Unsupported,
                "attn_mask: a float mask over the grid must hold only 0 (keep) and -inf (hide); "
                "VIDEO_SPARSE takes no additive bias", "attn_mask")
        m = finite_zero
    return m.expand(b, rows).contiguous()


# --- the grid call in compiled graphs ------------------------------------------------------------

_KEYS = itertools.count(1)
#: The live VideoSparsity objects by key: what a compiled graph's grid call names.
_VIDEOS: "weakref.WeakValueDictionary[int, VideoSparsity]" = weakref.WeakValueDictionary()


@torch.library.custom_op("dattn::video_grid_attention", mutates_args=(), device_types="cpu")
def video_grid_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: Optional[torch.Tensor], timestep: Optional[torch.Tensor],
                         handle: int, first: bool, grid: List[int], scale: Optional[float],
                         enable_gqa: bool, bhsd: bool) -> torch.Tensor:
    """A grid call of a forward compiled under a VIDEO_SPARSE handle (the key ``handle``): the
    handle's step and layer counting, block selection and dense policy at run time, out of the
    compiler's sight (VideoSparsity.serve_compiled_call). ``first``: the forward's first grid
    call, which starts its step; ``grid``: the forward's latent grid as traced."""
    video = _VIDEOS.get(handle)
    if video is None:
        raise _with_field(
            Unsupported,
            "torch.compile: this compiled graph was traced under a dattn.diffusers VIDEO_SPARSE "
            "handle that no longer exists; compile the model again (torch._dynamo.reset())",
            "torch.compile")
    return video.serve_compiled_call(query, key, value, attn_mask, timestep, first, grid, scale,
                                     enable_gqa, bhsd)


@video_grid_attention.register_fake
def _video_grid_attention_fake(query, key, value, attn_mask, timestep, handle, first, grid, scale,
                               enable_gqa, bhsd):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
