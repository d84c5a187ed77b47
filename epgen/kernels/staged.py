"""``StagedDestination``: the staged receive buffer, the destination strategy without
``ep_final_layout`` (``destination`` says how a build gets its strategy).

Send side (dispatch_async): a routed token's message (payload and header) goes to row
``(e * R + src) * block_capacity + slot`` of the destination's receive buffer; the monitor
publishes the count, clamped to the block capacity. Wait side (dispatch_wait): the aux block
takes the count words as they are and pads the groups as the format says; the copy blocks move
each message to its grouped output row (``staged_copy``).

The final layout (``final_layout.FinalRowsDestination``) overrides what differs; the slot
reservation on the source-local counters is the same for both and lives here only.
"""

from __future__ import annotations

import contextlib

import ir
from ir import AtomOp, Scope, Sem, ShflMode
from ir import types as T

from . import rank_mask
from .common import copy_vectors, load_pointer
from .common import word as _word
from .shmem_send import in_group, put_to_remote
from .staged_copy import copy_staged_messages, copy_scratch_bytes

NO_SLOT = 0xFFFFFFFF   # a top-k slot that sends nothing (skip_a2a: not this device's expert)


class StagedDestination:
    """The staged receive buffer (module docstring). ``cfg`` the configuration, ``p`` the
    kernel's parameters (``dispatch_async.AsyncParams`` on the send side,
    ``dispatch_wait.WaitParams`` on the wait side); ``declare_send`` / ``declare_wait``
    build it while the kernel declares its parameters."""

    def __init__(self, cfg, p):
        self.cfg, self.p = cfg, p

    @classmethod
    def declare_send(cls, kb: ir.KernelBuilder, cfg, p) -> StagedDestination:
        """The send side's strategy for dispatch_async's parameters ``p``, its own parameters
        declared on ``kb`` (here: none)."""
        return cls(cfg, p)

    @classmethod
    def declare_wait(cls, kb: ir.KernelBuilder, cfg, p) -> StagedDestination:
        """The wait side's strategy for dispatch_wait's parameters ``p``, its own parameters
        declared on ``kb`` (here: none)."""
        return cls(cfg, p)

    # ---- send side: the monitor ---------------------------------------------------------------
    def offset_var(self, r: ir.RoleBuilder):
        """The monitor's u32 var for its block offset, or None when the count word carries
        none (here: none)."""
        return None

    def reserve(self, r: ir.RoleBuilder, g, count, offset=None) -> None:
        """Monitor warp of global expert ``g``, after counting ``count``: reserve this
        source's block on the destination, its offset into ``offset`` where there is one
        (here: nothing, the block is the receive buffer's)."""

    def reserve_counted(self, r: ir.RoleBuilder, owns, g, load_count, keep_offset) -> None:
        """Role ``monitor`` of the split monitor: when ``owns``, ``reserve`` with the count
        ``load_count()`` loads, and ``keep_offset(off)`` the offset (here: nothing)."""

    def carried_offset(self, r: ir.RoleBuilder, load_offset):
        """Role ``signal`` of the split monitor: the block offset ``load_offset()`` loads back,
        or None (here: None)."""
        return None

    def count_word(self, count, offset) -> ir.Expr:
        """The receive count the monitor publishes: ``count``, clamped to the block capacity
        when a block may hold fewer than a full call's tokens."""
        lay = self.cfg.layout
        if lay.block_capacity < self.cfg.max_tokens_per_rank:
            return count.min(lay.block_capacity)
        return count

    def rearm(self, r: ir.RoleBuilder, counter_offset) -> None:
        """Monitor lane 0, after its comm warps finished: reset this strategy's words of
        ``(expert, destination)`` ``counter_offset`` (here: none)."""

    # ---- send side: the comm warps --------------------------------------------------------------
    def takes_slot(self, g, dst_rank) -> ir.Expr:
        """Whether a top-k slot routed to global expert ``g`` on ``dst_rank`` takes a slot
        from this sender's peer stores: under ``skip_a2a`` (global ids) only this device's
        experts; else an expert below ``n_experts`` (an id past them is the id check's
        sentinel for a bad one) and, when some destinations are reached through NVSHMEM
        (``needs_shmem``), one in this rank's P2P group (the others are the cross-group
        fan-out's)."""
        cfg, p = self.cfg, self.p
        if not cfg.layout.crosses_devices:
            return dst_rank.eq(p.my_rank)
        if cfg.needs_shmem:
            return in_group(cfg, dst_rank, p.my_rank) & (g < cfg.n_experts)
        return g < cfg.n_experts

    @contextlib.contextmanager
    def slot_counter(self, r: ir.RoleBuilder, g, dst_rank, e):
        """``with dest.slot_counter(r, g, dst_rank, e) as co:`` the body runs for a slot that
        ``takes_slot``, with ``co`` its source-local counter ``e * R + dst`` (rank coordinate:
        ``layout.rank_coord``)."""
        with r.if_(self.takes_slot(g, dst_rank)):
            yield r.let("co", e * self.cfg.n_ranks + self.cfg.layout.rank_coord(dst_rank))

    def take_slot(self, r: ir.RoleBuilder, co) -> ir.Var:
        """The next slot of counter ``co``'s block (``atom.relaxed.gpu.add`` on the reserved
        counter)."""
        return r.atomic(AtomOp.ADD, _word(self.p.counters, co), 1, Sem.RELAXED, Scope.GPU,
                        name="slot0")

    def reserve_slot(self, r: ir.RoleBuilder, g, dst_rank, co_word, slot, addr, token=None):
        """One top-k slot of a token routed to global expert ``g`` (on ``dst_rank``), per
        thread: when it ``takes_slot``, ``co_word`` := its counter offset, ``slot`` := the
        row reserved on it (``take_slot``), then ``slot_address``. Vars not set keep their
        values (``NO_SLOT``, 0: nothing sent). ``token``: ``(t, k)``, the slot's source token
        and top-k index (u32 expressions), for a strategy whose rows depend on them
        (``rank_dedup``); unused here."""
        e = r.let("e", g % self.cfg.layout.n_local_experts)
        with self.slot_counter(r, g, dst_rank, e) as co:
            r.assign(co_word, co)
            r.assign(slot, self.take_slot(r, co))
            self.slot_address(r, e, dst_rank, slot, addr)

    @contextlib.contextmanager
    def _receive_slot(self, r: ir.RoleBuilder, e, dst_rank, slot):
        """``with self._receive_slot(...) as at:`` the body runs unless ``slot`` is past the
        block's capacity (device guard: the host refuses such routings; the monitor
        publishes the clamped count) or ``dst_rank`` is masked (``ep_rank_mask``: the slot is
        taken and counted finished, nothing is stored), with ``at`` the address of row
        ``slot`` of block ``(e, my_rank)`` of ``dst_rank``'s receive buffer."""
        cfg, p = self.cfg, self.p
        lay = cfg.layout
        recv = load_pointer(r, p.recv_buf_ptrs, lay.peer_index(dst_rank), "recv_dst",
                            peer=lay.crosses_devices)
        fits = slot < lay.block_capacity
        mp = getattr(p, "mask", None)
        with r.if_(fits if mp is None else fits & rank_mask.live(r, mp, dst_rank)):
            row = ((e * cfg.n_ranks + lay.rank_coord(p.my_rank)) * lay.block_capacity
                   + slot).cast(T.u64)
            yield recv + row * lay.msg_bytes

    def slot_address(self, r: ir.RoleBuilder, e, dst_rank, slot, addr) -> None:
        """``addr`` (a u64 var) := the staged message's address in the destination's receive
        buffer (``_receive_slot``)."""
        with self._receive_slot(r, e, dst_rank, slot) as at:
            r.assign(addr, ir.Cast(T.u64, at))

    def stage_source(self, r: ir.RoleBuilder, msg) -> None:
        """Thread 0 of a token's send-buffer staging, after the source index: the rest of the
        message's source field (here: nothing)."""

    def stage_slot(self, r: ir.RoleBuilder, msg, t, k) -> None:
        """Thread ``k < K`` of token ``t``'s send-buffer staging (send-buffer row ``msg``),
        after its top-k id: what else the strategy stages per slot (here: nothing)."""

    def copy_message(self, r: ir.RoleBuilder, msg, dst_rank, e, co, slot) -> None:
        """One comm warp, one (token, k) of the send-buffer path: the staged message ``msg`` to
        its receive slot (``_receive_slot``; ``copy_vectors``: 16-byte stores)."""
        lay = self.cfg.layout
        with self._receive_slot(r, e, dst_rank, slot) as at:
            dst = r.let("dst", at, peer=lay.crosses_devices)
            copy_vectors(r, dst, msg, lay.msg_bytes // 16, r.lane, 32, tag="fan")

    def send_slot(self, r: ir.RoleBuilder, msg, t, k, g, dst_rank, e) -> None:
        """One comm warp of the send-buffer path, top-k slot ``k`` of token ``t`` (global
        expert ``g``, local ``e`` on ``dst_rank``) staged in send-buffer row ``msg``: when it
        ``takes_slot``, lane 0 reserves its row (``take_slot``, broadcast by
        ``shfl.sync.idx``), the warp copies the message there (``copy_message``),
        ``bar.warp.sync``, then lane 0 counts the copy finished (``red.release.gpu.add``)."""
        finished = _word(self.p.counters, self.cfg.n_experts)
        with self.slot_counter(r, g, dst_rank, e) as co:
            slot = r.var("slot", T.u32, 0)
            with r.if_(r.lane.eq(0)):
                r.assign(slot, self.take_slot(r, co))
            slot_b = r.shfl(ShflMode.IDX, slot, 0, name="slot_b")
            self.copy_message(r, msg, dst_rank, e, co, slot_b)
            r.warp_sync()
            with r.if_(r.lane.eq(0)):
                r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)

    def put_slot_to_remote(self, r: ir.RoleBuilder, msg, t, k, g, dst_rank, e, issued) -> None:
        """The send-buffer path with destinations outside the P2P group (``cfg.needs_shmem``),
        the warp of top-k slot ``k`` of token ``t`` staged in send-buffer row ``msg``, when
        ``dst_rank`` is remote: ``shmem_send.put_to_remote`` (the message put with a signal
        on its block's arrival word); ``issued`` := 1 when it issued a put."""
        put_to_remote(r, self.cfg, self.p, msg, g, dst_rank, e, issued)

    def warp_rows(self, r: ir.RoleBuilder, co_word, slot, dst_rank, addr):
        """The warp send path, after ``reserve_slot``: ``(header address, source rank to write
        in it or None, scales address or None)`` of the lane's slot, ``addr`` then holding
        the payload's destination (0: nothing sent). Here the header is the message's own."""
        return addr + self.cfg.token_fmt.src_info_offset, None, None

    @property
    def shares_tokens(self) -> bool:
        """Whether warps may share a token on the warp send path."""
        return True

    # ---- wait side: the aux block ---------------------------------------------------------------
    def start_arrivals(self, r: ir.RoleBuilder) -> None:
        """The aux block at entry, before it waits for the count words (here: nothing)."""

    def count_offset_var(self, r: ir.RoleBuilder):
        """The aux thread's u32 var for the block offset its count word carries, or None
        (here: None)."""
        return None

    def read_count_offset(self, r: ir.RoleBuilder, seen, offset) -> None:
        """After the wait that saw count word ``seen``: the block offset it carries into
        ``offset`` (here: there is none)."""

    def group_end(self, e, incl) -> ir.Expr:
        """``row_offsets[e + 1]`` before padding: the inclusive prefix ``incl`` of the count
        words up to local expert ``e``'s last source."""
        return incl

    def pad_groups(self, r: ir.RoleBuilder, row_offsets, n_groups: int) -> None:
        """The whole aux block: the groups' ends rounded up as the format pads them
        (``emit_pad_expert_offsets``)."""
        self.cfg.token_fmt.emit_pad_expert_offsets(r, row_offsets, n_groups)

    def pair_end_word(self, flag, incl, raw_start, aligned, block_off, count) -> ir.Expr:
        """Region A's first word of pair ``(e, src)``: ``flag`` plus its end row (its
        inclusive prefix ``incl`` past the expert's routed start ``raw_start``, shifted to
        the expert's padded start ``aligned``)."""
        return flag + incl + (aligned - raw_start)

    def rearm_arrivals(self, r: ir.RoleBuilder) -> None:
        """The aux block, after the count words were re-armed: this strategy's words of the
        receive-count buffer (here: none)."""

    # ---- wait side: the copy blocks -------------------------------------------------------------
    def message_address(self, r: ir.RoleBuilder, e, src_rank, j, token=None) -> ir.Expr:
        """The copy pass: the address of the message in slot ``j`` of block ``(e,
        src_rank)`` of this rank's receive buffer (u64 byte arithmetic on ``recv_buf_p``):
        row ``(e * R + src) * block_capacity + j``. ``token``: ``message_token``'s answer."""
        lay = self.cfg.layout
        slot = ((e * self.cfg.n_ranks + lay.rank_coord(src_rank)) * lay.block_capacity
                + j).cast(T.u64)
        return self.p.recv_buf_p + slot * lay.msg_bytes

    def start_copies(self, r: ir.RoleBuilder, expand: bool) -> None:
        """The copy pass, the whole role, once the ready flag is seen and before its first
        tile: what the strategy reads once per block (here: nothing). ``expand``: as in
        ``output_rows``."""

    def message_token(self, r: ir.RoleBuilder, e, src_rank, j):
        """The copy pass: the source token index of slot ``j`` of block ``(e, src_rank)``
        where the strategy knows it before the message's header is read, else None (here:
        None)."""
        return None

    def output_rows(self, r: ir.RoleBuilder, e, src_rank, token, row, gid, expand: bool):
        """The copy pass, one warp, the message of a slot of local expert ``e`` from
        ``src_rank`` (``token``: ``message_token``'s answer; ``gid``: lane ``k < K``'s top-k
        id from the header as u16, 0xFFFF on the other lanes) whose own grouped-output row
        is ``row``: ``(rows, copies)``, what the warp copies the payload into (a row or a
        ``fanout.RowFan``) and a warp-uniform predicate for whether it copies at all (None:
        always). ``expand`` False: every slot copies its own row. Here: ``(row, None)``."""
        return row, None

    def record_row(self, r: ir.RoleBuilder, src_rank, src_token, k, row) -> None:
        """The copy pass, the lane that writes ``src_info[row] = (src_token, k)`` (slot
        ``k`` of source ``src_rank``'s token ``src_token`` filled grouped-output row
        ``row``): what else the strategy records (here: nothing)."""

    def copy_pass(self, r: ir.RoleBuilder, *, l1_release=None, scatter_sm_id=None,
                  copy_trace=None) -> None:
        """The copy blocks' work (``copy_received_tokens_to_output``): every message into its
        grouped output row (``staged_copy.copy_staged_messages``)."""
        copy_staged_messages(r, self.cfg, self.p, self, l1_release=l1_release,
                             scatter_sm_id=scatter_sm_id, copy_trace=copy_trace)

    @classmethod
    def copy_scratch_bytes(cls, cfg, n_threads: int) -> int:
        """Shared scratch bytes of ``copy_pass`` on a role of ``n_threads`` threads (its
        dynamic shared memory past the role's ``smem_base`` when it has one)."""
        return copy_scratch_bytes(cfg)


__all__ = ["StagedDestination", "NO_SLOT"]
