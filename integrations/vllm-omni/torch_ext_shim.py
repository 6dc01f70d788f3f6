"""Import-time shim of the vllm-omni test environment (integrations/vllm-omni/setup_env.sh
installs it as site-packages/dattn_torch_ext_shim.py with a .pth line): PyPI's CUDA-only
torchvision / torchaudio wheels beside a CPU torch. Environment only: dattn's package never
carries it, and on a machine with CPU builds of both (PyTorch's CPU index) it does nothing.

PyPI only serves CUDA builds of torchvision (0.28.0+cu130) and torchaudio
(2.11.1); their extension .so files need libc10_cuda.so / libtorch_cuda.so and
fail to load next to torch 2.13.0+cpu.  The pure-Python parts (transforms,
functional, ...) work fine once the import itself survives:

* torchvision: extension.py catches the OSError (_has_ops() -> False), but
  _meta_registrations.py:163 and :177 do *unguarded*
      @torch.library.register_fake("torchvision::nms")  / ("torchvision::qnms")
  -> `RuntimeError: operator torchvision::nms does not exist`.
  Fix: right before torchvision._meta_registrations runs, if the C++ ops are
  missing, define the two schemas (no kernels: torchvision.ops.nms still raises
  its own "Couldn't load custom C++ ops" error when called).
* torchaudio: _extension/__init__.py calls utils._load_lib("_torchaudio"),
  which lets the OSError from torch.ops.load_library propagate
  ("Could not load this library: .../torchaudio/lib/_torchaudio.so").
  Fix: after torchaudio._extension.utils executes, replace _load_lib with a
  version that returns False on OSError (= "extension not built"), so
  torchaudio.functional / transforms import (pure-torch ops work).

Nothing is imported until torchvision / torchaudio is imported; DATTN_TORCH_EXT_SHIM=0
switches it off.
"""
import importlib.abc
import importlib.machinery
import sys

_LIBS = []


def _after_tv_extension():
    import torch
    import torchvision.extension as ext

    if ext._has_ops():
        return  # a working (CPU) build: nothing to do
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)  # keep the registration alive


def _patch_ta_utils(mod):
    orig = mod._load_lib

    def _load_lib(lib):
        try:
            return orig(lib)
        except OSError:
            return False

    mod._load_lib = _load_lib


class _Shim(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision._meta_registrations":
            try:
                _after_tv_extension()
            except Exception as e:  # never break an import
                print(f"dattn_torch_ext_shim: {type(e).__name__}: {e}", file=sys.stderr)
            return None
        if fullname == "torchaudio._extension.utils":
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            orig_exec = spec.loader.exec_module

            def exec_module(module, _orig=orig_exec):
                _orig(module)
                _patch_ta_utils(module)

            spec.loader.exec_module = exec_module
            return spec
        return None


import os as _os

if _os.environ.get("DATTN_TORCH_EXT_SHIM", "1") != "0":
    sys.meta_path.insert(0, _Shim())
