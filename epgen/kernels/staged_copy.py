"""dispatch_wait's copy pass of the staged receive buffer (``StagedDestination.copy_pass``,
reference ``copy_received_tokens_to_output``): the copy blocks claim tiles of each local
expert's tokens and move every message from its receive slot into its grouped output row,
writing ``src_info``; optionally publishing each tile's rows on the L1 arrival counters of a
consumer fused next to it (``L1Release``).
"""

from __future__ import annotations

import contextlib

import attrs

import ir
from ir import AtomOp, Scope, Sem
from ir import types as T

from . import trace
from .common import lower_ready_flag_if_last, lowest_set_bit, wait_ready_flag
from .common import comm_sync
from .common import word as _word
from .schedule import claim_next_tile, first_expert, load_expert_tiles


@attrs.frozen
class L1Release:
    """The reference's ``emit_l1_release`` arguments: after each tile's rows have landed, warp
    0 publishes them on expert ``e``'s L1 arrival counter (u32 word ``arrival_ptr + e *
    atomic_pad``), one ``red.release.gpu.global.add.u32`` of ``delta`` per ``token_block``
    tokens (``l1_arrival_ptr``, ``l1_release_token_block``, ``l1_release_atomic_pad``,
    ``l1_release_delta``)."""

    arrival_ptr: object
    token_block: int = 1
    atomic_pad: int = 1
    delta: int = 1

    def check(self, cfg) -> None:
        """``ValueError`` naming the reference parameter and its rule."""
        TT, KS = cfg.token_fmt.dispatch_wait_tile_shape
        token_block, atomic_pad, delta = self.token_block, self.atomic_pad, self.delta
        if self.arrival_ptr is None:
            raise ValueError("emit_l1_release needs l1_arrival_ptr (the L1 arrival counters)")
        if isinstance(token_block, bool) or not isinstance(token_block, int) \
                or token_block < 1 or TT % token_block:
            raise ValueError(f"l1_release_token_block must be a positive divisor of the "
                             f"dispatch_wait tile's {TT} tokens (a token block never straddles "
                             f"two tiles, which different blocks copy), got {token_block!r}")
        if isinstance(atomic_pad, bool) or not isinstance(atomic_pad, int) or atomic_pad < 1:
            raise ValueError(f"l1_release_atomic_pad must be a positive word count, got "
                             f"{atomic_pad!r}")
        if isinstance(delta, bool) or not isinstance(delta, int) or not 1 <= delta < 2**32:
            raise ValueError(f"l1_release_delta must be a u32 in [1, 2**32), got {delta!r}")
        if KS != 1:
            raise ValueError(f"emit_l1_release needs a format whose dispatch_wait tile has one "
                             f"k split (a row lands only when every split is copied), got "
                             f"{cfg.token_fmt.name} with {KS}")


def copy_scratch_bytes(cfg) -> int:
    """Shared scratch bytes of ``copy_staged_messages``: the rank prefixes, the tile values
    and the format's per-tile message addresses (``tile_smem_bytes``)."""
    fmt = cfg.token_fmt
    tile = -(-fmt.tile_smem_bytes(fmt.dispatch_wait_tile_shape[0]) // 16) * 16
    return -(-4 * max(cfg.n_ranks, 1) // 16) * 16 + 16 + tile


def copy_staged_messages(r: ir.RoleBuilder, cfg, p, dest, *,
                         l1_release: L1Release | None = None, scatter_sm_id=None,
                         copy_trace: trace.CopyTrace | None = None):
    """Copy blocks. Thread 0 waits (bounded, ``ld.acquire.gpu``) for the ready flag. Block
    ``b`` starts on expert ``sm_schedule[b]`` and warp 0 claims tiles of 128 of the expert's
    tokens (``atom.acquire.gpu.add`` on its tile counter), moving on to later experts when it
    is exhausted (``schedule.claim_next_tile``). Warp ``w`` of the role copies tile tokens
    ``w, w + n_warps, ...``: the source rank of a token is the lowest lane ``r`` with ``token <
    rank_prefix[r]`` (``vote.sync.ballot``), its message is that of slot ``token -
    prefix[r-1]`` of block ``[e, r]`` (where it lies: ``dest.message_address``, ``dest`` the
    build's destination strategy); lanes ``k < K`` load the header's top-k id ``k`` and
    source index before the format copies the payload (so the two dependent round trips that would
    follow the copy hide behind it; measured neutral on the H200, kept as it costs nothing),
    then the lane whose top-k id is this expert writes ``src_info[row] = (source index, k)``.
    A format that copies scales per tile (``copies_scales_per_tile``: transposed scales) gets
    each message's address in the role's scratch (lane 0, ``st.shared.u64``) and, after the
    tile's barrier, the whole role copies the tile's scales (``emit_copy_tile_scales``). The
    last block to finish lowers the flag. With ``fused_shared_expert`` expert ``e``'s rows
    start at ``row_offsets[e + 1]``.

    The role's context (``kb.role``) gives the thread range, the barrier (``comm_sync``) and
    where the scratch (``copy_scratch_bytes``) lives. ``l1_release``: after each tile's rows
    have landed (the role's barrier), warp 0 publishes them (``L1Release``; the last token
    block of an expert may be partial), so expert ``e``'s counter ends at ``delta *
    ceil(count_e / token_block)``. ``scatter_sm_id`` (a u32 IR value, default the block
    index): the block's index among the copy blocks, which picks its entry of the SM
    schedule. ``copy_trace`` (``trace.CopyTrace``): ``copy.flag_seen`` in each warp,
    ``copy.tile`` for each of warp 0's claims and, with its ``scatter_release``,
    ``copy.l1_release`` before each L1 release."""
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R, K = lay.n_local_experts, cfg.n_ranks, lay.top_k
    se = int(bool(cfg.fused_shared_expert))
    TT, KS = fmt.dispatch_wait_tile_shape
    copy_trace = trace.CopyTrace() if copy_trace is None else copy_trace
    ring = copy_trace.ring()
    if l1_release is not None:
        l1_release.check(cfg)
    n_warps = r.n_threads // 32
    ctr = p.atomic_counter
    prefix = r.scratch("rank_prefix", 4 * max(R, 1))
    vals = r.scratch("tile_vals", 16)          # [start row, tile id, expert (L: done)]
    tile_msgs = r.scratch("tile_msgs", fmt.tile_smem_bytes(TT)) \
        if fmt.copies_scales_per_tile else None
    wait_ready_flag(r, cfg, ctr, p.err_buf)
    ring.stamp(r, "copy.flag_seen")
    dest.start_copies(r, expand=l1_release is None)
    # warp 0's claim state (registers; meaningful in warp 0 only)
    cur_e = r.var("cur_e", T.u32, L)
    cur_tiles = r.var("cur_tiles", T.u32, 0)
    claim = r.var("claim", T.u32, 0)
    loaded_e = r.var("loaded_e", T.u32, L)
    with r.if_(r.warp.eq(0)):
        r.assign(cur_e, first_expert(r, cfg, ctr, scatter_sm_id).min(L))
        with r.if_(cur_e < L):
            r.assign(cur_tiles, load_expert_tiles(r, cfg, ctr, cur_e))
    with r.while_(ir.Const(1, T.pred)):
        with r.if_(r.warp.eq(0)):
            claim_next_tile(r, cfg, ctr, cur_e, cur_tiles, claim)
            if ring.enabled:
                with r.if_(cur_e < L):
                    ring.stamp(r, "copy.tile", (cur_e.cast(T.u64) << 32) | claim.cast(T.u64))
            with r.if_((cur_e < L) & cur_e.ne(loaded_e)):
                with r.if_(r.lane < R):
                    r.store(_word(prefix, r.lane),
                            r.load(_word(ctr, lay.rank_prefix_offset + cur_e * R + r.lane),
                                   T.u32, name="pfx"))
                with r.if_(r.lane.eq(0)):
                    first_row = _word(p.row_offsets, cur_e + se if se else cur_e)
                    r.store(vals, r.load(first_row, T.u32, name="expert_start"))
                r.assign(loaded_e, cur_e)
            with r.if_(r.lane.eq(0)):
                r.store(vals + 4, claim)
                r.store(vals + 8, cur_e)
        comm_sync(r)
        e = r.let("e", r.load(vals + 8, T.u32, name="e_ld"))
        with r.if_(e >= L):
            r.break_()
        g = r.let("g", p.my_rank * L + e)
        start = r.let("start", r.load(vals, T.u32, name="start_ld"))
        tile = r.let("tile", r.load(vals + 4, T.u32, name="tile_ld"))
        total = r.let("total", r.load(_word(prefix, R - 1), T.u32, name="total_ld"))
        ts = r.let("ts", (tile // KS if KS > 1 else tile) * TT)
        n_in_tile = r.let("n_in_tile", (total - ts).min(TT))
        with r.for_range("j", r.warp, n_in_tile, n_warps) as j:
            tok = r.let("tok", ts + j)
            mine = r.var("below", T.pred, ir.Const(0, T.pred))
            with r.if_(r.lane < R):
                r.assign(mine, tok < r.load(_word(prefix, r.lane), T.u32, name="pfx_l"))
            src_rank = lowest_set_bit(r, r.ballot(mine, name="below_mask"), "src_rank")
            base_r = r.var("base_r", T.u32, 0)
            with r.if_(src_rank > 0):
                r.assign(base_r, r.load(_word(prefix, src_rank - 1), T.u32, name="base_ld"))
            token = dest.message_token(r, e, src_rank, tok - base_r)
            msg = r.let("msg", dest.message_address(r, e, src_rank, tok - base_r, token),
                        peer=lay.crosses_devices)
            row = r.let("row", start + tok)
            gid = r.var("gid16", T.u16, ir.Const(0xFFFF, T.u16))
            src_idx = r.var("src_idx", T.u32, 0)
            with r.if_(r.lane < K):
                r.assign(gid, r.load(msg + fmt.topk_info_offset + (r.lane * 2).cast(T.u64),
                                     T.u16, name="gid16_ld"))
                r.assign(src_idx, r.load(msg + fmt.src_info_offset, T.u32, name="src_idx_ld"))
            if tile_msgs is not None:
                with r.if_(r.lane.eq(0)):
                    r.store(tile_msgs + (j * 8).cast(T.u64), msg)
            extras = {"scales": False} if fmt.copies_scales_per_tile else {}
            rows, copies = dest.output_rows(r, e, src_rank, token, row, gid,
                                            expand=l1_release is None)
            with r.if_(copies) if copies is not None else contextlib.nullcontext():
                fmt.emit_copy_msg_to_output(r, msg, rows, p.output_tokens, **extras)
            with r.if_((r.lane < K) & gid.eq(g.cast(T.u16))):
                r.store(_word(p.src_info, row * 2), src_idx)
                r.store(_word(p.src_info, row * 2 + 1), r.lane)
                dest.record_row(r, src_rank, src_idx, r.lane, row)
        comm_sync(r)
        if fmt.copies_scales_per_tile:
            # the next tile's addresses are stored only after warp 0's claim barrier
            fmt.emit_copy_tile_scales(r, tile_msgs, r.let("tile_row0", start + ts), n_in_tile,
                                      TT, r.tid, r.n_threads)
            if l1_release is not None:
                comm_sync(r)
        if l1_release is not None:
            emit_l1_arrival_release(r, l1_release, e, n_in_tile,
                                    ring if copy_trace.scatter_release else trace.NullTrace(),
                                    ts // l1_release.token_block)
    with r.if_(r.tid.eq(0)):
        lower_ready_flag_if_last(r, cfg, ctr)


def emit_l1_arrival_release(r: ir.RoleBuilder, l1: L1Release, e, n_in_tile,
                            ring=trace.NullTrace(), first_block=0):
    """Warp 0, after the barrier that follows a tile's copy: ``ceil(n_in_tile /
    l1.token_block)`` ``red.release.gpu.global.add.u32`` of ``l1.delta`` on expert ``e``'s L1
    arrival counter (u32 word ``e * l1.atomic_pad``), one per token block, spread over the
    lanes; each lane stamps ``copy.l1_release`` on ``ring`` just before each of its releases
    (payload: ``e << 32`` and the expert's token block, ``first_block`` that of the tile's
    first)."""
    token_block = l1.token_block
    n_rel = (n_in_tile + (token_block - 1)) // token_block if token_block > 1 else n_in_tile
    with r.if_(r.warp.eq(0)):
        with r.for_range("l1_rel", r.lane, n_rel, 32) as i:
            if ring.enabled:    # before the release: no consumer can precede the stamp
                ring.stamp(r, "copy.l1_release", (e.cast(T.u64) << 32)
                           | (first_block + i).cast(T.u64), leader=False)
            r.red(AtomOp.ADD, _word(l1.arrival_ptr, e * l1.atomic_pad), l1.delta, Sem.RELEASE,
                  Scope.GPU)


__all__ = ["L1Release", "copy_staged_messages", "copy_scratch_bytes",
           "emit_l1_arrival_release"]
