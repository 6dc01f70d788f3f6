"""dattn under PyTorch's machinery (issues 26 and 29): attention biases, torch.compile,
TorchScript, export, fake tensors, functorch, forward-mode AD, lazy negation, autocast,
``__torch_function__`` overrides and modes, the default device, ``sdpa_kernel``, PyTorch's
argument rules and non-finite inputs, threads. Every case is PyTorch's own answer (computed by
its function with dattn switched off) or its own exception, and says whether dattn served it
(the patch's counters)."""

import copy
import io
import gc
import pickle
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import dattn  # noqa: E402
import dattn.diffusers as dd  # noqa: E402
from dattn import torch_adapter as ta  # noqa: E402
from conftest import rand  # noqa: E402

F = torch.nn.functional
PYTORCH = torch._C._nn.scaled_dot_product_attention  # PyTorch's kernel, never the patch


def qkv(B=2, H=4, L=7, S=11, E=16, seed=0, dtype=torch.float32):
    return (rand(B, H, L, E, seed=seed, dtype=dtype), rand(B, H, S, E, seed=seed + 1, dtype=dtype),
            rand(B, H, S, E, seed=seed + 2, dtype=dtype))


def close(got, want, tol=1e-5):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    err = float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0
    assert err <= tol * max(1.0, float(want[finite].abs().max()) if finite.any() else 1.0), err


@pytest.fixture
def patch():
    with dattn.patch_torch_sdpa() as handle:
        yield handle


def served(handle, fn):
    before, fallbacks = handle.calls, sum(handle.fallbacks.values())
    out = fn()
    return out, handle.calls - before, sum(handle.fallbacks.values()) - fallbacks


# --- attention biases ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("L,S", [(7, 11), (11, 7), (9, 9)])
def test_causal_bias_is_served_as_dattn_causal(patch, variant, L, S):
    from torch.nn.attention import bias

    q, k, v = qkv(L=L, S=S)
    b = getattr(bias, f"causal_{variant}")(L, S)
    want = PYTORCH(q, k, v, attn_mask=b._materialize())
    got, n, _ = served(patch, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=b))
    close(got, want)
    assert n == 1  # dattn computed it, never reading the bias's storage


def test_causal_bias_with_gradients_is_pytorchs(patch):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = qkv()
    b = causal_lower_right(7, 11)
    qg = q.clone().requires_grad_(True)
    out, n, fb = served(patch, lambda: F.scaled_dot_product_attention(qg, k, v, attn_mask=b))
    out.sum().backward()
    qr = q.clone().requires_grad_(True)
    want = PYTORCH(qr, k, v, attn_mask=b._materialize())
    want.sum().backward()
    close(out, want)
    close(qg.grad, qr.grad)
    assert n == 0 and fb >= 1


def test_causal_bias_and_is_causal_is_pytorchs_value_error(patch):
    from torch.nn.attention.bias import causal_upper_left

    q, k, v = qkv()
    with pytest.raises(ValueError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(7, 11),
                                       is_causal=True)


def test_causal_bias_in_dattns_own_function():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = qkv()
    b = causal_lower_right(7, 11)
    close(dattn.scaled_dot_product_attention(q, k, v, attn_mask=b),
          PYTORCH(q, k, v, attn_mask=b._materialize()))


# --- torch.compile ---------------------------------------------------------------------------


def _compiled(fn, backend, dynamic):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_keeps_dattn_in_the_graph(patch, backend, dynamic):
    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m) * 2

    c = _compiled(f, backend, dynamic)
    for L in (7, 5, 9):
        q, k, v = qkv(L=L, seed=L)
        m = rand(1, 1, L, 11, seed=3) > -0.5
        got, n, fb = served(patch, lambda: c(q, k, v, m))
        close(got, PYTORCH(q, k, v, attn_mask=m) * 2)
        assert n == 1 and fb == 0


def test_compile_records_the_custom_op(patch):
    from torch._dynamo.testing import EagerAndRecordGraphs

    rec = EagerAndRecordGraphs()
    torch._dynamo.reset()
    q, k, v = qkv()
    torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                  backend=rec, fullgraph=True)(q, k, v)
    code = rec.graphs[0].code
    assert "dattn.sdpa" in code and "scaled_dot_product_attention" not in code


def test_compile_with_unbacked_sizes(patch):
    def f(q, k, v, n):
        s = n.item()
        torch._check(s >= 0)
        torch._check(s <= k.shape[2])
        return F.scaled_dot_product_attention(q, k[:, :, :s], v[:, :, :s])

    c = _compiled(f, "inductor", None)
    q, k, v = qkv()
    for s in (5, 0, 11):
        close(c(q, k, v, torch.tensor(s)), PYTORCH(q, k[:, :, :s], v[:, :, :s]))


def test_compile_of_a_causal_bias_argument(patch):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = qkv()
    b = causal_lower_right(7, 11)
    c = _compiled(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                  "aot_eager", False)
    close(c(q, k, v, b), PYTORCH(q, k, v, attn_mask=b._materialize()))


def test_compile_of_dattns_own_functions():
    layer = dattn.Attention(4, 16)
    q, k, v = qkv()
    bq, bk, bv = (t.transpose(1, 2) for t in (q, k, v))
    joint = rand(2, 3, 4, 16, seed=9)
    meta = dattn.AttentionMetadata(joint_query=joint, joint_key=joint, joint_value=joint)
    c = _compiled(lambda a, b, c_, j: layer.forward(a, b, c_, dattn.AttentionMetadata(
        joint_query=j, joint_key=j, joint_value=j), return_lse=True), "aot_eager", False)
    out, lse = c(bq, bk, bv, joint)
    want_out, want_lse = layer.forward(bq, bk, bv, meta, return_lse=True)
    close(out, want_out)
    close(lse, want_lse)
    c2 = _compiled(lambda a, b, c_: dattn.scaled_dot_product_attention(a, b, c_, is_causal=True),
                   "inductor", False)
    close(c2(q, k, v), PYTORCH(q, k, v, is_causal=True))


def test_compile_of_an_enabled_diffusers_model():
    from test_diffusers import flux, run, sd3

    for build in (flux, sd3):
        model, inputs = build()
        want = run(model, inputs)
        with dd.enable(model) as handle:
            torch._dynamo.reset()
            got = run(torch.compile(model, fullgraph=True), inputs)
        assert handle.calls >= 2 and not handle.fallbacks, handle
        close(got, want, 1e-4)


# --- TorchScript -----------------------------------------------------------------------------


def test_script_sees_pytorchs_function_and_nothing_survives_undo():
    with dattn.patch_torch_sdpa():
        mha = torch.jit.script(torch.nn.MultiheadAttention(16, 2, batch_first=True).eval())
        layer = torch.jit.script(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True))

        class Sub(torch.nn.TransformerEncoderLayer):
            pass

        sub = torch.jit.script(Sub(16, 2, 32, batch_first=True))
    x = rand(2, 5, 16, seed=4)
    with torch.no_grad():
        out = mha(x, x, x)[0]
    assert out.shape == (2, 5, 16) and layer(x).shape == sub(x).shape == (2, 5, 16)
    assert F.scaled_dot_product_attention is PYTORCH
    table = torch.jit._builtins._get_builtin_table()
    ours = {id(h.wrapper) for h in ta.Hook._sites.values()}
    assert not ours & set(table), "a dattn wrapper is still TorchScript's builtin after undo"
    # Scripting again after the undo (TorchScript's cache was never poisoned).
    torch.jit.script(torch.nn.MultiheadAttention(16, 2))


def test_jit_trace_replays_the_computation():
    q, k, v = qkv()
    q2 = rand(2, 4, 7, 16, seed=20)
    layer = dattn.Attention(4, 16)
    bq, bk, bv = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with dattn.patch_torch_sdpa():
        patched = torch.jit.trace(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), (q, k, v))
    own = torch.jit.trace(lambda a, b, c: dattn.scaled_dot_product_attention(a, b, c), (q, k, v))
    traced_layer = torch.jit.trace(lambda a, b, c: layer.forward(a, b, c), (bq, bk, bv))
    close(patched(q2, k, v), PYTORCH(q2, k, v))
    close(own(q2, k, v), PYTORCH(q2, k, v))
    b2 = q2.transpose(1, 2).contiguous()
    close(traced_layer(b2, bk, bv), PYTORCH(q2, k, v).transpose(1, 2))


# --- export and fake tensors -----------------------------------------------------------------


def test_export_and_fake_tensors(patch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv()
    ep = torch.export.export(M(), (q, k, v))
    assert any("dattn.sdpa" in str(n.target) for n in ep.graph.nodes)
    close(ep.module()(q, k, v), PYTORCH(q, k, v, is_causal=True))
    layer = dattn.Attention(4, 16)
    with FakeTensorMode():
        a, b = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 11, 16)
        assert F.scaled_dot_product_attention(a, b, b).shape == (2, 4, 7, 16)
        assert dattn.scaled_dot_product_attention(a, b, b).shape == (2, 4, 7, 16)
        out, lse = layer.forward(a.transpose(1, 2), b.transpose(1, 2), b.transpose(1, 2),
                                 return_lse=True)
        assert out.shape == (2, 7, 4, 16) and lse.shape == (2, 4, 7)


# --- functorch, forward AD, nested tensors -----------------------------------------------------


def test_vmap_and_grad_transforms_are_pytorchs(patch):
    q, k, v = qkv()
    got, n, _ = served(patch, lambda: torch.func.vmap(F.scaled_dot_product_attention)(q, k, v))
    close(got, PYTORCH(q, k, v))
    assert n == 0 and patch.fallbacks["functorch"] >= 1
    g = torch.func.grad(lambda a: F.scaled_dot_product_attention(a, k, v).sum())(q)
    want = torch.func.grad(lambda a: PYTORCH(a, k, v).sum())(q)
    close(g, want)
    close(dattn.scaled_dot_product_attention(q, k, v),
          torch.func.vmap(dattn.scaled_dot_product_attention)(q, k, v))


def test_forward_mode_ad_is_pytorchs(patch):
    import torch.autograd.forward_ad as fwAD

    q, k, v = qkv()

    def call(fn):
        with fwAD.dual_level():
            try:
                out = fn(fwAD.make_dual(q, torch.ones_like(q)), k, v)
                return fwAD.unpack_dual(out).tangent
            except Exception as e:  # PyTorch 2.13's CPU kernel has no forward AD
                return type(e)

    theirs = call(PYTORCH)
    ours = call(F.scaled_dot_product_attention)
    if isinstance(theirs, type):
        assert ours is theirs
    else:
        close(ours, theirs)
    assert patch.calls == 0 and patch.fallbacks["forward_ad"] == 1
    with pytest.raises(dattn.Unsupported, match="forward_ad"):
        with fwAD.dual_level():
            dattn.Attention(4, 16).forward(fwAD.make_dual(q, torch.ones_like(q)), k, v)


def test_nested_tensors_are_pytorchs(patch):
    nt = torch.nested.nested_tensor([rand(2, 5, 16, seed=1), rand(2, 7, 16, seed=2)],
                                    layout=torch.jagged).transpose(1, 2)
    want = None
    try:
        want = PYTORCH(nt, nt, nt)
    except Exception as e:
        with pytest.raises(type(e)):
            F.scaled_dot_product_attention(nt, nt, nt)
    if want is not None:
        got = F.scaled_dot_product_attention(nt, nt, nt)
        assert got.is_nested
        for a, b in zip(got.unbind(), want.unbind()):
            close(a, b)
    assert patch.fallbacks["torch_function"] >= 1  # the nested tensor's own implementation


# --- lazy bits, subclasses, modes, autocast, devices -------------------------------------------


def test_negation_bits_are_read_resolved(patch):
    c = torch.complex(rand(2, 4, 7, 16, seed=1), rand(2, 4, 7, 16, seed=2))
    q = c.conj().imag  # is_neg(): the values are -imag
    assert q.is_neg()
    k, v = qkv(S=7)[1:]
    got, n, _ = served(patch, lambda: F.scaled_dot_product_attention(q, k, v))
    close(got, PYTORCH(q.resolve_neg(), k, v))
    assert n == 1
    close(dattn.scaled_dot_product_attention(q, k, v), PYTORCH(q.resolve_neg(), k, v))
    layer = dattn.Attention(4, 16)
    bq, bk, bv = (t.transpose(1, 2) for t in (q, k, v))
    want = layer.forward(bq.resolve_neg(), bk, bv)
    close(layer.forward(bq, bk, bv), want)
    out_c = torch.complex(torch.zeros(2, 7, 4, 16), torch.zeros(2, 7, 4, 16)).conj().imag
    assert out_c.is_neg()
    layer.forward(bq, bk, bv, out=out_c)
    close(out_c, want)  # reads back the result through the negated view


def test_torch_function_overrides_and_modes_see_the_call(patch):
    from torch.overrides import TorchFunctionMode

    q, k, v = qkv()

    class Sub(torch.Tensor):
        pass

    out = F.scaled_dot_product_attention(q.as_subclass(Sub), k, v)
    assert type(out) is Sub
    close(out.as_subclass(torch.Tensor), PYTORCH(q, k, v))

    class Override(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                return "overridden"
            return super().__torch_function__(func, types, args, kwargs or {})

    assert F.scaled_dot_product_attention(q.as_subclass(Override), k, v) == "overridden"

    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        close(F.scaled_dot_product_attention(q, k, v), PYTORCH(q, k, v))
    assert seen.count(F.scaled_dot_product_attention) == 1


@pytest.mark.parametrize("mixed", [False, True])
def test_autocast_casts_as_pytorch_does(patch, mixed):
    q, k, v = qkv()
    if mixed:
        q = q.bfloat16()  # from an autocast Linear, with f32 k/v
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = PYTORCH(q, k, v)
        got, n, _ = served(patch, lambda: F.scaled_dot_product_attention(q, k, v))
    assert got.dtype == want.dtype == torch.bfloat16
    close(got, want, 2e-2)
    assert n == 1


def test_the_default_device_does_not_move_the_output(patch):
    q, k, v = qkv()
    torch.set_default_device("meta")
    try:
        out, n, _ = served(patch, lambda: F.scaled_dot_product_attention(q, k, v))
        assert n == 1
        own = dattn.scaled_dot_product_attention(q, k, v)
        layer_out = dattn.Attention(4, 16).forward(*(t.transpose(1, 2) for t in (q, k, v)))
    finally:
        torch.set_default_device(None)
    assert out.device.type == own.device.type == layer_out.device.type == "cpu"
    close(out, PYTORCH(q, k, v))


def test_sdpa_kernel_restrictions_are_pytorchs(patch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        with pytest.raises(RuntimeError):
            PYTORCH(q, k, v)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):
        got, n, _ = served(patch, lambda: F.scaled_dot_product_attention(q, k, v))
        assert torch.equal(got, PYTORCH(q, k, v)) and n == 0
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        _, n, _ = served(patch, lambda: F.scaled_dot_product_attention(q, k, v))
        assert n == 1


# --- PyTorch's argument rules and non-finite inputs ---------------------------------------------


def _same_as_pytorch(call):
    """The patched call gives PyTorch's result, or raises PyTorch's exception class."""
    try:
        want = call(PYTORCH)
    except Exception as e:
        with dattn.patch_torch_sdpa(), pytest.raises(type(e)):
            call(F.scaled_dot_product_attention)
        return None
    with dattn.patch_torch_sdpa():
        got = call(F.scaled_dot_product_attention)
    close(got, want)
    return got


@pytest.mark.parametrize("case", [
    lambda f, q, k, v: f(q[:, :0], k[:, :0], v[:, :0]),  # H = 0
    lambda f, q, k, v: f(q[..., :0], k[..., :0], v),  # E = 0
    lambda f, q, k, v: f(q, k, v[..., :0]),  # Ev = 0
    lambda f, q, k, v: f(q, k[:, :, :0], v[:, :, :0]),  # S = 0
    lambda f, q, k, v: f(q[:, :, :0], k, v),  # L = 0
    lambda f, q, k, v: f(q, k, v, scale=float("inf")),
    lambda f, q, k, v: f(q, k, v, scale=float("nan")),
    lambda f, q, k, v: f(q, k, v, is_causal=1),
    lambda f, q, k, v: f(q, k, v, is_causal="yes"),
    lambda f, q, k, v: f(q, k, v, is_causal=torch.tensor(True)),
    lambda f, q, k, v: f(q, k, v, attn_mask=torch.ones(11, dtype=torch.bool)),
    lambda f, q, k, v: f(q, k, v, attn_mask=torch.ones(7, 11, dtype=torch.int32)),
], ids=["H0", "E0", "Ev0", "S0", "L0", "scale-inf", "scale-nan", "causal-1", "causal-str",
        "causal-tensor", "mask-1d", "mask-int"])
def test_pytorchs_argument_rules(case):
    q, k, v = qkv()
    _same_as_pytorch(lambda f: case(f, q, k, v))


@pytest.mark.parametrize("where", ["k_inf", "k_nan", "v_neg_inf", "q_inf"])
def test_non_finite_inputs_give_pytorchs_rows(where):
    q, k, v = qkv()
    target = {"k": k, "v": v, "q": q}[where[0]]
    target[0, 0, 3, 5] = {"k_inf": float("inf"), "k_nan": float("nan"),
                          "v_neg_inf": float("-inf"), "q_inf": float("inf")}[where]
    got = _same_as_pytorch(lambda f: f(q, k, v))
    want = PYTORCH(q, k, v)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


def test_dtype_errors_name_only_valid_dtypes():
    q, k, v = qkv()
    for bad in (torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn):
        with pytest.raises(dattn.InvalidArgument) as e:
            dattn.scaled_dot_product_attention(q.to(bad), k, v)
        valid = str(e.value).split("valid:")[1]
        assert "float32" in valid and str(bad).replace("torch.", "") not in valid, str(e.value)


# --- threads ----------------------------------------------------------------------------------


def test_dattn_follows_torchs_thread_count_in_every_thread(patch, monkeypatch):
    seen = []
    real = ta.call_threads
    monkeypatch.setattr(ta, "call_threads", lambda: seen.append(real()) or seen[-1])
    q, k, v = qkv()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        F.scaled_dot_product_attention(q, k, v)
        t = threading.Thread(target=lambda: F.scaled_dot_product_attention(q, k, v))
        t.start()
        t.join()
        dattn.set_num_threads(2)
        dattn.scaled_dot_product_attention(q, k, v)
    finally:
        dattn.set_num_threads(None)
        torch.set_num_threads(before)
    assert seen == [1, 1, 2]
    with pytest.raises(dattn.InvalidArgument, match="threads"):
        dattn.set_num_threads(0)


# --- handles: lifetime, copies, pickles, nesting, the patch beside them -------------------------


def test_a_dropped_model_is_freed_and_its_hooks_released():
    from test_diffusers import sd3

    model, inputs = sd3()
    handle = dd.enable(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and not handle.active
    assert ta.hook_of(F.scaled_dot_product_attention) is None
    assert F.scaled_dot_product_attention is PYTORCH


def test_deepcopy_and_pickle_of_an_enabled_model_are_plain():
    from test_diffusers import flux, run

    model, inputs = flux()
    want = run(model, inputs)
    with dd.enable(model) as handle:
        twin = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        pickle.dumps(model)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        assert torch.equal(run(twin, inputs), want) and torch.equal(run(loaded, inputs), want)
        assert handle.calls == 0  # the copies are not this handle's model
        with dd.enable(twin) as twin_handle:
            close(run(twin, inputs), want, 1e-4)
        assert twin_handle.calls == 2


def test_enables_that_overlap_are_refused_and_leave_nothing_behind():
    from test_diffusers import flux, snapshot

    model, _ = flux()
    before = snapshot(model)
    with dd.enable(model):
        with pytest.raises(dattn.InvalidArgument, match="model"):
            dd.enable(model.transformer_blocks[0])
    block = dd.enable(model.transformer_blocks[0])
    with pytest.raises(dattn.InvalidArgument, match="model"):
        dd.enable(model)
    block.disable()
    assert snapshot(model) == before


def test_the_patch_and_diffusers_share_one_hook():
    from test_diffusers import run, sd3

    model, inputs = sd3()
    handle = dd.enable(model)
    patch = dattn.patch_torch_sdpa()
    patch.undo()  # undoing the patch keeps the model served
    run(model, inputs)
    assert handle.calls == 3
    patch = dattn.patch_torch_sdpa()
    handle.disable()
    stale = F.scaled_dot_product_attention
    patch.undo()
    assert F.scaled_dot_product_attention is PYTORCH
    # A third party restoring what it saw gets an inert wrapper: PyTorch's function.
    F.scaled_dot_product_attention = stale
    try:
        q, k, v = qkv()
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), PYTORCH(q, k, v))
        assert patch.calls == 0
    finally:
        F.scaled_dot_product_attention = PYTORCH


def test_calls_on_torch_tensors_do_not_import_dynamo():
    """A process that never compiles never pays torch._dynamo's import (2.6 s, about 70 MiB of
    RSS): dattn's layer calls, its SDPA function and the patched SDPA leave it unloaded."""
    import subprocess
    import sys

    code = (
        "import sys, torch, dattn\n"
        "q = torch.randn(1, 4, 64, 32)\n"
        "dattn.Attention(4, 32)(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))\n"
        "dattn.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
        "with dattn.patch_torch_sdpa():\n"
        "    torch.nn.functional.scaled_dot_product_attention(q, q, q)\n"
        "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_json_of_a_graphs_metadata_is_marked_as_dynamo_marks_a_constant():
    """dattn marks its JSON writer as torch._dynamo.assume_constant_result would, without
    importing dynamo: the decorator must still set the same mark (a PyTorch upgrade that
    changes it fails here, not in a compiled graph)."""
    import torch._dynamo

    from dattn import torch_layer

    def f():
        return 0

    marked = torch._dynamo.assume_constant_result(f)
    marks = {k for k in vars(marked) if "dynamo" in k}
    assert marks == {"_dynamo_marked_constant"}
    assert all(getattr(torch_layer._dumps, k) is True for k in marks)
