"""dattn inside Hugging Face diffusers: one home for the integration.

    import dattn.diffusers
    handle = dattn.diffusers.enable(transformer)                  # FLASH for this model
    handle = dattn.diffusers.enable(transformer, backend="SAGE")  # 8-bit Q.K^T
    handle = dattn.diffusers.enable(wan, backend="VIDEO_SPARSE",  # sparse over the video grid
                                    backend_kwargs={"sparsity": 0.9, "dense_steps": 2})
    model.set_attention_backend("dattn")                          # diffusers' own switch, by name

The modules:

- :mod:`dattn.diffusers.handle`: :func:`enable` / :func:`disable` / :func:`handle_of` and
  :class:`DiffusersHandle` (routing each attention module's calls to dattn, the counters);
- :mod:`dattn.diffusers.video`: VIDEO_SPARSE in the video transformers (the per-model geometry
  table, the step- and layer-aware selection, ``handle.stats()``); docs/video.md;
- :mod:`dattn.diffusers.backend`: the backend names "dattn" / "dattn_sage" registered with
  diffusers (:func:`register`, :func:`unregister`, :func:`registered`, :func:`backend_client`)
  and diffusers' context parallelism on the CPU (:func:`enable_parallelism`).

``dattn.diffusers_backend`` is :mod:`dattn.diffusers.backend` under its former name. Importing
this package registers the names with diffusers where diffusers is installed.
"""

from .handle import (
    DiffusersHandle,
    backend_client,
    disable,
    enable,
    enable_parallelism,
    handle_of,
    register,
    registered,
    unregister,
)
from .handle import _register_at_import, torch as _torch

if _torch is not None:  # diffusers needs torch; without it enable() says so
    from .video import GEOMETRY, POLICY_DEFAULTS

__all__ = ["DiffusersHandle", "GEOMETRY", "POLICY_DEFAULTS", "backend_client", "disable",
           "enable", "enable_parallelism", "handle_of", "register", "registered", "unregister"]

if _torch is not None:
    _register_at_import()
