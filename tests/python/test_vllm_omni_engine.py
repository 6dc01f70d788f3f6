"""dattn inside the real vllm-omni engine modules (the pinned vllm-omni from PyPI, installed
with --no-deps), the way the engine loads its plugins.

vllm itself is a CUDA stack, so a minimal stand-in ``vllm`` package (tests/python/stubs/vllm)
goes on sys.path for these tests only. Over it, the real, unmodified vllm-omni modules are
loaded: platform resolution (``vllm_omni.platforms``), plugin loading (``vllm_omni.plugins``),
the platform interface, the attention backend registry, the selector and the abstract backend
classes. dattn's plugin reaches the engine through a real entry point: a ``dattn`` distribution
(``.dist-info`` with ``entry_points.txt``) on sys.path, found by ``importlib.metadata`` as an
installed wheel's is. Not loaded: the package root ``vllm_omni/__init__.py`` (it imports
``vllm_omni.patch`` and ``vllm_omni.config``, which need vllm's real model and config
machinery); the test registers the package root as a plain package over the real directory, so
every module below it is the real file. Nor ``vllm_omni.diffusion.data`` (where
``build_attention_config`` reads DIFFUSION_ATTENTION_BACKEND: it imports pydantic, PIL,
huggingface_hub, vllm's config and quantization modules); the selector is given the config that
function builds from the variable, an object with its ``resolve_with_source``.
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
from conftest import assert_close, rand  # noqa: E402

PINNED = "0.30.0"
STUBS = Path(__file__).resolve().parent / "stubs"
ENTRY_POINTS = """\
[vllm_omni.platform_plugins]
dattn = dattn.vllm_omni_plugin:platform_plugin

[vllm_omni.general_plugins]
dattn = dattn.vllm_omni_plugin:general_plugin
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
        name in ("vllm", "vllm_omni", "dattn.vllm_omni_platform")
        or name.startswith(("vllm.", "vllm_omni."))
    )


@contextlib.contextmanager
def _engine(tmp_path, monkeypatch, entry_point=True):
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
        sys.path.insert(0, str(STUBS))
        if entry_point:
            dist = tmp_path / "dattn-0.0.0.dist-info"
            dist.mkdir()
            (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dattn\nVersion: 0.0.0\n")
            (dist / "entry_points.txt").write_text(ENTRY_POINTS)
            sys.path.insert(0, str(tmp_path))
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
        root = types.ModuleType("vllm_omni")
        root.__path__ = list(spec.submodule_search_locations)
        root.__file__ = spec.origin
        sys.modules["vllm_omni"] = root
        ns = types.SimpleNamespace()
        ns.platforms = importlib.import_module("vllm_omni.platforms")
        ns.plugins = importlib.import_module("vllm_omni.plugins")
        ns.interface = importlib.import_module("vllm_omni.platforms.interface")
        ns.abstract = importlib.import_module("vllm_omni.diffusion.attention.backends.abstract")
        ns.registry = importlib.import_module("vllm_omni.diffusion.attention.backends.registry")
        ns.selector = importlib.import_module("vllm_omni.diffusion.attention.selector")
        ns.nvml = importlib.import_module("vllm.utils.import_utils")
        ns.adapter = importlib.reload(dattn.vllm_omni)
        assert ns.adapter.ENGINE_AVAILABLE
        for m in (ns.platforms, ns.selector, ns.abstract):
            assert Path(m.__file__).is_relative_to(Path(spec.origin).parent), m  # the real files
        yield ns
    finally:
        sys.path[:] = saved_path
        for n in [n for n in sys.modules if _ours(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        importlib.reload(dattn.vllm_omni)


@pytest.fixture
def engine(tmp_path, monkeypatch):
    with _engine(tmp_path, monkeypatch) as ns:
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
    from dattn.vllm_omni_plugin import general_plugin, platform_plugin

    assert found == {"dattn": platform_plugin}
    found = engine.plugins.load_omni_plugins_by_group(engine.plugins.OMNI_DEFAULT_PLUGINS_GROUP)
    assert found == {"dattn": general_plugin}


def test_no_accelerator_resolves_dattns_platform(engine):
    assert resolve(engine) == "dattn.vllm_omni_platform.DattnCpuOmniPlatform"
    platform = engine.platforms.current_omni_platform  # the engine's lazy global
    from dattn.vllm_omni_platform import DattnCpuOmniPlatform

    assert isinstance(platform, DattnCpuOmniPlatform)
    assert isinstance(platform, engine.interface.OmniPlatform)
    assert platform.is_out_of_tree() and not platform.is_cuda()
    assert platform.get_torch_device() == torch.device("cpu")


def test_without_the_entry_point_the_engine_has_no_platform(engine_without_entry_point):
    assert resolve(engine_without_entry_point) == "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"


def test_a_cuda_host_changes_nothing(engine, monkeypatch):
    """NVML reports a GPU: the engine's CUDA platform is chosen, dattn's plugin returns None."""
    monkeypatch.setattr(engine.nvml, "NVML_DEVICE_COUNT", 1)
    from dattn.vllm_omni_plugin import platform_plugin

    assert platform_plugin() is None
    assert resolve(engine) == "vllm_omni.platforms.cuda.platform.CudaOmniPlatform"
    monkeypatch.setenv("DATTN_VLLM_OMNI", "1")  # the user opts in: dattn's platform wins
    assert resolve(engine) == "dattn.vllm_omni_platform.DattnCpuOmniPlatform"


def test_opting_out(engine, monkeypatch):
    monkeypatch.setenv("DATTN_VLLM_OMNI", "0")
    assert resolve(engine) == "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"
    monkeypatch.setenv("DATTN_VLLM_OMNI", "auto")
    assert resolve(engine) == "dattn.vllm_omni_platform.DattnCpuOmniPlatform"


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
    assert backend is engine.adapter.DattnAttentionBackend and spec is config.default
    impl = backend.get_impl_cls()(
        num_heads=2, head_size=128, softmax_scale=None, causal=False, backend_kwargs=spec.backend_kwargs(),
        role="self", backend_explicit=True,
    )
    assert impl.backend_name == ("REFERENCE" if value == "REFERENCE" else "FLASH")


def test_selector_refuses_the_engines_gpu_backends(engine):
    with pytest.raises(ValueError, match="TORCH_SDPA.*DATTN"):
        engine.selector.get_attn_backend_for_role(
            "self", 128, attention_config=EnvAttentionConfig("TORCH_SDPA"))


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
    from dattn.vllm_omni_plugin import general_plugin

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
    from dattn.vllm_omni_platform import DattnCpuOmniPlatform

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


def test_the_engines_layer_builds_impls_with_these_arguments():
    """vllm_omni.diffusion.attention.layer (the engine's Attention module) cannot be imported
    over the stand-in vllm (its imports reach vllm's LoRA, quantization, distributed and v1 KV
    modules, transformers and pydantic). Its source is read instead: the keyword arguments it
    builds the implementation with are those the forward test above passes."""
    import ast

    version, spec = _engine_spec()
    if spec is None or version != PINNED:
        pytest.skip(f"vllm-omni {PINNED} is not installed")
    path = Path(spec.origin).parent / "diffusion" / "attention" / "layer.py"
    calls = [
        node for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "attn_impl_cls"
    ]
    assert len(calls) == 1, "the engine builds its AttentionImpl elsewhere now: re-check"
    keywords = {k.arg for k in calls[0].keywords}
    assert keywords == {"num_heads", "head_size", "softmax_scale", "causal", "num_kv_heads",
                        "qkv_layout", "prefix", "backend_kwargs", "role", "backend_explicit"}


def test_the_plugins_without_the_engine(monkeypatch):
    """The entry points load and run where vllm-omni is not importable (the engine is absent
    or broken): the platform hook answers from torch's view alone, the general hook does
    nothing."""
    from dattn import vllm_omni_plugin as plugin

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
