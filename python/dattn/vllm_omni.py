"""dattn as an attention backend of the vllm-omni diffusion engine (the seed's interface).

``DattnAttentionBackend`` and ``DattnAttentionImpl`` have the shape of the seed's
``AttentionBackend`` / ``AttentionImpl`` (``vllm_omni.diffusion.attention.backends.abstract``).
When that module is importable at the time this module is imported, the classes subclass the
engine's own bases and ``get_metadata_cls()`` is the engine's ``AttentionMetadata``; otherwise
they stand alone on local bases with the same methods and use ``dattn.AttentionMetadata``
(``ENGINE_AVAILABLE`` says which). Reload this module after making the engine importable.

The capability flags are read from dattn's FLASH backend (``dattn.get_backend("FLASH")``), the
backend a layer gets unless ``backend_kwargs["backend"]`` picks another; ``supported_platforms``
adds the engine's out-of-tree platform value ``"oot"`` to FLASH's ``"cpu"``. The engine's
metadata objects are read field by field, ``extra`` included (``cu_seqlens_q/k``,
``max_seqlen_q/k``, ``valid_kv_length``, ``kv_cache_dtype``, ``laser_input_scale``; unknown
keys are ignored).

CPU tensors are computed by dattn whatever the engine's current platform is; other tensors go
to the base class's platform dispatch (``forward_cuda`` etc.), which this class does not
implement, so they are refused with :class:`dattn.Unsupported` naming the tensor's device.

The engine picks it through dattn's plugins (entry points ``vllm_omni.platform_plugins`` and
``vllm_omni.general_plugins``, :mod:`dattn.vllm_omni_plugin`): on a machine without an
accelerator, or with ``DATTN_VLLM_OMNI=1``, dattn's CPU platform
(:mod:`dattn.vllm_omni_platform`) resolves the diffusion attention to
``"dattn.vllm_omni.DattnAttentionBackend"`` (see docs/python.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Optional, Set

from .attention import Attention, PagedCall
from .backends import adapter_backend, get_backend
from .errors import InvalidArgument, Unsupported, UnsupportedTensor, _with_field
from .metadata import AttentionMetadata as _DattnMetadata

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


class DattnAttentionImpl(_ImplBase):
    """One attention layer of the engine, computed by a :class:`dattn.Attention`.

    ``backend_kwargs`` are dattn's backend options; the key ``"backend"`` picks the dattn
    backend (e.g. ``"REFERENCE"``). Without it: ``DIFFUSION_ATTENTION_BACKEND`` if it names one
    of dattn's backends, else (unset, ``auto``, or the engine's names such as ``DATTN``) the
    automatic choice, FLASH; the name is passed to dattn's core explicitly, so the engine's
    value of that variable never reaches dattn's registry (see
    :func:`dattn.backends.adapter_backend`). ``extra_impl_args`` may carry ``kv_cache_dtype``
    (``"fp8"``/``"int8"``); other extra arguments of the engine (``role``,
    ``backend_explicit``, ...) are kept in ``self.extra_impl_args`` and ignored.
    """

    _supported_kv_cache_dtypes: Dict[str, Set[str]] = {
        platform: set(dtypes) for platform, dtypes in _FLASH.kv_cache_dtypes.items()
    }

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
        self.num_heads = num_heads
        self.head_size = head_size
        self.causal = bool(causal)
        self.prefix = prefix
        self.qkv_layout = qkv_layout
        self.extra_impl_args = dict(extra_impl_args)
        self.layer = Attention(
            num_heads,
            head_size,
            softmax_scale=softmax_scale,
            causal=causal,
            num_kv_heads=num_kv_heads,
            prefix=prefix,
            qkv_layout=qkv_layout,
            backend=backend,
            backend_kwargs=options,
            kv_cache_dtype=extra_impl_args.get("kv_cache_dtype"),
            allow_fallback=allow_fallback,
        )
        self.num_kv_heads = self.layer.num_kv_heads
        self.softmax_scale = self.layer.softmax_scale

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
        default). Returns the output (joint rows included, in joint-strategy order)."""
        return self.layer.forward(query, key, value, attn_metadata, out=output)

    def forward_paged(self, paged_kv_context: PagedCall):
        """One paged-KV call, described by a :class:`dattn.PagedCall` (dattn's page pool and
        block tables). Returns the output [T, H, Dv] (and the LSE with ``return_lse``)."""
        if not isinstance(paged_kv_context, PagedCall):
            raise _with_field(
                InvalidArgument,
                f"paged_kv_context: expected a dattn.PagedCall, got "
                f"{type(paged_kv_context).__name__}",
                "paged_kv_context",
            )
        return self.layer.forward_paged(paged_kv_context)

    def __repr__(self) -> str:
        return (
            f"DattnAttentionImpl(prefix={self.prefix!r}, heads={self.num_heads}, "
            f"kv_heads={self.num_kv_heads}, head_size={self.head_size}, causal={self.causal}, "
            f"backend={self.backend_name!r})"
        )


class DattnAttentionBackend(_BackendBase):
    """dattn as the engine's attention backend; capabilities are dattn's FLASH data."""

    accept_output_buffer: bool = _FLASH.accept_output_buffer
    supports_piecewise_spans: bool = _FLASH.supports_piecewise_spans
    supports_paged_kv: bool = _FLASH.supports_paged_kv
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
        return _FLASH.indexes_kv_by_block_stride()

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


#: Shorter names for the same classes.
DattnBackend = DattnAttentionBackend
DattnImpl = DattnAttentionImpl

__all__ = ["DattnAttentionBackend", "DattnAttentionImpl", "DattnBackend", "DattnImpl", "ENGINE_AVAILABLE"]
