"""``ep_final_layout`` and ``ep_prod_reserve`` (docs/final-layout.md): the final rows, the
destination strategy of both flags (``destination`` picks it once, from the configuration).

Sources write each routed payload row straight into its final row of the destination's grouped
output, and the row's header (source token index, source rank, top-k ids) into the
destination's header array at the same row; dispatch_wait moves no payload: its copy blocks
run the header pass (``header_pass``: ``src_info`` from the headers).

Where a source's block of rows starts:

- capacity-strided (``ep_final_layout`` alone, ``CapacityStridedRows``): local expert ``e``'s
  range starts at row ``e * R * max_tokens_per_rank``. The monitor warp of (destination,
  expert) reserves its block with one ``atom.relaxed.sys.global.add.u64`` of its count on the
  destination's reservation cursor (``rc_cursor_base + e`` of the receive-count buffer) and
  hands the block's first row to its comm warps through a rank-local word (``st.release.gpu``
  / ``ld.acquire.gpu``). The count word it publishes at the end carries the block's offset in
  its high half; the destination's aux block reads it back and re-arms the cursors.
- ``ep_prod_reserve`` (``ProdReservedRows``): each monitor publishes ``count | gen << 32`` to
  the destination's early count word (``st.release.sys.global.b64``); the monitor warp of each
  local expert is that expert's reserver: it waits for the early counts of every expert up to
  its own from every source, and writes ``base | gen << 32`` into every source's mailbox (one
  ``st.release.sys.global.b64`` into the source's memory): the standard grouped layout,
  source-rank-major inside an expert. dispatch_wait's aux block advances the generation.

In both, a comm warp takes its slot inside the block from the source-local per-(expert,
destination) slot counter as in the staged layout (``StagedDestination.slot_counter``), waits
(bounded, ``block_base``) for its block's first row, and writes row ``base + slot``: rows
inside a block are in reservation order, as in the reference's staging buffer.
"""

from __future__ import annotations

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from . import rank_mask
from .common import copy_vectors, exit_if_aborted, load_pointer, lowest_set_bit
from .common import warp_inclusive_scan
from .common import word as _word
from .header_pass import copy_headers, header_scratch_bytes
from .staged import NO_SLOT, StagedDestination

FINAL_BASE_VALID = 1 << 31      # hand-off word: bit 31 set = the block base is published
#: ``ep_rank_mask``: the base handed off for a masked destination: every row ``base + slot``
#: is past the output (rows are below 2**31 - 1, ``EPConfig``), so nothing is written
MASKED_BASE = (1 << 31) - 1
GEN_SHIFT = 32                  # early counts and mailboxes: value | gen << 32
LOW32 = 0xFFFFFFFF


@attrs.frozen
class FinalAsyncParams:
    """dispatch_async parameters of the final rows: tables of every P2P rank's grouped output
    and header array (and, for a format with output scales, its output scales:
    ``scales_ptrs``); the rank-local hand-off words (capacity-strided); with
    ``ep_prod_reserve`` the table of every rank's prod buffer, this rank's mailboxes
    (``prod_gen_p``, the reference ``copy_and_send_tokens`` argument) and this rank's
    generation word (``prod_gen_word``: the last call's generation)."""

    out_ptrs: ir.Param
    hdr_ptrs: ir.Param
    base_handoff_p: ir.Param | None = None
    prod_ptrs: ir.Param | None = None
    prod_gen_p: ir.Param | None = None
    prod_gen_word: ir.Param | None = None
    scales_ptrs: ir.Param | None = None


@attrs.frozen
class FinalWaitParams:
    """dispatch_wait parameters of the final rows: ``hdr_p`` (this rank's header array,
    written by peers) and with ``ep_prod_reserve`` ``prod_gen_word`` (this rank's generation
    word, which the aux block advances)."""

    hdr_p: ir.Param
    prod_gen_word: ir.Param | None = None


def _next_generation(last) -> ir.Expr:
    """``last + 1``, skipping 0 (the value of a freshly zeroed tag) when the u32 wraps."""
    nxt = ir.as_expr(last) + 1
    return ir.Select(nxt.eq(0), ir.Const(1, T.u32), nxt)


def advance_generation(r: ir.RoleBuilder, word) -> None:
    """dispatch_wait's aux block, thread 0, at entry: store this call's generation into the
    rank's generation word (``ld.relaxed.gpu.global.b32`` then ``st.relaxed.gpu.global.b32``).
    Every dispatch_async block has exited before dispatch_wait starts (stream order, or a
    programmatic launch triggered at each block's exit), so each read the old value; the
    next call's dispatch_async starts after this kernel ends."""
    with r.if_(r.tid.eq(0)):
        last = r.load(word, T.u32, Sem.RELAXED, Scope.GPU, name="gen_last")
        r.store(word, _next_generation(last), Sem.RELAXED, Scope.GPU)


def _tagged(value, gen) -> ir.Expr:
    """``value | gen << 32`` as a u64."""
    return ir.as_expr(value).cast(T.u64) | (ir.as_expr(gen).cast(T.u64) << GEN_SHIFT)


def _padded(cfg, n) -> ir.Expr:
    """``n`` rounded up to the format's ``expert_m_padding`` (``pad_row_offsets``)."""
    pad = cfg.token_fmt.expert_m_padding
    return n if pad == 1 else (n + (pad - 1)) // pad * pad


class FinalRowsDestination(StagedDestination):
    """What both final layouts share (module docstring): the send side writes each slot's
    payload and header to row ``base + slot`` of the destination's output and header array
    once ``block_base`` gives the block's first row; the wait side's copy blocks run the
    header pass. ``params``: ``FinalAsyncParams`` on the send side, ``FinalWaitParams`` on
    the wait side. Subclasses say where the base comes from (``reserve_block``,
    ``generation``, ``block_base``)."""

    def __init__(self, cfg, p, params):
        super().__init__(cfg, p)
        self.params = params

    @classmethod
    def declare_send(cls, kb: ir.KernelBuilder, cfg, p) -> FinalRowsDestination:
        """Declares the output, header (and output-scales) tables, then the subclass's own
        parameters (``send_params``)."""
        tables = dict(out_ptrs=kb.param("out_ptrs", T.ptr_global),
                      hdr_ptrs=kb.param("hdr_ptrs", T.ptr_global))
        if cfg.token_fmt.out_scales is not None:
            # the sender writes the scales of its rows into the destination's output scales
            tables["scales_ptrs"] = kb.param("scales_ptrs", T.ptr_global)
        return cls(cfg, p, FinalAsyncParams(**tables, **cls.send_params(kb)))

    @classmethod
    def send_params(cls, kb: ir.KernelBuilder) -> dict:
        """The subclass's dispatch_async parameters, declared on ``kb``."""
        raise NotImplementedError

    @classmethod
    def declare_wait(cls, kb: ir.KernelBuilder, cfg, p) -> FinalRowsDestination:
        """Declares ``hdr_p``, then the subclass's own parameters (``wait_params``)."""
        hdr_p = kb.param("hdr_p", T.ptr_global, peer=True)
        return cls(cfg, p, FinalWaitParams(hdr_p, **cls.wait_params(kb)))

    @classmethod
    def wait_params(cls, kb: ir.KernelBuilder) -> dict:
        """The subclass's dispatch_wait parameters besides ``hdr_p``, declared on ``kb``."""
        return {}

    # ---- send side: the monitor ---------------------------------------------------------------
    def reserve(self, r: ir.RoleBuilder, g, count, offset=None) -> None:
        """``reserve_rows`` of ``count`` rows for global expert ``g``; the offset into
        ``offset`` where the count word carries one."""
        off = self.reserve_rows(r, g, count)
        if offset is not None:
            r.assign(offset, off)

    def reserve_counted(self, r: ir.RoleBuilder, owns, g, load_count, keep_offset) -> None:
        """When ``owns``: ``reserve_rows`` with the loaded count, its offset (if any) to
        ``keep_offset``."""
        with r.if_(owns):
            off = self.reserve_rows(r, g, load_count())
            if off is not None:
                keep_offset(off)

    def reserve_rows(self, r: ir.RoleBuilder, g, count):
        """Monitor warp of global expert ``g`` (destination ``g // L``, local expert ``g %
        L``), after counting: ``reserve_block`` of this source's ``count`` rows on the
        destination. Returns the block's offset inside the expert's range (a u32 var), or
        None where the count word carries none."""
        L = self.cfg.layout.n_local_experts
        dst_rank = r.let("fl_dst_rank", g // L)
        e = r.let("fl_e", g % L)
        return self.reserve_block(r, e, dst_rank, count)

    def reserve_block(self, r: ir.RoleBuilder, e, dst_rank, count):
        """``reserve_rows`` for local expert ``e`` of ``dst_rank``."""
        raise NotImplementedError

    def count_word(self, count, offset) -> ir.Expr:
        """The receive-count word the monitor publishes: ``count`` (never the sentinel,
        ``count <= max_tokens_per_rank``)."""
        return count.cast(T.u64)

    # ---- send side: the comm warps --------------------------------------------------------------
    def generation(self, r: ir.RoleBuilder):
        """This call's generation, the tag ``block_base`` waits for, or None."""
        return None

    def block_base(self, r: ir.RoleBuilder, co, gen) -> ir.Expr:
        """Every lane waits (bounded) for the first row of block ``co`` (its counter offset
        ``e * R + dst``); returns it (u32)."""
        raise NotImplementedError

    def slot_address(self, r: ir.RoleBuilder, e, dst_rank, slot, addr) -> None:
        """Nothing: the row comes from the block base, once published (``warp_rows``)."""

    def stage_source(self, r: ir.RoleBuilder, msg) -> None:
        """``my_rank`` into the padding of the staged message's source-index field
        (``st.global.b32``), so the header carries the source rank."""
        lay = self.cfg.layout
        r.store(msg + self.cfg.token_fmt.src_info_offset + lay.hdr_src_rank_offset,
                self.p.my_rank)

    def copy_message(self, r: ir.RoleBuilder, msg, dst_rank, e, co, slot) -> None:
        """One comm warp, one (token, k): ``block_base`` of ``co``, then row ``base + slot`` of
        the destination: the payload by the format's ``copy_msg_to_output_tensor`` step into
        the destination's grouped output (its scales, if any, into the destination's output
        scales: ``scales_ptrs``; transposed ones into the header row, ``hdr_scale_bytes``),
        and the header fields (``st.global.v4.b32``) into its header array. A row past the
        output is never written (device guard)."""
        cfg, fl = self.cfg, self.params
        lay, fmt = cfg.layout, cfg.token_fmt
        dst_p2p = lay.peer_index(dst_rank)
        base = r.let("row_base", self.block_base(r, co, self.generation(r)))
        row = r.let("final_row", base + slot)
        out = load_pointer(r, fl.out_ptrs, dst_p2p, "out_dst")
        hdr = load_pointer(r, fl.hdr_ptrs, dst_p2p, "hdr_dst")
        scales = {} if fl.scales_ptrs is None else \
            {"out_scales": load_pointer(r, fl.scales_ptrs, dst_p2p, "scales_dst")}
        with r.if_(row < lay.max_out_rows):
            hdr_row = r.let("hdr_row", hdr + row.cast(T.u64) * lay.hdr_bytes)
            if lay.hdr_scale_bytes:     # transposed scales: row-major into the header row
                fmt.emit_copy_msg_to_output(r, msg, row, out, scales=False)
                copy_vectors(r, hdr_row + lay.hdr_scales_offset, msg + fmt.scales_offset,
                             lay.hdr_scale_bytes // 16, r.lane, 32, unroll=1, tag="hdr_sc")
            else:
                fmt.emit_copy_msg_to_output(r, msg, row, out, **scales)
            copy_vectors(r, hdr_row, msg + fmt.src_info_offset, lay.hdr_scales_offset // 16,
                         r.lane, 32, unroll=1, tag="hdr")

    def warp_rows(self, r: ir.RoleBuilder, co_word, slot, dst_rank, addr):
        """The warp send path's final rows: lane ``k < K`` holds top-k slot ``k``'s counter
        offset ``co_word`` (``NO_SLOT``: nothing sent), its ``slot`` and ``dst_rank``. The
        warp waits for each slot's block base in turn, every lane on the same word
        (``block_base``), so a wait that gives up exits the whole warp; lane ``k`` keeps its
        base. ``addr`` := lane ``k``'s output row ``base + slot`` (0 when nothing is written:
        no slot, or a row past the output: device guard); returns its header row address,
        ``my_rank`` and its scales address (the row's first scale in the destination's output
        scales, ``out_scale_row_offset``, or in its header row where the layout keeps them
        there, ``hdr_scale_bytes``: transposed scales, written row-major; None for a format
        without output scales)."""
        cfg, fl = self.cfg, self.params
        lay, fmt = cfg.layout, cfg.token_fmt
        gen = self.generation(r)
        base = r.var("row_base", T.u32, 0)
        # the lanes still to serve, lowest first (a data-dependent loop LLVM does not unroll,
        # so the PTX holds one copy of each wait)
        pending = r.var("pending", T.u32, r.ballot(ir.as_expr(co_word).ne(NO_SLOT),
                                                   name="sent"))
        with r.while_(pending.ne(0)):
            k = lowest_set_bit(r, pending, "k_next")
            r.assign(pending, pending & (pending - 1))
            co = r.shfl(ir.ShflMode.IDX, co_word, k, name="co_k")
            value = self.block_base(r, co, gen)
            with r.if_(r.lane.eq(k)):
                r.assign(base, value)
        out_addr = r.var("out_addr", T.u64, ir.Const(0, T.u64))
        hdr_addr = r.var("hdr_addr", T.u64, ir.Const(0, T.u64))
        scale_addr = r.var("scale_addr", T.u64, ir.Const(0, T.u64)) \
            if fl.scales_ptrs is not None else None
        with r.if_(ir.as_expr(co_word).ne(NO_SLOT)):
            row = r.let("final_row", base + slot)
            with r.if_(row < lay.max_out_rows):
                dst_p2p = lay.peer_index(dst_rank)
                out = load_pointer(r, fl.out_ptrs, dst_p2p, "out_dst")
                hdr = load_pointer(r, fl.hdr_ptrs, dst_p2p, "hdr_dst")
                r.assign(out_addr, ir.Cast(T.u64, out + row.cast(T.u64) * fmt.out_row_bytes))
                r.assign(hdr_addr, ir.Cast(T.u64, hdr + row.cast(T.u64) * lay.hdr_bytes))
                if scale_addr is not None and lay.hdr_scale_bytes:
                    r.assign(scale_addr, hdr_addr + lay.hdr_scales_offset)
                elif scale_addr is not None:
                    scales = load_pointer(r, fl.scales_ptrs, dst_p2p, "scales_dst")
                    r.assign(scale_addr, ir.Cast(T.u64, scales + fmt.out_scale_row_offset(row)))
        r.assign(addr, out_addr)
        return hdr_addr, self.p.my_rank, scale_addr

    @property
    def shares_tokens(self) -> bool:
        """No: the rows come from the monitors' hand-off, one warp per token."""
        return False

    # ---- wait side: the copy blocks (the header pass) ------------------------------------------
    def copy_pass(self, r: ir.RoleBuilder, *, l1_release=None, scatter_sm_id=None,
                  copy_trace=None) -> None:
        """The header pass: ``src_info`` from this rank's header rows
        (``header_pass.copy_headers``). It publishes no L1 arrivals and takes its expert from
        the block index: the arguments it would otherwise drop are refused, named."""
        if l1_release is not None:
            raise ValueError("emit_l1_release is not implemented with ep_final_layout (the "
                             "final layout's header pass publishes no L1 arrival counters): "
                             "build without one of them")
        if scatter_sm_id is not None:
            raise ValueError("scatter_sm_id is not taken with ep_final_layout (its header "
                             "pass assigns experts by block index)")
        copy_headers(r, self.cfg, self.p, self.params.hdr_p)

    @classmethod
    def copy_scratch_bytes(cls, cfg, n_threads: int) -> int:
        """The header pass's scratch (``header_pass.header_scratch_bytes``)."""
        return header_scratch_bytes(cfg, n_threads)


class CapacityStridedRows(FinalRowsDestination):
    """``ep_final_layout`` alone (module docstring): the monitor reserves on the
    destination's cursor and hands the block's first row to its comm warps over a rank-local
    word; the count word carries the block's offset, from which the destination's aux block
    takes each pair's rows; ``row_offsets`` are capacity-strided, unpadded."""

    @classmethod
    def send_params(cls, kb: ir.KernelBuilder) -> dict:
        """``base_handoff_p``: this rank's hand-off words (rank-local)."""
        return {"base_handoff_p": kb.param("base_handoff_p", T.ptr_global)}

    # ---- send side ------------------------------------------------------------------------------
    def offset_var(self, r: ir.RoleBuilder):
        """The block offset the count word carries (``fl_off``)."""
        return r.var("fl_off", T.u32, 0)

    def reserve_block(self, r: ir.RoleBuilder, e, dst_rank, count):
        """Lane 0: ``atom.relaxed.sys.global.add.u64`` of ``count`` on the destination's cursor
        ``rc_cursor_base + e`` (skipped when ``count`` is 0), then ``st.release.gpu.global.b32``
        of ``first_row | FINAL_BASE_VALID`` into the hand-off word ``e * R + dst``. Returns
        the block's offset inside the expert's range (a u32 var). With ``ep_rank_mask`` a
        masked destination gets no cursor add and its comm warps ``MASKED_BASE``, so they
        write nothing and still count their copies."""
        cfg, p = self.cfg, self.p
        lay, R = cfg.layout, cfg.n_ranks
        off = r.var("fl_off", T.u32, 0)
        with r.if_(r.lane.eq(0)):
            masked = None if p.mask is None else rank_mask.masked(r, p.mask, dst_rank)
            with r.if_(count > 0 if masked is None else (count > 0) & masked.eq(0)):
                rc_dst = load_pointer(r, p.recv_count_ptrs, lay.peer_index(dst_rank),
                                      "rc_cursor_dst")
                old = r.atomic(AtomOp.ADD, _word(rc_dst, lay.rc_cursor_base + e, 8),
                               count.cast(T.u64), Sem.RELAXED, Scope.SYS, dtype=T.u64,
                               name="cursor_old")
                r.assign(off, old.cast(T.u32))
            first_row = e * (R * cfg.max_tokens_per_rank) + off
            if masked is not None:
                first_row = ir.Select(masked.ne(0), ir.Const(MASKED_BASE, T.u32), first_row)
            r.store(_word(self.params.base_handoff_p, e * R + dst_rank),
                    first_row | FINAL_BASE_VALID, Sem.RELEASE, Scope.GPU)
        return off

    def carried_offset(self, r: ir.RoleBuilder, load_offset):
        """The block offset, loaded back (``fl_off``)."""
        return r.let("fl_off", load_offset())

    def count_word(self, count, offset) -> ir.Expr:
        """``count | offset << 32``: the destination learns where each block landed."""
        return count.cast(T.u64) | (offset.cast(T.u64) << 32)

    def rearm(self, r: ir.RoleBuilder, counter_offset) -> None:
        """Monitor lane 0, after every comm warp of the block has finished (so has read the
        base): hand-off word ``counter_offset`` back to 0 (plain ``st.global.b32``)."""
        r.store(_word(self.params.base_handoff_p, counter_offset), 0)

    def block_base(self, r: ir.RoleBuilder, co, gen) -> ir.Expr:
        """``ld.acquire.gpu.global.b32`` of hand-off word ``co`` until bit 31 is set; the
        base is the low 31 bits."""
        seen = r.spin_wait(_word(self.params.base_handoff_p, co), T.u32, CmpOp.EQ, 1,
                           buffer="final_base_handoff", index=co, sem=Sem.ACQUIRE,
                           scope=Scope.GPU, shift=31, mask=1, name="handoff")
        return seen & (FINAL_BASE_VALID - 1)

    # ---- wait side ------------------------------------------------------------------------------
    def count_offset_var(self, r: ir.RoleBuilder):
        """The block offset a count word carries (``block_off``)."""
        return r.var("block_off", T.u32, 0)

    def read_count_offset(self, r: ir.RoleBuilder, seen, offset) -> None:
        """The count word's high half."""
        r.assign(offset, (seen >> 32).cast(T.u32))

    def group_end(self, e, incl) -> ir.Expr:
        """``(e + 1) * R * max_tokens_per_rank``: the capacity, not the count."""
        return (e + 1) * (self.cfg.n_ranks * self.cfg.max_tokens_per_rank)

    def pad_groups(self, r: ir.RoleBuilder, row_offsets, n_groups: int) -> None:
        """Nothing: capacity-strided groups are not padded."""

    def pair_end_word(self, flag, incl, raw_start, aligned, block_off, count) -> ir.Expr:
        """``flag`` plus the pair's end row: its block lands where the reservation put it
        (``block_off`` from the count word) in the expert's range."""
        return flag + aligned + block_off + count

    def rearm_arrivals(self, r: ir.RoleBuilder) -> None:
        """Thread ``e < L`` stores 0 into cursor ``rc_cursor_base + e`` (plain
        ``st.global.b64``; after every count word was acquired, so after every source's cursor
        add; the next call's adds start after this kernel, see the world)."""
        lay = self.cfg.layout
        with r.if_(r.tid < lay.n_local_experts):
            r.store(_word(self.p.recv_count_p, lay.rc_cursor_base + r.tid, 8),
                    ir.Const(0, T.u64))


class ProdReservedRows(FinalRowsDestination):
    """``ep_final_layout`` with ``ep_prod_reserve`` (module docstring): early counts, the
    destination's reservers and the sources' mailboxes, tagged with a generation that the
    kernels advance themselves; the standard grouped layout, so the wait side's offsets are
    the staged layout's."""

    @classmethod
    def send_params(cls, kb: ir.KernelBuilder) -> dict:
        """``prod_ptrs`` (every rank's prod buffer), ``prod_gen_p`` (this rank's mailboxes,
        written by peers) and ``prod_gen_word`` (this rank's generation word)."""
        return dict(prod_ptrs=kb.param("prod_ptrs", T.ptr_global),
                    prod_gen_p=kb.param("prod_gen_p", T.ptr_global, peer=True),
                    prod_gen_word=kb.param("prod_gen_word", T.ptr_global))

    @classmethod
    def wait_params(cls, kb: ir.KernelBuilder) -> dict:
        """``prod_gen_word``: this rank's generation word (``start_arrivals`` advances it)."""
        return {"prod_gen_word": kb.param("prod_gen_word", T.ptr_global)}

    # ---- send side ------------------------------------------------------------------------------
    def generation(self, r: ir.RoleBuilder) -> ir.Var:
        """This call's generation tag in dispatch_async: the generation word holds the last
        call's (``ld.relaxed.gpu.global.b32``; 0 before the first call), this call's is the
        next. Every rank's word advances once per call, so all ranks agree on the tag with no
        host involvement (a captured graph replays unchanged)."""
        last = r.load(self.params.prod_gen_word, T.u32, Sem.RELAXED, Scope.GPU,
                      name="prod_gen_last")
        return r.let("prod_gen", _next_generation(last))

    def reserve_block(self, r: ir.RoleBuilder, e, dst_rank, count):
        """Lane 0: ``st.release.sys.global.b64`` of ``count | gen << 32`` into the
        destination's early-count word ``e * R + my_rank``; then, when this rank is the
        destination, the whole warp runs ``reserve_for_sources`` for local expert ``e``.
        Returns None (the block base reaches the comm warps through their mailbox)."""
        cfg, p = self.cfg, self.p
        lay = cfg.layout
        gen = self.generation(r)
        with r.if_(r.lane.eq(0)):
            prod_dst = load_pointer(r, self.params.prod_ptrs, lay.peer_index(dst_rank),
                                    "prod_dst")
            r.store(_word(prod_dst, lay.prod_early_count_offset + e * cfg.n_ranks + p.my_rank,
                          8), _tagged(count, gen), Sem.RELEASE, Scope.SYS)
        with r.if_(dst_rank.eq(p.my_rank)):
            self.reserve_for_sources(r, e, gen)
        return None

    def reserve_for_sources(self, r: ir.RoleBuilder, e, gen):
        """The reserver of local expert ``e`` (the whole monitor warp of global expert
        ``my_rank * L + e``). For each expert ``e2 <= e``, lanes ``< R`` wait (bounded,
        ``ld.acquire.sys.global.b64``) until early-count word ``e2 * R + lane`` carries this
        call's generation; the warp sums each expert (``redux.sync.add``), the padded totals
        of ``e2 < e`` give expert ``e``'s first row, an exclusive scan over sources
        (``shfl.sync.up``) each source's block base. Lane ``src`` writes ``base | gen << 32``
        into mailbox ``e * R + my_rank`` of rank ``src`` (``st.release.sys.global.b64``), an
        empty block's too: every mailbox then holds the last call's tag or this one's, so no
        stale tag can match when the 32-bit generation wraps."""
        cfg, p, fl = self.cfg, self.p, self.params
        lay = cfg.layout
        R = cfg.n_ranks
        early = load_pointer(r, fl.prod_ptrs, lay.peer_index(p.my_rank), "early_here")
        start = r.var("rsv_start", T.u32, 0)
        mine = r.var("rsv_mine", T.u32, 0)
        with r.for_range("e2", 0, e + 1) as e2:
            c = r.var("rsv_c", T.u32, 0)
            with r.if_(r.lane < R):
                idx = r.let("rsv_idx", e2 * R + r.lane)
                seen = r.spin_wait(_word(early, lay.prod_early_count_offset + idx, 8), T.u64,
                                   CmpOp.EQ, gen, buffer="prod_early_count", index=idx,
                                   sem=Sem.ACQUIRE, scope=Scope.SYS, shift=GEN_SHIFT,
                                   mask=LOW32, name="early")
                r.assign(c, seen.cast(T.u32))
            total = r.warp_sum(c, name="rsv_total")
            with r.if_(e2 < e):
                r.assign(start, start + _padded(cfg, total))
            r.assign(mine, c)
        exit_if_aborted(r, p.err_buf)
        incl = warp_inclusive_scan(r, mine, "rsv_scan")
        base = r.let("rsv_base", start + incl - mine)
        with r.if_(r.lane < R):
            src = load_pointer(r, fl.prod_ptrs, r.lane, "mailbox_src")
            r.store(_word(src, lay.prod_mailbox_offset + e * R + p.my_rank, 8),
                    _tagged(base, gen), Sem.RELEASE, Scope.SYS)

    def block_base(self, r: ir.RoleBuilder, co, gen) -> ir.Expr:
        """``ld.acquire.sys.global.b64`` of this rank's mailbox ``co`` until its tag is
        ``gen``; the base is the low half."""
        seen = r.spin_wait(_word(self.params.prod_gen_p, co, 8), T.u64, CmpOp.EQ, gen,
                           buffer="prod_mailbox", index=co, sem=Sem.ACQUIRE, scope=Scope.SYS,
                           shift=GEN_SHIFT, mask=LOW32, name="mailbox")
        return seen.cast(T.u32)

    # ---- wait side ------------------------------------------------------------------------------
    def start_arrivals(self, r: ir.RoleBuilder) -> None:
        """``advance_generation`` of this rank's generation word."""
        advance_generation(r, self.params.prod_gen_word)


__all__ = ["FinalRowsDestination", "CapacityStridedRows", "ProdReservedRows",
           "FinalAsyncParams", "FinalWaitParams", "advance_generation", "FINAL_BASE_VALID",
           "GEN_SHIFT"]
