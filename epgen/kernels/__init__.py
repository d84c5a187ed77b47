"""The EP kernel builders: one function per reference method, composed into entry points."""

from __future__ import annotations

import ir

from .dispatch_async import build_dispatch_async
from .dispatch_wait import build_dispatch_wait


def build_module(cfg) -> ir.Module:
    """Both dispatch entry points of ``cfg`` in one module (``dispatch_async`` and
    ``dispatch_wait``)."""
    cfg.require_p2p_only()
    return ir.Module("ep_dispatch", (build_dispatch_async(cfg), build_dispatch_wait(cfg)))


__all__ = ["build_module", "build_dispatch_async", "build_dispatch_wait"]
