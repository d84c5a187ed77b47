"""dispatch_wait's copy pass under ``ep_final_layout`` (``FinalRowsDestination.copy_pass``):
the payload is already in its output row, so the copy blocks only build ``src_info`` from the
header rows the sources wrote (and, for transposed output scales, write the scales the header
rows carry), a thread per row.
"""

from __future__ import annotations

import contextlib
import math

import ir
from ir import AtomOp, Scope, Sem
from ir import types as T

from .common import comm_sync, lower_ready_flag_if_last, wait_ready_flag
from .common import word as _word


def header_scratch_bytes(cfg, n_threads: int) -> int:
    """The scratch of ``copy_headers`` on a role of ``n_threads`` threads: the tile values,
    and with header-row scales (``hdr_scale_bytes``) a header address per row of a tile (one
    row per thread)."""
    return 16 + (8 * n_threads if cfg.layout.hdr_scale_bytes else 0)


def copy_headers(r: ir.RoleBuilder, cfg, p, hdr_p):
    """Copy blocks of dispatch_wait (``p``: its parameters, ``hdr_p`` this rank's header
    array). Block ``b`` serves local expert ``b % L``: thread 0 waits (bounded,
    ``ld.acquire.gpu``) for the ready flag and claims tiles of one row per thread of the
    expert's dense range ``[row_offsets[e], + total)`` (``atom.acquire.gpu.add``); thread
    ``j`` reads row ``j``'s top-k ids from the header array (``ld.global.v4.b32``, 8 ids a
    vector), finds the slot ``k`` whose id is this expert's, and writes ``src_info[row] =
    (source index, k)`` (``ld.global.u32``, ``st.global.v2.b32``). Where the header rows hold
    the scales (``hdr_scale_bytes``: transposed output scales), thread ``j`` leaves its row's
    header address in the role's scratch (``st.shared.u64``) and, after the tile's barrier,
    the block writes the tile's scales transposed in chunks of up to 128 rows
    (``emit_copy_tile_scales``: ``ld.global.v4.b32`` of a row's 16 bytes, ``st.global.b32`` of
    32 adjacent rows of one group per warp store). The last block to finish lowers the flag.
    The role's context gives its threads, its barrier (``comm_sync``) and where its scratch
    (``header_scratch_bytes``) lives. A thread per row, against the warp per row it replaced
    (a dependent load pair per row, per warp, in turn), took the header pass from 50-60 us to
    14-23 us at prefill (measured on the H200; docs/PERF.md's tuning table). The scale chunk
    is ``cfg.tuning.scale_chunk_rows``."""
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R = lay.n_local_experts, cfg.n_ranks
    rows_per_tile = r.n_threads
    ctr = p.atomic_counter
    vals = r.scratch("tile_vals", 8)
    tile_rows = r.scratch("tile_hdr_rows", 8 * rows_per_tile) if lay.hdr_scale_bytes else None
    e = r.let("e", r.block % L)
    g = r.let("g", p.my_rank * L + e)
    wait_ready_flag(r, cfg, ctr, p.err_buf)
    with r.if_(r.tid.eq(0)):
        r.store(vals, r.load(_word(p.row_offsets, e), T.u32, name="expert_start"))
        r.store(vals + 4, r.atomic(AtomOp.ADD, _word(ctr, lay.work_counter_offset + e), 1,
                                   Sem.ACQUIRE, Scope.GPU, name="claim0"))
    comm_sync(r)
    start = r.let("start", r.load(vals, T.u32, name="start_ld"))
    tile = r.let("tile", r.load(vals + 4, T.u32, name="tile_ld"))
    total = r.let("total", r.load(_word(ctr, lay.rank_prefix_offset + e * R + (R - 1)), T.u32,
                                  name="total_ld"))
    with r.while_(ir.Const(1, T.pred)):
        ts = r.let("ts", tile * rows_per_tile)
        with r.if_(ts >= total):
            r.break_()
        n_in_tile = r.let("n_in_tile", (total - ts).min(rows_per_tile))
        _header_row_per_thread(r, cfg, p, hdr_p, start + ts, n_in_tile, g, tile_rows)
        comm_sync(r)
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
        comm_sync(r)
        r.assign(tile, r.load(vals + 4, T.u32, name="tile_next"))
    with r.if_(r.tid.eq(0)):
        lower_ready_flag_if_last(r, cfg, ctr)


def _header_row_per_thread(r: ir.RoleBuilder, cfg, p, hdr_p, row0, n_rows, g, tile_rows):
    """Thread ``j < n_rows``: row ``row0 + j``'s ``src_info`` from its header row (and its
    header address into ``tile_rows[j]``)."""
    lay = cfg.layout
    with r.if_(r.tid < n_rows):
        row = r.let("row", row0 + r.tid)
        hdr = r.let("hdr", hdr_p + row.cast(T.u64) * lay.hdr_bytes, peer=True)
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


__all__ = ["copy_headers", "header_scratch_bytes"]
