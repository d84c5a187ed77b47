"""Destinations outside the sender's P2P group, through NVSHMEM (``use_shmem`` with
``p2p_world_size < n_ranks``; ``cfg.needs_shmem`` is the rule).

Destination ``d`` is in rank ``m``'s P2P group when ``d // P == m // P`` (``P =
p2p_world_size``): those get the peer stores as before. Every other destination (a *remote*
one) is reached with the NVSHMEM calls below. What NVSHMEM promises, and nothing more, is what
the ordering rests on (docs/shmem.md, "What NVSHMEM promises"): a put-with-signal's signal
is delivered after its data; a plain signal and the puts of other threads are ordered with
nothing; ``nvshmem_quiet`` completes every operation of the calling thread (and, after a
warp-collective call, which ends with the warp's barrier, of its warp); a kernel's end
completes nothing.

The send side (``send_staged.send_buffer_tokens``, through the destination strategy's
``put_slot_to_remote``; with ``ep_rank_dedup`` one message per (token, remote rank) instead,
``rank_dedup.RankDedupDestination.put_slot_to_remote``), per remote top-k slot ``k`` of token
``t``: the warp that owns slot ``k`` in the fan-out (warp ``k`` strided over the role's
warps, the same warp that would copy it to an in-group destination) runs ``put_to_remote``:

1. lane 0 reserves a slot on the source-local reserved counter ``e * R + dst``
   (``atom.relaxed.gpu.add``), broadcast to the warp (``shfl.sync.idx``);
2. unless the slot is past the block's capacity (device guard: the host refuses such
   routings; the monitor publishes the clamped count), the whole warp calls
   ``nvshmemx_putmem_signal_nbi_warp(row, msg, msg_bytes, arrival, 1, SIGNAL_ADD, dst)``:
   the staged message (send-buffer row ``t``) to the slot's row of ``dst``'s receive
   buffer, then 1 added to the arrival word of block ``(e, my_rank)`` at ``dst``
   (``layout.shmem_arrival_base + e * R + my_rank`` of its receive-count buffer), which
   NVSHMEM delivers after the row. Both addresses are this rank's own addresses of the
   symmetric objects (``recv_buf_ptrs[my_rank % P]``, ``recv_count_ptrs[my_rank % P]``);
3. lane 0 counts the slot issued: ``red.release.gpu.add`` on the finished counter
   ``e * R + dst`` (the release orders the reservation before the monitor's re-arm of the
   reserved counter; it says nothing about the data, which the arrival word carries).

No quiet per message. Each warp that issued a put completes them once, after its last token
(``complete_remote_puts``: ``bar.warp.sync``, then lane 0's ``nvshmem_quiet``): the rows'
sources are the send buffer, which the next call overwrites, and NVSHMEM completes nothing at
a kernel's end. Consecutive slots of one block are not merged into one put: their messages are
different tokens' send-buffer rows, not contiguous in the source.

The monitor (``monitor.signal_completion``, remote destination: ``signal_remote_count``):
after the bounded acquire poll of the finished counter (every slot of the block reserved and
its put issued), ``nvshmemx_signal_op(SIGNAL_SET)`` of the (clamped) count into the count word
``e * R + my_rank`` at ``dst`` (``recv_count_ptrs[my_rank % P]``), with or without
``ep_ord_r`` (remote destinations get no rank flag), then ``nvshmem_quiet`` (the signal is
this thread's operation to complete before it exits).

The receive side (dispatch_wait's aux block, ``wait_remote_arrivals``): the thread of count
word ``w = e * R + src`` with ``src`` remote waits (bounded, ``ld.acquire.sys``) until the
word is published (not the sentinel: count ``c``), then (bounded, ``ld.acquire.sys``) until
arrival word ``w`` equals ``c``. After the ready flag it re-arms the arrival words to 0
(``rearm_arrivals``) with the count words; the next call's puts come after every PE's
dispatch_wait of this call (the world's call boundary).

Ordering: the count word says how many messages to expect, the arrival word how many have
landed; each 1 added to the arrival word is delivered after that message's row (put-with-
signal), and the aux thread's acquire of the arrival word reads a value that every one of
those signals contributed to, so when it sees ``c``, the ``c`` rows of the block are in the
receive buffer and in its causal past; the ready flag's release hands them to the copy blocks.
Nothing relies on the count signal arriving before or after the rows, nor on the order in
which NVSHMEM delivers different messages.
"""

from __future__ import annotations

import ir
from ir import AtomOp, CmpOp, Scope, Sem, ShflMode
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


def issued_flag(r: ir.RoleBuilder) -> ir.Var:
    """A u32 var, 0 until the thread (its warp) issues an NVSHMEM operation it must complete
    (``complete_remote_puts``)."""
    return r.var("shmem_issued", T.u32, 0)


def arrival_address(r: ir.RoleBuilder, cfg, p, e) -> ir.Var:
    """This rank's own (symmetric) address of the arrival word of block ``(e, my_rank)``:
    ``recv_count_ptrs[my_rank % P]`` plus word ``shmem_arrival_base + e * R + my_rank``."""
    lay = cfg.layout
    own = load_pointer(r, p.recv_count_ptrs, p.my_rank % cfg.p2p_world_size, "count_sym")
    w = e * cfg.n_ranks + p.my_rank + lay.shmem_arrival_base
    return r.let("arrival_sym", ir.Cast(T.u64, own) + w.cast(T.u64) * 8)


def put_to_remote(r: ir.RoleBuilder, cfg, p, msg, g, dst_rank, e, issued):
    """The whole warp, top-k slot routed to global expert ``g`` (local ``e`` on
    ``dst_rank``) of the token staged in send-buffer row ``msg``, when ``dst_rank`` is remote:
    reserve, ``nvshmemx_putmem_signal_nbi_warp`` of the message with 1 added to the block's
    arrival word, count it issued (module docstring, steps 1 to 3); ``issued`` := 1."""
    lay = cfg.layout
    E, R, P, msg_bytes = cfg.n_experts, cfg.n_ranks, cfg.p2p_world_size, lay.msg_bytes
    reserved, finished = p.counters, _word(p.counters, E)
    with r.if_(is_remote(cfg, dst_rank, p.my_rank) & (g < E)):
        co = r.let("co_rm", e * R + dst_rank)
        slot = r.var("slot_rm", T.u32, 0)
        with r.if_(r.lane.eq(0)):
            r.assign(slot, r.atomic(AtomOp.ADD, _word(reserved, co), 1, Sem.RELAXED,
                                    Scope.GPU, name="slot_rm0"))
        slot_b = r.shfl(ShflMode.IDX, slot, 0, name="slot_rm_b")
        with r.if_(slot_b < lay.block_capacity):
            own = load_pointer(r, p.recv_buf_ptrs, p.my_rank % P, "recv_sym")
            row = ((e * R + p.my_rank) * lay.block_capacity + slot_b).cast(T.u64)
            dest = r.let("put_dst", ir.Cast(T.u64, own) + row * msg_bytes)
            sig = arrival_address(r, cfg, p, e)
            nvshmem.putmem_signal_nbi_warp(r, dest, ir.Cast(T.u64, msg), msg_bytes, sig, 1,
                                           nvshmem.SIGNAL_ADD, dst_rank)
            r.assign(issued, 1)
        with r.if_(r.lane.eq(0)):
            r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)


def complete_remote_puts(r: ir.RoleBuilder, issued):
    """The whole warp, after its last token: ``bar.warp.sync``, then lane 0 completes the
    warp's puts with one ``nvshmem_quiet`` when it issued any (``issued``)."""
    r.warp_sync()
    with r.if_(r.lane.eq(0) & issued.ne(0)):
        nvshmem.quiet(r)


def signal_remote_count(r: ir.RoleBuilder, cfg, p, signal_offset, value, dst_rank):
    """Monitor lane 0, remote destination: ``nvshmemx_signal_op(SIGNAL_SET)`` of ``value``
    into count word ``signal_offset`` of ``dst_rank``'s receive-count buffer, addressed by
    this rank's own address of that word (``recv_count_ptrs[my_rank % P]``), then
    ``nvshmem_quiet`` (the lane's only NVSHMEM operation of the call, completed before it
    exits)."""
    own = load_pointer(r, p.recv_count_ptrs, p.my_rank % cfg.p2p_world_size, "count_sym")
    sig = r.let("sig_addr", ir.Cast(T.u64, own) + signal_offset.cast(T.u64) * 8)
    nvshmem.signal_op(r, sig, ir.as_expr(value).cast(T.u64), nvshmem.SIGNAL_SET, dst_rank)
    nvshmem.quiet(r)


def wait_remote_arrivals(r: ir.RoleBuilder, cfg, recv_count_p, w, count):
    """dispatch_wait's aux thread of count word ``w`` from a remote source, after it saw the
    word published with ``count``: bounded wait (``ld.acquire.sys``) until arrival word ``w``
    (``shmem_arrival_base + w``) equals ``count`` (every message of the block landed); once
    it has, ``nvshmem_signal_wait_until`` of the same condition, which returns at once and
    runs NVSHMEM's consistency step, so that messages a network transport wrote are visible
    to this rank's loads (``landed_consistently``)."""
    lay = cfg.layout
    at = _word(recv_count_p, ir.as_expr(w) + lay.shmem_arrival_base, 8)
    want = ir.as_expr(count).cast(T.u64)
    seen = r.spin_wait(at, T.u64, CmpOp.EQ, want, buffer="shmem_arrival", index=w,
                       sem=Sem.ACQUIRE, scope=Scope.SYS)
    landed_consistently(r, at, seen.eq(want), want)


def landed_consistently(r: ir.RoleBuilder, sig_addr, met, value) -> None:
    """After a bounded poll of this rank's signal word ``sig_addr``: when it saw the word
    reach ``value`` (``met``; an expired poll must not block), ``nvshmem_signal_wait_until(
    sig_addr, NVSHMEM_CMP_GE, value)``. The word only grows until it is re-armed, so the call
    returns at once; what it adds is NVSHMEM's consistency step after a wait (over a network
    transport, making the NIC's writes visible to the GPU's loads; nothing over NVLink)."""
    with r.if_(met):
        nvshmem.signal_wait_until(r, sig_addr, nvshmem.CMP_GE, value)


def rearm_arrivals(r: ir.RoleBuilder, cfg, recv_count_p):
    """dispatch_wait's aux block, after the ready flag: thread ``w < E`` re-arms arrival word
    ``w`` to 0 (plain ``st.global.b64``; only remote sources' words ever change)."""
    lay = cfg.layout
    with r.if_(r.tid < cfg.n_experts):
        r.store(_word(recv_count_p, r.tid + lay.shmem_arrival_base, 8), ir.Const(0, T.u64))


__all__ = ["is_remote", "in_group", "issued_flag", "arrival_address", "put_to_remote",
           "complete_remote_puts", "signal_remote_count", "wait_remote_arrivals",
           "landed_consistently", "rearm_arrivals"]
