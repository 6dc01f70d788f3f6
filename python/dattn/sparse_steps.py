"""Step- and layer-aware VIDEO_SPARSE: the options (``dense_steps``, ``dense_layers``,
``refresh_steps``, ``max_selection_mb``), the kept block selections per (layer, classifier-free
guidance branch) and the sparse call that selects or reuses (docs/semantics.md, "VIDEO_SPARSE in
diffusers' video models"). Framework-neutral: dattn.diffusers' handle counts steps from the
model's timestep, dattn.vllm_omni's layer from the engine's forward context; both run their
grid calls through :class:`SelectionCache`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from .errors import InvalidArgument, InvalidArgumentType, _with_field

#: The step policy's options (the rest of ``backend_kwargs`` is VIDEO_SPARSE's), with defaults.
POLICY_DEFAULTS: Dict[str, int] = {
    "dense_steps": 0,
    "dense_layers": 0,
    "refresh_steps": 1,
    "max_selection_mb": 256,
}

#: Options of VIDEO_SPARSE that FLASH takes too: the dense calls (dense steps and layers, and the
#: calls that are not over the grid) run on FLASH with them.
FLASH_OPTIONS = ("isa", "compute_dtype")




def _count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _with_field(
            InvalidArgumentType,
            f"{name}: expected an integer >= {minimum}, got {type(value).__name__} {value!r:.40}",
            name)
    if value < minimum:
        raise _with_field(InvalidArgument,
                          f"{name}: expected an integer >= {minimum}, got {value}", name)
    return int(value)


def split_options(backend_kwargs: Optional[dict]) -> Tuple[Dict[str, int], dict, dict]:
    """(policy, VIDEO_SPARSE's options, FLASH's options for the dense calls)."""
    opts = dict(backend_kwargs or {})
    policy = {}
    for name, default in POLICY_DEFAULTS.items():
        minimum = 1 if name == "refresh_steps" else 0
        policy[name] = _count(opts.pop(name, default), name, minimum)
    flash = {k: opts[k] for k in FLASH_OPTIONS if k in opts}
    return policy, opts, flash




@dataclass
class Selection:
    signature: tuple
    step: Optional[int]
    shape: Tuple[int, ...]
    packed: np.ndarray  # np.packbits of the block map
    sparsity: float

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)

    def block_map(self):
        """The bool block map ``[B|1, H|1, query blocks, key blocks]`` (a torch tensor where
        torch is loaded, else a numpy array)."""
        import sys

        n = int(np.prod(self.shape))
        bits = np.unpackbits(self.packed, count=n).astype(bool).reshape(self.shape)
        torch = sys.modules.get("torch")
        return torch.from_numpy(bits) if torch is not None else bits


def _field(meta, name: str):
    return meta.get(name) if isinstance(meta, dict) else getattr(meta, name, None)


def is_dense(policy: Dict[str, int], step: Optional[int], layer: Optional[int]) -> bool:
    """Whether a grid call at (step, layer) runs dense (an unknown step or layer: sparse)."""
    return ((step is not None and step < policy["dense_steps"])
            or (layer is not None and layer < policy["dense_layers"]))


def mask_key(mask) -> Optional[str]:
    """A digest of a key mask (a torch tensor or numpy array), for a selection's signature."""
    if mask is None:
        return None
    data = mask.contiguous().numpy() if hasattr(mask, "contiguous") else np.ascontiguousarray(mask)
    return hashlib.sha1(data.tobytes()).hexdigest()


def layout_key(layout) -> tuple:
    return (layout.prefix_len, None if layout.latent_grid is None else tuple(layout.latent_grid),
            layout.used_len,
            tuple((s.start, tuple(s.latent_grid), s.role) for s in layout.video_spans))


class SelectionCache:
    """The kept block selections of one policy, by (layer, branch), bounded by
    ``max_selection_mb`` (the oldest dropped first), and the sparse call."""

    def __init__(self, policy: Dict[str, int]):
        self.policy = policy
        self._kept: "OrderedDict[tuple, Selection]" = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def memory(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._kept.values())

    def get(self, layer: int, branch: int) -> Optional["Selection"]:
        with self._lock:
            return self._kept.get((layer, branch))

    def _keep(self, key, selection: "Selection") -> None:
        if self.policy["refresh_steps"] == 1:
            return  # never reused: nothing kept
        limit = self.policy["max_selection_mb"] << 20
        with self._lock:
            self._kept.pop(key, None)
            if selection.nbytes > limit:
                return
            self._kept[key] = selection
            while sum(s.nbytes for s in self._kept.values()) > limit:
                self._kept.popitem(last=False)  # the oldest: recomputed when next needed

    def sparse_call(self, layer, q, k, v, meta, *, step: Optional[int], layer_index: int,
                    branch: int, threads: int) -> Tuple[object, dict]:
        """``layer`` (a VIDEO_SPARSE dattn.Attention) on the call, with the selection of this
        step: recomputed at a refresh step (or when nothing fitting is kept), else the kept
        one; run as an explicit ``block_map``. Returns (out, report)."""
        from .metadata import metadata_dict
        from .tensors import empty_like_input, tensor_arg

        signature = (tuple(q.shape), tuple(k.shape), tuple(v.shape),
                     layout_key(_field(meta, "video_layout")), mask_key(_field(meta, "attn_mask")))
        key = (layer_index, branch)
        kept = self.get(layer_index, branch)
        refresh = (step is None or (step - self.policy["dense_steps"])
                   % self.policy["refresh_steps"] == 0
                   or kept is None or kept.signature != signature)
        seconds = 0.0
        if refresh:
            t0 = time.perf_counter()
            out = empty_like_input((*q.shape[:3], v.shape[3]), q)
            s = layer._layer.video_sparse_selection(
                tensor_arg(q, "query"), tensor_arg(k, "key"), tensor_arg(v, "value"),
                metadata_dict(meta, tensor_arg), tensor_arg(out, "out"), threads)
            bits = np.frombuffer(s["block_map"], dtype=np.uint8)
            kept = Selection(signature, step, tuple(int(x) for x in s["shape"]),
                             np.packbits(bits), float(s["sparsity"]))
            seconds = time.perf_counter() - t0
            self._keep(key, kept)
        extra = dict(_field(meta, "extra") or {}, selection="explicit",
                     block_map=kept.block_map())
        if isinstance(meta, dict):
            call = dict(meta, extra=extra)
        else:
            import dataclasses

            call = dataclasses.replace(meta, extra=extra)
        out = layer.forward(q, k, v, call)
        return out, {"mode": "sparse", "block_sparsity": kept.sparsity,
                     "selection_seconds": seconds, "reused": not refresh,
                     "selection_step": kept.step}
