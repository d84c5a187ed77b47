"""The EP kernel builders: one function per reference method, composed into entry points."""

from __future__ import annotations

import ir

from .dispatch_async import build_dispatch_async
from .dispatch_fused import build_dispatch_fused
from .dispatch_wait import build_dispatch_wait


def build_module(cfg) -> ir.Module:
    """The dispatch entry points of ``cfg`` in one module: ``ep_dispatch_async``,
    ``ep_dispatch_wait`` and the fused single launch ``ep_dispatch``; with
    ``fused_shared_expert`` only ``ep_dispatch`` (the standalone kernels do not take the shared
    expert: the reference packs it only in the fused dispatch kernel); with ``ep_final_layout`` only the two standalone kernels."""
    if cfg.fused_shared_expert:
        return ir.Module("ep_dispatch", (build_dispatch_fused(cfg),))
    split = (build_dispatch_async(cfg), build_dispatch_wait(cfg))
    if cfg.ep_final_layout:     # the fused kernel does not take ep_final_layout (yet)
        return ir.Module("ep_dispatch", split)
    return ir.Module("ep_dispatch", split + (build_dispatch_fused(cfg),))


__all__ = ["build_module", "build_dispatch_async", "build_dispatch_wait", "build_dispatch_fused"]
