"""dattn as an attention backend of the vllm-omni diffusion engine (the seed's interface),
``dattn.vllm_omni.backends``; the engine's class paths name the package,
``dattn.vllm_omni.DattnAttentionBackend``.

``DattnAttentionBackend`` and ``DattnAttentionImpl`` have the shape of the seed's
``AttentionBackend`` / ``AttentionImpl`` (``vllm_omni.diffusion.attention.backends.abstract``).
When that module is importable at the time this module is imported, the classes subclass the
engine's own bases and ``get_metadata_cls()`` is the engine's ``AttentionMetadata``; otherwise
they stand alone on local bases with the same methods and use ``dattn.AttentionMetadata``
(``ENGINE_AVAILABLE`` says which). Reload this module after making the engine importable.

The capability flags are read from dattn's FLASH backend (``dattn.get_backend("FLASH")``), the
backend a layer gets unless ``backend_kwargs["backend"]`` picks another; ``supported_platforms``
adds the engine's out-of-tree platform value ``"oot"`` to FLASH's ``"cpu"``. The paged flags are
False: dattn's paged KV (``forward_paged`` with a :class:`dattn.PagedCall`) is its own page pool,
not the engine's paged-KV context over vLLM's cache. The engine's metadata objects are read
field by field, ``extra`` included (``cu_seqlens_q/k``, ``max_seqlen_q/k``, ``valid_kv_length``,
``kv_cache_dtype``, ``laser_input_scale``; unknown keys are ignored).

Calls mean what they mean in the engine's own ``Attention`` layer
(``vllm_omni.diffusion.attention.layer``, which runs its sequence-parallel strategies around
the backend): head counts come from the tensors (per-rank shards under Ulysses), joint tokens
the layer has already joined are not attached again, 2-D masks of integer or 0/1 float dtypes
are keep-masks as the engine's SDPA reads them, and the layer's ``role`` decides whether a key
mask also zeroes padding query rows (``self``) or not (``cross``); see
:class:`DattnAttentionImpl`.

CPU tensors are computed by dattn whatever the engine's current platform is; other tensors go
to the base class's platform dispatch (``forward_cuda`` etc.), which this class does not
implement, so they are refused with :class:`dattn.Unsupported` naming the tensor's device.

The engine picks it through dattn's plugins (entry points ``vllm_omni.platform_plugins`` and
``vllm_omni.general_plugins``, :mod:`dattn.vllm_omni.plugin`): on a machine without an
accelerator, or with ``DATTN_VLLM_OMNI=1``, dattn's CPU platform
(:mod:`dattn.vllm_omni.platform`) resolves the diffusion attention to
``"dattn.vllm_omni.DattnAttentionBackend"`` (see docs/vllm-omni.md).
"""

from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Dict, Optional, Set, Tuple

from ..attention import Attention, PagedCall
from ..backends import adapter_backend, get_backend
from ..errors import InvalidArgument, Unsupported, UnsupportedTensor, _with_field
from ..metadata import AttentionMetadata as _DattnMetadata
from .patches import note_computed

try:
    from vllm_omni.diffusion.attention.backends import abstract as _engine
except ImportError:
    _engine = None

#: Whether the classes below subclass the engine's own bases.
ENGINE_AVAILABLE: bool = _engine is not None

#: The backend whose capabilities the backend class advertises.
_FLASH = get_backend("FLASH")


class _StandaloneAttentionBackend(ABC):
    """The seed's ``AttentionBackend`` (capability flags and probes with its defaults), for
    use without the engine."""

    accept_output_buffer: bool = False
    supports_piecewise_spans: bool = False
    supports_paged_kv: bool = False
    supports_prefix_kv_slicing: bool = False
    supported_platforms: Optional[tuple] = None

    @classmethod
    def supports_packed_mask_free(cls) -> bool:
        return False

    @classmethod
    def supports_multi_doc_packed_varlen(cls) -> bool:
        return False

    @classmethod
    def validate_available(cls) -> None:
        return None

    @classmethod
    def supports_attention_mask(cls, attention_spec: object = None) -> bool:
        del attention_spec
        return False

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_builder_cls():
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def get_supported_head_sizes() -> list:
        raise NotImplementedError

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        sizes = cls.get_supported_head_sizes()
        return (not sizes) or head_size in sizes

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False


class _StandaloneAttentionImpl(ABC):
    """The seed's ``AttentionImpl`` without the engine: the same methods; with no engine
    platform to dispatch to, ``forward`` raises ``NotImplementedError`` as the seed's does for
    a platform it does not know."""

    _supported_kv_cache_dtypes: Dict[str, Set[str]] = {}

    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: float,
        causal: bool = False,
        num_kv_heads: Optional[int] = None,
        prefix: str = "",
        qkv_layout: Optional[str] = None,
        backend_kwargs: Optional[dict] = None,
        **extra_impl_args,
    ) -> None:
        raise NotImplementedError

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Optional[str], platform_key: str) -> bool:
        if kv_cache_dtype is None:
            return True
        return kv_cache_dtype in cls._supported_kv_cache_dtypes.get(platform_key, set())

    def forward(self, query, key, value, attn_metadata=None):
        raise NotImplementedError(
            "no forward implementation: no engine platform (vllm_omni is not importable)"
        )

    def forward_paged(self, paged_kv_context: Any):
        del paged_kv_context
        raise NotImplementedError(f"{type(self).__name__} does not support paged KV attention")

    def forward_cuda(self, query, key, value, attn_metadata=None):
        raise NotImplementedError

    forward_npu = forward_xpu = forward_hip = forward_musa = forward_cuda


if _engine is not None:
    _BackendBase = _engine.AttentionBackend
    _ImplBase = _engine.AttentionImpl
    _MetadataCls = _engine.AttentionMetadata
else:
    _BackendBase = _StandaloneAttentionBackend
    _ImplBase = _StandaloneAttentionImpl
    _MetadataCls = _DattnMetadata


def _device_of(x) -> str:
    """'cpu' for host tensors and numpy arrays, else the torch device's name."""
    device = getattr(x, "device", None)
    if device is None:
        return "cpu"  # numpy arrays and other host objects
    return str(device) if getattr(device, "type", "cpu") != "cpu" else "cpu"


def dattn_role(role) -> str:
    """dattn's role ("self" or "cross") for the engine's role string: "self" for ``self``,
    ``joint`` and model-scoped ones ending in ``.self``; "cross" for everything else
    (``cross``, ``ltx2.audio_to_video``, ...), where a 2-D mask masks keys only, as in the
    engine's own backends."""
    if role is None:
        return "self"
    name = str(role).strip().lower()
    if name in ("self", "joint") or name.endswith((".self", ".joint")):
        return "self"
    return "cross"


#: (tensor rank, head dim) of Q/K/V per qkv_layout.
_HEAD_DIM = {"BSHD": (4, 2), "BHSD": (4, 1), "THD": (3, 1)}


def _batch_rows(layout, q_shape, k_shape):
    """(batch, query rows, key rows) of a call, or (None, None, None) for shapes the core will
    refuse anyway."""
    rank = _HEAD_DIM[layout][0]
    if len(q_shape) != rank or len(k_shape) != rank:
        return None, None, None
    if layout == "BSHD":
        return int(q_shape[0]), int(q_shape[1]), int(k_shape[1])
    if layout == "BHSD":
        return int(q_shape[0]), int(q_shape[2]), int(k_shape[2])
    return 1, int(q_shape[0]), int(k_shape[0])


#: The seed's metadata fields (what a metadata object that is not a dataclass is copied by).
_METADATA_FIELDS = tuple(f.name for f in dataclasses.fields(_DattnMetadata))


def _get(md, name):
    if isinstance(md, Mapping):
        return md.get(name)
    return getattr(md, name, None)


def _replace(md, changes):
    """``md`` with ``changes``: the same class for dataclasses, else a dict of its fields."""
    if dataclasses.is_dataclass(md) and not isinstance(md, type):
        return dataclasses.replace(md, **changes)
    if isinstance(md, Mapping):
        d = dict(md)
    else:
        d = {n: getattr(md, n) for n in _METADATA_FIELDS if hasattr(md, n)}
    d.update(changes)
    return d



def _keep_mask(mask, field):
    """A 2-D mask as a bool keep-mask, as the engine's SDPA makes it (``mask.to(bool)``):
    integers nonzero = attend; floats must be 0/1 (an additive mask would be inverted)."""
    torch = sys.modules["torch"]
    if mask.dtype == torch.bool or mask.dtype.is_complex:
        return mask  # complex: the core names the dtype
    if mask.dtype.is_floating_point:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise _with_field(
                InvalidArgument,
                f"{field}: a 2-D float mask must hold 0/1 keep flags (1 = attend), as the "
                f"engine's SDPA reads it; this one has other values (an additive mask, "
                f"which read as a keep-mask would be inverted): pass a bool [B, Skv] mask, or "
                f"the additive mask as 4-D [B, 1, 1, Skv]",
                field,
            )
    return mask != 0


def _engine_sp_active() -> bool:
    """Whether the call runs in the engine's sequence-parallel region: its forward context set,
    SP active there, and a Ulysses, Ring or AllGather-KV degree above 1 (the engine's layer
    then runs its parallel strategy, which joins the joint tokens into Q/K/V)."""
    fc = sys.modules.get("vllm_omni.diffusion.forward_context")
    if fc is None:
        return False  # the engine's forward context was never imported: no context is set
    try:
        if not fc.is_forward_context_available():
            return False
        ctx = fc.get_forward_context()
        config = getattr(ctx, "omni_diffusion_config", None)
        if config is None:
            return False
        p = config.parallel_config
        degree = max(int(getattr(p, name, 1) or 1)
                     for name in ("ulysses_degree", "ring_degree", "allgather_degree"))
        return degree > 1 and bool(ctx.sp_active)
    except Exception:  # a context of another shape: not the engine's SP region
        return False


def _ulysses_joined(query, key, md) -> bool:
    """What the engine's Ulysses strategy leaves: ``joint_key`` sliced to the key's heads while
    ``joint_query`` keeps every head, and the query's leading (front) or trailing (rear) rows
    exactly one contiguous head block of ``joint_query``."""
    torch = sys.modules.get("torch")
    jq, jk = _get(md, "joint_query"), _get(md, "joint_key")
    tensors = (query, key, jq, jk)
    if torch is None or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    hq, jhq, rows = query.shape[2], jq.shape[2], jq.shape[1]
    if hq == 0 or jhq == hq or jhq % hq or jk.shape[2] != key.shape[2] or query.shape[1] < rows:
        return False
    if rows == 0 or jq.shape[0] != query.shape[0] or jq.shape[3] != query.shape[3]:
        return False
    strategy = _get(md, "joint_strategy") or "front"
    head = query[:, :rows] if strategy == "front" else query[:, query.shape[1] - rows:]
    return any(torch.equal(head, jq[:, :, r * hq:(r + 1) * hq]) for r in range(jhq // hq))


def _declared_options(backend: Optional[str]):
    """The option names of the dattn backend a layer named ``backend`` gets (None: the automatic
    choice, resolved as the layer resolves it), or None where that backend declares none."""
    return get_backend(Attention(1, 64, backend=backend).backend_name).options


def _layer_index(prefix: str) -> Optional[int]:
    """The layer index in a module prefix such as "transformer_blocks.3.attn1" (the one integer
    among its dotted parts, as the engine's ``extract_layer_index`` reads it), or None."""
    ints = [int(p) for p in (prefix or "").split(".") if p.isdigit()]
    return ints[0] if len(ints) == 1 else None


def _denoise_steps() -> Tuple[Optional[int], Optional[int]]:
    """The engine's current denoising step and its step count (its forward context's
    ``denoise_step_idx`` and ``total_denoise_steps``), each None where unknown."""
    fc = sys.modules.get("vllm_omni.diffusion.forward_context")
    if fc is None:
        return None, None
    try:
        if not fc.is_forward_context_available():
            return None, None
        ctx = fc.get_forward_context()
        step, total = ctx.denoise_step_idx, getattr(ctx, "total_denoise_steps", None)
        return (None if step is None else int(step)), (None if total is None else int(total))
    except Exception:  # a context of another shape: no step known
        return None, None


#: The engine's typed block-sparse config (``AttentionSpec.block_sparse``, which reaches a
#: backend as these ``backend_kwargs``), as VIDEO_SPARSE's: ``sparsity`` is VIDEO_SPARSE's own
#: (the fraction of key blocks skipped), ``start_step`` its ``dense_steps``, ``skip_layers``
#: (the engine's layer indices) and ``end_step`` (the last steps) dense as well; ``precision``
#: must be the engine's default ``bf16`` (VIDEO_SPARSE computes in its ``compute_dtype``).
_ENGINE_BLOCK_SPARSE = ("start_step", "end_step", "skip_layers", "precision")


def _engine_block_sparse(options: dict) -> Tuple[dict, Set[int], int]:
    """(options with the engine's block-sparse keys taken out, the dense layer indices, the
    dense last steps)."""
    options = dict(options)
    if not any(k in options for k in _ENGINE_BLOCK_SPARSE):
        return options, set(), 0
    start = options.pop("start_step", 0) or 0
    if start:
        if options.get("dense_steps") not in (None, start):
            raise _with_field(
                InvalidArgument,
                f"start_step: the engine's block_sparse.start_step = {start} and dattn's "
                f"dense_steps = {options['dense_steps']} say two things; give one", "start_step")
        options["dense_steps"] = start
    precision = str(options.pop("precision", "bf16") or "bf16").lower()
    if precision != "bf16":
        raise _with_field(
            InvalidArgument,
            f"precision: block_sparse.precision = {precision!r} is RainFusion's; VIDEO_SPARSE "
            f"takes 'bf16' (the default) and computes in its compute_dtype (backend option)",
            "precision")
    skip = options.pop("skip_layers", None) or []
    layers = {int(i) for i in skip}
    end = int(options.pop("end_step", 0) or 0)
    return options, layers, end


class _StepPolicy:
    """VIDEO_SPARSE's step policy in the engine's layer: dense on FLASH for the first
    ``dense_steps`` steps and ``dense_layers`` layers, the block selection kept per (layer,
    CFG branch) and reused for ``refresh_steps`` steps. An unknown step (no forward context)
    or layer (no index in the prefix) never makes a call dense, and an unknown step never
    reuses. The calls of one layer within one step are its CFG branches in call order."""

    def __init__(self, policy: dict, flash_options: dict, layer_index: Optional[int],
                 dense_layer_indices: Set[int] = frozenset(), dense_last_steps: int = 0):
        from ..sparse_steps import SelectionCache

        self.policy = policy
        self.flash_options = flash_options
        self.layer_index = layer_index
        #: The engine's block_sparse.skip_layers and end_step (_engine_block_sparse).
        self.dense_layer_indices = set(dense_layer_indices)
        self.dense_last_steps = int(dense_last_steps)
        self.cache = SelectionCache(policy)
        self._dense: Dict[Tuple[int, int], Attention] = {}
        self._step: Optional[int] = None
        self._branch = 0

    def _dense_layer(self, impl, layer: Attention) -> Attention:
        key = (layer.num_heads, layer.num_kv_heads)
        dense = self._dense.get(key)
        if dense is None:
            args = dict(impl._layer_args, backend="FLASH", backend_kwargs=self.flash_options,
                        allow_fallback=False)
            dense = self._dense[key] = Attention(
                layer.num_heads, layer.head_size, softmax_scale=layer.softmax_scale,
                causal=impl.causal, num_kv_heads=layer.num_kv_heads, **args)
        return dense

    def forward(self, impl, layer: Attention, query, key, value, meta, output):
        from ..sparse_steps import is_dense
        from ..tensors import is_torch

        step, total = _denoise_steps()
        if step is None or step != self._step:
            self._step, self._branch = step, 0
        else:
            self._branch += 1
        if step is not None and step == 0 and self._branch == 0:
            self.cache.clear()  # step 0: a new generation
        tail = (self.dense_last_steps > 0 and step is not None and total is not None
                and step >= total - self.dense_last_steps)
        if (is_dense(self.policy, step, self.layer_index) or tail
                or self.layer_index in self.dense_layer_indices):
            note_computed("dattn:FLASH")
            return self._dense_layer(impl, layer).forward(query, key, value, meta, out=output)
        note_computed("dattn:VIDEO_SPARSE")
        threads = 0
        if is_torch(query):
            from ..torch_layer import call_threads

            threads = call_threads()
        out, _ = self.cache.sparse_call(layer, query, key, value, meta, step=step,
                                        layer_index=self.layer_index or 0,
                                        branch=self._branch, threads=threads)
        if output is not None:
            output[...] = out
            return output
        return out


class DattnAttentionImpl(_ImplBase):
    """One attention layer of the engine, computed by :class:`dattn.Attention` layers.

    ``backend_kwargs`` are dattn's backend options; the key ``"backend"`` picks the dattn
    backend (e.g. ``"REFERENCE"``). As the engine's own backends do with the per-role specs it
    hands every backend (keys such as ``skip_softmax_threshold``, ``target_sparsity`` or
    ``dtype_qk`` belong to its other backends), the impl takes the options the chosen dattn
    backend declares (:attr:`dattn.backends.BackendInfo.options`, checked by type and value:
    ``InvalidArgument`` naming the option) and ignores the others, listed in
    ``self.ignored_backend_kwargs``. Without it: ``DIFFUSION_ATTENTION_BACKEND`` if it names one
    of dattn's backends, else (unset, ``auto``, or the engine's names such as ``DATTN``) the
    automatic choice, FLASH; the name is passed to dattn's core explicitly, so the engine's
    value of that variable never reaches dattn's registry (see
    :func:`dattn.backends.adapter_backend`). ``extra_impl_args`` may carry ``kv_cache_dtype``
    (``"fp8"``/``"int8"``) and the engine's ``role`` (see :func:`dattn_role`); all of them are
    kept in ``self.extra_impl_args``, the others (``backend_explicit``, ...) are ignored.

    What a call means follows the engine's layer (``vllm_omni.diffusion.attention.layer``):

    - **Heads come from the tensors.** ``self.layer`` is built for the model's head counts;
      a call whose query/key carry other counts (the per-rank head shard under Ulysses
      sequence parallelism, padded shards of its ``advanced_uaa`` mode) runs on a layer built
      for those counts (cached per pair), provided they keep the model's GQA ratio
      (``query_heads * num_kv_heads == key_heads * num_heads``); otherwise
      :class:`dattn.InvalidArgument` naming ``query`` (or ``key``).
    - **Joint tokens are attached once.** Called directly, the metadata's
      ``joint_query/key/value`` are attached to Q/K/V (dattn's rule, docs/semantics.md). Inside
      the engine's sequence-parallel region (its forward context has SP active with a Ulysses,
      Ring or AllGather-KV degree above 1) the layer's parallel strategy has already joined
      them into Q/K/V (and merged ``joint_attn_mask`` into ``attn_mask``), as the engine's own
      backends assume, so they are not attached again; the same holds for a call whose
      leading (``front``) or trailing (``rear``) query rows are exactly a head shard of
      ``joint_query`` (what the Ulysses strategy leaves when no forward context is set).
    - **2-D masks as the engine's SDPA reads them.** A ``[B, Skv]`` mask of an integer dtype
      (int64, int32, uint8, ...) is a keep-mask, nonzero = attend (``attn_mask.to(bool)``); a
      float one must hold only 0/1 and means the same (other values, an additive mask, raise
      :class:`dattn.InvalidArgument` naming the field: read as bool they would invert). A 2-D
      mask of another shape that PyTorch broadcasts over ``[Sq, Skv]`` (``[Sq, Skv]``,
      ``[1, Skv]``) is that 4-D mask, as the engine's SDPA hands it to PyTorch; a 4-D mask with a
      size-1 query or key dim (``[B, 1, 1, Skv]``) is broadcast over the rows as PyTorch does.
    - **The role decides what a key mask does to query rows.** In ``cross`` attention a 2-D
      mask masks keys only and every query row is computed, whatever ``Sq`` and ``Skv`` are; in
      ``self`` attention with ``Sq == Skv`` a query row whose own key is masked is padding and
      outputs zeros (dattn's rule; the engine's SDPA computes such rows, which models discard).
    """

    _supported_kv_cache_dtypes: Dict[str, Set[str]] = {
        platform: set(dtypes) for platform, dtypes in _FLASH.kv_cache_dtypes.items()
    }

    #: How many per-call head-count layers are kept (besides ``self.layer``).
    MAX_SHARD_LAYERS = 8

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: Optional[float],
        causal: bool = False,
        num_kv_heads: Optional[int] = None,
        prefix: str = "",
        qkv_layout: Optional[str] = None,
        backend_kwargs: Optional[Dict[str, Any]] = None,
        **extra_impl_args,
    ) -> None:
        options = dict(backend_kwargs or {})
        backend, allow_fallback = adapter_backend(options.pop("backend", None))
        #: VIDEO_SPARSE's step policy (dense_steps, dense_layers, refresh_steps,
        #: max_selection_mb): the step from the engine's forward context, the layer from the
        #: prefix (docs/semantics.md, "VIDEO_SPARSE in diffusers' video models"); None otherwise.
        self._steps: Optional[_StepPolicy] = None
        if backend == "VIDEO_SPARSE":
            from ..sparse_steps import split_options

            options, dense_layers, dense_last = _engine_block_sparse(options)
            policy, options, flash = split_options(options)
            self._steps = _StepPolicy(policy, flash, _layer_index(prefix), dense_layers,
                                      dense_last)
        declared = _declared_options(backend)
        #: backend_kwargs keys the chosen dattn backend does not take (the engine's other
        #: backends' keys), left out of its layers.
        self.ignored_backend_kwargs: Dict[str, Any] = {}
        if declared is not None:
            self.ignored_backend_kwargs = {k: v for k, v in options.items() if k not in declared}
            options = {k: v for k, v in options.items() if k in declared}
        self.num_heads = num_heads
        self.head_size = head_size
        self.causal = bool(causal)
        self.prefix = prefix
        self.qkv_layout = qkv_layout
        self.extra_impl_args = dict(extra_impl_args)
        self.role = dattn_role(extra_impl_args.get("role"))
        self._layer_args = dict(
            prefix=prefix,
            qkv_layout=qkv_layout,
            backend=backend,
            backend_kwargs=options,
            role=self.role,
            kv_cache_dtype=extra_impl_args.get("kv_cache_dtype"),
            allow_fallback=allow_fallback,
        )
        self.layer = Attention(
            num_heads,
            head_size,
            softmax_scale=softmax_scale,
            causal=causal,
            num_kv_heads=num_kv_heads,
            **self._layer_args,
        )
        self.num_kv_heads = self.layer.num_kv_heads
        self.softmax_scale = self.layer.softmax_scale
        self._shard_layers: Dict[Tuple[int, int], Attention] = {}

    @property
    def backend_name(self) -> str:
        """The dattn backend this layer runs on (e.g. "FLASH")."""
        return self.layer.backend_name

    def forward(self, query, key, value, attn_metadata=None, output=None):
        """The seed's forward: CPU tensors (and numpy arrays) run on dattn whatever the engine's
        platform is; anything else goes to the base class's platform dispatch and, since no
        device path is implemented here, is refused naming the device. ``output`` (an
        extension, as ``accept_output_buffer`` allows) is written in place and returned."""
        tensors = (("query", query), ("key", key), ("value", value))
        off_cpu = [(name, _device_of(t)) for name, t in tensors if _device_of(t) != "cpu"]
        if not off_cpu:
            return self.forward_cpu(query, key, value, attn_metadata, output=output)
        try:
            return super().forward(query, key, value, attn_metadata)
        except NotImplementedError as e:
            if isinstance(e, Unsupported):
                raise
            name, dev = off_cpu[0]
            raise _with_field(
                UnsupportedTensor,
                f"{name}: lives on device {dev}; {type(self).__name__} computes on CPU tensors "
                f"only and has no path for that device ({e or 'not implemented'}); move the "
                f"tensors with .cpu() or pick another backend",
                name,
            ) from e

    def forward_cpu(self, query, key, value, attn_metadata=None, output=None):
        """The CPU path: the call on dattn (tensors in the layer's ``qkv_layout``, BSHD by
        default), on the layer for the tensors' head counts, with the metadata read as the
        engine's layer means it (see the class docstring). Returns the output (joint rows
        included, in joint-strategy order, where dattn attaches them)."""
        layer = self._layer_for(query, key)
        meta = self._call_metadata(query, key, attn_metadata)
        if (self._steps is not None and _get(meta, "video_layout") is not None
                and self.layer.layout == "BSHD"):
            return self._steps.forward(self, layer, query, key, value, meta, output)
        note_computed("dattn:" + layer.backend_name)
        return layer.forward(query, key, value, meta, out=output)

    # --- heads ---------------------------------------------------------------------------

    def _heads(self, x) -> Optional[int]:
        shape = getattr(x, "shape", None)
        rank, dim = _HEAD_DIM[self.layer.layout]
        if shape is None or len(shape) != rank:
            return None  # the core names the tensor whose rank is wrong
        return int(shape[dim])

    def _layer_for(self, query, key) -> Attention:
        """``self.layer``, or the layer for the call's (query heads, key heads)."""
        hq, hkv = self._heads(query), self._heads(key)
        if hq is None or hkv is None or (hq, hkv) == (self.num_heads, self.num_kv_heads):
            return self.layer
        if hq <= 0 or hkv <= 0:
            return self.layer  # the core refuses empty head dims, naming the tensor
        layer = self._shard_layers.get((hq, hkv))
        if layer is not None:
            return layer
        if hq * self.num_kv_heads != hkv * self.num_heads:
            name = "key" if hq == self.num_heads else "query"
            group = self.num_heads // self.num_kv_heads
            raise _with_field(
                InvalidArgument,
                f"{name}: query has {hq} heads and key {hkv}; this layer was built with "
                f"num_heads = {self.num_heads}, num_kv_heads = {self.num_kv_heads}, so a call "
                f"(or a per-rank head shard under sequence parallelism) needs query heads = "
                f"{group} x key heads",
                name,
            )
        layer = Attention(
            hq,
            self.head_size,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            num_kv_heads=hkv,
            **self._layer_args,
        )
        if len(self._shard_layers) >= self.MAX_SHARD_LAYERS:
            self._shard_layers.pop(next(iter(self._shard_layers)))
        self._shard_layers[(hq, hkv)] = layer
        return layer

    # --- metadata ------------------------------------------------------------------------

    def _call_metadata(self, query, key, md):
        """The call's metadata as dattn reads it: joint tokens dropped where the engine's layer
        has joined them already, 2-D masks normalised (a new object; ``md`` is not changed)."""
        if md is None:
            return None
        changes = {}
        joint = _get(md, "joint_query") is not None
        if joint and self._joined_by_engine(query, key, md):
            changes.update(joint_query=None, joint_key=None, joint_value=None,
                           joint_attn_mask=None)
            joint = False
        mask = _get(md, "attn_mask")
        new = self._engine_mask(mask, query, key, "attn_mask", broadcast=not joint)
        new = self._broadcast_rows(new, query, key, md if joint else None)
        if new is not mask:
            changes["attn_mask"] = new
        if joint:
            jmask = _get(md, "joint_attn_mask")
            new = self._engine_mask(jmask, query, key, "joint_attn_mask", broadcast=False)
            if new is not jmask:
                changes["joint_attn_mask"] = new
        return _replace(md, changes) if changes else md

    def _joined_by_engine(self, query, key, md) -> bool:
        """Whether the engine's parallel strategy has already put the joint tokens into Q/K/V
        (see the class docstring)."""
        if _engine_sp_active():
            return True
        return self.layer.layout == "BSHD" and _ulysses_joined(query, key, md)

    def _engine_mask(self, mask, query, key, field, broadcast):
        """A torch 2-D mask as the engine's SDPA reads it (see the class docstring)."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return mask
        layout = self.layer.layout
        qs, ks = getattr(query, "shape", ()), getattr(key, "shape", ())
        batch, sq, skv = _batch_rows(layout, qs, ks)
        if batch is None:
            return mask
        if field == "joint_attn_mask":
            keyed = mask.shape[0] == batch  # [B, J]: its length is the joint rows'
        else:
            keyed = tuple(mask.shape) == (batch, skv)
        if keyed:
            return _keep_mask(mask, field)
        if broadcast and mask.shape[0] in (1, sq) and mask.shape[1] in (1, skv):
            if mask.dtype == torch.bool or mask.dtype.is_floating_point:
                # PyTorch's broadcast of a 2-D mask: [Sq|1, Skv|1] over every batch and head
                # (expanded over the rows by _broadcast_rows).
                return mask[None, None]
        return mask  # the core refuses it, naming the field

    def _broadcast_rows(self, mask, query, key, joint_md):
        """A 4-D mask with a size-1 query or key dim (``[B, 1, 1, Skv]``, which PyTorch's SDPA
        broadcasts) expanded over the call's rows (joint rows included where dattn attaches
        them), as dattn's core takes 4-D masks: ``[B|1, H|1, Sq, Skv]``."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            return mask
        batch, sq, skv = _batch_rows(self.layer.layout, getattr(query, "shape", ()),
                                     getattr(key, "shape", ()))
        if batch is None or (mask.shape[2] != 1 and mask.shape[3] != 1):
            return mask
        if joint_md is not None:
            jq, jk = _get(joint_md, "joint_query"), _get(joint_md, "joint_key")
            rows = {"BSHD": 1, "BHSD": 2, "THD": 0}[self.layer.layout]
            sq += int(jq.shape[rows]) if getattr(jq, "ndim", 0) > rows else 0
            skv += int(jk.shape[rows]) if getattr(jk, "ndim", 0) > rows else 0
        if mask.shape[2] not in (1, sq) or mask.shape[3] not in (1, skv):
            return mask  # the core names the shape it expects
        return mask.expand(mask.shape[0], mask.shape[1], sq, skv)

    def forward_paged(self, paged_kv_context: PagedCall):
        """One paged-KV call, described by a :class:`dattn.PagedCall` (dattn's page pool and
        block tables): a dattn extension. The engine's paged context (vLLM's KV cache and
        block tables, prepared by its worker) is not read by dattn, so the backend class
        advertises ``supports_paged_kv = False`` and the engine never routes a paged call
        here. Returns the output [T, H, Dv] (and the LSE with ``return_lse``)."""
        if not isinstance(paged_kv_context, PagedCall):
            raise _with_field(
                InvalidArgument,
                f"paged_kv_context: expected a dattn.PagedCall (dattn reads its own page pool, "
                f"not the engine's paged KV context), got {type(paged_kv_context).__name__}",
                "paged_kv_context",
            )
        return self.layer.forward_paged(paged_kv_context)

    def __repr__(self) -> str:
        return (
            f"DattnAttentionImpl(prefix={self.prefix!r}, heads={self.num_heads}, "
            f"kv_heads={self.num_kv_heads}, head_size={self.head_size}, causal={self.causal}, "
            f"role={self.role!r}, backend={self.backend_name!r})"
        )


class DattnAttentionBackend(_BackendBase):
    """dattn as the engine's attention backend; capabilities are dattn's FLASH data, except the
    paged ones (``supports_paged_kv``, ``indexes_kv_by_block_stride()``), False: they would
    promise that dattn consumes the engine's paged-KV context and vLLM's cache layout."""

    accept_output_buffer: bool = _FLASH.accept_output_buffer
    supports_piecewise_spans: bool = _FLASH.supports_piecewise_spans
    # dattn's paged KV (forward_paged with a dattn.PagedCall) reads dattn's own page pool, not
    # the engine's Scheduler-owned vLLM cache: the engine is told neither paged capability.
    supports_paged_kv: bool = False
    supports_prefix_kv_slicing: bool = _FLASH.supports_prefix_kv_slicing
    # dattn's own platform key ("cpu") and the engine's value for an out-of-tree platform
    # ("oot", OmniPlatformEnum.OOT), which the engine's validation compares.
    supported_platforms = (tuple(_FLASH.supported_platforms) + ("oot",)
                           if _FLASH.supported_platforms else None)

    @classmethod
    def supports_packed_mask_free(cls) -> bool:
        return _FLASH.supports_packed_mask_free()

    @classmethod
    def supports_multi_doc_packed_varlen(cls) -> bool:
        return _FLASH.supports_multi_doc_packed_varlen()

    @classmethod
    def validate_available(cls) -> None:
        """Raises :class:`dattn.NotAvailable` if FLASH cannot run on this machine."""
        _FLASH.validate_available()

    @classmethod
    def supports_attention_mask(cls, attention_spec: object = None) -> bool:
        return _FLASH.supports_attention_mask(attention_spec)

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return False  # dattn never reads the engine's (vLLM's) paged cache

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return _FLASH.supports_head_size(head_size)

    @staticmethod
    def get_name() -> str:
        return "DATTN"

    @staticmethod
    def get_impl_cls() -> type:
        return DattnAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type:
        return _MetadataCls

    @staticmethod
    def get_builder_cls():
        return None  # the engine's models build the metadata; dattn needs no builder

    @staticmethod
    def get_supported_head_sizes() -> list:
        return _FLASH.get_supported_head_sizes()  # [] = any head size


class _BoundImpl(DattnAttentionImpl):
    """A :class:`DattnAttentionImpl` whose layers run on one dattn backend (``dattn_backend``)
    unless ``backend_kwargs["backend"]`` names another: what the engine gets for a dattn
    backend's name (its per-role config names the backend only to the platform, which returns
    this class; the impl is told only the options)."""

    dattn_backend = ""

    def __init__(self, *args, backend_kwargs: Optional[Dict[str, Any]] = None, **kwargs) -> None:
        options = dict(backend_kwargs or {})
        options.setdefault("backend", self.dattn_backend)
        super().__init__(*args, backend_kwargs=options, **kwargs)


class DattnSageAttentionImpl(_BoundImpl):
    """The engine's ``SAGE_ATTN`` / ``SAGE_ATTN_3`` on dattn's platform: a layer on dattn's SAGE
    backend (8-bit Q.K^T with K smoothing, P.V in int16, bf16, f32 or int8; docs/semantics.md,
    "SAGE"), unless ``backend_kwargs["backend"]`` names another dattn backend; SAGE's options
    (``pv_dtype``, ``smooth_k``, ``balance_qk``, ``isa``) in ``backend_kwargs``."""

    dattn_backend = "SAGE"


class DattnSageAttentionBackend(DattnAttentionBackend):
    """The engine's SAGE names on dattn's platform (:class:`DattnSageAttentionImpl`)."""

    @staticmethod
    def get_name() -> str:
        return "DATTN_SAGE"

    @staticmethod
    def get_impl_cls() -> type:
        return DattnSageAttentionImpl


#: The prefix of the class paths of the backends bound to one dattn backend.
BOUND_PREFIX = "DattnAttentionBackend_"


def bound_backend(name: str) -> type:
    """The engine backend class whose layers run on dattn's backend ``name`` (e.g.
    ``VIDEO_SPARSE``): ``dattn.vllm_omni.backends.DattnAttentionBackend_<NAME>``, made once."""
    name = get_backend(name).name  # an unknown name: dattn's InvalidArgument listing them
    cls = _BOUND.get(name)
    if cls is None:
        impl = type(f"DattnAttentionImpl_{name}", (_BoundImpl,), {
            "dattn_backend": name, "__module__": __name__,
            "__doc__": f"A DattnAttentionImpl on dattn's {name} backend."})
        cls = type(BOUND_PREFIX + name, (DattnAttentionBackend,), {
            "__module__": __name__,
            "__doc__": f"DattnAttentionBackend with its layers on dattn's {name} backend.",
            "get_impl_cls": staticmethod(lambda: impl)})
        cls = _BOUND.setdefault(name, cls)
    return cls


_BOUND: Dict[str, type] = {}


def __getattr__(attr: str):
    if attr.startswith(BOUND_PREFIX):
        return bound_backend(attr[len(BOUND_PREFIX):])
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


#: Shorter names for the same classes.
DattnBackend = DattnAttentionBackend
DattnImpl = DattnAttentionImpl

__all__ = ["DattnAttentionBackend", "DattnAttentionImpl", "DattnBackend", "DattnImpl",
           "DattnSageAttentionBackend", "DattnSageAttentionImpl", "ENGINE_AVAILABLE"]
