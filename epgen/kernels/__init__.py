"""The EP kernel builders: one function per reference method, composed into entry points."""

from __future__ import annotations

import warnings

import ir

from ..config import EPFlagNoEffect

from .combine_async import build_combine_async
from ..combine_fp8 import check_hid_dim as check_fp8_hid_dim
from .combine_fp8 import Fp8Wire
from .combine_fused import build_combine_fused
from .combine_partial import PartialWire
from .combine_wait import build_combine_wait, check_hid_dim
from .dispatch_async import build_dispatch_async
from .dispatch_fused import build_dispatch_fused
from .dispatch_wait import build_dispatch_wait


def build_module(cfg) -> ir.Module:
    """The dispatch entry points of ``cfg`` in one module: ``ep_dispatch_async``,
    ``ep_dispatch_wait`` and the fused single launch ``ep_dispatch``; with
    ``fused_shared_expert`` only ``ep_dispatch`` (the standalone kernels do not take the shared
    expert: the reference packs it only in the fused dispatch kernel); with ``ep_final_layout``
    or ``ep_rank_mask`` only the two standalone kernels.
    A flag that builds nothing different here (``cfg.inert_flags()``) is an
    ``EPFlagNoEffect`` warning."""
    for flag, why in cfg.inert_flags().items():
        warnings.warn(f"{flag}: {why}", EPFlagNoEffect, stacklevel=2)
    if cfg.fused_shared_expert:
        return ir.Module("ep_dispatch", (build_dispatch_fused(cfg),))
    split = (build_dispatch_async(cfg), build_dispatch_wait(cfg))
    if cfg.ep_final_layout or cfg.ep_rank_mask:   # the fused kernel takes neither (yet)
        return ir.Module("ep_dispatch", split)
    return ir.Module("ep_dispatch", split + (build_dispatch_fused(cfg),))


def check_combine_config(cfg) -> None:
    """``ValueError`` for a configuration no combine kernel takes: ``hid_dim`` not a multiple
    of 8, more ranks than the combine rank-completion region's done counters."""
    check_hid_dim(cfg)
    if cfg.n_ranks > cfg.layout.combine_rank_completion_region.size:
        raise ValueError(f"combine: n_ranks={cfg.n_ranks} exceeds the "
                         f"{cfg.layout.combine_rank_completion_region.size} done counters of "
                         f"the combine rank-completion region (one P2P group)")


def build_combine_module(cfg) -> ir.Module:
    """The combine entry points of ``cfg`` (docs/combine.md) in a module of their own, so the
    dispatch module is unchanged: ``ep_combine_async``, ``ep_combine_wait`` and the fused
    single launch ``ep_combine``; with ``fused_shared_expert`` only ``ep_combine`` (as for
    dispatch: only the fused kernels take the shared expert). Every dispatch format (the
    expert outputs are BF16), every layout, ``skip_a2a``; over P2P, and NVSHMEM to the sources outside a P2P
    group (``use_shmem``); ``hid_dim`` a multiple of 8. With ``ep_rank_mask`` only the two
    standalone kernels (the fused one does not take the mask)."""
    check_combine_config(cfg)
    split = (build_combine_async(cfg), build_combine_wait(cfg)) \
        if not cfg.fused_shared_expert else ()
    if cfg.ep_rank_mask:        # the fused kernel does not take the rank mask (yet)
        return ir.Module("ep_combine", split)
    return ir.Module("ep_combine", split + (build_combine_fused(cfg),))


def build_combine_fp8_module(cfg) -> ir.Module:
    """The FP8 combine's entry points (docs/combine.md, "FP8 combine"), the twins of
    ``build_combine_module``'s (``ep_combine_async_fp8``, ``ep_combine_wait_fp8``,
    ``ep_combine_fp8``, with the same selection) in a module of their own, so the BF16
    combine module and its goldens are unchanged; a world loads it on its first ``fp8=True``
    call and then switches per call. ``ValueError`` naming ``hid_dim`` unless it is a
    multiple of 128."""
    check_fp8_hid_dim(cfg.token_fmt.hid_dim, "build_combine_fp8_module")
    check_combine_config(cfg)
    wire = Fp8Wire(cfg)
    split = (build_combine_async(cfg, wire), build_combine_wait(cfg, wire)) \
        if not cfg.fused_shared_expert else ()
    if cfg.ep_rank_mask:        # as the BF16 module: the fused kernel does not take the mask
        return ir.Module("ep_combine_fp8", split)
    return ir.Module("ep_combine_fp8", split + (build_combine_fused(cfg, wire),))


def build_combine_partial_module(cfg) -> ir.Module:
    """The partial-reduce combine's entry points (``ep_rank_dedup`` only; docs/combine.md,
    "Partial reduce"), the twins of ``build_combine_module``'s (``ep_combine_async_partial``,
    ``ep_combine_wait_partial``, ``ep_combine_partial``, with the same selection) in a module
    of their own, so the BF16 combine module and its goldens are unchanged; a world loads it
    on its first ``partial_reduce=True`` call. ``ValueError`` for a configuration it does
    not take (``combine_partial.check_config``)."""
    check_combine_config(cfg)
    wire = PartialWire(cfg)
    split = (build_combine_async(cfg, wire), build_combine_wait(cfg, wire)) \
        if not cfg.fused_shared_expert else ()
    if cfg.ep_rank_mask:
        return ir.Module("ep_combine_partial", split)
    return ir.Module("ep_combine_partial", split + (build_combine_fused(cfg, wire),))


__all__ = ["build_module", "build_combine_module", "build_combine_fp8_module",
           "build_combine_partial_module", "build_combine_async", "build_combine_wait",
           "build_combine_fused", "build_dispatch_async", "build_dispatch_wait", "build_dispatch_fused"]
