"""A real ComfyUI checkout (COMFYUI_DIR: make comfyui-check COMFYUI_DIR=...) imported as a library
on the CPU, in the project's .venv: its own model classes, attention functions, model patcher,
sampler and custom-node loader, with dattn's override and node pack.

The environment's workaround (never dattn's package): PyPI's torchvision and torchaudio are CUDA
builds that cannot load beside a CPU torch, and are not installed here; ComfyUI imports them at
module level in modules these tests do not use (cascade, cosmos, audio encoders), so stand-ins
whose attributes raise when used are registered under those names.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
if not COMFYUI_DIR:
    pytest.skip("COMFYUI_DIR is not set: make comfyui-check COMFYUI_DIR=<a ComfyUI checkout> runs "
                "this suite", allow_module_level=True)
if not os.path.isfile(os.path.join(COMFYUI_DIR, "comfy", "ldm", "modules", "attention.py")):
    raise RuntimeError(f"COMFYUI_DIR={COMFYUI_DIR} is not a ComfyUI checkout")


class _Unusable:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision / torchaudio are not installed here")


class _StandIn(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("torchvision", "torchaudio")

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


import importlib.util  # noqa: E402

if not any(importlib.util.find_spec(r) for r in _StandInFinder.ROOTS):
    sys.meta_path.insert(0, _StandInFinder())
sys.path.insert(0, COMFYUI_DIR)

from comfy.cli_args import args  # noqa: E402

args.cpu = True  # ComfyUI's --cpu, read when comfy.model_management is imported
import comfy.model_management  # noqa: E402,F401

HERE = os.path.dirname(os.path.abspath(__file__))
NODE_PACK = os.path.join(os.path.dirname(os.path.dirname(HERE)), "integrations", "comfyui")


def pytest_report_header(config):
    commit = "unknown"
    head = os.path.join(COMFYUI_DIR, ".git")
    try:
        import subprocess

        commit = subprocess.run(["git", "-C", COMFYUI_DIR, "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or commit
    except Exception:
        pass
    if commit == "unknown" and os.path.exists(os.path.join(COMFYUI_DIR, "COMMIT")):
        commit = open(os.path.join(COMFYUI_DIR, "COMMIT")).read().strip()
    return f"ComfyUI: {COMFYUI_DIR} at {commit}"
