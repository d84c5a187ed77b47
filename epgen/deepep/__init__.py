"""DeepEP's Python API on epgen's kernels (docs/deepep.md): ``Buffer`` (low-latency mode; the
normal mode's ``get_dispatch_layout`` and ``dispatch``),
``EventOverlap``, ``topk_idx_t``, and ``EmulatedGroup`` (every rank in one process, on a GPU
or on the CPU simulator). An engine written for DeepEP imports it in DeepEP's place::

    import epgen.deepep as deep_ep

or, where the engine's own code says ``import deep_ep``, ``epgen.deepep.install_as_deep_ep()``
(before the engine imports it, in every process) makes that import find this module.
"""

from __future__ import annotations

import torch as _torch

import sys as _sys

from .buffer import Buffer
from .config import Config
from .emulated import EmulatedGroup, EmulatedRank
from .events import EventOverlap
from .ports import PeerFailedError

#: the dtype of DeepEP's top-k indices
topk_idx_t = _torch.int64



def install_as_deep_ep(name: str = "deep_ep") -> None:
    """Make ``import deep_ep`` (or ``name``) in this process give this module (also to
    ``importlib.util.find_spec``, which engines test first). Refused when another module
    of that name is already imported."""
    current = _sys.modules.get(name)
    me = _sys.modules[__name__]
    if current is not None and current is not me:
        raise RuntimeError(f"install_as_deep_ep: {name!r} is already imported "
                           f"({getattr(current, '__file__', current)!r})")
    _sys.modules[name] = me


__all__ = ["Buffer", "Config", "EmulatedGroup", "EmulatedRank", "EventOverlap",
           "PeerFailedError", "topk_idx_t", "install_as_deep_ep"]
