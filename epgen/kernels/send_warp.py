"""The warp send path (``warp_broadcast_tokens``, the stock one): each warp reads a token once
and stores it from registers to its ``K`` destinations, no block-wide join; with
``send_warps_per_token`` > 1 a group of warps shares each token (``token_group_sync``).
"""

from __future__ import annotations

import functools

import ir
from ir import AtomOp, CacheHint, Scope, Sem, ShflMode
from ir import types as T

from .common import send_sm
from .common import word as _word
from .send_policy import TOKEN_GROUP_BARRIER_BASE
from .staged import NO_SLOT


def token_group_sync(r: ir.RoleBuilder, group, token_warps: int):
    """``bar.sync <id>, <32 token_warps>`` on the barrier of the warp's token group ``group``
    (a warp-uniform u32): one ``NamedBarrier(group=True)`` per group of the role's warps,
    ids from ``TOKEN_GROUP_BARRIER_BASE``, each under its own branch."""
    n_groups = r.n_threads // 32 // token_warps
    for i in range(n_groups):
        bar = r.barrier(f"token_group{i}", TOKEN_GROUP_BARRIER_BASE + i, 32 * token_warps,
                        group=True)
        with r.if_(group.eq(i)):
            r.bar_sync(bar)


def warp_broadcast_tokens(r: ir.RoleBuilder, cfg, p, first_block: int,
                          token_warps: int = 1, sm_id=None, n_active_send_sms=None):
    """The stock P2P send path: each warp sends its tokens alone, no block-wide join, so
    each block has as many tokens in flight as it has warps. The sending warps are those of
    blocks ``[first_block, grid)`` (0 when the monitor blocks send too), numbered
    block-fastest (``warp * n_send_blocks + block``: a few tokens still reach every block);
    warp ``w`` takes tokens ``w, w + n_send_warps, ...`` in rounds of ``min(32 // K, 4)``, one top-k
    slot per lane. Per round:

    - lane ``l < rounds * K`` holds slot ``l % K`` of the round's token ``l // K``: it loads
      ``topk_ids[t, k]``, reserves the slot's row on its destination
      (``p.dest.reserve_slot``: ``atom.relaxed.gpu.add`` on the reserved counter) and
      computes its address (0 when
      nothing is sent: ``skip_a2a`` on another device, or a slot past the block capacity);
      the round's atomics are in flight together;
    - each lane writes its destination's message header (source index, the token's ``K``
      ids gathered by ``shfl.sync.idx``, zero padding: ``st.global.v4.b32``);
    - per token of the round, the ``K`` addresses reach every lane by ``shfl.sync.idx`` and
      the format reads the token once, lane-strided (``ld.global.nc.v4.b32``, several in
      flight), and stores each piece to every destination (``K`` x ``st.global``), from
      registers: the token never visits the send buffer or shared memory;
    - ``bar.warp.sync``, then each lane counts its copy finished (``red.release.gpu.add``,
      as the stock fan-out does after its warp copy): one release per round, not per token.

    Where the rows go is the build's destination strategy (``p.dest``): the staged
    receive buffer's messages, or with ``ep_final_layout`` the final output rows
    (``FinalRowsDestination.warp_rows`` waits for each slot's block base), each lane then
    writing its header row, source rank included, into the destination's header array.

    With ``token_warps`` ``n > 1`` (``send_warps_per_token``) a group of ``n`` adjacent
    warps of a block takes the place of each warp above (groups numbered block-fastest):
    the group's first warp (part 0) reserves the slots and writes the headers, leaves the
    addresses and counter offsets in shared memory, and a group barrier
    (``token_group_sync``) hands them to the other parts; each part then moves its share of
    each token (``part=(index, n)`` of the format's broadcast) and counts its share of each
    copy finished, so a copy's finished counter gains ``n`` (the monitor waits for ``n``
    times its count: ``signal_completion``); a second group barrier ends the round before
    part 0 writes the next round's addresses.

    Same slots, counters and completion as ``copy_and_send_tokens``."""
    lay, fmt = cfg.layout, cfg.token_fmt
    E, L, K = cfg.n_experts, lay.n_local_experts, lay.top_k
    dest = p.dest
    finished = _word(p.counters, E)
    warps = r.n_threads // 32
    split = token_warps > 1
    if split and (warps % token_warps or not dest.shares_tokens):
        raise ValueError(f"token_warps={token_warps} must divide the role's {warps} warps, "
                         f"and the final layout keeps one warp per token")
    per_round = min(32 // K, 4)               # tokens per round: one top-k slot per lane
    sm, n_active = send_sm(r, first_block, sm_id, n_active_send_sms)
    n_send_blocks = r.let("n_send_blocks", n_active)
    # block-fastest numbering: few tokens (decode) still spread over every sending block
    if split:
        part = r.let("token_part", r.warp % token_warps)
        group = r.let("token_group", r.warp // token_warps)
        n_send_warps = r.let("n_send_groups", n_send_blocks * (warps // token_warps))
        first = r.let("first_token", group * n_send_blocks + sm)
    else:
        n_send_warps = r.let("n_send_warps", n_send_blocks * warps)
        first = r.let("first_token", r.warp * n_send_blocks + sm)
    lane_tok = r.let("lane_tok", r.lane // K)
    with r.for_range("t0", first, p.n_tokens, n_send_warps * per_round) as t0:
        t = r.let("t", t0 + lane_tok * n_send_warps)     # the token of this lane's slot
        g = r.var("g", T.u32, 0)
        addr = r.var("dst_addr", T.u64, ir.Const(0, T.u64))
        co_word = r.var("co_word", T.u32, NO_SLOT)
        slot = r.var("slot", T.u32, 0)
        dst_rank = r.var("dst_rank", T.u32, 0)
        reserves = (r.lane < per_round * K) & (t < p.n_tokens)
        with r.if_(reserves & part.eq(0) if split else reserves):
            r.assign(g, r.load(_word(p.topk_ids, t * K + r.lane % K), T.u32,
                               cache=CacheHint.NC, name="g_ld"))
            r.assign(dst_rank, g // L)
            dest.reserve_slot(r, g, dst_rank, co_word, slot, addr, token=(t, r.lane % K))
        # the header row (the message's own, or the final layout's), and the scales' place
        hdr, src_rank, scale_addr = dest.warp_rows(r, co_word, slot, dst_rank, addr)
        ids = [r.shfl(ShflMode.IDX, g, lane_tok * K + k, name=f"id{k}") for k in range(K)]
        with r.if_(addr.ne(ir.Const(0, T.u64))):
            write_header(r, fmt, ir.Cast(T.ptr_global, hdr), t, ids, src_rank)
        # the round's tokens: a data-dependent trip count, so LLVM keeps one copy of the
        # broadcast loop (code size and compile time) instead of unrolling per token
        n_in_round = r.let("n_in_round", ((p.n_tokens - t0 - 1) // n_send_warps + 1)
                           .min(per_round))
        if split:      # part 0's addresses and counter offsets, to the group's other warps
            table = r.scratch("send_dsts", 8 * r.n_threads)
            cos = r.scratch("send_cos", 4 * r.n_threads)
            with r.if_(part.eq(0)):
                r.store(table + (r.tid * 8).cast(T.u64), addr)
                r.store(_word(cos, r.tid), co_word)
            token_group_sync(r, group, token_warps)
            lead = r.let("lead_lane", (r.warp - part) * 32 + r.lane)
            r.assign(co_word, r.load(_word(cos, lead), T.u32, name="co_lead"))
            warp_dsts = r.let("warp_dsts", table + ((r.warp - part) * 256).cast(T.u64))
        else:
            table = r.scratch("send_dsts", 8 * r.n_threads)
            r.store(table + (r.tid * 8).cast(T.u64), addr)
            if scale_addr is not None:
                scale_table = r.scratch("send_scale_dsts", 8 * r.n_threads)
                r.store(scale_table + (r.tid * 8).cast(T.u64), scale_addr)
                warp_scale_dsts = r.let("warp_scale_dsts",
                                        scale_table + (r.warp * 256).cast(T.u64))
            r.warp_sync()
            warp_dsts = r.let("warp_dsts", table + (r.warp * 256).cast(T.u64))
        with r.for_range("q", 0, n_in_round, 1) as q:
            tq = r.let("tq", t0 + q * n_send_warps)
            scales = {}
            # fetched at each use: nothing held across the loop
            dsts = [functools.partial(load_dst, r, warp_dsts, q * K + k) for k in range(K)]
            if scale_addr is not None:
                scales["scale_dsts"] = [functools.partial(load_dst, r, warp_scale_dsts,
                                                          q * K + k) for k in range(K)]
            src = p.input_tokens + tq.cast(T.u64) * fmt.input_row_bytes
            if scales:     # transposed scales go row-major into the header rows
                scales["scales_row_major"] = bool(cfg.layout.hdr_scale_bytes)
            if split:
                fmt.emit_broadcast_token(r, src, dsts, part=(part, token_warps),
                                         tuning=cfg.tuning)
            else:
                fmt.emit_broadcast_token(r, src, dsts, tuning=cfg.tuning, **scales)
        r.warp_sync()
        with r.if_(co_word.ne(NO_SLOT)):
            r.red(AtomOp.ADD, _word(finished, co_word), 1, Sem.RELEASE, Scope.GPU)
        if split:      # every part is done with the round's table before part 0 rewrites it
            token_group_sync(r, group, token_warps)


def load_dst(r: ir.RoleBuilder, warp_dsts, index) -> ir.Var:
    """Destination ``index`` of the warp's round: the u64 its lane ``index`` left in shared
    memory (``ld.shared.u64``). The warp send path keeps each round's destinations there
    instead of holding the ``K`` addresses in registers through the token's loop: under the
    64-register cap of two co-resident 512-thread blocks this removes the quantising formats'
    spills (ptxas: 20-28 bytes -> 0); BF16 measures the same either way on the H200."""
    return r.load(warp_dsts + (index * 8).cast(T.u64), T.u64, name="dst")


def write_header(r: ir.RoleBuilder, fmt, hdr, t, ids, src_rank=None):
    """One thread writes a message header at ``hdr`` (the src field's address: a message's
    ``src_info_offset``, or a final-layout header row): the source index ``t`` and, when
    given, ``src_rank`` (at ``hdr_src_rank_offset``, 4) in the src field, the ``uint16``
    top-k ids (``ids``, u32 expressions) in the topk field, padding zero; as
    ``st.global.v4.b32`` when the fields are 16-byte multiples (else ``st.global.b32``)."""
    zero = ir.Const(0, T.u32)
    src_words = [ir.as_expr(t)] + [zero] * (fmt.src_info_size // 4 - 1)
    if src_rank is not None:
        src_words[1] = ir.as_expr(src_rank)
    id_words = []
    for j in range(fmt.topk_info_size // 4):
        pair = ids[2 * j:2 * j + 2]
        if not pair:
            id_words.append(zero)
        else:
            lo = ir.as_expr(pair[0]) & 0xFFFF
            id_words.append(lo | (ir.as_expr(pair[1]) << 16) if len(pair) == 2 else lo)
    topk_at = fmt.topk_info_offset - fmt.src_info_offset
    for base, words in ((0, src_words), (topk_at, id_words)):
        step = 4 if len(words) % 4 == 0 and base % 16 == 0 else 1
        for j in range(0, len(words), step):
            value = (words[j] if step == 1
                     else ir.Pack(T.vec(T.u32, 4), tuple(words[j:j + 4])))
            r.store(hdr + (base + 4 * j), value)


__all__ = ["warp_broadcast_tokens", "token_group_sync", "load_dst", "write_header"]
