"""Where the send path writes a routed token: the destination strategy, chosen once per build.

``destination(cfg, p)`` picks one of

- ``StagedDestination`` (the default): row ``slot`` of block ``(e, src)`` of the destination's
  receive buffer; dispatch_wait later copies it to the grouped output. The monitor publishes
  the count, clamped to the block capacity.
- ``FinalRowsDestination`` (``ep_final_layout``; ``prod_reserve`` with ``ep_prod_reserve``):
  the destination's final output row and its header row (``final_layout``: the monitor
  reserves the block of rows, the senders wait for its base); dispatch_wait moves no payload.

Both answer the operations the send path needs, so the monitor and the send loops read
straight, with no test of the layout: ``reserve_slot`` (a top-k slot's counter and row on
its ``(expert, destination)`` block, and its receive-buffer address where there is one),
``copy_message`` / ``warp_rows`` (where the staged message or the warp's token goes, header
included), ``stage_source`` (what the staged message's header carries besides the source
index), and for the monitor ``offset_var`` / ``reserve`` / ``reserve_counted`` /
``carried_offset`` (the block reservation and the offset the count word carries),
``count_word`` (the published count) and ``rearm`` (what the monitor resets after a call).
dispatch_wait's side of the final layout (its re-arm of the reservation cursors, the header
pass) stays in ``final_layout``.
"""

from __future__ import annotations

import ir
from ir import AtomOp, Scope, Sem
from ir import types as T

from . import final_layout
from .common import copy_vectors, load_pointer
from .common import word as _word

NO_SLOT = 0xFFFFFFFF   # a top-k slot that sends nothing (skip_a2a: not this device's expert)


class StagedDestination:
    """The staged receive buffer: row ``(e * R + src) * block_capacity + slot`` of the
    destination's receive buffer holds the whole message (payload and header)."""

    final = False

    def __init__(self, cfg, p):
        self.cfg, self.p = cfg, p

    # ---- monitor ----------------------------------------------------------------------------
    def offset_var(self, r: ir.RoleBuilder):
        """The monitor's u32 var for its block offset, or None when the count word carries
        none (here: none)."""
        return None

    def reserve(self, r: ir.RoleBuilder, g, count, offset=None) -> None:
        """Monitor warp of global expert ``g``, after counting ``count``: reserve this
        source's block on the destination (here: nothing, the block is the receive
        buffer's)."""

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

    # ---- send -------------------------------------------------------------------------------
    def reserve_slot(self, r: ir.RoleBuilder, g, dst_rank, co_word, slot, addr):
        """One top-k slot of a token routed to global expert ``g`` (on ``dst_rank``): unless
        ``skip_a2a`` leaves it to another device, set ``co_word`` to its counter offset ``e * R
        + dst`` and ``slot`` to the row reserved on it (``atom.relaxed.gpu.add`` on the
        reserved counter), then ``slot_address``; ``g >= n_experts`` (an id the id check
        dropped) reserves nothing. Vars not set keep their values (``NO_SLOT``, 0: nothing
        sent)."""
        cfg, p = self.cfg, self.p
        lay = cfg.layout
        L, R = lay.n_local_experts, cfg.n_ranks
        e = r.let("e", g % L)
        # under skip_a2a ids are global and another device's are skipped; else an id past
        # the experts (the id check's sentinel for a bad one) reserves nothing
        with r.if_(dst_rank.eq(p.my_rank) if cfg.skip_a2a else g < cfg.n_experts):
            co = r.let("co", e * R + (0 if cfg.skip_a2a else dst_rank))
            r.assign(co_word, co)
            r.assign(slot, r.atomic(AtomOp.ADD, _word(p.counters, co), 1, Sem.RELAXED,
                                    Scope.GPU, name="slot0"))
            self.slot_address(r, e, dst_rank, slot, addr)

    def slot_address(self, r: ir.RoleBuilder, e, dst_rank, slot, addr) -> None:
        """``addr`` (a u64 var) := the staged message's address in the destination's receive
        buffer, unless the slot is past the block's capacity (device guard: the host refuses
        such routings; the monitor publishes the clamped count)."""
        cfg, p = self.cfg, self.p
        lay = cfg.layout
        R = cfg.n_ranks
        recv = load_pointer(r, p.recv_buf_ptrs,
                            0 if cfg.skip_a2a else dst_rank % cfg.p2p_world_size,
                            "recv_dst", peer=not cfg.skip_a2a)
        # device guard: a slot past the block's capacity is never written (the host refuses
        # such routings; the monitor publishes the clamped count)
        with r.if_(slot < lay.block_capacity):
            row = ((e * R + (0 if cfg.skip_a2a else p.my_rank)) * lay.block_capacity
                   + slot).cast(T.u64)
            r.assign(addr, ir.Cast(T.u64, recv + row * lay.msg_bytes))

    def stage_source(self, r: ir.RoleBuilder, msg) -> None:
        """Thread 0 of a token's send-buffer staging, after the source index: the rest of the
        message's source field (here: nothing)."""

    def copy_message(self, r: ir.RoleBuilder, msg, dst_rank, e, co, slot) -> None:
        """One comm warp, one (token, k) of the send-buffer path: the staged message ``msg`` to
        row ``slot`` of block ``(e, my_rank)`` of ``dst_rank``'s receive buffer
        (``copy_vectors``: 16-byte stores), unless past the block's capacity."""
        cfg, p = self.cfg, self.p
        lay = cfg.layout
        R, msg_bytes = cfg.n_ranks, lay.msg_bytes
        rank_coord = 0 if cfg.skip_a2a else p.my_rank
        dst_p2p = 0 if cfg.skip_a2a else dst_rank % cfg.p2p_world_size
        recv = load_pointer(r, p.recv_buf_ptrs, dst_p2p, "recv_dst",
                            peer=not cfg.skip_a2a)
        # device guard: a slot past the block's capacity is never written (the host
        # refuses such routings; the monitor publishes the clamped count)
        with r.if_(slot < lay.block_capacity):
            row = ((e * R + rank_coord) * lay.block_capacity + slot).cast(T.u64)
            dst = r.let("dst", recv + row * msg_bytes, peer=not cfg.skip_a2a)
            copy_vectors(r, dst, msg, msg_bytes // 16, r.lane, 32, tag="fan")

    def warp_rows(self, r: ir.RoleBuilder, co_word, slot, dst_rank, addr):
        """The warp send path, after ``reserve_slot``: ``(header address, source rank to write
        in it or None, scales address or None)`` of the lane's slot, ``addr`` then holding
        the payload's destination (0: nothing sent). Here the header is the message's own."""
        return addr + self.cfg.token_fmt.src_info_offset, None, None

    @property
    def shares_tokens(self) -> bool:
        """Whether warps may share a token on the warp send path."""
        return True


class FinalRowsDestination(StagedDestination):
    """``ep_final_layout``: the payload goes to its final row of the destination's grouped
    output, the header (source index and rank, top-k ids) to the same row of its header array
    (``final_layout``). Capacity-strided (``prod_reserve`` False): the monitor reserves the
    block on the destination's cursor and hands its base over a rank-local word; with
    ``ep_prod_reserve`` the destination's reserver mails each source its base."""

    final = True

    def __init__(self, cfg, p, prod_reserve: bool):
        super().__init__(cfg, p)
        self.prod_reserve = prod_reserve
        self.fl = p.final

    def offset_var(self, r: ir.RoleBuilder):
        """The block offset the capacity-strided count word carries (``fl_off``)."""
        return None if self.prod_reserve else r.var("fl_off", T.u32, 0)

    def reserve(self, r: ir.RoleBuilder, g, count, offset=None) -> None:
        """``final_layout.reserve_rows`` of ``count`` rows for global expert ``g``; its offset
        into ``offset`` (capacity-strided)."""
        off = final_layout.reserve_rows(r, self.cfg, self.p, self.fl, g, count)
        if offset is not None:
            r.assign(offset, off)

    def reserve_counted(self, r: ir.RoleBuilder, owns, g, load_count, keep_offset) -> None:
        """When ``owns``: ``final_layout.reserve_rows`` with the loaded count; the
        capacity-strided offset to ``keep_offset``."""
        with r.if_(owns):
            off = final_layout.reserve_rows(r, self.cfg, self.p, self.fl, g, load_count())
            if off is not None:
                keep_offset(off)

    def carried_offset(self, r: ir.RoleBuilder, load_offset):
        """The capacity-strided block offset, loaded back (``fl_off``); None with
        ``ep_prod_reserve``."""
        return None if self.prod_reserve else r.let("fl_off", load_offset())

    def count_word(self, count, offset) -> ir.Expr:
        """``final_layout.count_word``: the count, with the block offset in its high half
        when capacity-strided."""
        return final_layout.count_word(self.cfg, count, offset)

    def rearm(self, r: ir.RoleBuilder, counter_offset) -> None:
        """The block-base hand-off word back to 0 (``final_layout.rearm_handoff``)."""
        final_layout.rearm_handoff(r, self.cfg, self.fl, counter_offset)

    def slot_address(self, r: ir.RoleBuilder, e, dst_rank, slot, addr) -> None:
        """Nothing: the row comes from the block base, once published (``warp_rows``)."""

    def stage_source(self, r: ir.RoleBuilder, msg) -> None:
        """``my_rank`` into the message's source field (``final_layout.stage_source_rank``)."""
        final_layout.stage_source_rank(r, self.cfg, self.p, msg)

    def copy_message(self, r: ir.RoleBuilder, msg, dst_rank, e, co, slot) -> None:
        """``final_layout.copy_to_final_row``: wait for the block base, then the payload to
        the output row and the header to the header row."""
        final_layout.copy_to_final_row(r, self.cfg, self.fl, msg, dst_rank, co, slot)

    def warp_rows(self, r: ir.RoleBuilder, co_word, slot, dst_rank, addr):
        """``final_layout.warp_final_rows`` (each slot's block base, then its rows): ``addr``
        := the output row; the header row, ``my_rank`` and the scales address."""
        out_addr, hdr_addr, scale_addr = final_layout.warp_final_rows(
            r, self.cfg, self.fl, co_word, slot, dst_rank, NO_SLOT)
        r.assign(addr, out_addr)
        return hdr_addr, self.p.my_rank, scale_addr

    @property
    def shares_tokens(self) -> bool:
        """No: the rows come from the monitors' hand-off, one warp per token."""
        return False


def destination(cfg, p) -> StagedDestination:
    """The destination strategy of a build: the final rows when ``p`` declares the final
    layout's parameters (``declare_params`` with ``cfg.ep_final_layout``), else the staged
    receive buffer."""
    if p.final is not None:
        return FinalRowsDestination(cfg, p, prod_reserve=bool(cfg.ep_prod_reserve))
    return StagedDestination(cfg, p)


__all__ = ["StagedDestination", "FinalRowsDestination", "destination", "NO_SLOT"]
