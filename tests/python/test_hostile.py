"""Hostile input through the Python layer (issue: out of memory, a mistyped DATTN_ISA,
overlapping outputs, lying tensor producers, untyped errors): every bad value is a dattn error
naming the field; a fault inside a call reaches Python as MemoryError and the process lives."""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import dattn


def _qkv(s=8, h=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, s, h, d)).astype(np.float32) for _ in range(3)]


def _layer(**kw):
    return dattn.Attention(num_heads=2, head_size=16, **kw)


def _field(fn):
    with pytest.raises(dattn.Error) as e:
        fn()
    assert e.value.field and e.value.field in str(e.value), str(e.value)
    return e.value


# ---- untyped errors: each bad value names its field ----

@pytest.mark.parametrize(
    "meta, field, kind",
    [
        (dattn.AttentionMetadata(extra={"valid_kv_length": 2**64}), "valid_kv_length", ValueError),
        (dattn.AttentionMetadata(extra={"max_seqlen_q": 2**64}), "max_seqlen_q", ValueError),
        (dattn.AttentionMetadata(extra={"max_seqlen_k": "8"}), "max_seqlen_k", TypeError),
        (dattn.AttentionMetadata(full_attn_spans=[[("a", "b")]]), "full_attn_spans", TypeError),
        (dattn.AttentionMetadata(full_attn_spans=[[(0, 1, 2)]]), "full_attn_spans", TypeError),
        (dattn.AttentionMetadata(full_attn_spans=5), "full_attn_spans", TypeError),
        (dattn.AttentionMetadata(query_ranges=[("x", 1, 2)]), "query_ranges", TypeError),
        (dattn.AttentionMetadata(q_global_start="0"), "q_global_start", TypeError),
        (dattn.AttentionMetadata(q_global_start=2**70), "q_global_start", ValueError),
        (dattn.AttentionMetadata(extra=[1, 2]), "extra", TypeError),
        ([1, 2], "attn_metadata", TypeError),
        ("metadata", "attn_metadata", TypeError),
        (7, "attn_metadata", TypeError),
    ],
)
def test_bad_metadata_values_are_dattn_errors_naming_the_field(meta, field, kind):
    q, k, v = _qkv()
    out = np.full_like(q, 7.0)
    e = _field(lambda: _layer().forward(q, k, v, meta, out=out))
    assert e.field == field
    assert isinstance(e, dattn.InvalidArgument) and isinstance(e, kind)
    assert (out == 7.0).all()  # nothing written


def test_numpy_integers_are_integers_everywhere():
    q, k, v = _qkv()
    want = _layer().forward(q, k, v, dattn.AttentionMetadata(q_global_start=0,
                                                              extra={"valid_kv_length": 8}))
    got = _layer().forward(q, k, v, dattn.AttentionMetadata(q_global_start=np.int64(0),
                                                             extra={"valid_kv_length": np.int32(8)}))
    np.testing.assert_array_equal(got, want)
    spans = dattn.AttentionMetadata(full_attn_spans=[[(np.int64(0), np.int64(4))]])
    causal = _layer(causal=True)
    np.testing.assert_array_equal(
        causal.forward(q, k, v, spans),
        causal.forward(q, k, v, dattn.AttentionMetadata(full_attn_spans=[[(0, 4)]])),
    )


def test_backend_kwargs_must_be_a_mapping():
    for bad in ([1, 2], "isa", 3):
        e = _field(lambda: _layer(backend_kwargs=bad))
        assert e.field == "backend_kwargs" and isinstance(e, TypeError)
    e = _field(lambda: _layer(backend_kwargs={1: "x"}))
    assert e.field == "backend_kwargs"


def test_sdpa_scale_must_be_a_number():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 8, 16)
    e = _field(lambda: dattn.scaled_dot_product_attention(q, q, q, scale="x"))
    assert e.field == "scale" and isinstance(e, TypeError) and isinstance(e, ValueError)
    # A numpy float is a number.
    out = dattn.scaled_dot_product_attention(q, q, q, scale=np.float32(0.25))
    assert torch.allclose(out, dattn.scaled_dot_product_attention(q, q, q, scale=0.25))


def test_isa_option_on_reference_is_an_error():
    e = _field(lambda: _layer(backend="REFERENCE", backend_kwargs={"isa": "amx"}))
    assert e.field == "isa" and isinstance(e, dattn.InvalidArgument)


# ---- DATTN_ISA: a configuration error raises instead of dropping onto REFERENCE ----

@pytest.mark.parametrize("value", ["junk", "amx,avx2", "x" * 5000], ids=["junk", "list", "long"])
def test_mistyped_dattn_isa_raises_from_python(value):
    code = (
        "import dattn, numpy as np\n"
        "q = np.ones((1, 4, 2, 16), np.float32)\n"
        "try:\n"
        "    dattn.Attention(num_heads=2, head_size=16).forward(q, q, q)\n"
        "    print('ran')\n"
        "except dattn.InvalidArgument as e:\n"
        "    print('InvalidArgument', e.field, len(str(e)))\n"
        "print(dattn.Attention(num_heads=2, head_size=16, backend='REFERENCE')"
        ".forward(q, q, q).shape)\n"
    )
    env = dict(os.environ, DATTN_ISA=value)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    kind, field, length = lines[0].split()
    assert (kind, field) == ("InvalidArgument", "DATTN_ISA")
    assert int(length) < 1024
    assert lines[1] == "(1, 4, 2, 16)"  # REFERENCE ignores DATTN_ISA


# ---- outputs that overlap ----

def test_self_overlapping_out_is_refused_before_anything_is_written():
    q, k, v = _qkv()
    row = np.full((1, 1, 2, 16), 3.0, np.float32)
    out = np.lib.stride_tricks.as_strided(row, shape=q.shape, strides=(0, 0, 64, 4),
                                          writeable=True)
    e = _field(lambda: _layer().forward(q, k, v, out=out))
    assert e.field == "out"
    assert (row == 3.0).all()


def test_out_overlapping_an_input_is_refused():
    q, k, v = _qkv()
    buf = np.zeros((2 * q.size,), np.float32)
    k_view = buf[: q.size].reshape(q.shape)
    k_view[...] = k
    out = buf[q.size // 2: q.size // 2 + q.size].reshape(q.shape)
    assert _field(lambda: _layer().forward(q, k_view, v, out=out)).field == "out"
    assert _field(lambda: _layer().forward(q, k, v, out=v)).field == "out"


def test_torch_expanded_out_is_refused():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 8, 2, 16)
    out = torch.zeros(1, 1, 2, 16).expand(1, 8, 2, 16)
    assert _field(lambda: _layer().forward(q, q.clone(), q.clone(), out=out)).field == "out"


# ---- lying tensor producers (DLPack) ----

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _Liar:
    """A producer whose __dlpack__ capsule describes memory that is not there."""

    def __init__(self, data, shape, strides=None):
        self.shape = tuple(shape)
        self._shape = (ctypes.c_int64 * 4)(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * 4)(*strides)
        self._m = _DLManagedTensor()
        t = self._m.dl_tensor
        t.data = data
        t.device = _DLDevice(1, 0)  # kDLCPU
        t.ndim = 4
        t.dtype = _DLDataType(2, 32, 1)  # float32
        t.shape = self._shape
        t.strides = self._strides
        t.byte_offset = 0

    def __dlpack__(self, *args, **kwargs):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor", None)

    def __dlpack_device__(self):
        return (1, 0)


def test_lying_dlpack_capsules_are_refused_naming_the_tensor():
    q, k, v = _qkv()
    null = _Liar(None, q.shape)
    assert _field(lambda: _layer().forward(null, k, v, out=np.zeros_like(q))).field == "query"
    huge = _Liar(k.ctypes.data, k.shape, [2**62, 2**61, 2**60, 1])
    assert _field(lambda: _layer().forward(q, huge, v, out=np.zeros_like(q))).field == "key"
    misaligned = _Liar(v.ctypes.data + 1, v.shape)
    assert _field(lambda: _layer().forward(q, k, misaligned, out=np.zeros_like(q))).field == "value"


# ---- out of memory inside a call: MemoryError, and the process lives ----

_OOM_CHILD = r"""
import resource, sys
import numpy as np
import dattn
limit_fraction = float(sys.argv[1])
rng = np.random.default_rng(0)
small = [rng.standard_normal((1, 64, 2, 64)).astype(np.float32) for _ in range(3)]
dattn.Attention(num_heads=2, head_size=64).forward(*small)   # warm-up: threads, small buffers
big = [rng.standard_normal((1, 1024, 4, 128)).astype(np.float32) for _ in range(3)]
out = np.zeros_like(big[0])
layer = dattn.Attention(num_heads=4, head_size=128)
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
base = vm()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (base + int(limit_fraction * 6 * 2**20), hard))
try:
    layer.forward(*big, out=out)
    result = "ok"
except MemoryError:
    result = "MemoryError"
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
again = layer.forward(*big)
want = dattn.Attention(num_heads=4, head_size=128, backend="REFERENCE").forward(
    big[0][:, :4], big[1], big[2])
assert np.abs(again[:, :4] - want).max() < 1e-4
print(result)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_out_of_memory_reaches_python_as_memory_error():
    results = []
    for i in range(6):
        r = subprocess.run([sys.executable, "-c", _OOM_CHILD, str(i / 6)],
                           capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        assert r.returncode == 0, f"limit {i}/6: exit {r.returncode}: {r.stderr[-2000:]}"
        results.append(r.stdout.strip())
    assert "MemoryError" in results, results
