"""How torch tensors and numpy arrays reach dattn._core, and how outputs are made.

torch.Tensor goes through DLPack (no copy, any strides). PyTorch's DLPack refuses tensors that
require grad: such a tensor is passed as ``.detach()``, and a bool tensor as its uint8 view (the
same memory; dattn is inference only); a tensor with PyTorch's lazy negation or conjugation bit
is read resolved (DLPack would hand over the raw memory). numpy arrays are read through
``__array_interface__`` (no copy), so read-only arrays such as ``np.broadcast_to`` results and
bool arrays need nothing special; an output must be writable.

torch is never imported here: an object is a torch tensor only if torch is already imported
(``import dattn`` imports neither torch nor any host framework).
"""

from __future__ import annotations

import sys

from .errors import InvalidArgument, UnsupportedTensor, _with_field

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def _torch():
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_numpy(x) -> bool:
    return np is not None and isinstance(x, np.ndarray)


def check_device(x, field: str):
    """Refuses a tensor that does not live in host memory, naming its device."""
    if is_torch(x):
        if x.device.type != "cpu":
            raise _with_field(
                UnsupportedTensor,
                f"{field}: lives on device {x.device}; dattn's Python package computes on CPU "
                f"tensors only (move it with .cpu())",
                field,
            )
    elif hasattr(x, "__dlpack_device__") and not is_numpy(x):
        dev = x.__dlpack_device__()
        if int(dev[0]) != 1:  # kDLCPU
            raise _with_field(
                UnsupportedTensor, f"{field}: lives on DLPack device {tuple(dev)}; only CPU tensors", field
            )


def tensor_arg(x, field: str):
    """What dattn._core takes for tensor `x` (argument `field`)."""
    if is_torch(x):
        torch = _torch()
        check_device(x, field)
        if x.requires_grad:
            x = x.detach()
        if x.is_neg():
            x = x.resolve_neg()
        if x.is_conj():
            x = x.resolve_conj()
        if x.dtype == torch.bool:
            return (x.view(torch.uint8), "bool")
        return x
    if is_numpy(x):
        return x
    if hasattr(x, "__dlpack__"):
        check_device(x, field)
        return x
    raise _with_field(
        InvalidArgument,
        f"{field}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}",
        field,
    )


#: Outputs from this size on live in dattn's result memory (dattn._core.result_capsule /
#: ResultBuffer: a mapping of the process's, never a block of the C heap that the small
#: objects layers keep could pin; docs/architecture.md, "Memory"); smaller ones are the
#: framework's own (torch.empty, np.empty).
RESULT_MAP_BYTES = 64 << 10

_TORCH_DTYPE_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _numel(shape) -> int:
    n = 1
    for e in shape:
        n *= int(e)
    return n


def empty_like_input(shape, like, dtype=None):
    """A new tensor of `shape` of the kind of `like` (torch or numpy), `dtype` or like's."""
    from . import _core

    shape = tuple(int(e) for e in shape)
    if is_torch(like):  # on like's device: never torch's default device (set_default_device)
        torch = _torch()
        dt = like.dtype if dtype is None else dtype
        name = _TORCH_DTYPE_NAMES.get(str(dt).replace("torch.", ""))
        if (like.device.type == "cpu" and name is not None
                and _numel(shape) * dt.itemsize >= RESULT_MAP_BYTES):
            return torch.from_dlpack(_core.result_capsule(list(shape), name))
        return torch.empty(shape, dtype=dt, device=like.device)
    if is_numpy(like):
        dt = np.dtype(like.dtype if dtype is None else dtype)
        nbytes = _numel(shape) * dt.itemsize
        if nbytes >= RESULT_MAP_BYTES:
            return np.frombuffer(_core.ResultBuffer(nbytes), dtype=dt).reshape(shape)
        return np.empty(shape, dtype=dt)
    raise _with_field(InvalidArgument, "query: expected a torch.Tensor or numpy.ndarray", "query")


def float32_like(like):
    if is_torch(like):
        return _torch().float32
    return np.float32
