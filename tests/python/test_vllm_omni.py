"""dattn.vllm_omni against the seed's own interface file.

The seed (``shared/seed/abstract.py.txt``, next to the clone; or the path in
``DATTN_SEED_ABSTRACT``) is loaded as ``vllm_omni.diffusion.attention.backends.abstract``
with stand-in parent modules and a stand-in ``vllm_omni.platforms.current_omni_platform``, then
dattn.vllm_omni is reloaded so that it subclasses the seed's real classes. The last tests run
dattn.vllm_omni with no engine at all (standalone mode). sys.modules is restored after each.
"""

import importlib
import os
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import dattn  # noqa: E402
import dattn.vllm_omni  # noqa: E402
import dattn.vllm_omni.backends  # noqa: E402
from conftest import assert_close, oracle, rand  # noqa: E402

ENGINE_MODULE = "vllm_omni.diffusion.attention.backends.abstract"


def seed_path() -> Path:
    env = os.environ.get("DATTN_SEED_ABSTRACT")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "seed" / "abstract.py.txt"


class StubPlatform:
    """Stands in for vllm_omni.platforms.current_omni_platform."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda

    def is_rocm(self):
        return False

    def is_cuda(self):
        return self.cuda

    def is_npu(self):
        return False

    def is_xpu(self):
        return False

    def is_musa(self):
        return False

    def __repr__(self):
        return "StubPlatform(cuda)" if self.cuda else "StubPlatform(cpu)"


def _engine_names():
    return [n for n in sys.modules if n == "vllm_omni" or n.startswith("vllm_omni.")]


def _reload_adapter():
    return importlib.reload(dattn.vllm_omni.backends)


@pytest.fixture
def engine():
    """The seed's abstract module under its engine name, and dattn.vllm_omni reloaded on it."""
    path = seed_path()
    if not path.is_file():
        pytest.skip(f"the seed's interface file is absent ({path}); set DATTN_SEED_ABSTRACT")
    saved = {n: sys.modules[n] for n in _engine_names()}
    for n in saved:
        del sys.modules[n]
    try:
        packages = ["vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.attention",
                    "vllm_omni.diffusion.attention.backends"]
        for name in packages:
            pkg = types.ModuleType(name)
            pkg.__path__ = []  # a package, so that submodule imports resolve through sys.modules
            sys.modules[name] = pkg
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, pkg)
        platforms = types.ModuleType("vllm_omni.platforms")
        platforms.current_omni_platform = StubPlatform()
        sys.modules["vllm_omni.platforms"] = platforms
        sys.modules["vllm_omni"].platforms = platforms

        lines = path.read_text().splitlines(keepends=True)
        # The file's first line names its path in the engine's repository; it is not Python.
        if lines and lines[0].strip().endswith(".py") and not lines[0].lstrip().startswith("#"):
            lines = lines[1:]
        abstract = types.ModuleType(ENGINE_MODULE)
        abstract.__file__ = str(path)
        sys.modules[ENGINE_MODULE] = abstract  # before exec: dataclasses look the module up
        exec(compile("".join(lines), str(path), "exec"), abstract.__dict__)
        sys.modules["vllm_omni.diffusion.attention.backends"].abstract = abstract

        adapter = _reload_adapter()
        assert adapter.ENGINE_AVAILABLE
        yield types.SimpleNamespace(abstract=abstract, platforms=platforms, adapter=adapter)
    finally:
        for n in _engine_names():
            del sys.modules[n]
        sys.modules.update(saved)
        _reload_adapter()


def test_subclasses_the_seeds_classes(engine):
    a, seed = engine.adapter, engine.abstract
    assert issubclass(a.DattnAttentionBackend, seed.AttentionBackend)
    assert issubclass(a.DattnAttentionImpl, seed.AttentionImpl)
    assert a.DattnAttentionBackend.get_metadata_cls() is seed.AttentionMetadata
    assert a.DattnAttentionBackend.get_impl_cls() is a.DattnAttentionImpl
    assert a.DattnAttentionBackend.get_name() == "DATTN"
    assert a.DattnAttentionBackend.get_builder_cls() is None
    a.DattnAttentionBackend.validate_available()


def test_the_seeds_abstract_init_is_satisfied(engine):
    seed, a = engine.abstract, engine.adapter
    with pytest.raises(TypeError):
        seed.AttentionImpl(4, 16, 0.25)  # abstract in the seed
    with pytest.raises(TypeError):
        seed.AttentionBackend()
    impl = a.DattnAttentionImpl(4, 16, 0.25)
    assert isinstance(impl, seed.AttentionImpl)
    assert a.DattnAttentionBackend() is not None  # every abstract method is defined


def test_flags_are_dattns_flash_data(engine):
    b, flash = engine.adapter.DattnAttentionBackend, dattn.get_backend("FLASH")
    for flag in ("accept_output_buffer", "supports_piecewise_spans", "supports_prefix_kv_slicing"):
        assert getattr(b, flag) == getattr(flash, flag), flag
    # FLASH's paged KV is dattn's own page pool (forward_paged with a dattn.PagedCall); the
    # engine's paged context and vLLM's block-outermost cache are not read: neither is claimed.
    assert flash.supports_paged_kv and not b.supports_paged_kv
    assert not b.indexes_kv_by_block_stride()
    assert tuple(flash.supported_platforms) == ("cpu",)
    assert b.supported_platforms == ("cpu", "oot")  # and the engine's out-of-tree value
    assert b.supports_packed_mask_free() == flash.supports_packed_mask_free()
    assert b.supports_multi_doc_packed_varlen() == flash.supports_multi_doc_packed_varlen()
    assert b.supports_attention_mask() == flash.supports_attention_mask()
    assert b.supports_attention_mask(attention_spec=object()) == flash.supports_attention_mask()
    assert b.get_supported_head_sizes() == flash.get_supported_head_sizes()
    assert b.supports_head_size(59) == flash.supports_head_size(59)


def test_kv_cache_dtypes(engine):
    impl = engine.adapter.DattnAttentionImpl
    assert impl._supported_kv_cache_dtypes == {"cpu": {"fp8", "int8"}}
    assert impl.supports_kv_cache_dtype("fp8", "cpu")
    assert impl.supports_kv_cache_dtype("int8", "cpu")
    assert not impl.supports_kv_cache_dtype("fp8", "cuda")
    assert impl.supports_kv_cache_dtype(None, "cuda")


def test_construction_with_the_seeds_arguments(engine):
    impl_cls = engine.adapter.DattnAttentionImpl
    impl = impl_cls(
        num_heads=4,
        head_size=16,
        softmax_scale=0.25,
        causal=False,
        num_kv_heads=2,
        prefix="transformer_blocks.0.attn",
        qkv_layout=None,
        backend_kwargs={"backend": "REFERENCE"},
        some_engine_argument="ignored",
    )
    assert impl.backend_name == "REFERENCE"
    assert impl.num_kv_heads == 2 and impl.softmax_scale == 0.25
    assert impl.extra_impl_args == {"some_engine_argument": "ignored"}
    assert impl_cls(4, 16, None).backend_name == "FLASH"
    quantized = impl_cls(4, 16, None, kv_cache_dtype="int8")
    q, k, v = rand(1, 64, 4, 16, seed=1), rand(1, 64, 4, 16, seed=2), rand(1, 64, 4, 16, seed=3)
    out = quantized.forward(q, k, v)
    diff = (out.double() - oracle(q, k, v)[0]).norm() / oracle(q, k, v)[0].norm()
    assert float(diff) < 1.5e-2


def _joint():
    B, S, J, H, D = 2, 40, 7, 4, 16
    q, k, v = rand(B, S, H, D, seed=1), rand(B, S, H, D, seed=2), rand(B, S, H, D, seed=3)
    tq, tk, tv = rand(B, J, H, D, seed=4), rand(B, J, H, D, seed=5), rand(B, J, H, D, seed=6)
    meta = dict(joint_query=tq, joint_key=tk, joint_value=tv, joint_strategy="front")
    cat = [torch.cat(p, dim=1) for p in ((tq, q), (tk, k), (tv, v))]
    return (q, k, v), meta, oracle(*cat)[0]


def _mask():
    B, S, H, D = 2, 36, 4, 16
    q, k, v = rand(B, S, H, D, seed=1), rand(B, S, H, D, seed=2), rand(B, S, H, D, seed=3)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 30:] = False
    keep[1, 11:13] = False
    want = oracle(q, k, v, visible=keep[:, None, None, :])[0]
    # Self-attention with a key mask: a row whose own key is masked is padding and outputs 0.
    want = want * keep[:, :, None, None]
    return (q, k, v), dict(attn_mask=keep), want


def _cu_seqlens():
    T, H, D = 50, 4, 16
    q, k, v = rand(1, T, H, D, seed=1), rand(1, T, H, D, seed=2), rand(1, T, H, D, seed=3)
    cu = torch.tensor([0, 18, 50], dtype=torch.int32)
    doc = torch.zeros(T, dtype=torch.long)
    doc[18:] = 1
    same = doc[:, None] == doc[None, :]
    extra = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 32, "max_seqlen_k": 32}
    return (q, k, v), dict(extra=extra), oracle(q, k, v, visible=same)[0]


def _valid_kv_length():
    B, Sq, Skv, H, D = 2, 20, 48, 4, 16
    q, k, v = rand(B, Sq, H, D, seed=1), rand(B, Skv, H, D, seed=2), rand(B, Skv, H, D, seed=3)
    visible = (torch.arange(Skv) < 33).view(1, 1, 1, Skv)
    return (q, k, v), dict(extra={"valid_kv_length": 33}), oracle(q, k, v, visible=visible)[0]


def _well_known_extras():
    B, S, H, D = 1, 30, 4, 16
    q, k, v = rand(B, S, H, D, seed=1), rand(B, S, H, D, seed=2), rand(B, S, H, D, seed=3)
    extra = {"kv_cache_dtype": None, "laser_input_scale": 4.0, "npu_attn_varlen": False,
             "some_other_backends_key": object()}
    return (q, k, v), dict(extra=extra), oracle(q, k, v)[0]


@pytest.mark.parametrize(
    "case", [_joint, _mask, _cu_seqlens, _valid_kv_length, _well_known_extras],
    ids=["joint", "attn_mask", "cu_seqlens", "valid_kv_length", "extras"],
)
def test_forward_with_the_seeds_metadata(engine, case):
    (q, k, v), fields, want = case()
    meta = engine.abstract.AttentionMetadata(**fields)
    impl = engine.adapter.DattnAttentionImpl(num_heads=4, head_size=16, softmax_scale=None)
    out = impl.forward(q, k, v, meta)
    assert isinstance(out, torch.Tensor)  # the seed's forward returns only the output
    assert_close(out, want)
    assert_close(impl.forward_cpu(q, k, v, meta), want)


def test_forward_into_an_output_buffer(engine):
    (q, k, v), fields, want = _joint()
    impl = engine.adapter.DattnAttentionImpl(4, 16, None)
    buf = torch.empty(want.shape, dtype=torch.float32)
    out = impl.forward(q, k, v, engine.abstract.AttentionMetadata(**fields), output=buf)
    assert out is buf
    assert_close(buf, want)


def test_forward_paged(engine):
    H, Hkv, D = 4, 2, 16
    impl = engine.adapter.DattnAttentionImpl(H, 16, None, num_kv_heads=Hkv)
    pool = dattn.PagePool(num_blocks=8, block_size=16, kv_heads=Hkv, head_size=D)
    pages = pool.allocate(3)
    q, k, v = rand(40, H, D, seed=1), rand(40, Hkv, D, seed=2), rand(40, Hkv, D, seed=3)
    # Step 1: the first 24 rows, non-causal. Step 2: 16 more rows, causal, attending the cache.
    out1 = impl.forward_paged(
        dattn.PagedCall(q[:24], k[:24], v[:24], [dattn.PagedRow(24, 24, 0, pages)], pool)
    )
    assert_close(out1, oracle(q[None, :24], k[None, :24], v[None, :24])[0][0])
    row = dattn.PagedRow(query_len=16, seq_len=40, kv_start_pos=24, block_table=pages)
    out2 = impl.forward_paged(dattn.PagedCall(q[24:], k[24:], v[24:], [row], pool, causal=True))
    assert_close(out2, oracle(q[None, 24:], k[None], v[None], causal_offset=24)[0][0])
    with pytest.raises(dattn.InvalidArgument, match="PagedCall"):
        impl.forward_paged({"query": q})


def test_non_cpu_tensors_are_refused_naming_the_device(engine):
    impl = engine.adapter.DattnAttentionImpl(2, 8, None)
    meta_t = torch.empty(1, 4, 2, 8, device="meta")
    cpu_t = rand(1, 4, 2, 8)
    with pytest.raises(dattn.Unsupported, match="meta") as info:
        impl.forward(meta_t, meta_t, meta_t)
    assert isinstance(info.value, NotImplementedError)
    with pytest.raises(dattn.Unsupported, match="key: lives on device meta"):
        impl.forward(cpu_t, meta_t, cpu_t)

    class CudaClaiming:
        """A tensor-like object that says it lives on a CUDA device (none is needed here)."""

        device = torch.device("cuda", 0)
        shape = (1, 4, 2, 8)

    with pytest.raises(dattn.Unsupported, match="value: lives on device cuda:0"):
        impl.forward(cpu_t, cpu_t, CudaClaiming())


def test_a_cuda_claiming_platform(engine, monkeypatch):
    """The engine says CUDA: CPU tensors still run on dattn; the base class's dispatch sends
    other tensors to forward_cuda, which dattn does not implement: refused naming the device."""
    cuda = StubPlatform(cuda=True)
    monkeypatch.setattr(engine.abstract, "current_omni_platform", cuda)
    monkeypatch.setattr(engine.platforms, "current_omni_platform", cuda)
    impl = engine.adapter.DattnAttentionImpl(2, 8, None)
    q, k, v = rand(1, 6, 2, 8, seed=1), rand(1, 6, 2, 8, seed=2), rand(1, 6, 2, 8, seed=3)
    assert_close(impl.forward(q, k, v), oracle(q, k, v)[0])
    meta_t = torch.empty(1, 6, 2, 8, device="meta")
    with pytest.raises(dattn.Unsupported, match="device meta"):
        impl.forward(meta_t, meta_t, meta_t)


# --- standalone mode -------------------------------------------------------------------------


@pytest.fixture
def standalone():
    """dattn.vllm_omni with no engine importable (even if one is installed)."""
    saved = {n: sys.modules[n] for n in _engine_names()}
    for n in saved:
        del sys.modules[n]
    sys.modules["vllm_omni"] = None  # makes `import vllm_omni...` raise ImportError
    try:
        yield _reload_adapter()
    finally:
        for n in _engine_names():
            del sys.modules[n]
        sys.modules.update(saved)
        _reload_adapter()


def test_standalone_mode(standalone):
    a = standalone
    assert not a.ENGINE_AVAILABLE
    assert issubclass(a.DattnAttentionBackend, a._StandaloneAttentionBackend)
    assert issubclass(a.DattnAttentionImpl, a._StandaloneAttentionImpl)
    assert a.DattnAttentionBackend.get_metadata_cls() is dattn.AttentionMetadata
    assert a.DattnAttentionBackend.supports_paged_kv is False
    assert a.DattnAttentionBackend.indexes_kv_by_block_stride() is False
    assert a.DattnAttentionImpl.supports_kv_cache_dtype("fp8", "cpu")
    assert not a.DattnAttentionImpl.supports_kv_cache_dtype("fp8", "cuda")
    (q, k, v), fields, want = _joint()
    impl = a.DattnAttentionImpl(4, 16, None, backend_kwargs={"backend": "REFERENCE"})
    assert_close(impl.forward(q, k, v, dattn.AttentionMetadata(**fields)), want)
    meta_t = torch.empty(1, 4, 4, 16, device="meta")
    with pytest.raises(dattn.Unsupported, match="query: lives on device meta"):
        impl.forward(meta_t, meta_t, meta_t)


def test_no_engine_modules_leak():
    """After the fixtures, sys.modules and dattn.vllm_omni are as they were: no stand-in
    module is left, and the adapter is in the mode the environment gives it."""
    stubs = [
        n for n in _engine_names()
        if sys.modules[n] is None
        or isinstance(getattr(sys.modules[n], "current_omni_platform", None), StubPlatform)
        or getattr(sys.modules[n], "__file__", None) == str(seed_path())
    ]
    assert not stubs
    assert dattn.vllm_omni.ENGINE_AVAILABLE == (ENGINE_MODULE in sys.modules)


def test_impl_takes_dattns_options_and_ignores_the_engines_others(engine):
    """The engine hands every backend the same per-role specs (keys of its other backends):
    the impl passes the options the chosen dattn backend declares (checked: a bad value names
    the option) and ignores, lists, the others."""
    a = engine.adapter
    impl = a.DattnSageAttentionImpl(
        4, 64, None, backend_kwargs={"pv_dtype": "int8", "skip_softmax_threshold": 0.1,
                                     "target_sparsity": 0.5, "dtype_qk": "fp8"})
    assert impl.backend_name == "SAGE"
    assert impl.ignored_backend_kwargs == {"skip_softmax_threshold": 0.1,
                                           "target_sparsity": 0.5, "dtype_qk": "fp8"}
    q = rand(1, 30, 4, 64, seed=1)
    impl.forward(q, q, q)
    with pytest.raises(dattn.InvalidArgument, match="pv_dtype"):
        a.DattnSageAttentionImpl(4, 64, None, backend_kwargs={"pv_dtype": "int4"})
    flash = a.DattnAttentionImpl(4, 64, None, backend_kwargs={"pv_dtype": "int8"})
    assert flash.backend_name == "FLASH" and flash.ignored_backend_kwargs == {"pv_dtype": "int8"}
