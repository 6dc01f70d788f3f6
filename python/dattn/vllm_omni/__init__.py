"""dattn in vllm-omni's diffusion engine: a CPU platform for the engine, its plugins, and dattn
as the engine's attention backends (docs/vllm-omni.md).

- :mod:`dattn.vllm_omni.backends`: ``DattnAttentionBackend`` / ``DattnAttentionImpl`` (the
  seed's interface; the engine's class path ``dattn.vllm_omni.DattnAttentionBackend``) and the
  SAGE pair ``DattnSageAttentionBackend`` / ``DattnSageAttentionImpl``;
- :mod:`dattn.vllm_omni.platform`: ``DattnCpuOmniPlatform``, the engine's out-of-tree platform
  on a CPU host (vLLM's ``CpuPlatform`` under the engine's ``OmniPlatform``);
- :mod:`dattn.vllm_omni.plugin`: the entry points the engine loads
  (``vllm_omni.platform_plugins``, ``vllm_omni.general_plugins``);
- :mod:`dattn.vllm_omni.patches`: what dattn changes in the engine where it has no seam, each
  for the vllm-omni versions that need it.

Importing this package imports nothing of the engine's: the classes above load on first use
(``dattn.vllm_omni.DattnAttentionBackend`` imports :mod:`.backends`), so the engine, which
imports dattn's platform while it imports itself, never meets a half-imported module of ours.
The old module paths ``dattn.vllm_omni_platform`` and ``dattn.vllm_omni_plugin`` name the same
modules.
"""

from __future__ import annotations

import importlib

#: What the package exports from :mod:`.backends` (looked up there on every access, so that a
#: reload of :mod:`.backends`, e.g. after the engine became importable, is what users see).
_BACKEND_NAMES = ("DattnAttentionBackend", "DattnAttentionImpl", "DattnBackend", "DattnImpl",
                  "DattnSageAttentionBackend", "DattnSageAttentionImpl", "ENGINE_AVAILABLE",
                  "dattn_role")

__all__ = list(_BACKEND_NAMES) + ["backends", "patches", "platform", "plugin"]


def __getattr__(name: str):
    if name in _BACKEND_NAMES:
        return getattr(importlib.import_module(".backends", __name__), name)
    if name in ("backends", "patches", "platform", "plugin"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
