"""dattn inside the real vllm-omni engine modules (the pinned vllm-omni from PyPI, installed
with --no-deps), the way the engine loads its plugins and runs its attention layer.

vllm itself is a CUDA stack, so a minimal stand-in ``vllm`` package (tests/python/stubs/vllm)
goes on sys.path for these tests only. Over it, the real, unmodified vllm-omni modules are
loaded: platform resolution (``vllm_omni.platforms``), plugin loading (``vllm_omni.plugins``),
the platform interface, the attention backend registry, the selector, the abstract backend
classes, the engine's SDPA backend and its ``Attention`` layer
(``vllm_omni.diffusion.attention.layer``) with its parallel strategies (Ulysses, Ring), ring
kernels, forward context and distributed parallel state. dattn's plugin reaches the engine
through a real entry point: a ``dattn`` distribution (``.dist-info`` with ``entry_points.txt``)
on sys.path, found by ``importlib.metadata`` as an installed wheel's is.

Not loaded: the package root ``vllm_omni/__init__.py`` (it imports ``vllm_omni.patch`` and
``vllm_omni.config``, which need vllm's real model and config machinery); the test registers
the package root as a plain package over the real directory, so every module below it is the
real file. Nor ``vllm_omni.diffusion.data`` (the serving config: it imports pydantic, PIL,
huggingface_hub, vllm's config, quantization and LoRA modules): a stand-in
(tests/python/stubs/vllm_omni_diffusion_data.py) is registered under its name, holding the
fields of ``OmniDiffusionConfig``, ``DiffusionParallelConfig``, ``AttentionConfig`` and
``AttentionSpec`` that the layer, forward context and parallel state read.

Sequence parallelism runs as the engine runs it: two processes (this file run as a script)
over gloo, each with the engine's ``init_distributed_environment`` and
``initialize_model_parallel``, the engine's ``Attention`` layer built under
``set_current_diffusion_config`` and called under ``set_forward_context``, once on dattn's
backend (the platform default) and once on the engine's ``TORCH_SDPA`` (the reference).
"""

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import dattn  # noqa: E402
import dattn.vllm_omni  # noqa: E402
import dattn.vllm_omni.backends  # noqa: E402
from conftest import assert_close, rand  # noqa: E402

PINNED = "0.30.0"
STUBS = Path(__file__).resolve().parent / "stubs"
ENTRY_POINTS = """\
[vllm_omni.platform_plugins]
dattn = dattn.vllm_omni.plugin:platform_plugin

[vllm_omni.general_plugins]
dattn = dattn.vllm_omni.plugin:general_plugin
"""


def _engine_spec():
    try:
        version = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None, None
    spec = importlib.util.find_spec("vllm_omni")
    return version, spec


def _ours(name):
    return (
        # dattn's platform module holds the class it made over the engine's bases
        name in ("vllm", "vllm_omni", "dattn.vllm_omni.platform", "dattn.vllm_omni_platform")
        or name.startswith(("vllm.", "vllm_omni."))
    )


def _write_dist_info(directory):
    """A ``dattn`` distribution declaring dattn's entry points, in ``directory``."""
    dist = Path(directory) / "dattn-0.0.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dattn\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)


def _register_data_stand_in():
    """The stand-in for ``vllm_omni.diffusion.data`` under that name (see the docstring)."""
    importlib.import_module("vllm_omni.diffusion")
    spec = importlib.util.spec_from_file_location(
        "vllm_omni.diffusion.data", STUBS / "vllm_omni_diffusion_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _install(spec, entry_points_dir=None, layer=False):
    """The engine's modules over the stand-in vllm (sys.path and sys.modules changed; the caller
    restores them), dattn's entry points from ``entry_points_dir`` (a directory holding a
    dist-info), dattn.vllm_omni reloaded on the engine's classes; with ``layer``, the engine's
    Attention layer and the modules around it too."""
    sys.path.insert(0, str(STUBS))
    if entry_points_dir is not None:
        sys.path.insert(0, str(entry_points_dir))
    root = types.ModuleType("vllm_omni")
    root.__path__ = list(spec.submodule_search_locations)
    root.__file__ = spec.origin
    sys.modules["vllm_omni"] = root
    ns = types.SimpleNamespace()
    ns.data = _register_data_stand_in()
    ns.platforms = importlib.import_module("vllm_omni.platforms")
    ns.plugins = importlib.import_module("vllm_omni.plugins")
    ns.interface = importlib.import_module("vllm_omni.platforms.interface")
    ns.abstract = importlib.import_module("vllm_omni.diffusion.attention.backends.abstract")
    ns.registry = importlib.import_module("vllm_omni.diffusion.attention.backends.registry")
    ns.selector = importlib.import_module("vllm_omni.diffusion.attention.selector")
    ns.nvml = importlib.import_module("vllm.utils.import_utils")
    ns.adapter = importlib.reload(dattn.vllm_omni.backends)
    assert ns.adapter.ENGINE_AVAILABLE
    modules = [ns.platforms, ns.selector, ns.abstract]
    if layer:
        ns.sdpa = importlib.import_module("vllm_omni.diffusion.attention.backends.sdpa")
        ns.layer = importlib.import_module("vllm_omni.diffusion.attention.layer")
        ns.config = importlib.import_module("vllm_omni.diffusion.config")
        ns.fc = importlib.import_module("vllm_omni.diffusion.forward_context")
        ns.parallel_state = importlib.import_module(
            "vllm_omni.diffusion.distributed.parallel_state")
        modules += [ns.sdpa, ns.layer, ns.fc, ns.parallel_state]
    for m in modules:
        assert Path(m.__file__).is_relative_to(Path(spec.origin).parent), m  # the real files
    return ns


@contextlib.contextmanager
def _engine(tmp_path, monkeypatch, entry_point=True, layer=False):
    """The real vllm-omni modules over the stand-in vllm, dattn's entry point installed (with
    ``entry_point``), dattn.vllm_omni reloaded on the engine's classes; sys.modules, sys.path
    and dattn.vllm_omni restored afterwards."""
    version, spec = _engine_spec()
    if spec is None:
        pytest.skip("vllm-omni is not installed (pip install --no-deps vllm-omni==0.30.0)")
    if version != PINNED:
        pytest.skip(f"vllm-omni {version} is installed; these tests pin {PINNED}")
    for var in ("DATTN_VLLM_OMNI", "DIFFUSION_ATTENTION_BACKEND", "VLLM_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    saved = {n: sys.modules[n] for n in list(sys.modules) if _ours(n)}
    for n in saved:
        del sys.modules[n]
    saved_path = list(sys.path)
    try:
        if entry_point:
            _write_dist_info(tmp_path)
        else:
            # dattn installed as a wheel declares the same entry points: hide them (the engine
            # reads importlib.metadata.entry_points(group=...) when it loads its plugins).
            real = importlib.metadata.entry_points

            def without_dattn(**kwargs):
                found = real(**kwargs)
                if "group" not in kwargs:
                    return found
                return importlib.metadata.EntryPoints(
                    ep for ep in found if not ep.value.startswith("dattn.")
                )

            monkeypatch.setattr(importlib.metadata, "entry_points", without_dattn)
        yield _install(spec, tmp_path if entry_point else None, layer=layer)
    finally:
        sys.path[:] = saved_path
        for n in [n for n in sys.modules if _ours(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        importlib.reload(dattn.vllm_omni.backends)


@pytest.fixture
def engine(tmp_path, monkeypatch):
    with _engine(tmp_path, monkeypatch) as ns:
        yield ns


@pytest.fixture
def layer_engine(tmp_path, monkeypatch):
    """The engine with its Attention layer, parallel strategies and forward context loaded."""
    with _engine(tmp_path, monkeypatch, layer=True) as ns:
        yield ns


@pytest.fixture
def engine_without_entry_point(tmp_path, monkeypatch):
    with _engine(tmp_path, monkeypatch, entry_point=False) as ns:
        yield ns


def resolve(ns):
    return ns.platforms.resolve_current_omni_platform_cls_qualname()


# --- platform resolution through the entry point ---------------------------------------------


def test_the_engine_finds_dattns_entry_points(engine):
    found = engine.plugins.load_omni_plugins_by_group(engine.plugins.OMNI_PLATFORM_PLUGINS_GROUP)
    from dattn.vllm_omni.plugin import general_plugin, platform_plugin

    assert found == {"dattn": platform_plugin}
    found = engine.plugins.load_omni_plugins_by_group(engine.plugins.OMNI_DEFAULT_PLUGINS_GROUP)
    assert found == {"dattn": general_plugin}


def test_no_accelerator_resolves_dattns_platform(engine):
    assert resolve(engine) == "dattn.vllm_omni.platform.DattnCpuOmniPlatform"
    platform = engine.platforms.current_omni_platform  # the engine's lazy global
    from dattn.vllm_omni.platform import DattnCpuOmniPlatform

    assert isinstance(platform, DattnCpuOmniPlatform)
    assert isinstance(platform, engine.interface.OmniPlatform)
    assert platform.is_out_of_tree() and not platform.is_cuda()
    assert platform.get_torch_device() == torch.device("cpu")


def test_without_the_entry_point_the_engine_has_no_platform(engine_without_entry_point):
    assert resolve(engine_without_entry_point) == "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"


def test_a_cuda_host_changes_nothing(engine, monkeypatch):
    """NVML reports a GPU: the engine's CUDA platform is chosen, dattn's plugin returns None."""
    monkeypatch.setattr(engine.nvml, "NVML_DEVICE_COUNT", 1)
    from dattn.vllm_omni.plugin import platform_plugin

    assert platform_plugin() is None
    assert resolve(engine) == "vllm_omni.platforms.cuda.platform.CudaOmniPlatform"
    monkeypatch.setenv("DATTN_VLLM_OMNI", "1")  # the user opts in: dattn's platform wins
    assert resolve(engine) == "dattn.vllm_omni.platform.DattnCpuOmniPlatform"


def test_opting_out(engine, monkeypatch):
    monkeypatch.setenv("DATTN_VLLM_OMNI", "0")
    assert resolve(engine) == "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"
    monkeypatch.setenv("DATTN_VLLM_OMNI", "auto")
    assert resolve(engine) == "dattn.vllm_omni.platform.DattnCpuOmniPlatform"


# --- the selector --------------------------------------------------------------------------


class EnvAttentionConfig:
    """What vllm_omni.diffusion.data.build_attention_config makes of DIFFUSION_ATTENTION_BACKEND
    (its ``default`` AttentionSpec), with the ``resolve_with_source`` the selector calls."""

    def __init__(self, backend):
        self.default = types.SimpleNamespace(backend=backend, backend_kwargs=lambda: None)

    def resolve_with_source(self, role="self", role_category=None):
        return self.default, "attention_config.default"


def test_selector_default_is_dattn(engine):
    backend, spec = engine.selector.get_attn_backend_for_role("self", head_size=128)
    assert backend is engine.adapter.DattnAttentionBackend and spec is None
    assert backend.get_name() == "DATTN"
    assert issubclass(backend, engine.abstract.AttentionBackend)
    cross, _ = engine.selector.get_attn_backend_for_role("cross", 64, attention_config=None)
    assert cross is backend
    assert engine.selector.get_attn_backend_for_capability("self") is backend


@pytest.mark.parametrize("value", ["DATTN", "dattn", "FLASH", "REFERENCE"])
def test_selector_with_the_variable(engine, monkeypatch, value):
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", value)
    config = EnvAttentionConfig(os.environ["DIFFUSION_ATTENTION_BACKEND"])
    backend, spec = engine.selector.get_attn_backend_for_role("self", 128, attention_config=config)
    # DATTN: dattn's own class; a dattn backend's name: the class bound to that backend (the
    # engine tells the impl the options only, not the name).
    if value.upper() == "DATTN":
        assert backend is engine.adapter.DattnAttentionBackend
    else:
        assert backend is engine.adapter.bound_backend(value)
        assert issubclass(backend, engine.adapter.DattnAttentionBackend)
    assert spec is config.default
    impl = backend.get_impl_cls()(
        num_heads=2, head_size=128, softmax_scale=None, causal=False, backend_kwargs=spec.backend_kwargs(),
        role="self", backend_explicit=True,
    )
    assert impl.backend_name == ("REFERENCE" if value == "REFERENCE" else "FLASH")


def test_selector_refuses_the_engines_gpu_backends(engine):
    with pytest.raises(ValueError, match="FLASH_ATTN.*DATTN.*TORCH_SDPA"):
        engine.selector.get_attn_backend_for_role(
            "self", 128, attention_config=EnvAttentionConfig("FLASH_ATTN"))


def test_selector_gives_the_engines_sdpa_for_torch_sdpa(engine):
    """TORCH_SDPA on dattn's platform is the engine's own SDPA backend (the class its registry
    names), and its forward runs here (the engine's _forward_impl)."""
    backend, spec = engine.selector.get_attn_backend_for_role(
        "self", 64, attention_config=EnvAttentionConfig("TORCH_SDPA"))
    sdpa = importlib.import_module("vllm_omni.diffusion.attention.backends.sdpa")
    assert backend is sdpa.SDPABackend and spec.backend == "TORCH_SDPA"
    impl = backend.get_impl_cls()(num_heads=2, head_size=64, softmax_scale=None)
    q, k, v = rand(1, 9, 2, 64, seed=1), rand(1, 9, 2, 64, seed=2), rand(1, 9, 2, 64, seed=3)
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    assert torch.equal(impl.forward(q, k, v), want.transpose(1, 2))
    with pytest.raises(ValueError, match="head size 2048"):
        engine.selector.get_attn_backend_for_role(
            "self", 2048, attention_config=EnvAttentionConfig("TORCH_SDPA"))


def test_the_general_plugin_names_dattn_in_the_engines_enum(engine):
    """The engine's capability probe for an explicit selection indexes its closed
    DiffusionAttentionBackendEnum: DATTN named explicitly fails there until the engine runs its
    general plugins (as its workers do at start), dattn's among them."""
    pytest.importorskip("aenum")  # a dependency of vllm-omni (installed here with --no-deps)
    config = EnvAttentionConfig("DATTN")
    with pytest.raises(ValueError, match="Unknown diffusion attention backend: 'DATTN'"):
        engine.selector.get_attn_backend_for_capability("self", attention_config=config)
    engine.plugins.load_omni_general_plugins()
    engine.plugins.load_omni_general_plugins()  # once per process; dattn's is idempotent too
    from dattn.vllm_omni.plugin import general_plugin

    general_plugin()
    enum = engine.registry.DiffusionAttentionBackendEnum
    assert enum["DATTN"].get_class() is engine.adapter.DattnAttentionBackend
    probe = engine.selector.get_attn_backend_for_capability("self", attention_config=config)
    assert probe is engine.adapter.DattnAttentionBackend
    assert probe.supports_attention_mask()
    assert enum["TORCH_SDPA"].get_path().endswith("sdpa.SDPABackend")  # the others unchanged


def test_the_general_plugin_does_nothing_on_a_cuda_host(engine, monkeypatch):
    pytest.importorskip("aenum")
    monkeypatch.setattr(engine.nvml, "NVML_DEVICE_COUNT", 2)
    members = list(engine.registry.DiffusionAttentionBackendEnum.__members__)
    engine.plugins.load_omni_general_plugins()
    assert list(engine.registry.DiffusionAttentionBackendEnum.__members__) == members


def test_backend_declares_the_engines_platform_value(engine):
    b = engine.adapter.DattnAttentionBackend
    assert engine.interface.OmniPlatformEnum.OOT.value in b.supported_platforms
    from dattn.vllm_omni.platform import DattnCpuOmniPlatform

    DattnCpuOmniPlatform.validate_dattn_backend(128)  # the engine's checks, passing
    key = DattnCpuOmniPlatform.device_name  # what the engine's layer passes as platform_key
    assert b.get_impl_cls().supports_kv_cache_dtype("fp8", key)


# --- a forward through the engine's AttentionImpl path -------------------------------------


def test_forward_through_the_engines_impl_equals_reference(engine, monkeypatch):
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "DATTN")  # the engine's name: no clash
    backend, _ = engine.selector.get_attn_backend_for_role(
        "self", 64, attention_config=EnvAttentionConfig("DATTN"))
    # The keyword arguments vllm_omni.diffusion.attention.layer.Attention passes.
    impl = backend.get_impl_cls()(
        num_heads=4, head_size=64, softmax_scale=0.125, causal=False, num_kv_heads=2,
        qkv_layout=None, prefix="transformer_blocks.0.attn", backend_kwargs=None, role="self",
        backend_explicit=True,
    )
    assert isinstance(impl, engine.abstract.AttentionImpl)
    B, S, J, H, Hkv, D = 2, 48, 7, 4, 2, 64
    q, k, v = rand(B, S, H, D, seed=1), rand(B, S, Hkv, D, seed=2), rand(B, S, Hkv, D, seed=3)
    tq, tk, tv = rand(B, J, H, D, seed=4), rand(B, J, Hkv, D, seed=5), rand(B, J, Hkv, D, seed=6)
    meta = engine.abstract.AttentionMetadata(joint_query=tq, joint_key=tk, joint_value=tv)
    got = impl.forward(q, k, v, meta)
    reference = dattn.Attention(4, 64, softmax_scale=0.125, num_kv_heads=2, backend="REFERENCE")
    want = reference.forward(q, k, v, dattn.AttentionMetadata(joint_query=tq, joint_key=tk,
                                                              joint_value=tv))
    assert impl.backend_name == "FLASH"
    assert_close(got, want.double())
    # Why dattn overrides forward: the engine's own dispatch knows no out-of-tree platform.
    with pytest.raises(NotImplementedError, match="No forward implementation for platform"):
        engine.abstract.AttentionImpl.forward(impl, q, k, v, meta)


def test_the_engines_layer_builds_impls_with_these_arguments(layer_engine):
    """The engine's own Attention layer on dattn's platform builds dattn's impl with the
    keyword arguments the forward test above passes (and SDPA as its sdpa_fallback)."""
    layer, _ = build_layer(layer_engine, heads=4, kv_heads=2, head_size=64)
    impl = layer.attention
    assert type(impl) is layer_engine.adapter.DattnAttentionImpl
    assert (impl.num_heads, impl.num_kv_heads, impl.head_size) == (4, 2, 64)
    assert impl.prefix == "transformer_blocks.0.attn" and impl.role == "self"
    assert impl.extra_impl_args == {"role": "self", "backend_explicit": False}
    assert layer.backend_pref == "DATTN" and not layer.backend_explicit
    assert type(layer.sdpa_fallback) is layer_engine.sdpa.SDPAImpl
    assert build_layer(layer_engine, role="cross")[0].attention.role == "cross"


def test_the_plugins_without_the_engine(monkeypatch):
    """The entry points load and run where vllm-omni is not importable (the engine is absent
    or broken): the platform hook answers from torch's view alone, the general hook does
    nothing."""
    from dattn.vllm_omni import plugin

    monkeypatch.delenv("DATTN_VLLM_OMNI", raising=False)
    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # `import vllm_omni...` raises
    assert plugin.accelerator_present() is None  # a CPU torch
    assert plugin.platform_plugin() == plugin.PLATFORM_QUALNAME
    assert plugin.general_plugin() is None
    monkeypatch.setenv("DATTN_VLLM_OMNI", "off")
    assert plugin.platform_plugin() is None
    monkeypatch.setenv("DATTN_VLLM_OMNI", "maybe")  # unknown: auto, with a warning
    assert plugin.mode() == "auto"


def test_pyproject_declares_the_entry_points_these_tests_register():
    """pyproject.toml declares the entry points these tests register (so the installed
    package is what the engine finds), and each names a callable."""
    import configparser
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = {
        group: points
        for group, points in project.get("entry-points", {}).items()
        if group.startswith("vllm_omni.")
    }
    registered = configparser.ConfigParser()
    registered.read_string(ENTRY_POINTS)
    assert declared == {g: dict(registered[g]) for g in registered.sections()}
    for group, points in declared.items():
        for target in points.values():
            module, _, func = target.partition(":")
            assert callable(getattr(importlib.import_module(module), func)), target


@pytest.mark.parametrize("value", ["DATTN", "TORCH_SDPA", "FLASH_ATTN", "auto", "reference"])
def test_the_engines_variable_never_breaks_dattns_layers(monkeypatch, value):
    """DIFFUSION_ATTENTION_BACKEND set for the engine: dattn's registry raises on names it does
    not know (a plain dattn.Attention), but the layers dattn's adapters build (the engine
    backend's impl, the SDPA drop-in and its patch) take dattn's choice explicitly."""
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", value)
    import collections

    import dattn.torch_adapter as ta

    monkeypatch.setattr(ta, "_LAYERS", collections.OrderedDict())  # cached with their backend
    want_backend = "REFERENCE" if value == "reference" else "FLASH"
    ours = value.lower() in ("auto", "reference")
    if not ours:
        with pytest.raises(dattn.InvalidArgument, match="unknown attention backend"):
            dattn.Attention(2, 16)
    q, k, v = rand(1, 2, 24, 16, seed=1), rand(1, 2, 24, 16, seed=2), rand(1, 2, 24, 16, seed=3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert_close(dattn.scaled_dot_product_attention(q, k, v).transpose(1, 2),
                 want.transpose(1, 2).double())
    with dattn.patch_torch_sdpa():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert_close(got.transpose(1, 2), want.transpose(1, 2).double())
    impl = dattn.vllm_omni.DattnAttentionImpl(2, 16, None)
    assert impl.backend_name == want_backend
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    assert_close(impl.forward(*bshd), want.transpose(1, 2).double())


# --- the engine's Attention layer on dattn's platform (one process) ---------------------------


def _config(ns, backend=None, parallel=None):
    """An OmniDiffusionConfig: the platform default (DATTN) or ``backend`` by name."""
    attention = ns.data.AttentionConfig(
        default=None if backend is None else ns.data.AttentionSpec(backend=backend))
    return ns.data.OmniDiffusionConfig(
        model="test", parallel_config=parallel or ns.data.DiffusionParallelConfig(),
        diffusion_attention_config=attention)


def build_layer(ns, backend=None, role="self", heads=4, kv_heads=None, head_size=16,
                parallel=None, **kwargs):
    """The engine's Attention layer, built as models build it (under the diffusion config and,
    as the engine's SP tests do, the forward context its parallel strategy is chosen from)."""
    config = _config(ns, backend, parallel)
    with ns.config.set_current_diffusion_config(config), \
            ns.fc.set_forward_context(omni_diffusion_config=config):
        layer = ns.layer.Attention(
            num_heads=heads, head_size=head_size, causal=False, softmax_scale=head_size ** -0.5,
            num_kv_heads=kv_heads, prefix="transformer_blocks.0.attn", role=role, **kwargs)
    return layer, config


def run_layer(ns, layer, config, q, k, v, meta=None):
    with ns.fc.set_forward_context(omni_diffusion_config=config):
        return layer(q, k, v, meta)


def both_layers(ns, **kwargs):
    """The same layer on dattn (the platform default) and on the engine's TORCH_SDPA."""
    ours, config = build_layer(ns, **kwargs)
    sdpa, sdpa_config = build_layer(ns, backend="TORCH_SDPA", **kwargs)
    assert type(ours.attention) is ns.adapter.DattnAttentionImpl
    assert type(sdpa.attention) is ns.sdpa.SDPAImpl
    return ((lambda *a: run_layer(ns, ours, config, *a)),
            (lambda *a: run_layer(ns, sdpa, sdpa_config, *a)))


def _padded_keys(B, S, dtype):
    """Key masks of different lengths per batch item, as Qwen-Image builds them for prompts of
    different lengths (int64 by default), in ``dtype``."""
    keep = torch.ones(B, S, dtype=torch.int64)
    keep[0, S - 9:] = 0
    keep[1, 3:5] = 0
    return keep.to(dtype)


MASK_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.int8, torch.float32, torch.bfloat16,
               torch.bool]


@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("role", ["cross", "self"])
def test_2d_masks_of_every_dtype_mean_what_the_engines_sdpa_makes_of_them(layer_engine, dtype,
                                                                           role):
    """A 2-D [B, Skv] mask of an integer or 0/1 float dtype is a key mask (nonzero = attend),
    as the engine's SDPA reads it. Cross-attention (here with Sq == Skv) computes every query
    row, as the engine's SDPA does; self-attention outputs zeros for the padding rows (dattn's
    rule, docs/semantics.md) and the engine's values everywhere else."""
    ours, sdpa = both_layers(layer_engine, role=role)
    B, S, H, D = 2, 24, 4, 16
    q, k, v = rand(B, S, H, D, seed=1), rand(B, S, H, D, seed=2), rand(B, S, H, D, seed=3)
    mask = _padded_keys(B, S, dtype)
    meta = layer_engine.abstract.AttentionMetadata
    got = ours(q, k, v, meta(attn_mask=mask))
    want = sdpa(q, k, v, meta(attn_mask=mask))
    assert torch.equal(mask, _padded_keys(B, S, dtype))  # the caller's mask is left alone
    keep = mask.bool()
    if role == "cross":
        assert_close(got, want.double())
        assert float(got[~keep].abs().amax()) > 0.1  # the rows past the valid keys are computed
    else:
        assert_close(got[keep], want[keep].double())
        assert torch.count_nonzero(got[~keep]) == 0


def test_an_additive_2d_float_mask_is_refused_naming_the_field(layer_engine):
    """Read as a keep-mask (the engine's SDPA does so), an additive 0/-inf 2-D mask would be
    inverted: dattn refuses it, naming the field, and takes it as a 4-D mask."""
    ours, sdpa = both_layers(layer_engine, role="cross")
    q, k, v = rand(2, 12, 4, 16, seed=1), rand(2, 12, 4, 16, seed=2), rand(2, 12, 4, 16, seed=3)
    additive = torch.zeros(2, 12)
    additive[0, 8:] = float("-inf")
    meta = layer_engine.abstract.AttentionMetadata
    match = "attn_mask: a 2-D float mask must hold 0/1"
    with pytest.raises(dattn.InvalidArgument, match=match) as e:
        ours(q, k, v, meta(attn_mask=additive))
    assert e.value.field == "attn_mask"
    four_d = additive[:, None, None, :]
    want = sdpa(q, k, v, meta(attn_mask=four_d))
    assert_close(ours(q, k, v, meta(attn_mask=four_d)), want.double())


def test_a_2d_mask_pytorch_broadcasts_over_the_rows(layer_engine):
    """A 2-D mask that is not [B, Skv] reaches PyTorch's SDPA as it is and broadcasts over
    [Sq, Skv] there: dattn reads it the same way (bool keep or additive float)."""
    ours, sdpa = both_layers(layer_engine, role="cross")
    B, Sq, Skv, H, D = 3, 10, 14, 4, 16
    q, k, v = rand(B, Sq, H, D, seed=1), rand(B, Skv, H, D, seed=2), rand(B, Skv, H, D, seed=3)
    keep = rand(Sq, Skv, seed=4) > -0.5
    keep[:, 0] = True
    bias = rand(Sq, Skv, seed=5)
    meta = layer_engine.abstract.AttentionMetadata
    for mask in (keep, bias, keep[:1], bias[:1]):
        want = sdpa(q, k, v, meta(attn_mask=mask))
        assert_close(ours(q, k, v, meta(attn_mask=mask)), want.double())


def test_cross_attention_with_a_key_mask_and_equal_lengths(layer_engine):
    """Issue item 3: cross-attention, Sq == Skv, a 2-D key mask; every query row is computed."""
    ours, sdpa = both_layers(layer_engine, role="cross", heads=4, kv_heads=2)
    B, S = 2, 40
    q, k, v = rand(B, S, 4, 16, seed=1), rand(B, S, 2, 16, seed=2), rand(B, S, 2, 16, seed=3)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 17:] = False
    keep[1, 30:] = False
    meta = layer_engine.abstract.AttentionMetadata
    got, want = ours(q, k, v, meta(attn_mask=keep)), sdpa(q, k, v, meta(attn_mask=keep))
    assert float((got - want).abs().amax()) < 1e-5
    # The engine's model-scoped cross roles are cross too; its self roles are self.
    assert layer_engine.adapter.dattn_role("longcat_video_avatar.cross") == "cross"
    assert layer_engine.adapter.dattn_role("ltx2.audio_to_video") == "cross"
    assert layer_engine.adapter.dattn_role("longcat_video_avatar.self") == "self"


@pytest.mark.parametrize("heads", [(4, 4, 2, 2), (8, 2, 4, 1), (4, 2, 2, 1), (28, 7, 16, 4)],
                         ids=["half-mha", "half-gqa", "half-gqa2", "uaa-padded"])
def test_heads_come_from_the_tensors(layer_engine, heads):
    """A call with other head counts than the layer's (a per-rank shard under Ulysses, a padded
    one under its advanced_uaa mode) runs on a layer for those counts, if they keep the model's
    GQA ratio; the engine's SDPA is the reference."""
    H, Hkv, hq, hkv = heads
    ours, sdpa = both_layers(layer_engine, heads=H, kv_heads=Hkv)
    q = rand(2, 20, hq, 16, seed=1)
    k, v = rand(2, 20, hkv, 16, seed=2), rand(2, 20, hkv, 16, seed=3)
    assert_close(ours(q, k, v), sdpa(q, k, v).double())
    assert_close(ours(q, k, v), sdpa(q, k, v).double())  # the cached shard layer


def test_head_counts_off_the_models_ratio_are_refused_naming_the_tensor(layer_engine):
    layer, config = build_layer(layer_engine, heads=4, kv_heads=2)
    run = lambda *a: run_layer(layer_engine, layer, config, *a)  # noqa: E731
    x = lambda h: rand(1, 8, h, 16)  # noqa: E731
    with pytest.raises(dattn.InvalidArgument, match="query: query has 3 heads and key 2") as e:
        run(x(3), x(2), x(2))
    assert e.value.field == "query"
    with pytest.raises(dattn.InvalidArgument, match="key: query has 4 heads and key 4") as e:
        run(x(4), x(4), x(4))
    assert e.value.field == "key"
    with pytest.raises(dattn.InvalidArgument, match="value"):
        run(x(2), x(1), x(2))  # a shard's value must match its key: the core names it


def test_joint_tokens_joined_by_the_engines_strategy_are_not_joined_again(layer_engine):
    """What the Ulysses strategy hands the backend: Q/K/V with the joint rows already joined,
    and the metadata still holding the joint tensors (joint_query with every head, joint_key
    and joint_value sliced to the rank's heads). dattn attaches them only where nothing has."""
    ns = layer_engine
    impl = ns.adapter.DattnAttentionImpl(num_heads=4, head_size=16, softmax_scale=None, role="self")
    B, S, J, D = 2, 12, 5, 16
    jq, jk, jv = (rand(B, J, 4, D, seed=s) for s in (4, 5, 6))
    q, k, v = (rand(B, S, 2, D, seed=s) for s in (1, 2, 3))  # rank 1's two heads
    for strategy in ("front", "rear"):
        order = (lambda j, x: [j, x]) if strategy == "front" else (lambda j, x: [x, j])
        qq = torch.cat(order(jq[:, :, 2:], q), dim=1)
        kk = torch.cat(order(jk[:, :, 2:], k), dim=1)
        vv = torch.cat(order(jv[:, :, 2:], v), dim=1)
        want = ns.sdpa.SDPAImpl(2, D, None)._forward_impl(qq, kk, vv)

        def meta():
            return ns.abstract.AttentionMetadata(
                joint_query=jq, joint_key=jk[:, :, 2:], joint_value=jv[:, :, 2:],
                joint_strategy=strategy)

        assert_close(impl.forward(qq, kk, vv, meta()), want.double())  # no forward context
        parallel = ns.data.DiffusionParallelConfig(ulysses_degree=2)
        with ns.fc.set_forward_context(omni_diffusion_config=_config(ns, parallel=parallel)):
            assert_close(impl.forward(qq, kk, vv, meta()), want.double())  # the SP region
    # Outside the SP region and without that trace, dattn attaches them (docs/semantics.md).
    q4, k4, v4 = (rand(B, S, 4, D, seed=s) for s in (1, 2, 3))
    fresh = ns.abstract.AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv)
    want = ns.sdpa.SDPAImpl(4, D, None)._forward_impl(
        *(torch.cat(p, dim=1) for p in ((jq, q4), (jk, k4), (jv, v4))))
    assert_close(impl.forward(q4, k4, v4, fresh), want.double())
    with ns.fc.set_forward_context(omni_diffusion_config=_config(ns)):  # SP off
        assert_close(impl.forward(q4, k4, v4, fresh), want.double())


def test_paged_kv_is_not_advertised(layer_engine):
    """dattn's backend claims neither paged capability, so the engine's layer refuses a
    Scheduler-paged call with its own error (never a dense fallback, never dattn handed the
    engine's paged context); dattn's own PagedCall still runs through forward_paged."""
    ns = layer_engine
    backend = ns.adapter.DattnAttentionBackend
    assert backend.supports_paged_kv is False and backend.indexes_kv_by_block_stride() is False
    layer, config = build_layer(ns, paged_kv_cache_role="self")
    q = rand(1, 8, 4, 16)
    with ns.fc.set_forward_context(omni_diffusion_config=config):
        ns.fc.get_forward_context().paged_kv_adapter = object()  # the Worker's adapter
        with pytest.raises(NotImplementedError, match="paged support; selected DATTN"):
            layer(q, q, q)
    with pytest.raises(dattn.InvalidArgument, match="paged_kv_context: expected a dattn.PagedCall"):
        layer.attention.forward_paged(types.SimpleNamespace(query=q))


def test_the_engines_sdpa_runs_on_dattns_platform(layer_engine):
    """Every engine layer builds an SDPAImpl (sdpa_fallback), which Sana-Video and Sana-WM call
    directly for masked cross-attention, and Ring runs the engine's SDPA ring: its base class
    dispatch knows no out-of-tree platform and its ring block kernel is CUDA's, until dattn's
    general plugin (or the platform, when a layer picks its backend) gives them the engine's
    own _forward_impl and PyTorch's CPU kernel here."""
    ns = layer_engine
    B, Sq, Skv = 2, 16, 10
    q, k, v = rand(B, Sq, 4, 16, seed=1), rand(B, Skv, 2, 16, seed=2), rand(B, Skv, 2, 16, seed=3)
    mask = torch.ones(B, Skv, dtype=torch.int64)
    mask[1, 6:] = 0
    meta = ns.abstract.AttentionMetadata(attn_mask=mask)
    bare = ns.sdpa.SDPAImpl(num_heads=4, head_size=16, softmax_scale=None, num_kv_heads=2)
    with pytest.raises(NotImplementedError, match="No forward implementation for platform"):
        bare.forward(q, k, v, meta)  # the engine alone
    ring_kernels = importlib.import_module(
        "vllm_omni.diffusion.attention.backends.ring.ring_kernels")
    qh, kh, vh = (t.transpose(1, 2)
                  for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
    with pytest.raises(NotImplementedError, match="_scaled_dot_product_efficient_attention"):
        ring_kernels.pytorch_attn_forward(q, k, v, causal=False, op_type="efficient")
    ns.plugins.load_omni_general_plugins()  # as every engine worker does at start
    from dattn.vllm_omni.plugin import general_plugin, serve_engine_sdpa

    general_plugin()
    assert serve_engine_sdpa()  # idempotent
    assert ns.sdpa.SDPAImpl._dattn_engine_forward is ns.abstract.AttentionImpl.forward
    want = bare._forward_impl(q, k, v, meta, mask_mode="broadcast_k")
    assert torch.equal(bare.forward(q, k, v, meta), want)
    out, lse = ring_kernels.pytorch_attn_forward(q, k, v, causal=False, op_type="efficient")
    want_ring = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)
    assert_close(out, want_ring.double())
    scores = torch.einsum("bhqd,bhkd->bhqk", qh.double(), kh.double()) / 4.0
    assert_close(lse, torch.logsumexp(scores, dim=-1), what="lse")
    layer, _ = build_layer(ns, role="cross", heads=4, kv_heads=2)
    assert torch.equal(layer.sdpa_fallback.forward(q, k, v, meta), want)  # Sana-Video's call
    assert_close(layer.attention.forward(q, k, v, meta), want.double())  # dattn: the same
    # On another platform the engine's own dispatch runs, unchanged.
    calls = []
    cuda = types.SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: True)
    platforms = sys.modules["vllm_omni.platforms"]  # its current_omni_platform is lazy
    saved = ns.abstract.current_omni_platform
    try:
        platforms.current_omni_platform = ns.abstract.current_omni_platform = cuda
        ns.sdpa.SDPAImpl.forward_cuda = lambda self, *a: calls.append(a) or "cuda"
        assert bare.forward(q, k, v, meta) == "cuda" and calls
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_efficient_attention"):
            ring_kernels.pytorch_attn_forward(q, k, v, causal=False, op_type="efficient")
    finally:
        del platforms.current_omni_platform  # back to the module's lazy lookup
        ns.abstract.current_omni_platform = saved
        del ns.sdpa.SDPAImpl.forward_cuda
    assert bare.forward(q, k, v, meta) is not None and len(calls) == 1


def test_sage_attn_runs_on_dattns_sage(layer_engine):
    """The engine's SAGE_ATTN (and SAGE_ATTN_3) on dattn's platform: a layer on dattn's SAGE
    (8-bit Q.K^T), the engine's SDPA within SAGE's accuracy; the names are not refused."""
    ns = layer_engine
    for name in ("SAGE_ATTN", "SAGE_ATTN_3"):
        layer, config = build_layer(ns, backend=name, heads=4, head_size=64)
        assert type(layer.attention) is ns.adapter.DattnSageAttentionImpl, name
        assert layer.attention.backend_name == "SAGE"
        sdpa, sdpa_config = build_layer(ns, backend="TORCH_SDPA", heads=4, head_size=64)
        q, k, v = rand(2, 80, 4, 64, seed=1), rand(2, 80, 4, 64, seed=2), rand(2, 80, 4, 64, seed=3)
        got = run_layer(ns, layer, config, q, k, v)
        want = run_layer(ns, sdpa, sdpa_config, q, k, v)
        cos = torch.nn.functional.cosine_similarity(got.flatten(2).double(),
                                                    want.flatten(2).double(), dim=-1)
        assert float(cos.min()) >= 0.9995, (name, float(cos.min()))
        assert "int8" in layer.attention.layer.last_engine or "vnni" in layer.attention.layer.last_engine


def test_the_layer_with_joint_rows_and_masks_matches_the_engines_sdpa_without_sp(layer_engine):
    """No SP: what a model such as Qwen-Image sends, Q/K/V already [text | image] and one
    int64 [B, J + S] mask, role self; the engine's SDPA is the reference on every valid row."""
    ours, sdpa = both_layers(layer_engine, heads=4)
    B, S = 2, 30
    q, k, v = rand(B, S, 4, 16, seed=1), rand(B, S, 4, 16, seed=2), rand(B, S, 4, 16, seed=3)
    mask = _padded_keys(B, S, torch.int64)
    meta = layer_engine.abstract.AttentionMetadata
    got, want = ours(q, k, v, meta(attn_mask=mask)), sdpa(q, k, v, meta(attn_mask=mask))
    keep = mask.bool()
    assert_close(got[keep], want[keep].double())
    assert torch.count_nonzero(got[~keep]) == 0


# --- sequence parallelism: two processes over gloo ----------------------------------------------

SP_WORLD = 2
SP_TIMEOUT_S = 60  # both runs together; each takes a few seconds
SP_B, SP_S, SP_J, SP_D = 2, 24, 6, 16


def _sp_cases(mode):
    """(id, heads, kv heads, joint rows, joint strategy, masked, DATTN named explicitly)."""
    cases = [
        ("plain", 4, 4, 0, "front", False, False),
        ("gqa", 4, 2, 0, "front", False, False),
        ("joint-front", 4, 4, SP_J, "front", False, False),
        ("joint-rear", 4, 4, SP_J, "rear", False, False),
        ("joint-gqa", 4, 2, SP_J, "front", False, False),
    ]
    if mode == "ulysses":  # the engine's Ring refuses masks
        cases += [("joint-int64-masks", 4, 2, SP_J, "front", True, False),
                  ("int64-mask", 4, 4, 0, "front", True, False),
                  ("explicit", 4, 4, SP_J, "front", False, True)]
    else:
        cases += [("explicit", 4, 4, SP_J, "rear", False, True)]
    return cases


def _sp_inputs(H, Hkv, J, strategy, masked):
    B, S, D = SP_B, SP_S, SP_D
    full = dict(q=rand(B, S, H, D, seed=1), k=rand(B, S, Hkv, D, seed=2),
                v=rand(B, S, Hkv, D, seed=3))
    if J:
        full.update(jq=rand(B, J, H, D, seed=4), jk=rand(B, J, Hkv, D, seed=5),
                    jv=rand(B, J, Hkv, D, seed=6))
    if masked:  # int64, as Qwen-Image sends them: the image's over the whole (gathered) sequence
        full["mask"] = _padded_keys(B, S, torch.int64)
        if J:
            full["jmask"] = torch.ones(B, J, dtype=torch.int64)
            full["jmask"][1, J - 2:] = 0
    return full


def _sp_metadata(ns, full, strategy):
    fields = {}
    if "jq" in full:
        fields.update(joint_query=full["jq"], joint_key=full["jk"], joint_value=full["jv"],
                      joint_strategy=strategy)
    if "mask" in full:
        fields["attn_mask"] = full["mask"].clone()
        if "jmask" in full:
            fields["joint_attn_mask"] = full["jmask"].clone()
    return ns.abstract.AttentionMetadata(**fields) if fields else None


def _sp_full_reference(full, strategy):
    """One process, all rows: [joint | image] (or [image | joint]) in PyTorch's SDPA."""
    def cat(joint, x):
        return torch.cat([joint, x] if strategy == "front" else [x, joint], dim=1)

    q, k, v = full["q"], full["k"], full["v"]
    keep = full.get("mask")
    if "jq" in full:
        q, k, v = cat(full["jq"], q), cat(full["jk"], k), cat(full["jv"], v)
        if keep is not None:
            keep = cat(full["jmask"], keep)
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = None if keep is None else keep.bool()[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2), (None if keep is None else keep.bool())


def _rel(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _sp_case(ns, rank, parallel, case):
    name, H, Hkv, J, strategy, masked, explicit = case
    full = _sp_inputs(H, Hkv, J, strategy, masked)
    shard = SP_S // SP_WORLD
    rows = slice(rank * shard, (rank + 1) * shard)
    local = [full[n][:, rows] for n in ("q", "k", "v")]
    result = {}
    outs = {}
    import dattn.vllm_omni.plugin as plugin

    for label, backend in (("dattn", "DATTN" if explicit else None), ("sdpa", "TORCH_SDPA")):
        layer, config = build_layer(ns, backend=backend, heads=H, kv_heads=Hkv, head_size=SP_D,
                                    parallel=parallel)
        blocks = plugin.ring_client().calls
        result[f"{label}_impl"] = type(layer.attention).__name__
        result[f"{label}_strategy"] = layer.parallel_strategy.name
        try:
            outs[label] = run_layer(ns, layer, config, *local, _sp_metadata(ns, full, strategy))
        except Exception as e:  # raised the same way on every rank (before any exchange)
            result[f"{label}_error"] = f"{type(e).__name__}: {e}"
            continue
        result[f"{label}_ring_blocks_on_dattn"] = plugin.ring_client().calls - blocks
        if label == "dattn" and hasattr(layer.attention, "_shard_layers"):
            result["shard_layers"] = sorted(layer.attention._shard_layers)
    if "dattn" not in outs or "sdpa" not in outs:
        return result
    # Rows this rank holds: [joint | local image] (front) or [local image | joint] (rear).
    want_full, keep_full = _sp_full_reference(full, strategy)
    if J:
        image = slice(J, None) if strategy == "front" else slice(0, shard)
        joint = slice(0, J) if strategy == "front" else slice(shard, None)
    else:
        image, joint = slice(None), None
    valid = torch.ones(outs["sdpa"].shape[:2], dtype=torch.bool)
    if keep_full is not None:
        keep_image = full["mask"].bool()[:, rows]
        valid[:, image] = keep_image
        if J:
            valid[:, joint] = full["jmask"].bool()
    ours, sdpa = outs["dattn"], outs["sdpa"]
    result["rel_vs_engine_sdpa"] = _rel(ours[valid], sdpa[valid])
    result["padding_rows_zero"] = bool(torch.count_nonzero(ours[~valid]) == 0)
    # Gathered over the ranks, the image rows are the one-process result.
    gathered = [torch.empty_like(ours[:, image].contiguous()) for _ in range(SP_WORLD)]
    torch.distributed.all_gather(gathered, ours[:, image].contiguous())
    image_all = torch.cat(gathered, dim=1)
    full_image = slice(J, None) if strategy == "front" else slice(0, SP_S)
    want_image = want_full[:, full_image]
    valid_image = (torch.ones(SP_B, SP_S, dtype=torch.bool) if keep_full is None
                   else keep_full[:, full_image])
    result["rel_gathered_vs_one_process"] = _rel(image_all[valid_image], want_image[valid_image])
    if J:
        want_joint = want_full[:, slice(0, J) if strategy == "front" else slice(SP_S, None)]
        valid_joint = valid[:, joint]
        result["rel_joint_vs_one_process"] = _rel(ours[:, joint][valid_joint],
                                                  want_joint[valid_joint])
    return result


def _sp_worker(rank, world, tmp, init_file, mode, out_file):
    """One rank: the engine's distributed setup, then every case on dattn and on TORCH_SDPA."""
    import json

    torch.set_num_threads(1)
    version, spec = _engine_spec()
    ns = _install(spec, tmp, layer=True)
    ps = ns.parallel_state
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    distributed_init_method=f"file://{init_file}")
    ulysses, ring = (world, 1) if mode == "ulysses" else (1, world)
    ps.initialize_model_parallel(sequence_parallel_size=world, ulysses_degree=ulysses,
                                 ring_degree=ring)
    ns.plugins.load_omni_general_plugins()  # as the engine's workers do
    parallel = ns.data.DiffusionParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    results = {"platform": type(ns.platforms.current_omni_platform).__qualname__}
    for case in _sp_cases(mode):
        try:
            results[case[0]] = _sp_case(ns, rank, parallel, case)
        except Exception as e:  # reported, not raised: the other rank must not wait forever
            import traceback

            results[case[0]] = {"error": "".join(traceback.format_exception(e))}
    ps.destroy_distributed_env()
    Path(out_file).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    """Both SP runs (Ulysses degree 2, Ring degree 2), two ranks each, at once; the per-rank
    results by mode."""
    import json
    import subprocess

    version, spec = _engine_spec()
    if spec is None or version != PINNED:
        pytest.skip(f"vllm-omni {PINNED} is not installed")
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("sp")
    _write_dist_info(tmp)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATTN_VLLM_OMNI", "DIFFUSION_ATTENTION_BACKEND", "VLLM_PLUGINS")}
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks are on this host
    procs = []
    for mode in ("ulysses", "ring"):
        for rank in range(SP_WORLD):
            out = tmp / f"{mode}-{rank}.json"
            log = open(tmp / f"{mode}-{rank}.log", "w")
            cmd = [sys.executable, __file__, "sp-worker", str(rank), str(SP_WORLD), str(tmp),
                   str(tmp / f"{mode}.init"), mode, str(out)]
            procs.append((mode, rank, out, log, subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent)))
    import time

    deadline = time.monotonic() + SP_TIMEOUT_S
    try:
        for mode, rank, out, log, proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for *_, log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    results = {"ulysses": [], "ring": []}
    for mode, rank, out, log, proc in procs:
        text = Path(log.name).read_text()[-4000:]
        assert proc.returncode == 0 and out.exists(), (
            f"{mode} rank {rank} exited with {proc.returncode} (killed after "
            f"{SP_TIMEOUT_S} s if negative):\n{text}")
        results[mode].append(json.loads(out.read_text()))
    return results


def _sp_check(sp_results, mode, case):
    for rank, ranks in enumerate(sp_results[mode]):
        assert ranks["platform"] == "DattnCpuOmniPlatform"
        r = ranks[case]
        assert "error" not in r, r.get("error")
        assert r["dattn_impl"] == "DattnAttentionImpl" and r["sdpa_impl"] == "SDPAImpl", r
        assert r["dattn_strategy"] == mode and r["sdpa_strategy"] == mode, r
        yield rank, r


@pytest.mark.parametrize("case", [c[0] for c in _sp_cases("ulysses") if c[0] != "explicit"])
def test_ulysses_through_the_engines_layer_matches_its_sdpa(sp_results, case):
    """Ulysses (degree 2): each rank computes half the heads over the whole sequence with the
    joint rows the strategy joined; dattn equals the engine's SDPA under the same layer, and
    the gathered result the one-process one (f32, 1e-5 relative). Padding rows of a self
    mask are zeros on dattn (dattn's rule); every other row is compared."""
    H, Hkv = next(c for c in _sp_cases("ulysses") if c[0] == case)[1:3]
    for rank, r in _sp_check(sp_results, "ulysses", case):
        assert r["rel_vs_engine_sdpa"] <= 1e-5, (rank, r)
        assert r["rel_gathered_vs_one_process"] <= 1e-5, (rank, r)
        assert r.get("rel_joint_vs_one_process", 0.0) <= 1e-5, (rank, r)
        assert r["padding_rows_zero"], (rank, r)
        assert r["shard_layers"] == [[H // SP_WORLD, Hkv // SP_WORLD]], (rank, r)  # per-rank heads


def test_ulysses_with_dattn_named_explicitly(sp_results):
    for rank, r in _sp_check(sp_results, "ulysses", "explicit"):
        assert r["rel_vs_engine_sdpa"] <= 1e-5 and r["rel_gathered_vs_one_process"] <= 1e-5, r


@pytest.mark.parametrize("case", [c[0] for c in _sp_cases("ring")])
def test_ring_through_the_engines_layer_matches_its_sdpa(sp_results, case):
    """Ring (degree 2): the engine's ring (its K/V exchange and LSE merge) with every block
    computed by dattn (out and LSE), for dattn as the platform's default and named explicitly
    (where the engine alone would refuse float32): the same answers as the engine's SDPA ring
    with TORCH_SDPA, whose blocks stay PyTorch's."""
    for rank, r in _sp_check(sp_results, "ring", case):
        assert "dattn_error" not in r, r
        assert r["rel_vs_engine_sdpa"] <= 1e-5, (rank, r)
        assert r["rel_gathered_vs_one_process"] <= 1e-5, (rank, r)
        assert r.get("rel_joint_vs_one_process", 0.0) <= 1e-5, (rank, r)
        assert r["dattn_ring_blocks_on_dattn"] >= SP_WORLD, (rank, r)  # one block per step
        assert r["sdpa_ring_blocks_on_dattn"] == 0, (rank, r)


if __name__ == "__main__" and len(sys.argv) == 8 and sys.argv[1] == "sp-worker":
    _sp_worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5], sys.argv[6],
               sys.argv[7])
