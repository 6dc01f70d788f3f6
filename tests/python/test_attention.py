"""dattn.Attention from Python against a float64 oracle written from PyTorch's math (conftest),
feature by feature: masks, joint tokens, packed documents, packed padding, valid_kv_length,
piecewise spans, query ranges, GQA, layouts and strided views, dtypes, LSE, numpy inputs."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import dattn
from conftest import assert_close, oracle, rand

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_gqa_every_dtype_with_lse(dtype, causal):
    q, k, v = rand(2, 37, 6, 24, dtype=dtype, seed=1), rand(2, 41, 2, 24, dtype=dtype, seed=2), rand(
        2, 41, 2, 24, dtype=dtype, seed=3
    )
    layer = dattn.Attention(6, 24, causal=causal, num_kv_heads=2)
    out, lse = layer.forward(q, k, v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 6, 37)
    want, want_lse = oracle(q, k, v, causal_offset=41 - 37 if causal else None)
    assert_close(out, want, dtype)
    engines = {e["name"]: e for e in dattn.flash_engines()}
    if engines[layer.last_engine]["compute_dtype"] == "int16":
        # bf16 / f16 calls on the 16-bit integer lanes (the automatic rule, where they outrun the
        # float mixes): the logits of 13-bit codes, the LSE within 1e-4 (docs/semantics.md).
        lse_err = float((lse.double() - want_lse.double()).norm() / want_lse.double().norm())
        assert lse_err <= 1e-4, lse_err
    else:
        assert_close(lse, want_lse, torch.float32, "lse")


def test_softmax_scale_and_value_head_size():
    q, k, v = rand(1, 20, 2, 32, seed=1), rand(1, 20, 2, 32, seed=2), rand(1, 20, 2, 48, seed=3)
    out = dattn.Attention(2, 32, softmax_scale=0.3).forward(q, k, v)
    assert out.shape == (1, 20, 2, 48)
    assert_close(out, oracle(q, k, v, scale=0.3)[0])


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("rank", [3, 4])
def test_dense_masks(kind, rank):
    B, S, H = 2, 30, 4
    q, k, v = rand(B, S, H, 16, seed=1), rand(B, S, H, 16, seed=2), rand(B, S, H, 16, seed=3)
    g = torch.Generator().manual_seed(5)
    shape = (B, S, S) if rank == 3 else (B, 1, S, S)
    if kind == "bool":
        mask = torch.rand(shape, generator=g) > 0.3
        mask[..., 0] = True
        m4 = mask if rank == 4 else mask.unsqueeze(1)
        want = oracle(q, k, v, visible=m4)[0]
    else:
        mask = torch.randn(shape, generator=g)
        mask[..., 3] = float("-inf")
        m4 = mask if rank == 4 else mask.unsqueeze(1)
        want = oracle(q, k, v, bias=m4)[0]
    out = dattn.Attention(H, 16).forward(q, k, v, dattn.AttentionMetadata(attn_mask=mask))
    assert_close(out, want)


def test_finfo_min_mask_attends_uniformly():
    q, k, v = rand(1, 8, 1, 16, seed=1), rand(1, 12, 1, 16, seed=2), rand(1, 12, 1, 16, seed=3)
    mask = torch.zeros(1, 1, 8, 12)
    mask[0, 0, 2, :] = torch.finfo(torch.float32).min
    out, lse = dattn.Attention(1, 16).forward(
        q, k, v, dattn.AttentionMetadata(attn_mask=mask), return_lse=True
    )
    assert torch.allclose(out[0, 2, 0], v[0, :, 0].mean(0), atol=1e-5)
    assert torch.isfinite(lse).all()


def test_key_padding_mask_self_and_cross():
    B, S = 2, 25
    q, k, v = rand(B, S, 2, 16, seed=1), rand(B, S, 2, 16, seed=2), rand(B, S, 2, 16, seed=3)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, 20:] = False
    keep[1, 3] = False
    vis = keep.view(B, 1, 1, S)
    want = oracle(q, k, v, visible=vis)[0]
    # self-attention: masked query rows are padding (zeros)
    want_self = want.clone()
    want_self[~keep] = 0
    out = dattn.Attention(2, 16).forward(q, k, v, dattn.AttentionMetadata(attn_mask=keep))
    assert_close(out, want_self)
    out = dattn.Attention(2, 16, role="cross").forward(q, k, v, dattn.AttentionMetadata(attn_mask=keep))
    assert_close(out, want)


@pytest.mark.parametrize("strategy", ["front", "rear"])
def test_joint_tokens(strategy):
    B, S, J, H = 2, 20, 7, 4
    q, k, v = rand(B, S, H, 16, seed=1), rand(B, S, H, 16, seed=2), rand(B, S, H, 16, seed=3)
    jq, jk, jv = rand(B, J, H, 16, seed=4), rand(B, J, H, 16, seed=5), rand(B, J, H, 16, seed=6)
    meta = dattn.AttentionMetadata(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=strategy)
    out, lse = dattn.Attention(H, 16).forward(q, k, v, meta, return_lse=True)
    cat = (lambda j, x: torch.cat([j, x], 1)) if strategy == "front" else (lambda j, x: torch.cat([x, j], 1))
    want, want_lse = oracle(cat(jq, q), cat(jk, k), cat(jv, v))
    assert out.shape == (B, J + S, H, 16)
    assert_close(out, want)
    assert_close(lse, want_lse, what="lse")


def test_packed_documents_thd():
    lens = [5, 0, 17, 9]
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = rand(T, 3, 16, seed=1), rand(T, 3, 16, seed=2), rand(T, 3, 16, seed=3)
    meta = dattn.AttentionMetadata(
        extra={"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lens), "max_seqlen_k": max(lens)}
    )
    out = dattn.Attention(3, 16, causal=True, qkv_layout="THD").forward(q, k, v, meta)
    want = torch.zeros(T, 3, 16, dtype=torch.float64)
    for d in range(len(lens)):
        a, e = int(cu[d]), int(cu[d + 1])
        if e > a:
            want[a:e] = oracle(q[None, a:e], k[None, a:e], v[None, a:e], causal_offset=0)[0][0]
    assert_close(out, want)


def test_packed_padding_and_valid_kv_length():
    S, used = 24, 17
    q, k, v = rand(1, S, 2, 16, seed=1), rand(1, S, 2, 16, seed=2), rand(1, S, 2, 16, seed=3)
    pp = dattn.PackedPaddingMetadata(
        q_length=used,
        kv_length=used,
        cu_seqlens_q=torch.tensor([0, used], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, used], dtype=torch.int32),
    )
    out = dattn.Attention(2, 16).forward(q, k, v, dattn.AttentionMetadata(packed_padding=pp))
    want = torch.zeros(1, S, 2, 16, dtype=torch.float64)
    want[:, :used] = oracle(q[:, :used], k[:, :used], v[:, :used])[0]
    assert_close(out, want)
    out = dattn.Attention(2, 16).forward(q, k, v, dattn.AttentionMetadata(extra={"valid_kv_length": used}))
    assert_close(out, oracle(q, k[:, :used], v[:, :used])[0])


def test_piecewise_spans_and_query_ranges():
    S = 30
    q, k, v = rand(1, S, 2, 16, seed=1), rand(1, S, 2, 16, seed=2), rand(1, S, 2, 16, seed=3)
    spans = [[(5, 12), (20, 26)]]
    vis = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        end = i + 1
        for a, e in spans[0]:
            if a <= i < e:
                end = max(end, e)
        vis[i, :end] = True
    out = dattn.Attention(2, 16, causal=True).forward(q, k, v, dattn.AttentionMetadata(full_attn_spans=spans))
    assert_close(out, oracle(q, k, v, visible=vis.view(1, 1, S, S))[0])
    # Query ranges: the last 10 queries, in two ranges, placed at global rows 20..29.
    qt = q[:, 20:]
    meta = dattn.AttentionMetadata(
        query_ranges=(dattn.QueryRange(0, 4, 20), dattn.QueryRange(4, 10, 24))
    )
    out = dattn.Attention(2, 16, causal=True).forward(qt, k, v, meta)
    assert_close(out, oracle(qt, k, v, causal_offset=20)[0])


def test_bhsd_views_and_strided_inputs_without_copies():
    B, H, S, D = 2, 4, 19, 16
    qkv = rand(B, S, 3, H, D, seed=1)  # a fused projection: q, k, v are strided views of it
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    want = oracle(q, k, v)[0]
    out = dattn.Attention(H, D).forward(q, k, v)
    assert_close(out, want)
    # BHSD views of the same memory, written into a caller's strided buffer.
    big = torch.full((B, S, H, 2 * D), 7.0)
    out_view = big[..., :D].transpose(1, 2)  # [B, H, S, D], not contiguous
    got = dattn.Attention(H, D, qkv_layout="BHSD").forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out=out_view
    )
    assert got is out_view
    assert_close(big[..., :D], want)
    assert torch.all(big[..., D:] == 7.0)  # nothing written outside the view


def test_numpy_inputs_read_only_and_bool_masks():
    q, k, v = (rand(1, 12, 2, 8, seed=s).numpy() for s in (1, 2, 3))
    keep = np.ones((1, 2, 12, 12), dtype=bool)
    keep[..., 5] = False
    mask = np.broadcast_to(keep[:, :1], (1, 2, 12, 12))  # read-only, stride 0
    assert not mask.flags.writeable
    q.setflags(write=False)
    out = dattn.Attention(2, 8).forward(q, k, v, dattn.AttentionMetadata(attn_mask=mask))
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    want = oracle(torch.from_numpy(q.copy()), torch.from_numpy(k), torch.from_numpy(v),
                  visible=torch.from_numpy(keep))[0]
    assert_close(torch.from_numpy(out), want)
    with pytest.raises(dattn.InvalidArgument):
        dattn.Attention(2, 8).forward(q, k, v, out=q)  # a read-only output


def test_tensors_that_require_grad_are_read_without_copy():
    q = rand(1, 10, 2, 8, seed=1).requires_grad_()
    k, v = rand(1, 10, 2, 8, seed=2), rand(1, 10, 2, 8, seed=3)
    out = dattn.Attention(2, 8).forward(q, k, v)
    assert not out.requires_grad
    assert_close(out, oracle(q, k, v)[0])


def test_out_is_written_in_place_and_untouched_on_error():
    q, k, v = rand(1, 10, 2, 8, seed=1), rand(1, 10, 2, 8, seed=2), rand(1, 10, 2, 8, seed=3)
    out = torch.full((1, 10, 2, 8), 3.0)
    assert dattn.Attention(2, 8).forward(q, k, v, out=out) is out
    assert_close(out, oracle(q, k, v)[0])
    before = torch.full((1, 10, 2, 8), 3.0)
    out.copy_(before)
    bad = [
        (dict(attn_metadata=dattn.AttentionMetadata(joint_query=q)), "joint_key"),
        (dict(attn_metadata=dattn.AttentionMetadata(extra={"valid_kv_length": 11})), "valid_kv_length"),
        (dict(attn_metadata=dattn.AttentionMetadata(joint_strategy="middle",
                                                   joint_query=q, joint_key=k, joint_value=v)), None),
        (dict(attn_metadata=dattn.AttentionMetadata(attn_mask=torch.zeros(1, 10))), "attn_mask"),
        (dict(attn_metadata=dattn.AttentionMetadata(
            extra={"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32)})), None),
        (dict(attn_metadata=dattn.AttentionMetadata(full_attn_spans=[[(5, 3)]])), "full_attn_spans"),
        (dict(attn_metadata=dattn.AttentionMetadata(query_ranges=(dattn.QueryRange(1, 10, 0),))),
         "query_ranges"),
    ]
    for kwargs, field in bad:
        with pytest.raises(dattn.InvalidArgument) as e:
            dattn.Attention(2, 8).forward(q, k, v, out=out, **kwargs)
        if field:
            assert e.value.field == field and field in str(e.value)
        assert torch.equal(out, before)
    with pytest.raises(dattn.InvalidArgument, match="num_kv_heads|heads"):
        dattn.Attention(3, 8, num_kv_heads=2)


def test_wrong_dtype_and_device_are_refused_with_a_message():
    q, k, v = rand(1, 4, 1, 8, seed=1), rand(1, 4, 1, 8, seed=2), rand(1, 4, 1, 8, seed=3)
    with pytest.raises(dattn.InvalidArgument, match="query"):
        dattn.Attention(1, 8).forward(q.double(), k, v)
    meta_q = torch.empty(1, 4, 1, 8, device="meta")
    with pytest.raises(dattn.Unsupported, match="meta"):
        dattn.Attention(1, 8).forward(meta_q, k, v)

    class CudaLooking:
        shape = (1, 4, 1, 8)

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

        def __dlpack__(self, stream=None):
            raise AssertionError("must not be read")

    with pytest.raises(dattn.Unsupported, match="device"):
        dattn.Attention(1, 8).forward(CudaLooking(), k, v)


def test_two_python_threads_run_two_layers_at_once():
    inputs = [tuple(rand(1, 300, 4, 32, seed=10 * t + s) for s in range(3)) for t in range(2)]
    layers = [dattn.Attention(4, 32, causal=t == 1) for t in range(2)]
    single = [layers[t].forward(*inputs[t]) for t in range(2)]
    results = [None, None]

    def work(t):
        for _ in range(5):
            results[t] = layers[t].forward(*inputs[t])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(2):
        assert torch.equal(results[t], single[t])


def test_backend_choice_and_environment():
    assert dattn.Attention(1, 8, backend="reference").backend_name == "REFERENCE"
    with pytest.raises(dattn.InvalidArgument, match="FLASH"):
        dattn.Attention(1, 8, backend="nonesuch")
    env = dict(os.environ, DIFFUSION_ATTENTION_BACKEND="REFERENCE")
    code = "import dattn; print(dattn.Attention(1, 8).backend_name)"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert got.stdout.strip() == "REFERENCE", got.stderr
    q, k, v = rand(1, 9, 2, 8, seed=1), rand(1, 9, 2, 8, seed=2), rand(1, 9, 2, 8, seed=3)
    for isa in ("portable",):
        out = dattn.Attention(2, 8, backend="FLASH", backend_kwargs={"isa": isa}).forward(q, k, v)
        assert_close(out, oracle(q, k, v)[0])


def test_forward_paged_over_a_page_pool():
    pool = dattn.PagePool(num_blocks=8, block_size=4, kv_heads=2, head_size=16)
    table = pool.allocate(5)[::-1]
    T, H = 18, 4
    q, k, v = rand(T, H, 16, seed=1), rand(T, 2, 16, seed=2), rand(T, 2, 16, seed=3)
    layer = dattn.Attention(H, 16, num_kv_heads=2)
    call = dattn.PagedCall(q, k, v, rows=[dattn.PagedRow(T, T, 0, table)], pool=pool, return_lse=True)
    out, lse = layer.forward_paged(call)
    want, want_lse = oracle(q[None], k[None], v[None])
    assert_close(out, want[0])
    assert_close(lse, want_lse[0], what="lse")
    assert pool.read(table[1], 2, 1) == pytest.approx(k[6, 1].tolist())
    # A later step rewrites the last 6 rows and attends the cached prefix.
    k2, v2, q2 = rand(6, 2, 16, seed=7), rand(6, 2, 16, seed=8), rand(6, H, 16, seed=9)
    out2 = layer.forward_paged(dattn.PagedCall(q2, k2, v2, [dattn.PagedRow(6, T, T - 6, table)], pool))
    kk, vv = torch.cat([k[: T - 6], k2]), torch.cat([v[: T - 6], v2])
    assert_close(out2, oracle(q2[None], kk[None], vv[None])[0][0])
    with pytest.raises(dattn.InvalidArgument):
        layer.forward_paged(dattn.PagedCall(q2, k2, v2, [dattn.PagedRow(6, 40, 34, table)], pool))


def test_sage_pv_dtype_int8_from_python():
    """SAGE's pv_dtype int8 (P.V in 8 bits) through backend_kwargs: an int8 engine runs it,
    within its documented accuracy (cosine >= 0.9995); a bad pv_dtype names the option."""
    q, k, v = rand(1, 150, 4, 64, seed=11), rand(1, 150, 2, 64, seed=12), rand(1, 150, 2, 64, seed=13)
    want, _ = oracle(q, k, v)
    layer = dattn.Attention(4, 64, num_kv_heads=2, backend="SAGE",
                            backend_kwargs={"pv_dtype": "int8"})
    got = layer.forward(q, k, v).double()
    int8 = {e["name"] for e in dattn.flash_engines() if e["compute_dtype"] == "int8"}
    assert layer.last_engine in int8
    cos = torch.nn.functional.cosine_similarity(got.flatten(2), want.double().flatten(2), dim=-1)
    assert float(cos.min()) >= 0.9995
    with pytest.raises(dattn.InvalidArgument, match="pv_dtype"):
        dattn.Attention(4, 64, num_kv_heads=2, backend="SAGE", backend_kwargs={"pv_dtype": "int4"})


def test_flash_engines_isa_compute_dtype_and_last_engine():
    engines = dattn.flash_engines()
    names = [e["name"] for e in engines]
    assert names[0] == "portable"
    assert {"avx2", "avx512", "avx512_bf16", "avx512_bf16_emulated", "amx", "amx_emulated"} <= set(names)
    assert [e["rank"] for e in engines] == sorted(e["rank"] for e in engines)
    q, k, v = rand(1, 40, 4, 40, seed=1), rand(1, 45, 2, 40, seed=2), rand(1, 45, 2, 40, seed=3)
    want, _ = oracle(q, k, v)
    for e in engines:
        sage = e["compute_dtype"] == "int8"  # SAGE's engines
        options = {"isa": e["name"]} if sage else {"isa": e["name"], "compute_dtype": "bf16"}
        backend = "SAGE" if sage else "FLASH"
        if e["unavailable_reason"] is not None:
            with pytest.raises(dattn.NotAvailable):
                dattn.Attention(4, 40, num_kv_heads=2, backend=backend, backend_kwargs=options)
            continue
        layer = dattn.Attention(4, 40, num_kv_heads=2, backend=backend, backend_kwargs=options)
        assert layer.last_engine == ""
        out = layer.forward(q, k, v)  # f32 inputs, compute_dtype bf16: the cap itself runs
        assert layer.last_engine == e["name"]
        if sage:  # 8-bit Q.K^T: within SAGE's documented accuracy
            got, ref = out.double().ravel(), want.double().ravel()
            assert float(got @ ref / (got.norm() * ref.norm())) >= 0.9995
        elif e["compute_dtype"] == "int16":  # the 16-bit integer lanes, named: bf16's bound
            assert_close(out, want, torch.bfloat16)
        else:
            assert_close(out, want, torch.bfloat16 if e["compute_dtype"] == "bf16" else torch.float32)
    # The exact default keeps f32 inputs on an f32 engine whatever the cap.
    layer = dattn.Attention(4, 40, num_kv_heads=2, backend_kwargs={"isa": "avx512_bf16_emulated"})
    assert_close(layer.forward(q, k, v), want)
    assert {e["name"]: e["compute_dtype"] for e in engines}[layer.last_engine] == "f32"
    with pytest.raises(dattn.InvalidArgument):
        dattn.Attention(4, 40, backend_kwargs={"compute_dtype": "f64"})
    with pytest.raises(dattn.InvalidArgument):
        dattn.Attention(4, 40, backend_kwargs={"isa": "sse9"})
    assert dattn.Attention(4, 40, backend="REFERENCE").last_engine == ""


def test_backend_kwargs_are_strict():
    """An unknown or misspelled backend option is InvalidArgument naming it and the valid ones
    (with the near miss), at construction; each backend lists its options; values by type."""
    with pytest.raises(dattn.InvalidArgument, match="pv_dtyp.*did you mean 'pv_dtype'") as e:
        dattn.Attention(2, 64, backend="SAGE", backend_kwargs={"pv_dtyp": "int8"})
    assert e.value.field == "pv_dtyp"
    with pytest.raises(dattn.InvalidArgument, match="not an option of FLASH"):
        dattn.Attention(2, 64, backend="FLASH", backend_kwargs={"pv_dtype": "int8"})
    with pytest.raises(dattn.InvalidArgument, match="rotate"):
        dattn.Attention(2, 64, backend="SAGE", backend_kwargs={"rotate": "yes"})
    assert set(dattn.get_backend("SAGE").options) == {
        "isa", "qk_dtype", "pv_dtype", "smooth_k", "balance_qk", "rotate"}
    assert dattn.get_backend("REFERENCE").options == ()
    layer = dattn.Attention(2, 64, backend="SAGE",
                            backend_kwargs={"pv_dtype": "int8", "rotate": False})
    q = rand(1, 20, 2, 64, seed=3)
    layer.forward(q, q, q)


def test_packed_padding_of_the_wrong_type_names_its_type():
    q = rand(1, 8, 2, 16, seed=1)
    layer = dattn.Attention(2, 16)
    for bad in (3, "padding", {"q_length": 4}):
        with pytest.raises(dattn.InvalidArgument, match="packed_padding: expected a "
                           "PackedPaddingMetadata") as e:
            layer.forward(q, q, q, dattn.AttentionMetadata(packed_padding=bad))
        assert type(bad).__name__ in str(e.value)


def test_int16_lanes_compute_dtype_and_qk_dtype():
    """FLASH's compute_dtype int16 runs on a 16-bit integer-lane engine (f32 where the CPU has
    none), SAGE's and VIDEO_SPARSE's qk_dtype int16 too; python -m dattn info holds those engines
    to the int16 dot's peak."""
    import torch

    from dattn.__main__ import _peak_kind

    engines = {e["name"]: e for e in dattn.flash_engines()}
    int16 = {n for n, e in engines.items() if e["compute_dtype"] == "int16"}
    assert {"avx2_int16", "avx_vnni_int16", "avx512_vnni_int16"} <= int16
    assert all(_peak_kind(engines[n]) == ("int16_dot" if not engines[n]["emulated"] else None)
               for n in int16)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 90, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    want = dattn.Attention(2, 64, backend="REFERENCE").forward(q, k, v).float()
    layer = dattn.Attention(2, 64, backend="FLASH", backend_kwargs={"compute_dtype": "int16"})
    got = layer.forward(q, k, v).float()
    real = {n for n in int16
            if not engines[n]["emulated"] and engines[n]["unavailable_reason"] is None}
    assert layer.last_engine in (real or {"avx512", "avx2", "portable"}), layer.last_engine
    assert ((got - want).norm() / want.norm()).item() < 1.6e-2
    for backend in ("SAGE", "VIDEO_SPARSE"):
        s = dattn.Attention(2, 64, backend=backend,
                            backend_kwargs={"qk_dtype": "int16", "isa": "avx2_int16_emulated"})
        s.forward(q, k, v)
        assert s.last_engine == "avx2_int16_emulated", backend
        with pytest.raises(dattn.InvalidArgument, match="qk_dtype"):
            dattn.Attention(2, 64, backend=backend, backend_kwargs={"qk_dtype": "int12"})
    with pytest.raises(dattn.InvalidArgument, match="compute_dtype"):
        dattn.Attention(2, 64, backend="FLASH", backend_kwargs={"compute_dtype": "int12"})
