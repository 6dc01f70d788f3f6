"""dattn.comfyui over ComfyUI's calling conventions of 2026 (comfy/ldm/modules/attention.py after
its comfy-kitchen attention work, PR #15479), written from that file's behaviour, without
ComfyUI (its later trees cannot be installed here; tests/comfyui runs the 0.3.64 tree):

- ``scale=`` replaces ``dim_head ** -0.5`` (attention_basic reads ``kwargs.get("scale", ...)``);
- ``enable_gqa=True``: K and V with fewer heads, their count from their inner size over the
  query's head size in ``[B, S, H*D]`` (``_reshape_qkv_to_heads``), from their own head axis with
  ``skip_reshape``; repeated as ``repeat_interleave`` (``comfy.ops.repeat_kv_for_gqa``);
- ``low_precision_attention=False``: approximate backends step aside (SAGE -> exact FLASH);
- ``AttentionTensorContainer`` q, k, v: ``wrap_attn`` takes them out before calling an override
  that has no ``container_function`` (dattn's has none);
- ``transformer_options`` / ``_inside_attn_wrapper`` arrive on every call; any other keyword
  dattn does not know goes to ComfyUI's function, counted;
- ``ModelPatcher`` cleanup callbacks (``CallbacksMP.ON_CLEANUP`` / ``ON_DETACH``) give dattn's
  idle memory back.
"""

import pytest

torch = pytest.importorskip("torch")

import dattn  # noqa: E402
from dattn import comfyui  # noqa: E402
from test_comfyui import close, rand  # noqa: E402  (the 0.3.64 conventions' helpers)


def reference(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False,
              scale=None, enable_gqa=False):
    """ComfyUI's attention_basic of 2026 in float64 (its scale and GQA rules)."""
    q, k, v = (t.double() for t in (q, k, v))
    if skip_reshape:
        b, dim_head = q.shape[0], q.shape[-1]
    else:
        b, dim_head = q.shape[0], q.shape[-1] // heads
        kv_heads = k.shape[-1] // dim_head if enable_gqa else heads
        q = q.reshape(b, -1, heads, dim_head).transpose(1, 2)
        k, v = (t.reshape(b, -1, kv_heads, dim_head).transpose(1, 2) for t in (k, v))
    if enable_gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    scale = dim_head ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        m = mask
        if m.dim() == 2:
            m = m.unsqueeze(0)
        if m.dim() == 3:
            m = m.unsqueeze(1)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    out = s.softmax(-1) @ v
    return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, heads * dim_head)


class Func:
    """ComfyUI's function as an override receives it (wrap_attn's ``func``): records its calls
    and the keywords it got."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        self.calls.append(dict(kwargs))
        kw = {n: kwargs[n] for n in ("scale", "enable_gqa") if n in kwargs}
        return reference(q, k, v, heads, mask, skip_reshape, skip_output_reshape,
                         **kw).to(q.dtype)


COMFY_KEYS = {"transformer_options": {"patches": {}}, "_inside_attn_wrapper": True}

LAYOUTS = [  # (q shape, k/v shape, heads, skip_reshape)
    ((2, 77, 4 * 24), (2, 77, 4 * 24), 4, False),
    ((1, 130, 2 * 64), (1, 9, 2 * 64), 2, False),
    ((2, 3, 65, 40), (2, 3, 131, 40), 3, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shapes", LAYOUTS, ids=["self", "cross", "bhsd"])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_the_scale_keyword_is_the_softmax_scale(dtype, shapes, skip_output_reshape):
    qs, ks, heads, skip = shapes
    q, k, v = rand(*qs, dtype=dtype, seed=1), rand(*ks, dtype=dtype, seed=2), rand(*ks, dtype=dtype, seed=3)
    for scale in (0.31, 1.0, 0.02):
        func, ov = Func(), comfyui.override()
        got = ov(func, q, k, v, heads, skip_reshape=skip, skip_output_reshape=skip_output_reshape,
                 scale=scale, **COMFY_KEYS)
        want = reference(q, k, v, heads, None, skip, skip_output_reshape, scale=scale)
        close(got, want, dtype)
        assert not func.calls and ov.calls == 1 and not ov.fallbacks
    # scale=None is the default scale (SDPA's meaning, as attention_pytorch passes it on).
    func, ov = Func(), comfyui.override()
    got = ov(func, q, k, v, heads, skip_reshape=skip, skip_output_reshape=skip_output_reshape,
             scale=None)
    close(got, reference(q, k, v, heads, None, skip, skip_output_reshape), dtype)


def test_the_scale_reaches_sage_and_a_mask():
    q, k, v = (rand(1, 96, 2 * 64, seed=i) for i in (4, 5, 6))
    mask = rand(96, 96, seed=7) > -1.0
    ov = comfyui.override("SAGE")
    got = ov(Func(), q, k, v, 2, mask, scale=0.05)
    want = reference(q, k, v, 2, mask, scale=0.05)
    assert float((got.double() - want).norm() / want.norm()) < 2e-2
    assert ov.calls == 1 and not ov.fallbacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 1, 8])
def test_enable_gqa_serves_fewer_kv_heads_in_both_layouts(dtype, skip_reshape, kv_heads):
    b, s, heads, d = 2, 64, 8, 16  # [B, S, H*D] K of 2 heads reshapes by 8 too: 64*32/(8*16)
    if skip_reshape:
        q = rand(b, heads, s, d, dtype=dtype, seed=8)
        k, v = (rand(b, kv_heads, s, d, dtype=dtype, seed=i) for i in (9, 10))
    else:
        q = rand(b, s, heads * d, dtype=dtype, seed=8)
        k, v = (rand(b, s, kv_heads * d, dtype=dtype, seed=i) for i in (9, 10))
    for skip_output_reshape in (False, True):
        func, ov = Func(), comfyui.override()
        got = ov(func, q, k, v, heads, skip_reshape=skip_reshape,
                 skip_output_reshape=skip_output_reshape, enable_gqa=True, scale=0.2,
                 **COMFY_KEYS)
        want = reference(q, k, v, heads, None, skip_reshape, skip_output_reshape, scale=0.2,
                         enable_gqa=True)
        close(got, want, dtype)
        assert not func.calls and ov.calls == 1 and not ov.fallbacks


def test_gqa_shapes_comfyui_rejects_go_to_its_function():
    q = rand(1, 64, 8 * 16, seed=11)
    k = v = rand(1, 64, 24, seed=12)  # 24 is no multiple of the head size 16: ComfyUI raises
    func, ov = Func(), comfyui.override()

    def raising(*args, **kwargs):
        func.calls.append(kwargs)
        raise ValueError("Key inner dimension 24 is not divisible by head dimension 16")

    with pytest.raises(ValueError):
        ov(raising, q, k, v, 8, enable_gqa=True)
    assert len(func.calls) == 1 and dict(ov.fallbacks) == {"shape": 1}
    k3 = v3 = rand(1, 64, 3 * 16, seed=13)  # 8 heads over 3: PyTorch's rule, ComfyUI's func
    with pytest.raises(RuntimeError):  # ComfyUI's own error
        ov(func, q, k3, v3, 8, enable_gqa=True)
    assert len(func.calls) == 2 and ov.calls == 0 and dict(ov.fallbacks) == {"shape": 1, "gqa": 1}


def test_low_precision_false_serves_sage_exactly_on_flash():
    q, k, v = (rand(1, 200, 2 * 64, dtype=torch.bfloat16, seed=i) for i in (14, 15, 16))
    flash = comfyui.override("FLASH")
    want = flash(Func(), q, k, v, 2, scale=0.1)
    for backend in ("SAGE", "VIDEO_SPARSE"):
        ov = comfyui.override(backend)
        func = Func()
        exact = ov(func, q, k, v, 2, scale=0.1, low_precision_attention=False, **COMFY_KEYS)
        assert torch.equal(exact, want), backend  # FLASH's answer, bit for bit
        assert ov.exact_calls == 1 and ov.calls == 1 and not func.calls and not ov.fallbacks
        ov(func, q, k, v, 2, low_precision_attention=True)
        assert ov.exact_calls == 1 and ov.calls == 2
    sage = comfyui.override("SAGE")(Func(), q, k, v, 2, scale=0.1)
    assert not torch.equal(sage, want)  # (so the exact answer above is not SAGE's by chance)
    ov = comfyui.override("FLASH")
    ov(Func(), q, k, v, 2, low_precision_attention=False)
    assert ov.calls == 1 and ov.exact_calls == 0  # FLASH is exact: nothing to step aside


@pytest.mark.parametrize("keyword,value", [("causal", True), ("attn_bias", 0.0),
                                           ("var_length", [3, 5])])
def test_keywords_dattn_does_not_know_go_to_comfyuis_function_counted(keyword, value):
    q, k, v = (rand(1, 16, 2 * 8, seed=i) for i in (17, 18, 19))
    func, ov = Func(), comfyui.override()
    ov(func, q, k, v, 2, **{keyword: value}, **COMFY_KEYS)
    assert len(func.calls) == 1 and func.calls[0][keyword] == value
    assert func.calls[0]["transformer_options"] is COMFY_KEYS["transformer_options"]
    assert ov.calls == 0 and dict(ov.fallbacks) == {f"keyword:{keyword}": 1}


@pytest.mark.parametrize("kwargs", [{"scale": "0.1"}, {"scale": float("nan")},
                                    {"scale": True}, {"enable_gqa": 1},
                                    {"low_precision_attention": "no"}])
def test_values_dattn_cannot_read_go_to_comfyuis_function(kwargs):
    q, k, v = (rand(1, 16, 2 * 8, seed=i) for i in (20, 21, 22))
    func, ov = Func(), comfyui.override()
    try:
        ov(func, q, k, v, 2, **kwargs)
    except Exception:
        pass  # what the reference makes of them does not matter here
    assert len(func.calls) == 1 and ov.calls == 0 and dict(ov.fallbacks) == {"arguments": 1}


class AttentionTensorContainer:
    """ComfyUI's single-owner input (attention.py, 2026): ``take`` hands the tensor over once."""

    def __init__(self, tensor):
        self.tensor = tensor

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        t = self.peek()
        self.tensor = None
        return t


def comfy_wrapper_call(override, func, q, k, v, *args, **kwargs):
    """How ComfyUI's ``wrap_attn`` of 2026 calls a model's override with containers: an
    override with a ``container_function`` gets the containers (and no ``func``), any other
    the tensors taken out of them."""
    containers = tuple(AttentionTensorContainer(t) for t in (q, k, v))
    kwargs = dict(kwargs, _inside_attn_wrapper=True)
    if hasattr(override, "container_function"):
        return override.container_function(*containers, *args, **kwargs)
    return override(func, *(c.take() for c in containers), *args, **kwargs)


def test_containers_are_taken_out_before_dattn_computes():
    q, k, v = (rand(2, 33, 3 * 16, seed=i) for i in (23, 24, 25))
    ov = comfyui.override()
    assert not hasattr(ov, "container_function")  # dattn keeps ComfyUI's func as its fallback
    func = Func()
    got = comfy_wrapper_call(ov, func, q, k, v, 3, transformer_options={})
    close(got, reference(q, k, v, 3), torch.float32)
    assert ov.calls == 1 and not func.calls
    # Called with the containers themselves (a registered function called directly): the same.
    containers = [AttentionTensorContainer(t) for t in (q, k, v)]
    got = ov(func, *containers, 3)
    close(got, reference(q, k, v, 3), torch.float32)
    assert all(c.tensor is None for c in containers) and ov.calls == 2


def test_model_attention_backend_composes_with_dattns_node():
    """ComfyUI's ModelAttentionBackend node sets the same override key through
    ``ModelPatcher.set_model_optimized_attention`` (a closure calling the chosen function,
    carrying its container_function): dattn's patch after it keeps that closure as the fallback;
    that node after dattn's replaces dattn's override (the later node wins)."""
    seen = []

    def pytorch_attention(q, k, v, heads, **kwargs):
        seen.append(kwargs.get("enable_gqa"))
        return Func()(q, k, v, heads, **kwargs)

    def containers(*args, **kwargs):
        raise AssertionError("dattn's override has no container_function: not called")

    def set_model_optimized_attention(options, fn):
        def optimized_attention_override(_, *args, **kwargs):
            return fn(*args, **kwargs)

        optimized_attention_override.container_function = containers
        options["optimized_attention_override"] = optimized_attention_override

    patcher = FakePatcher()
    set_model_optimized_attention(patcher.model_options["transformer_options"], pytorch_attention)
    patched = comfyui.patch_model(patcher)
    ov = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(ov, comfyui.Override) and ov.previous is not None
    q, k, v = (rand(1, 32, 2 * 16, seed=i) for i in (26, 27, 28))
    comfy_wrapper_call(ov, Func(), q, k, v, 2, transformer_options={})
    assert ov.calls == 1 and seen == []
    comfy_wrapper_call(ov, Func(), q, k, v, 2, transformer_options={}, var_length=1)
    assert seen == [None] and dict(ov.fallbacks) == {"keyword:var_length": 1}


class FakePatcher:
    """The parts of ComfyUI's ModelPatcher (0.3.64 and later) dattn uses: clone (options and
    callbacks copied), model_options, keyed callbacks run by cleanup() and detach()."""

    def __init__(self):
        self.model_options = {"transformer_options": {}}
        self.callbacks = {}

    def clone(self):
        import copy

        n = FakePatcher()
        n.model_options = copy.deepcopy(self.model_options)
        n.callbacks = copy.deepcopy(self.callbacks)
        return n

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def remove_callbacks_with_key(self, call_type, key):
        self.callbacks.get(call_type, {}).pop(key, None)

    def get_all_callbacks(self, call_type):
        return [c for cs in self.callbacks.get(call_type, {}).values() for c in cs]

    def cleanup(self):
        for c in self.get_all_callbacks("on_cleanup"):
            c(self)

    def detach(self, unpatch_all=True):
        for c in self.get_all_callbacks("on_detach_after"):
            c(self, unpatch_all)


def _hold_idle_memory(layer):
    q = k = v = rand(1, 512, 4, 64)
    layer.forward(q, k, v)
    assert dattn.memory_stats()["idle_bytes"] > 0


@pytest.mark.parametrize("event", ["cleanup", "detach"])
def test_the_models_cleanup_gives_dattns_memory_back(event):
    patched = comfyui.patch_model(comfyui.patch_model(FakePatcher()), "SAGE")
    for name in ("on_cleanup", "on_detach_after"):
        assert len(patched.get_all_callbacks(name)) == 1  # once, however many patches
    layer = dattn.Attention(4, 64)
    _hold_idle_memory(layer)
    getattr(patched, event)()
    assert dattn.memory_stats()["idle_bytes"] == 0
    del layer
