"""Destinations outside the sender's P2P group, through NVSHMEM (``use_shmem`` with
``p2p_world_size < n_ranks``; ``cfg.needs_shmem`` is the rule).

Destination ``d`` is in rank ``m``'s P2P group when ``d // P == m // P`` (``P =
p2p_world_size``): those get the peer stores as before. Every other destination (a *remote*
one) gets, from the send-buffer path (``send_staged.send_buffer_tokens``):

- ``cross_group_fan_out``: after the block's join, lane ``k < K`` of warp ``w < n_rcs``
  (``n_rcs = min(L, n_warps)``, ``rc = (block * n_warps + w) % n_rcs``) takes top-k slot
  ``k`` of the staged token when ``g % n_rcs == rc`` and ``g``'s rank is remote: it reserves
  a slot on the same source-local reserved counter (``atom.relaxed.gpu.add``), puts the staged
  message (send-buffer row ``t``) to the slot's row of the destination's receive buffer
  (``nvshmem_putmem_nbi``; the destination address is this rank's own address of that row,
  ``recv_buf_ptrs[my_rank % P]``: the receive buffers are symmetric), waits for the put to
  complete (``nvshmem_quiet``), and only then counts the copy finished
  (``red.release.gpu.add``). The ``n_rcs`` warps of a block cover every residue once, so
  every remote slot of a token is handled by exactly one lane.
- ``signal_remote_count`` (the monitor's completion, ``monitor.signal_completion``): after
  the bounded acquire poll of the finished counter, ``nvshmemx_signal_op(SIGNAL_SET)`` of the
  count into the destination's count word (this rank's own address of that word,
  ``recv_count_ptrs[my_rank % P]``), with or without ``ep_ord_r`` (remote destinations get no
  rank flag).

The ordering holds by construction: every put is complete at its destination before the
``red.release`` that counts it (``quiet``), the monitor's acquire of the finished counter
happens after every such release, and the signal is issued after that acquire, so when the
destination's aux block sees the count word (``ld.acquire.sys``) every message it counts is
already in its receive buffer. Nothing relies on the order in which puts or signals are
delivered.
"""

from __future__ import annotations

import ir
from ir import AtomOp, CacheHint, Scope, Sem
from ir import nvshmem
from ir import types as T

from .common import load_pointer
from .common import word as _word


def is_remote(cfg, rank_a, rank_b) -> ir.Expr:
    """Whether ranks ``rank_a`` and ``rank_b`` are in different P2P groups (a predicate)."""
    P = cfg.p2p_world_size
    return (ir.as_expr(rank_a) // P).ne(ir.as_expr(rank_b) // P)


def in_group(cfg, dst_rank, my_rank) -> ir.Expr:
    """Whether ``dst_rank`` is in ``my_rank``'s P2P group (a predicate)."""
    P = cfg.p2p_world_size
    return (ir.as_expr(dst_rank) // P).eq(ir.as_expr(my_rank) // P)


def n_rcs(cfg, n_warps: int) -> int:
    """The warps of a block that fan out to remote destinations: ``min(L, n_warps)``."""
    return min(cfg.layout.n_local_experts, n_warps)


def cross_group_fan_out(r: ir.RoleBuilder, cfg, p, t, msg):
    """After the join that ends token ``t``'s staging in send-buffer row ``msg``: the remote
    top-k slots of ``t`` (module docstring): reserve, ``nvshmem_putmem_nbi``,
    ``nvshmem_quiet``, ``red.release.gpu.add`` on the finished counter."""
    lay = cfg.layout
    E, L, R, K = cfg.n_experts, lay.n_local_experts, cfg.n_ranks, lay.top_k
    P, msg_bytes = cfg.p2p_world_size, lay.msg_bytes
    n_warps = r.n_threads // 32
    rcs = n_rcs(cfg, n_warps)
    reserved, finished = p.counters, _word(p.counters, E)
    rc = r.let("rc", (r.block * n_warps + r.warp) % rcs)
    with r.if_((r.warp < rcs) & (r.lane < K)):
        g = r.load(_word(p.topk_ids, t * K + r.lane), T.u32, cache=CacheHint.NC, name="g_rc")
        dst_rank = r.let("dst_rank_rc", g // L)
        with r.if_((g % rcs).eq(rc) & is_remote(cfg, dst_rank, p.my_rank) & (g < E)):
            e = r.let("e_rc", g % L)
            co = r.let("co_rc", e * R + dst_rank)
            slot = r.atomic(AtomOp.ADD, _word(reserved, co), 1, Sem.RELAXED, Scope.GPU,
                            name="slot_rc")
            # device guard: a slot past the block's capacity is never written (the host
            # refuses such routings; the monitor publishes the clamped count)
            with r.if_(slot < lay.block_capacity):
                own = load_pointer(r, p.recv_buf_ptrs, p.my_rank % P, "recv_sym")
                row = ((e * R + p.my_rank) * lay.block_capacity + slot).cast(T.u64)
                dest = r.let("put_dst", ir.Cast(T.u64, own) + row * msg_bytes)
                nvshmem.putmem_nbi(r, dest, ir.Cast(T.u64, msg), msg_bytes, dst_rank)
                nvshmem.quiet(r)
            r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)


def signal_remote_count(r: ir.RoleBuilder, cfg, p, signal_offset, value, dst_rank):
    """Monitor lane 0, remote destination: ``nvshmemx_signal_op(SIGNAL_SET)`` of ``value``
    into count word ``signal_offset`` of ``dst_rank``'s receive-count buffer, addressed by
    this rank's own address of that word (``recv_count_ptrs[my_rank % P]``)."""
    own = load_pointer(r, p.recv_count_ptrs, p.my_rank % cfg.p2p_world_size, "count_sym")
    sig = r.let("sig_addr", ir.Cast(T.u64, own) + signal_offset.cast(T.u64) * 8)
    nvshmem.signal_op(r, sig, ir.as_expr(value).cast(T.u64), nvshmem.SIGNAL_SET, dst_rank)


__all__ = ["is_remote", "in_group", "n_rcs", "cross_group_fan_out", "signal_remote_count"]
