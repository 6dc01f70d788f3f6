"""The registry's backends as data, with the seed's capability names."""

from __future__ import annotations

import os
from typing import List, Optional

from . import _core
from .errors import NotAvailable, _with_field


class BackendInfo:
    """One registered backend: its name, static capability flags (attributes, as on the seed's
    AttentionBackend class) and probes (methods with the seed's names)."""

    def __init__(self, data: dict):
        self._data = dict(data)
        self.name: str = data["name"]
        self.description: str = data["description"]
        self.priority: int = data["priority"]
        self.exact: bool = data["exact"]
        self.accept_output_buffer: bool = data["accept_output_buffer"]
        self.supports_piecewise_spans: bool = data["supports_piecewise_spans"]
        self.supports_paged_kv: bool = data["supports_paged_kv"]
        self.supports_prefix_kv_slicing: bool = data["supports_prefix_kv_slicing"]
        self.supports_causal: bool = data["supports_causal"]
        self.supports_dense_attention_mask: bool = data["supports_dense_attention_mask"]
        self.supported_platforms: Optional[tuple] = data["supported_platforms"]
        self.dtypes: dict = dict(data["dtypes"])
        self.available: bool = data["available"]
        self.kv_cache_dtypes: dict = {k: set(v) for k, v in data["kv_cache_dtypes"].items()}
        #: The construction options (``backend_kwargs``) the backend reads, or None where it
        #: does not declare them (then they are not checked); a layer refuses any other key.
        self.options: Optional[tuple] = (
            None if data.get("options") is None else tuple(data["options"]))

    def get_name(self) -> str:
        return self.name

    def supports_packed_mask_free(self) -> bool:
        return self._data["supports_packed_mask_free"]

    def supports_multi_doc_packed_varlen(self) -> bool:
        return self._data["supports_multi_doc_packed_varlen"]

    def supports_attention_mask(self, attention_spec=None) -> bool:
        del attention_spec
        return self._data["supports_attention_mask"]

    def get_supported_head_sizes(self) -> List[int]:
        return list(self._data["supported_head_sizes"])

    def supports_head_size(self, head_size: int) -> bool:
        sizes = self.get_supported_head_sizes()
        return (not sizes) or head_size in sizes

    def indexes_kv_by_block_stride(self) -> bool:
        return self._data["indexes_kv_by_block_stride"]

    def supports_kv_cache_dtype(self, kv_cache_dtype: Optional[str], platform_key: str) -> bool:
        if kv_cache_dtype is None or kv_cache_dtype in ("auto", "float"):
            return True
        return kv_cache_dtype in self.kv_cache_dtypes.get(platform_key, set())

    def supports_dtype(self, dtype: str) -> bool:
        return bool(self.dtypes.get(dtype, False))

    def validate_available(self) -> None:
        if not self.available:
            raise _with_field(NotAvailable, self._data["unavailable_reason"], "backend")

    def __repr__(self) -> str:
        return f"BackendInfo({self.name!r}, priority={self.priority}, exact={self.exact})"


def backends() -> List[BackendInfo]:
    """Every registered backend, highest priority first."""
    return [BackendInfo(d) for d in _core.backends()]


def get_backend(name: str) -> BackendInfo:
    """The backend called `name` (case-insensitive)."""
    for b in backends():
        if b.name.lower() == name.lower():
            return b
    from .errors import InvalidArgument

    valid = ", ".join(b.name for b in backends())
    raise _with_field(InvalidArgument, f"backend: unknown backend '{name}'; valid: {valid}", "backend")


def cpu_info() -> dict:
    """The CPU as dattn sees it: vendor, brand, logical CPUs, one core's L2 in bytes
    (``l2_bytes``, 0 when the OS does not say), the feature flags the OS enables (e.g.
    ["avx2", "fma", "f16c"]) and the thread limit. FLASH's instruction set is chosen from these
    (and its work items sized by the L2); ``backend_kwargs={"isa": "avx2"}`` caps it for one
    layer."""
    return dict(_core.cpu_info())


def flash_engines() -> List[dict]:
    """FLASH's compute engines in ladder order (VIDEO_SPARSE uses the same): ``name`` (what
    ``backend_kwargs={"isa": name}`` and DATTN_ISA accept), ``rank`` on the ladder
    amx > avx512_bf16 > avx512 > avx2 > portable, ``compute_dtype`` ("f32" or "bf16"),
    ``emulated`` (a portable twin, chosen only by name) and ``unavailable_reason`` (why this
    machine cannot run it; None when it can)."""
    return [dict(e) for e in _core.flash_engines()]


def measure_peak_gflops(threads: int = 0, seconds: float = 0.2) -> dict:
    """The machine's measured peaks in GFLOP/s over `threads` threads (0 = every CPU), as
    `dattn info` reports them: ``f32_fma``, ``bf16_dot`` (vdpbf16ps; None without AVX512-BF16)
    and ``amx_bf16`` (AMX tdpbf16ps; None where this process cannot run AMX tiles), the SAGE
    engines' ``int8_dot`` (GOP/s: vpdpbusd or AVX2's vpmaddubsw sign trick, named by ``int8_dot_isa``),
    ``int16_dot`` (GOP/s: the 16-bit integer lanes, vpdpwssd or AVX2's vpmaddwd + vpaddd, named
    by ``int16_dot_isa``) and
    ``amx_int8`` (GOP/s, AMX tdpbssd; None without AMX-INT8 tiles), with the ``threads`` that
    ran, the f32 ``isa``, and ``<kind>_unavailable``: why that peak is None (None when it was
    measured)."""
    return dict(_core.measure_peak_gflops(threads, seconds))


_TABLE = None


def _backend_table():
    """(dattn's backend names, the automatic choice's name), computed once per process: the
    registry and the machine do not change while it runs."""
    global _TABLE
    if _TABLE is None:
        all_ = backends()  # highest priority first
        auto = next(
            (b.name for b in all_
             if b.exact and b.available
             and (b.supported_platforms is None or "cpu" in b.supported_platforms)),
            "REFERENCE",
        )
        _TABLE = (tuple(b.name for b in all_), auto)
    return _TABLE


def _dattn_backend_name(name: Optional[str]) -> Optional[str]:
    """dattn's spelling of backend ``name`` if it names one of dattn's backends, else None."""
    if not name:
        return None
    wanted = name.strip().lower()
    for known in _backend_table()[0]:
        if known.lower() == wanted:
            return known
    return None


def adapter_backend(requested: Optional[str] = None):
    """The dattn backend name and ``allow_fallback`` for a layer an adapter builds (the vllm-omni
    backend, dattn.diffusers), passed to the core explicitly so that a value of
    ``DIFFUSION_ATTENTION_BACKEND`` meant for another library never breaks the layer.

    - ``requested`` (a dattn backend name): that backend, no fallback (an unknown name raises
      :class:`dattn.InvalidArgument` listing the valid ones); ``auto`` and ``DATTN`` count as
      no request;
    - else ``DIFFUSION_ATTENTION_BACKEND`` if it names a dattn backend (e.g. ``REFERENCE``):
      that backend, no fallback, as the core treats the variable;
    - else (unset, ``auto``, or a name of the engine's or of diffusers' such as ``DATTN``,
      ``TORCH_SDPA`` or ``FLASH_ATTN``): the automatic choice, the highest-priority exact
      backend available here, with ``allow_fallback=True`` (a call it cannot serve runs on the
      best exact backend that can, as an automatic choice does)."""
    if requested and requested.strip().upper() in ("AUTO", "DATTN"):
        requested = None  # "choose": as if none was given
    if requested:
        name = _dattn_backend_name(requested)
        if name is None:
            get_backend(requested)  # raises, naming the valid backends
        return name, False
    env = _dattn_backend_name(os.environ.get("DIFFUSION_ATTENTION_BACKEND"))
    if env is not None:
        return env, False
    return _backend_table()[1], True
