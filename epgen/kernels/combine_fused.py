"""``ep_combine``: the fused single-launch combine kernel: combine_async and combine_wait in
one grid, as two roles in kernel order (every thread runs the send role, then the reduce
role).

    role send    blocks [0, grid)   send_tokens_back            (combine_async)
    role reduce  blocks [0, grid)   wait_for_all_arrivals       (combine_wait)
                                    reduce_and_copy_to_output   (+ the shared expert)

A block's reduce waits for every destination's arrival word, which the last warp of that
destination's send role publishes; so every block of every rank's grid must be resident at
once (as for the fused dispatch kernel ``ep_dispatch``; the world's co-residency rule and
capacity check cover it). Parameters: those of both halves, ``counters``, ``my_rank`` and
``err_buf`` once. With ``fused_shared_expert`` (only this kernel takes it, as only the fused
dispatch kernel packs the shared expert): the shared expert's output of token ``t``, row
``t - row0`` of this rank's own ``expert_out`` (group 0 of the grouped output, tokens
``[row0, row0 + T_se)``: ``shared_expert.se_token_slice``), is added after the routed slots
and before the residual; under ``skip_a2a`` the slice needs ``allreduce_world_size`` too.
"""

from __future__ import annotations

import attrs

import ir
from ir import types as T

from . import combine_async, combine_wait, trace, wait_time
from .dispatch_fused import SharedParams
from .shared_expert import se_token_slice

KERNEL_NAME = "ep_combine"


def build_combine_fused(cfg, wire=None) -> ir.Kernel:
    """The fused entry point ``ep_combine`` (module docstring); with the FP8 combine's
    ``wire`` (``combine_fp8.Fp8Wire``) its FP8 twin ``ep_combine_fp8``: both halves take
    it."""
    combine_wait.check_hid_dim(cfg)
    kb = ir.KernelBuilder(KERNEL_NAME if wire is None else wire.name(KERNEL_NAME),
                          cfg.num_threads)
    view = SharedParams(kb)
    pa = combine_async.declare_params(view)
    pw = combine_wait.declare_params(view)
    pw = attrs.evolve(pw, wait_time=wait_time.declare(kb, cfg))
    se = bool(cfg.fused_shared_expert)
    world = kb.param("allreduce_world_size", T.u32) if se and cfg.skip_a2a else None
    trace.instrument(kb, cfg, pw.my_rank)
    with kb.role("send", blocks=(0, None)) as r:
        combine_async.send_tokens_back(r, cfg, pa, wire)
    with kb.role("reduce", blocks=(0, None)) as r:
        combine_wait.wait_for_all_arrivals(r, cfg, pw)
        shared = None
        if se:
            row0, t_se = se_token_slice(r, cfg, pw.n_tokens, pw.my_rank, world)
            shared = (pa.expert_out, row0, t_se)
        combine_wait.reduce_and_copy_to_output(
            r, cfg, pw, shared_expert=shared, reader=None if wire is None else wire.reader,
            partial=wire is not None and wire.reduces_at_destination)
    return kb.build()


__all__ = ["build_combine_fused", "KERNEL_NAME"]
