"""ORD-R: rank-level completion (``ep_ord_r`` + ``has_rank_flag``).

Producer side (the monitor of ``dispatch_async``, reference ``ep_signal_completion`` ORD-R
branch): each monitor lane 0 stores its per-expert count word as plain progress data, then
takes a ticket on the source-local election counter of its destination with an acq_rel RMW;
the ``L``-th ticket (the elected producer) happens-after every other producer for that
destination, so its one release store of ``L`` into the destination's rank flag
``rank_flag_offset(my_rank)`` publishes all ``L`` count words and every payload they count.

Consumer side (the aux block of ``dispatch_wait``): acquire the ``R`` rank flags (one per source
rank), then read the count words with plain loads; after the ready flag, restore the flags to
the sentinel along with the count words.

Under ``skip_a2a`` (``my_rank`` the device id, its own only source) the rank coordinate of the
flag is forced to 0, as in the receive layouts: one flag, ``rank_flag_offset(0)``, and the
count words of the rank-0 column; the scope is ``gpu``.
"""

from __future__ import annotations

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from .common import SENTINEL, comm_sync, exit_if_aborted, published_count_word, signal_scope
from .common import word as _word
from .shmem_send import in_group, is_remote, wait_remote_arrivals


def rank_flag_word(cfg, src_rank):
    """Word of source ``src_rank``'s rank flag in a destination's receive-count buffer:
    ``rank_flag_offset(src_rank)`` of its rank coordinate (``layout.rank_coord``: 0 under
    ``skip_a2a``)."""
    return cfg.layout.rank_flag_offset(cfg.layout.rank_coord(src_rank))


def rank_completion_counter(cfg, counters):
    """The source-local election counters: dispatch_async counter words ``[2E, 2E + 8)``,
    one per destination P2P rank."""
    return _word(counters, 2 * cfg.n_experts)


def signal_rank_completion(r: ir.RoleBuilder, cfg, counts, signal_offset, value, dst_p2p,
                           counters, my_rank):
    """Monitor lane 0, ORD-R (reference ``ep_signal_completion[ep_ord_r=True]``): plain
    ``st.global.b64`` of ``value`` into count word ``signal_offset`` of ``counts`` (the
    destination's receive-count buffer), then ``atom.acq_rel.gpu.global.add.u32`` on the
    election counter of ``dst_p2p``; the producer that sees ``L - 1`` does
    ``st.release.sys.global.b64`` of ``L`` into the destination's rank flag
    (``st.release.gpu`` under ``skip_a2a``) and only then resets the counter to 0, so a next
    call's ticket cannot be lost."""
    L = cfg.layout.n_local_experts
    r.store(_word(counts, signal_offset, 8), value.cast(T.u64))
    election = _word(rank_completion_counter(cfg, counters), dst_p2p)
    old = r.atomic(AtomOp.ADD, election, 1, Sem.ACQ_REL, Scope.GPU, name="rc_ticket")
    with r.if_(old.eq(L - 1)):
        r.store(_word(counts, rank_flag_word(cfg, my_rank), 8), ir.Const(L, T.u64),
                Sem.RELEASE, signal_scope(cfg))
        r.store(election, 0)


def acquire_rank_flags(r: ir.RoleBuilder, cfg, recv_count_p, err_buf, my_rank=None) -> ir.Var:
    """dispatch_wait aux block, ORD-R arrivals: thread ``s < n_sources`` (``R``; 1 under
    ``skip_a2a``) waits (bounded, ``ld.acquire.sys``; ``gpu`` under ``skip_a2a``) until source
    ``s``'s rank flag holds ``L``; after the role's barrier, thread ``w < E`` of a published word
    (``common.published_count_word``; the others count 0) reads count word ``w`` with
    a plain ``ld.global.b64`` (published by the flag). Returns the u32 count of this thread.

    With a source outside this rank's P2P group (``cfg.needs_shmem``; ``my_rank`` is then
    this rank) that source raises no rank flag: its count words arrive
    one by one through ``nvshmemx_signal_op``, so thread ``w`` whose source ``w % R`` is remote
    waits for its count word itself (bounded, ``ld.acquire.sys``, until it is not the
    sentinel) and then for the word's arrival count (``shmem_send.wait_remote_arrivals``),
    before the barrier, and the flag waits cover the in-group sources only."""
    lay = cfg.layout
    R, E, L = cfg.n_ranks, cfg.n_experts, lay.n_local_experts
    tid = r.tid
    shmem = cfg.needs_shmem
    if shmem and my_rank is None:
        raise ValueError("acquire_rank_flags: with sources outside the P2P group it needs "
                         "my_rank (which sources raise a rank flag)")
    flag_cond = tid < lay.n_sources
    if shmem:
        flag_cond = flag_cond & in_group(cfg, tid, my_rank)
    with r.if_(flag_cond):
        flag = rank_flag_word(cfg, tid)
        r.spin_wait(_word(recv_count_p, flag, 8), T.u64, CmpOp.EQ, L, buffer="rank_flag",
                    index=flag, sem=Sem.ACQUIRE, scope=signal_scope(cfg))
    c = r.var("c", T.u32, 0) if shmem else None
    if shmem:
        remote = is_remote(cfg, tid % R, my_rank)
        with r.if_((tid < E) & remote):
            seen = r.spin_wait(_word(recv_count_p, tid, 8), T.u64, CmpOp.NE, SENTINEL,
                               buffer="recv_count", index=tid, sem=Sem.ACQUIRE,
                               scope=Scope.SYS)
            r.assign(c, seen.cast(T.u32))
            wait_remote_arrivals(r, cfg, recv_count_p, tid, c)
    comm_sync(r)
    exit_if_aborted(r, err_buf)
    if c is None:
        c = r.var("c", T.u32, 0)
    plain = published_count_word(cfg, tid)
    if shmem:
        plain = plain & in_group(cfg, tid % R, my_rank)
    with r.if_(plain):
        r.assign(c, r.load(_word(recv_count_p, tid, 8), T.u64, name="count_word").cast(T.u32))
    return c


def rearm_rank_flags(r: ir.RoleBuilder, cfg, recv_count_p):
    """dispatch_wait aux block, after the ready flag: thread ``s < n_sources`` restores
    source ``s``'s rank flag to the sentinel (plain ``st.global.b64``), the destination
    consumer's duty in ORD-R."""
    with r.if_(r.tid < cfg.layout.n_sources):
        r.store(_word(recv_count_p, rank_flag_word(cfg, r.tid), 8), ir.Const(SENTINEL, T.u64))


__all__ = ["signal_rank_completion", "acquire_rank_flags", "rearm_rank_flags",
           "rank_flag_word", "rank_completion_counter"]
