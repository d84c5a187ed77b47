"""``ep_final_layout`` and ``ep_prod_reserve`` (docs/final-layout.md).

Sources write each routed payload row straight into its final row of the destination's grouped
output, and the row's header (source token index, source rank, top-k ids) into the
destination's header array at the same row; dispatch_wait moves no payload.

Where a source's block of rows starts:

- capacity-strided (``ep_final_layout`` alone): local expert ``e``'s range starts at row
  ``e * R * max_tokens_per_rank``. The monitor warp of (destination, expert) reserves its block
  with one ``atom.relaxed.sys.global.add.u64`` of its count on the destination's reservation
  cursor (``rc_cursor_base + e`` of the receive-count buffer) and hands the block's first row
  to its comm warps through a rank-local word (``st.release.gpu`` / ``ld.acquire.gpu``). The
  count word it publishes at the end carries the block's offset in its high half.
- ``ep_prod_reserve``: each monitor publishes ``count | gen << 32`` to the destination's early
  count word (``st.release.sys.global.b64``); the monitor warp of each local expert is that
  expert's reserver: it waits for the early counts of every expert up to its own from every
  source, and writes ``base | gen << 32`` into each non-empty source's mailbox (one
  ``st.release.sys.global.b64`` into the source's memory): the standard grouped layout,
  source-rank-major inside an expert.

In both, a comm warp takes its slot inside the block from the source-local per-(expert,
destination) slot counter as today (``expert_reserved_counter``, ``atom.relaxed.gpu``), waits
(bounded) for its block's first row, and writes row ``base + slot``: rows inside a block are in
reservation order, as in the reference's staging buffer.
"""

from __future__ import annotations

import contextlib
import math

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from .common import (comm_sync, copy_vectors, exit_if_aborted, load_pointer, lowest_set_bit,
                     wait_ready_flag, warp_inclusive_scan)
from .common import word as _word

FINAL_BASE_VALID = 1 << 31      # hand-off word: bit 31 set = the block base is published
GEN_SHIFT = 32                  # early counts and mailboxes: value | gen << 32
LOW32 = 0xFFFFFFFF


@attrs.frozen
class FinalAsyncParams:
    """dispatch_async parameters added by ``ep_final_layout``: tables of every P2P rank's
    grouped output and header array (and, for a format with output scales, its output
    scales: ``scales_ptrs``); the rank-local hand-off words (capacity-strided); with
    ``ep_prod_reserve`` the table of every rank's prod buffer, this rank's mailboxes
    (``prod_gen_p``, the reference ``copy_and_send_tokens`` argument) and this rank's
    generation word (``prod_gen_word``: the last call's generation, ``call_generation``)."""

    out_ptrs: ir.Param
    hdr_ptrs: ir.Param
    base_handoff_p: ir.Param | None = None
    prod_ptrs: ir.Param | None = None
    prod_gen_p: ir.Param | None = None
    prod_gen_word: ir.Param | None = None
    scales_ptrs: ir.Param | None = None


def declare_async_params(kb: ir.KernelBuilder, cfg) -> FinalAsyncParams | None:
    """The parameters of ``FinalAsyncParams``, or None without ``ep_final_layout``."""
    if not cfg.ep_final_layout:
        return None
    tables = dict(out_ptrs=kb.param("out_ptrs", T.ptr_global),
                  hdr_ptrs=kb.param("hdr_ptrs", T.ptr_global))
    if cfg.token_fmt.out_scales is not None:
        # the sender writes the scales of its rows into the destination's output scales
        tables["scales_ptrs"] = kb.param("scales_ptrs", T.ptr_global)
    if cfg.ep_prod_reserve:
        return FinalAsyncParams(
            **tables,
            prod_ptrs=kb.param("prod_ptrs", T.ptr_global),
            prod_gen_p=kb.param("prod_gen_p", T.ptr_global, peer=True),
            prod_gen_word=kb.param("prod_gen_word", T.ptr_global))
    return FinalAsyncParams(**tables, base_handoff_p=kb.param("base_handoff_p", T.ptr_global))


def declare_wait_params(kb: ir.KernelBuilder, cfg) -> ir.Param | None:
    """dispatch_wait's ``hdr_p`` (this rank's header array, written by peers), or None
    without ``ep_final_layout``."""
    return kb.param("hdr_p", T.ptr_global, peer=True) if cfg.ep_final_layout else None


def declare_wait_generation(kb: ir.KernelBuilder, cfg) -> ir.Param | None:
    """dispatch_wait's ``prod_gen_word`` (this rank's generation word, which its aux block
    advances: ``advance_generation``), or None without ``ep_prod_reserve``."""
    return kb.param("prod_gen_word", T.ptr_global) if cfg.ep_prod_reserve else None


def _next_generation(last) -> ir.Expr:
    """``last + 1``, skipping 0 (the value of a freshly zeroed tag) when the u32 wraps."""
    nxt = ir.as_expr(last) + 1
    return ir.Select(nxt.eq(0), ir.Const(1, T.u32), nxt)


def call_generation(r: ir.RoleBuilder, fl: FinalAsyncParams) -> ir.Var:
    """This call's generation tag in dispatch_async: the word ``prod_gen_word`` holds the
    last call's (``ld.relaxed.gpu.global.b32``; 0 before the first call), this call's is the
    next (``_next_generation``). Every rank's word advances once per call, so all ranks agree
    on the tag with no host involvement (a captured graph replays unchanged)."""
    last = r.load(fl.prod_gen_word, T.u32, Sem.RELAXED, Scope.GPU, name="prod_gen_last")
    return r.let("prod_gen", _next_generation(last))


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


# ---- dispatch_async: monitor (monitor_and_signal_completion) ---------------------------------
def reserve_rows(r: ir.RoleBuilder, cfg, p, fl: FinalAsyncParams, g, count):
    """Monitor warp of global expert ``g`` (destination ``g // L``, local expert ``g % L``),
    after counting: reserve this source's block of rows on the destination.

    Capacity-strided, lane 0: ``atom.relaxed.sys.global.add.u64`` of ``count`` on the
    destination's cursor ``rc_cursor_base + e`` (skipped when ``count`` is 0), then
    ``st.release.gpu.global.b32`` of ``first_row | FINAL_BASE_VALID`` into the hand-off word
    ``e * R + dst``. Returns the block's offset inside the expert's range (a u32 var).

    ``ep_prod_reserve``, lane 0: ``st.release.sys.global.b64`` of ``count | gen << 32`` into
    the destination's early-count word ``e * R + my_rank``; then, when this rank is the
    destination, the whole warp runs ``reserve_for_sources`` for local expert ``e``. Returns
    None (the block base reaches the comm warps through their mailbox)."""
    lay = cfg.layout
    L, R = lay.n_local_experts, cfg.n_ranks
    dst_rank = r.let("fl_dst_rank", g // L)
    e = r.let("fl_e", g % L)
    dst_p2p = dst_rank % cfg.p2p_world_size
    if cfg.ep_prod_reserve:
        gen = call_generation(r, fl)
        with r.if_(r.lane.eq(0)):
            prod_dst = load_pointer(r, fl.prod_ptrs, dst_p2p, "prod_dst")
            r.store(_word(prod_dst, lay.prod_early_count_offset + e * R + p.my_rank, 8),
                    _tagged(count, gen), Sem.RELEASE, Scope.SYS)
        with r.if_(dst_rank.eq(p.my_rank)):
            reserve_for_sources(r, cfg, p, fl, e, gen)
        return None
    off = r.var("fl_off", T.u32, 0)
    with r.if_(r.lane.eq(0)):
        with r.if_(count > 0):
            rc_dst = load_pointer(r, p.recv_count_ptrs, dst_p2p, "rc_cursor_dst")
            old = r.atomic(AtomOp.ADD, _word(rc_dst, lay.rc_cursor_base + e, 8),
                           count.cast(T.u64), Sem.RELAXED, Scope.SYS, dtype=T.u64,
                           name="cursor_old")
            r.assign(off, old.cast(T.u32))
        first_row = e * (R * cfg.max_tokens_per_rank) + off
        r.store(_word(fl.base_handoff_p, e * R + dst_rank), first_row | FINAL_BASE_VALID,
                Sem.RELEASE, Scope.GPU)
    return off


def reserve_for_sources(r: ir.RoleBuilder, cfg, p, fl: FinalAsyncParams, e, gen):
    """The reserver of local expert ``e`` (``ep_prod_reserve``; the whole monitor warp of
    global expert ``my_rank * L + e``). For each expert ``e2 <= e``, lanes ``< R`` wait
    (bounded, ``ld.acquire.sys.global.b64``) until early-count word ``e2 * R + lane`` carries
    this call's generation; the warp sums each expert (``redux.sync.add``), the padded totals
    of ``e2 < e`` give expert ``e``'s first row, an exclusive scan over sources
    (``shfl.sync.up``) each source's block base. Lane ``src`` writes ``base | gen << 32``
    into mailbox ``e * R + my_rank`` of rank ``src`` (``st.release.sys.global.b64``), an
    empty block's too: every mailbox then holds the last call's tag or this one's, so no
    stale tag can match when the 32-bit generation wraps."""
    lay = cfg.layout
    R, P = cfg.n_ranks, cfg.p2p_world_size
    early = load_pointer(r, fl.prod_ptrs, p.my_rank % P, "early_here")
    start = r.var("rsv_start", T.u32, 0)
    mine = r.var("rsv_mine", T.u32, 0)
    with r.for_range("e2", 0, e + 1) as e2:
        c = r.var("rsv_c", T.u32, 0)
        with r.if_(r.lane < R):
            idx = r.let("rsv_idx", e2 * R + r.lane)
            seen = r.spin_wait(_word(early, lay.prod_early_count_offset + idx, 8), T.u64,
                               CmpOp.EQ, gen, buffer="prod_early_count", index=idx,
                               sem=Sem.ACQUIRE, scope=Scope.SYS, shift=GEN_SHIFT, mask=LOW32,
                               name="early")
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


def count_word(cfg, count, off) -> ir.Expr:
    """The receive-count word the monitor publishes at the end: ``count | off << 32`` in the
    capacity-strided layout (the destination learns where each block landed), else
    ``count``. Never the sentinel (``count <= max_tokens_per_rank``)."""
    if cfg.layout.capacity_strided:
        return count.cast(T.u64) | (off.cast(T.u64) << 32)
    return count.cast(T.u64)


def rearm_handoff(r: ir.RoleBuilder, cfg, fl: FinalAsyncParams, counter_offset):
    """Monitor lane 0, after every comm warp of the block has finished (so has read the
    base): hand-off word back to 0 (plain ``st.global.b32``; capacity-strided only)."""
    if fl.base_handoff_p is not None:
        r.store(_word(fl.base_handoff_p, counter_offset), 0)


# ---- dispatch_async: comm (copy_and_send_tokens) ---------------------------------------------
def stage_source_rank(r: ir.RoleBuilder, cfg, p, msg):
    """Thread 0 of the token's staging: ``my_rank`` into the padding of the message's
    source-index field (``st.global.b32``), so the header carries the source rank."""
    r.store(msg + cfg.token_fmt.src_info_offset + cfg.layout.hdr_src_rank_offset, p.my_rank)


def copy_to_final_row(r: ir.RoleBuilder, cfg, fl: FinalAsyncParams, msg, dst_rank, co, slot):
    """One comm warp, one (token, k): every lane waits (bounded) for the block's first row,
    capacity-strided on the hand-off word ``co`` (``ld.acquire.gpu.global.b32`` until bit 31),
    with ``ep_prod_reserve`` on its mailbox ``co`` (``ld.acquire.sys.global.b64`` until the
    tag is ``prod_gen``); then row ``base + slot`` of the destination: the payload by the
    format's ``copy_msg_to_output_tensor`` step into the destination's grouped output (its
    scales, if any, into the destination's output scales: ``scales_ptrs``; transposed ones
    into the header row, ``hdr_scale_bytes``), and the header fields (``st.global.v4.b32``)
    into its header array. A row past the output is never written (device guard)."""
    lay, fmt = cfg.layout, cfg.token_fmt
    dst_p2p = dst_rank % cfg.p2p_world_size
    if cfg.ep_prod_reserve:
        seen = r.spin_wait(_word(fl.prod_gen_p, co, 8), T.u64, CmpOp.EQ, call_generation(r, fl),
                           buffer="prod_mailbox", index=co, sem=Sem.ACQUIRE, scope=Scope.SYS,
                           shift=GEN_SHIFT, mask=LOW32, name="mailbox")
        base = r.let("row_base", seen.cast(T.u32))
    else:
        seen = r.spin_wait(_word(fl.base_handoff_p, co), T.u32, CmpOp.EQ, 1,
                           buffer="final_base_handoff", index=co, sem=Sem.ACQUIRE,
                           scope=Scope.GPU, shift=31, mask=1, name="handoff")
        base = r.let("row_base", seen & (FINAL_BASE_VALID - 1))
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


def warp_final_rows(r: ir.RoleBuilder, cfg, fl: FinalAsyncParams, co_word, slot, dst_rank,
                    no_slot: int):
    """The warp send path's final rows: lane ``k < K`` holds top-k slot ``k``'s counter
    offset ``co_word`` (``no_slot`` = nothing sent), its ``slot`` and ``dst_rank``. The warp
    waits for each slot's block base in turn, every lane on the same word (bounded, as
    ``copy_to_final_row``: ``ld.acquire.gpu.global.b32`` of the hand-off word, or with
    ``ep_prod_reserve`` ``ld.acquire.sys.global.b64`` of the mailbox), so a wait that gives
    up exits the whole warp; lane ``k`` keeps its base. Returns (output row address, header
    row address, scales address) of lane ``k``'s row ``base + slot`` as u64 vars, 0 when
    nothing is written (no slot, or a row past the output: device guard); the last is the
    row's first scale in the destination's output scales (``out_scale_row_offset``), or in
    its header row where the layout keeps them there (``hdr_scale_bytes``: transposed
    scales, written row-major), and None for a format without output scales."""
    lay, fmt = cfg.layout, cfg.token_fmt
    gen = call_generation(r, fl) if cfg.ep_prod_reserve else None
    base = r.var("row_base", T.u32, 0)
    # the lanes still to serve, lowest first (a data-dependent loop LLVM does not unroll, so
    # the PTX holds one copy of each wait)
    pending = r.var("pending", T.u32, r.ballot(ir.as_expr(co_word).ne(no_slot), name="sent"))
    with r.while_(pending.ne(0)):
        k = lowest_set_bit(r, pending, "k_next")
        r.assign(pending, pending & (pending - 1))
        co = r.shfl(ir.ShflMode.IDX, co_word, k, name="co_k")
        if cfg.ep_prod_reserve:
            seen = r.spin_wait(_word(fl.prod_gen_p, co, 8), T.u64, CmpOp.EQ, gen,
                               buffer="prod_mailbox", index=co, sem=Sem.ACQUIRE,
                               scope=Scope.SYS, shift=GEN_SHIFT, mask=LOW32, name="mailbox")
            value = seen.cast(T.u32)
        else:
            seen = r.spin_wait(_word(fl.base_handoff_p, co), T.u32, CmpOp.EQ, 1,
                               buffer="final_base_handoff", index=co, sem=Sem.ACQUIRE,
                               scope=Scope.GPU, shift=31, mask=1, name="handoff")
            value = seen & (FINAL_BASE_VALID - 1)
        with r.if_(r.lane.eq(k)):
            r.assign(base, value)
    out_addr = r.var("out_addr", T.u64, ir.Const(0, T.u64))
    hdr_addr = r.var("hdr_addr", T.u64, ir.Const(0, T.u64))
    scale_addr = r.var("scale_addr", T.u64, ir.Const(0, T.u64)) \
        if fl.scales_ptrs is not None else None
    with r.if_(ir.as_expr(co_word).ne(no_slot)):
        row = r.let("final_row", base + slot)
        with r.if_(row < lay.max_out_rows):
            dst_p2p = dst_rank % cfg.p2p_world_size
            out = load_pointer(r, fl.out_ptrs, dst_p2p, "out_dst")
            hdr = load_pointer(r, fl.hdr_ptrs, dst_p2p, "hdr_dst")
            r.assign(out_addr, ir.Cast(T.u64, out + row.cast(T.u64) * fmt.out_row_bytes))
            r.assign(hdr_addr, ir.Cast(T.u64, hdr + row.cast(T.u64) * lay.hdr_bytes))
            if scale_addr is not None and lay.hdr_scale_bytes:
                r.assign(scale_addr, hdr_addr + lay.hdr_scales_offset)
            elif scale_addr is not None:
                scales = load_pointer(r, fl.scales_ptrs, dst_p2p, "scales_dst")
                r.assign(scale_addr, ir.Cast(T.u64, scales + fmt.out_scale_row_offset(row)))
    return out_addr, hdr_addr, scale_addr


# ---- dispatch_wait: aux (wait_for_arrivals_and_compute_offsets) -------------------------------
def group_end(cfg, e, incl) -> ir.Expr:
    """``row_offsets[e + 1]``: ``(e + 1) * R * max_tokens_per_rank`` capacity-strided, else the
    inclusive prefix ``incl`` (then padded by the format)."""
    if cfg.layout.capacity_strided:
        return (e + 1) * (cfg.n_ranks * cfg.max_tokens_per_rank)
    return incl


def rearm_cursors(r: ir.RoleBuilder, cfg, recv_count_p):
    """Aux block, after every count word was acquired (so after every source's cursor add):
    thread ``e < L`` stores 0 into cursor ``rc_cursor_base + e`` (plain ``st.global.b64``;
    capacity-strided only; the next call's adds start after this kernel, see the world)."""
    if not cfg.layout.capacity_strided:
        return
    with r.if_(r.tid < cfg.layout.n_local_experts):
        r.store(_word(recv_count_p, cfg.layout.rc_cursor_base + r.tid, 8), ir.Const(0, T.u64))


# ---- dispatch_wait: comm (copy_received_tokens_to_output) ------------------------------------
def copy_received_headers(r: ir.RoleBuilder, kb: ir.KernelBuilder, cfg, p,
                          comm_barrier_id: int = -1):
    """Comm blocks of dispatch_wait under ``ep_final_layout``: the payload is already in
    place, so nothing but ``src_info`` is written. Block ``b`` serves local expert
    ``b % L``: thread 0 waits (bounded, ``ld.acquire.gpu``) for the ready flag and claims
    tiles of one row per thread of the expert's dense range ``[row_offsets[e], + total)``
    (``atom.acquire.gpu.add``); thread ``j`` reads row ``j``'s top-k ids from the header
    array (``ld.global.v4.b32``, 8 ids a vector), finds the slot ``k`` whose id is this
    expert's, and writes ``src_info[row] = (source index, k)`` (``ld.global.u32``,
    ``st.global.v2.b32``). Where the header rows hold the scales (``hdr_scale_bytes``:
    transposed output scales), thread ``j`` leaves its row's header address in shared memory
    (``st.shared.u64``) and, after the tile's barrier, the block writes the tile's scales
    transposed in chunks of up to 128 rows (``emit_copy_tile_scales``: ``ld.global.v4.b32``
    of a row's 16 bytes, ``st.global.b32`` of 32 adjacent rows of one group per warp store).
    The last block to finish lowers the flag. A thread per row, against the warp per row
    it replaced (a dependent load pair per row, per warp, in turn), took the header pass
    from 50-60 us to 14-23 us at prefill (measured on the H200; docs/PERF.md's tuning table).
    The scale chunk is ``cfg.tuning.scale_chunk_rows``."""
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R = lay.n_local_experts, cfg.n_ranks
    rows_per_tile = r.n_threads
    ctr = p.atomic_counter
    vals = kb.shared_buffer("tile_vals", 8)
    tile_rows = kb.shared_buffer("tile_hdr_rows", 8 * rows_per_tile) \
        if lay.hdr_scale_bytes else None
    e = r.let("e", r.block % L)
    g = r.let("g", p.my_rank * L + e)
    wait_ready_flag(r, cfg, ctr, p.err_buf, comm_barrier_id)
    with r.if_(r.tid.eq(0)):
        r.store(vals, r.load(_word(p.row_offsets, e), T.u32, name="expert_start"))
        r.store(vals + 4, r.atomic(AtomOp.ADD, _word(ctr, lay.work_counter_offset + e), 1,
                                   Sem.ACQUIRE, Scope.GPU, name="claim0"))
    comm_sync(r, comm_barrier_id)
    start = r.let("start", r.load(vals, T.u32, name="start_ld"))
    tile = r.let("tile", r.load(vals + 4, T.u32, name="tile_ld"))
    total = r.let("total", r.load(_word(ctr, lay.rank_prefix_offset + e * R + (R - 1)), T.u32,
                                  name="total_ld"))
    with r.while_(ir.Const(1, T.pred)):
        ts = r.let("ts", tile * rows_per_tile)
        with r.if_(ts >= total):
            r.break_()
        n_in_tile = r.let("n_in_tile", (total - ts).min(rows_per_tile))
        _header_row_per_thread(r, cfg, p, start + ts, n_in_tile, g, tile_rows)
        comm_sync(r, comm_barrier_id)
        if tile_rows is not None:
            # the next tile's addresses are stored only after the claim's barrier below
            chunk = math.gcd(rows_per_tile, cfg.tuning.scale_chunk_rows)
            for c in range(0, rows_per_tile, chunk):
                # a chunk past the tile's rows is skipped: the copy's clamped loads need a row
                with r.if_(n_in_tile > c) if c else contextlib.nullcontext():
                    fmt.emit_copy_tile_scales(r, tile_rows + c * 8,
                                              r.let("tile_row0", start + ts + c),
                                              (n_in_tile - c).min(chunk), chunk, r.tid,
                                              r.n_threads, scales_at=lay.hdr_scales_offset)
        with r.if_(r.tid.eq(0)):
            r.store(vals + 4, r.atomic(AtomOp.ADD, _word(ctr, lay.work_counter_offset + e), 1,
                                       Sem.ACQUIRE, Scope.GPU, name="claim"))
        comm_sync(r, comm_barrier_id)
        r.assign(tile, r.load(vals + 4, T.u32, name="tile_next"))
    with r.if_(r.tid.eq(0)):
        old = r.atomic(AtomOp.ADD, _word(ctr, lay.cleanup_counter_offset), 0xFFFFFFFF,
                       Sem.RELAXED, Scope.GPU, name="cleanup_old")
        with r.if_(old.eq(1)):
            r.store(_word(ctr, lay.ready_flag_offset), 0)


def _header_row_per_thread(r: ir.RoleBuilder, cfg, p, row0, n_rows, g, tile_rows):
    """Thread ``j < n_rows``: row ``row0 + j``'s ``src_info`` from its header row (and its
    header address into ``tile_rows[j]``)."""
    lay = cfg.layout
    with r.if_(r.tid < n_rows):
        row = r.let("row", row0 + r.tid)
        hdr = r.let("hdr", p.hdr_p + row.cast(T.u64) * lay.hdr_bytes, peer=True)
        if tile_rows is not None:
            r.store(tile_rows + (r.tid * 8).cast(T.u64), hdr)
        k = _slot_of_expert(r, hdr + lay.hdr_topk_offset, lay.top_k, g)
        with r.if_(k < lay.top_k):
            src_idx = r.load(hdr, T.u32, name="src_idx")
            r.store(_word(p.src_info, row * 2), ir.Pack(T.vec(T.u32, 2), (src_idx, k)))


def _slot_of_expert(r: ir.RoleBuilder, ids_addr, K: int, g) -> ir.Var:
    """The top-k slot (u32) whose uint16 id at ``ids_addr`` is ``g``, or ``K`` when none is:
    the ids as 16-byte vectors (``ld.global.v4.b32``; the field is a multiple of 16 bytes),
    each half-word compared in turn (``selp``)."""
    k = r.var("k_hit", T.u32, K)
    g16 = ir.as_expr(g) & 0xFFFF
    for v in range(-(-K // 8)):
        words = r.load(ids_addr + 16 * v, T.vec(T.u32, 4), name="ids_v")
        for q in range(4):
            word = ir.Extract(words, q)
            for half in range(2):
                slot = 8 * v + 2 * q + half
                if slot >= K:
                    break
                gid = (word >> 16) if half else (word & 0xFFFF)
                r.assign(k, ir.Select(gid.eq(g16), ir.Const(slot, T.u32), k))
    return k


__all__ = ["FinalAsyncParams", "declare_async_params", "declare_wait_params", "reserve_rows",
           "reserve_for_sources", "count_word", "rearm_handoff", "stage_source_rank",
           "copy_to_final_row", "warp_final_rows", "group_end", "rearm_cursors", "copy_received_headers",
           "FINAL_BASE_VALID"]
