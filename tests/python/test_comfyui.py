"""dattn.comfyui's override over ComfyUI's calling convention, without ComfyUI: the callable
``override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
skip_output_reshape=False, **kwargs)`` against a float64 reference of ComfyUI's
``attention_pytorch`` (its layouts and mask rule), and what goes to ComfyUI's ``func``, counted.
The real ComfyUI: tests/comfyui (make comfyui-check COMFYUI_DIR=...)."""

import copy

import pytest

torch = pytest.importorskip("torch")

import dattn  # noqa: E402
from dattn import comfyui  # noqa: E402


def reference(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False):
    """ComfyUI's attention_pytorch in float64: [B, S, H*D] (or [B, H, S, D]) in; a 2-D mask
    gets a batch dim, a 3-D one a heads dim; bool keeps, float adds."""
    q, k, v = (t.double() for t in (q, k, v))
    if skip_reshape:
        b, dim_head = q.shape[0], q.shape[-1]
    else:
        b, dim_head = q.shape[0], q.shape[-1] // heads
        q, k, v = (t.reshape(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        mask = mask if mask.dtype == torch.bool else mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, heads * dim_head)


class Func:
    """ComfyUI's own attention function as the override receives it: records its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        self.calls += 1
        return reference(q, k, v, heads, mask, skip_reshape, skip_output_reshape).to(q.dtype)


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(got, want, dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.double() - want).norm() / want.norm()
    assert err <= tol, float(err)


LAYOUTS = [
    # (q shape, k/v shape, heads, skip_reshape): [B, S, H*D] self and cross, and [B, H, S, D]
    ((2, 77, 4 * 24), (2, 77, 4 * 24), 4, False),
    ((1, 130, 2 * 64), (1, 9, 2 * 64), 2, False),
    ((2, 3, 65, 40), (2, 3, 131, 40), 3, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shapes", LAYOUTS, ids=["self", "cross", "bhsd"])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_layouts_and_dtypes_match_comfyuis_attention(dtype, shapes, skip_output_reshape):
    qs, ks, heads, skip = shapes
    q, k, v = rand(*qs, dtype=dtype, seed=1), rand(*ks, dtype=dtype, seed=2), rand(*ks, dtype=dtype, seed=3)
    func, ov = Func(), comfyui.override()
    got = ov(func, q, k, v, heads, skip_reshape=skip, skip_output_reshape=skip_output_reshape,
             transformer_options={}, _inside_attn_wrapper=True)
    close(got, reference(q, k, v, heads, None, skip, skip_output_reshape), dtype)
    assert func.calls == 0 and ov.calls == 1 and not ov.fallbacks


def test_positional_heads_and_mask_a_4d_value_and_non_contiguous_inputs():
    """Flux and Qwen pass heads (and Qwen the mask) positionally, Wan and SD3 by keyword; SD3's
    value arrives as [B, S, H, D], Flux's single-stream one non-contiguous."""
    b, s, h, d = 1, 50, 2, 32
    qkv = rand(b, s, 3, h * d, seed=4)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # non-contiguous views
    assert not q.is_contiguous()
    mask = torch.randn(s, s)
    ov = comfyui.override()
    want = reference(q, k, v, h, mask)
    close(ov(Func(), q, k, v, h, mask), want, torch.float32)
    close(ov(Func(), q, k, v, heads=h, mask=mask), want, torch.float32)
    v4 = v.reshape(b, s, h, d)
    close(ov(Func(), q, k, v4, heads=h), reference(q, k, v, h), torch.float32)


MASKS = {
    # ComfyUI's 2-D mask is [Sq, Skv] for every batch item and head, not a key mask
    "2d-additive": lambda b, h, sq, skv: torch.randn(sq, skv),
    "2d-bool": lambda b, h, sq, skv: torch.rand(sq, skv) > 0.3,
    "3d-per-batch": lambda b, h, sq, skv: torch.randn(b, sq, skv),
    "3d-keys": lambda b, h, sq, skv: torch.where(torch.arange(skv) < skv - 5, 0.0,
                                                 -torch.finfo(torch.float32).max)[None, None],
    "4d-per-head": lambda b, h, sq, skv: torch.randn(b, h, sq, skv),
    "4d-bool-broadcast": lambda b, h, sq, skv: torch.rand(1, 1, 1, skv) > 0.5,
    "4d-minus-inf": lambda b, h, sq, skv: torch.where(torch.rand(b, 1, sq, skv) > 0.2, 0.0,
                                                      float("-inf")),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_mean_what_comfyui_means(name, dtype):
    b, h, sq, skv, d = 2, 3, 37, 53, 32
    q, k, v = rand(b, sq, h * d, dtype=dtype, seed=5), rand(b, skv, h * d, dtype=dtype, seed=6), \
        rand(b, skv, h * d, dtype=dtype, seed=7)
    torch.manual_seed(8)
    mask = MASKS[name](b, h, sq, skv)
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    if name == "4d-minus-inf":
        mask[..., 0] = 0.0  # every row sees a key (a row that sees none: NaN in PyTorch's SDPA)
    ov = comfyui.override()
    got = ov(Func(), q, k, v, h, mask=mask)
    close(got, reference(q, k, v, h, mask), dtype)
    assert ov.calls == 1, ov


def test_attn_precision_float32_computes_half_inputs_in_f32():
    b, s, h, d = 1, 64, 2, 64
    q, k, v = (rand(b, s, h * d, dtype=torch.float16, seed=i) * 4 for i in (9, 10, 11))
    ov = comfyui.override()
    plain = ov(Func(), q, k, v, h)
    upcast = ov(Func(), q, k, v, h, attn_precision=torch.float32)
    want = reference(q, k, v, h)
    e_plain = float((plain.double() - want).norm() / want.norm())
    e_upcast = float((upcast.double() - want).norm() / want.norm())
    assert upcast.dtype == torch.float16 and e_upcast <= e_plain and e_upcast < 1e-3


def test_what_dattn_does_not_serve_goes_to_comfyuis_function_counted():
    b, s, h, d = 1, 16, 2, 8
    q, k, v = (rand(b, s, h * d, seed=i) for i in (12, 13, 14))
    func, ov = Func(), comfyui.override()
    meta = [t.to("meta") for t in (q, k, v)]
    ov(func, *meta, h)                                   # another device
    qg = q.clone().requires_grad_()
    out = ov(func, qg, k, v, h)                          # gradients
    out.sum().backward()
    assert qg.grad is not None
    ov(func, q.double(), k.double(), v.double(), h)      # a dtype dattn does not serve
    assert func.calls == 3 and ov.calls == 0
    assert dict(ov.fallbacks) == {"device": 1, "grad": 1, "dtype": 1}


def test_an_override_the_model_carried_gets_the_fallbacks():
    calls = []

    def previous(func, *args, **kwargs):
        calls.append(args[0].device.type)
        return func(*args, **kwargs)

    q, k, v = (rand(1, 8, 16, seed=i) for i in (15, 16, 17))
    func, ov = Func(), comfyui.override(previous=previous)
    ov(func, q, k, v, 2)
    ov(func, *(t.to("meta") for t in (q, k, v)), 2)
    assert calls == ["meta"] and func.calls == 1 and ov.calls == 1


def test_options_are_strict_and_a_copy_is_the_same_override():
    with pytest.raises(dattn.InvalidArgument) as e:
        comfyui.override("SAGE", pv_dtpye="int8")
    assert "pv_dtpye" in str(e.value)
    with pytest.raises(dattn.InvalidArgument) as e:
        comfyui.override("FLASH_ATTN")
    assert e.value.field == "backend" and "SAGE" in str(e.value)
    ov = comfyui.override("SAGE", pv_dtype="int16")
    assert copy.deepcopy({"o": ov})["o"] is ov  # ComfyUI's ModelPatcher.clone deep-copies
    q, k, v = (rand(1, 128, 2 * 64, seed=i) for i in (18, 19, 20))
    got = ov(Func(), q, k, v, 2)
    want = reference(q, k, v, 2)
    assert float((got.double() - want).norm() / want.norm()) < 2e-2


def test_register_needs_comfyui():
    assert comfyui.register() is False  # ComfyUI is not importable in this environment
