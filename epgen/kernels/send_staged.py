"""The block-staged send paths: the block stages a token, joins (``send_join``), then sends
it. ``broadcast_tokens`` (shared-memory staging as a two-buffer pipeline: the staged
variants' prefill path and ``ep_send_join_named``'s) and ``send_buffer_tokens`` (the send
buffer and a warp per destination: the role split, the shared expert, and the final layout
of formats whose scale rows the warp path cannot write).
"""

from __future__ import annotations

import ir
from ir import AtomOp, CacheHint, Scope, Sem
from ir import types as T

from .common import VEC, comm_sync, send_sm
from .common import word as _word
from .shmem_send import complete_remote_puts, issued_flag
from .staged import NO_SLOT


def send_buffer_tokens(r: ir.RoleBuilder, cfg, p, n_signal_sms: int, sm_id=None,
                       n_active_send_sms=None):
    """The send-buffer path of ``copy_and_send_tokens`` (the role split, the shared expert,
    the final layout of formats the warp path cannot write). Comm blocks: block-strided
    over tokens. All threads stage token ``t`` (payload by the
    format, then the header: source index and top-k ids) in send-buffer row ``t``, join
    (``send_join``), then warp ``k`` (strided) reserves a slot on destination expert
    ``topk_ids[t, k]`` (lane 0's ``p.dest.take_slot``: ``atom.relaxed.gpu.add``), copies the
    message to the destination's receive buffer with 16-byte stores, and counts the copy
    finished with ``red.release.gpu.add``. Which slots it takes and where the copy goes is
    the destination strategy's (``p.dest``: ``slot_counter``, ``stage_source``,
    ``copy_message``): with ``ep_final_layout`` the header also carries the source rank and
    the copy goes straight to the destination's output row and header row. With
    ``ep_copy_role_split`` (when its geometry qualifies) the format's copy runs on the
    copy-role threads only and just the publisher warps fan out (``fan_out_slots``);
    ``ep_send_join_named`` moves the join to ``bar.sync 3, <threads>``.
    Under ``skip_a2a`` destinations other than ``my_rank`` are skipped and only this device's
    own receive buffer (pointer-table entry 0) is written. With an NVSHMEM destination
    (``cfg.needs_shmem``) the warp that owns a top-k slot whose destination is outside the
    P2P group puts the staged message there instead (``p.dest.put_slot_to_remote``, the
    staged layout's ``shmem_send.put_to_remote``: a warp-wide put-with-signal, then the
    finished count), and after its last token completes its puts with one quiet
    (``shmem_send.complete_remote_puts``)."""
    lay, fmt = cfg.layout, cfg.token_fmt
    L, K = lay.n_local_experts, lay.top_k
    dest = p.dest
    split = active_role_split(r, cfg)
    sm, n_active = send_sm(r, n_signal_sms, sm_id, n_active_send_sms)
    n_comm = r.let("n_comm", n_active)
    issued = issued_flag(r) if cfg.needs_shmem else None
    with r.for_range("t", sm, p.n_tokens, n_comm) as t:
        msg = r.let("msg", p.send_buf_p + t.cast(T.u64) * lay.send_buf_row_bytes)
        src_row = p.input_tokens + t.cast(T.u64) * fmt.input_row_bytes
        if split is None:
            fmt.emit_copy_token_to_send_buf(r, src_row, msg, r.tid, r.n_threads)
        else:
            fmt.emit_copy_token_to_send_buf_split(r, src_row, msg, r.tid, split)
        with r.if_(r.tid < K):
            gid = r.load(_word(p.topk_ids, t * K + r.tid), T.u32, cache=CacheHint.NC, name="gid")
            r.store(msg + fmt.topk_info_offset + (r.tid * 2).cast(T.u64), gid.cast(T.u16))
            dest.stage_slot(r, msg, t, r.tid)
        with r.if_(r.tid.eq(0)):
            r.store(msg + fmt.src_info_offset, t)
            dest.stage_source(r, msg)
        send_join(r, cfg)
        k_first, k_step = fan_out_slots(r, cfg, split)
        with r.for_range("k", k_first, K, k_step) as k:
            g = r.load(_word(p.topk_ids, t * K + k), T.u32, cache=CacheHint.NC, name="g")
            dst_rank = r.let("dst_rank", g // L)
            e = r.let("e", g % L)
            dest.send_slot(r, msg, t, k, g, dst_rank, e)
            if cfg.needs_shmem:
                dest.put_slot_to_remote(r, msg, t, k, g, dst_rank, e, issued)
    if cfg.needs_shmem:
        complete_remote_puts(r, issued)


def stage_token(r: ir.RoleBuilder, cfg, p, t, msg, dsts, cos):
    """The whole block stages token ``t`` in the shared message ``msg`` (the format's payload,
    then its header: threads ``k < K`` write top-k id ``k``, reserve slot ``k``'s row
    (``p.dest.reserve_slot``) and leave its address in ``dsts[k]`` and its counter in
    ``cos[k]``,
    thread 0 the source index)."""
    fmt, K, L = cfg.token_fmt, cfg.layout.top_k, cfg.layout.n_local_experts
    src_row = p.input_tokens + t.cast(T.u64) * fmt.input_row_bytes
    fmt.emit_copy_token_to_send_buf(r, src_row, msg, r.tid, r.n_threads)
    with r.if_(r.tid < K):
        g = r.load(_word(p.topk_ids, t * K + r.tid), T.u32, cache=CacheHint.NC, name="g")
        r.store(msg + fmt.topk_info_offset + (r.tid * 2).cast(T.u64), g.cast(T.u16))
        dst_rank = r.let("dst_rank", g // L)
        addr = r.var("dst_addr", T.u64, ir.Const(0, T.u64))
        co_word = r.var("co_word", T.u32, NO_SLOT)
        p.dest.reserve_slot(r, g, dst_rank, co_word, r.var("slot", T.u32, 0), addr,
                            token=(t, r.tid))
        r.store(_word(dsts, r.tid, 8), addr)
        r.store(_word(cos, r.tid), co_word)
    with r.if_(r.tid.eq(0)):
        r.store(msg + fmt.src_info_offset, t)


def prefetch_topk_id(r: ir.RoleBuilder, cfg, p, t) -> ir.Var:
    """The prefetching pipeline (``splits_staging`` formats): threads ``k < K`` load top-k
    id ``k`` of token ``t`` (when
    ``t < n_tokens``) into a u32 var that ``begin_staging`` consumes and reloads."""
    K = cfg.layout.top_k
    g = r.var("g_ahead", T.u32, 0)
    with r.if_((r.tid < K) & (t < p.n_tokens)):
        r.assign(g, r.load(_word(p.topk_ids, t * K + r.tid), T.u32, cache=CacheHint.NC,
                           name="g_pf"))
    return g


def begin_staging(r: ir.RoleBuilder, cfg, p, t, n_comm, g_ahead):
    """The prefetching pipeline (``splits_staging`` formats: BF16): ``stage_token`` for token
    ``t`` in two halves around the current token's broadcast, so the round trips of the
    input loads and reservations that preceded each broadcast run under it (measured on the
    H200 at prefill, ``ep_send_join_named`` BF16 round trip 0.802 -> 0.822 of copy;
    docs/PERF.md's tuning table). Now: the block's loads of ``t``'s input row (row ``min(t,
    n_tokens - 1)``: always a valid address), and threads ``k < K`` reserve slot ``k``
    (``p.dest.reserve_slot``) with the top-k id ``g_ahead`` holds, then load the id of
    token ``t + n_comm`` into it. Returns ``finish(msg, dsts, cos)``: when ``t < n_tokens``, the payload
    stores, the header's top-k ids and source index, the destinations and counters, as
    ``stage_token`` leaves them."""
    fmt, K, L = cfg.token_fmt, cfg.layout.top_k, cfg.layout.n_local_experts
    live = r.let("stage_live", t < p.n_tokens)
    row = r.let("stage_row", t.min(p.n_tokens - 1))
    store_payload = fmt.emit_stage_loads(r, p.input_tokens + row.cast(T.u64)
                                         * fmt.input_row_bytes, r.tid, r.n_threads)
    g = r.let("g_next", g_ahead)
    addr = r.var("dst_addr", T.u64, ir.Const(0, T.u64))
    co_word = r.var("co_word", T.u32, NO_SLOT)
    with r.if_(live & (r.tid < K)):
        p.dest.reserve_slot(r, g, r.let("dst_rank", g // L), co_word,
                            r.var("slot", T.u32, 0), addr, token=(t, r.tid))
        after = r.let("t_after", t + n_comm)
        with r.if_(after < p.n_tokens):
            r.assign(g_ahead, r.load(_word(p.topk_ids, after * K + r.tid), T.u32,
                                     cache=CacheHint.NC, name="g_pf"))

    def finish(msg, dsts, cos):
        with r.if_(live):
            store_payload(msg)
            with r.if_(r.tid < K):
                r.store(msg + fmt.topk_info_offset + (r.tid * 2).cast(T.u64), g.cast(T.u16))
                r.store(_word(dsts, r.tid, 8), addr)
                r.store(_word(cos, r.tid), co_word)
            with r.if_(r.tid.eq(0)):
                r.store(msg + fmt.src_info_offset, t)
    return finish


def broadcast_staged_token(r: ir.RoleBuilder, cfg, msg, dsts):
    """Every thread stores its 16-byte vectors of the staged message ``msg`` to each non-zero
    destination of ``dsts`` (``ld.shared.v4`` then ``K`` x ``st.global.v4``)."""
    K, msg_bytes = cfg.layout.top_k, cfg.layout.msg_bytes
    targets = [r.load(_word(dsts, k, 8), T.u64, name=f"dst{k}") for k in range(K)]
    with r.for_range("v", r.tid, msg_bytes // 16, r.n_threads) as v:
        x = r.load(msg + v.cast(T.u64) * 16, VEC, name="vec")
        for dst in targets:
            with r.if_(dst.ne(ir.Const(0, T.u64))):
                r.store(ir.Cast(T.ptr_global, dst + v.cast(T.u64) * 16), x)


def count_staged_copies(r: ir.RoleBuilder, cfg, p, cos):
    """After the join that follows a broadcast: threads ``k < K`` count copy ``k`` finished
    (``red.release.gpu.add``; the barrier orders every thread's stores before it)."""
    finished = _word(p.counters, cfg.n_experts)
    with r.if_(r.tid < cfg.layout.top_k):
        co = r.load(_word(cos, r.tid), T.u32, name="co_done")
        with r.if_(co.ne(NO_SLOT)):
            r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)


def broadcast_tokens_pipelined(r: ir.RoleBuilder, cfg, p, n_signal_sms: int, sm_id=None,
                               n_active_send_sms=None):
    """``broadcast_tokens`` as a two-stage pipeline on two shared buffers, one send join per
    token (measured on the H200 at prefill against three joins per token, one buffer:
    ``ep_send_join_named`` round trip BF16 0.764 -> 0.799 of copy, NVFP4 0.475 -> 0.533,
    BlockwiseFP8 0.603 -> 0.663; docs/PERF.md's tuning table). The block stages
    its first token, joins; then per token ``t``: stage the block's next token into the other
    buffer (``stage_token``), broadcast ``t`` (``broadcast_staged_token``), one send join,
    count ``t``'s copies finished (``count_staged_copies``). A buffer is written only after
    the join that ends the broadcast that read it; the same threads ``k < K`` read a
    buffer's counter word before they stage the next token into it. Same slots, counters,
    bytes and completion as ``broadcast_tokens``."""
    lay, K = cfg.layout, cfg.layout.top_k
    msg_stride = -(-lay.msg_bytes // 16) * 16
    msgs = r.scratch("send_msg", 2 * msg_stride)
    dsts = r.scratch("send_dst", 2 * 8 * K)
    cos = r.scratch("send_co", 2 * 4 * K)

    def buffers(b):
        return (msgs + (b * msg_stride).cast(T.u64), dsts + (b * 8 * K).cast(T.u64),
                cos + (b * 4 * K).cast(T.u64))

    sm, n_active = send_sm(r, n_signal_sms, sm_id, n_active_send_sms)
    n_comm = r.let("n_comm", n_active)
    first = r.let("t_first", sm)
    with r.if_(first < p.n_tokens):
        stage_token(r, cfg, p, first, *buffers(ir.Const(0, T.u32)))
    prefetch = cfg.token_fmt.splits_staging
    g_ahead = prefetch_topk_id(r, cfg, p, first + n_comm) if prefetch else None
    send_join(r, cfg)
    b = r.var("send_buf", T.u32, 0)
    with r.for_range("t", first, p.n_tokens, n_comm) as t:
        nxt = r.let("t_next", t + n_comm)
        if prefetch:
            finish = begin_staging(r, cfg, p, nxt, n_comm, g_ahead)
        else:
            with r.if_(nxt < p.n_tokens):
                stage_token(r, cfg, p, nxt, *buffers(1 - b))
        msg, dst, co = buffers(b)
        broadcast_staged_token(r, cfg, msg, dst)
        if prefetch:
            finish(*buffers(1 - b))
        send_join(r, cfg)
        count_staged_copies(r, cfg, p, co)
        r.assign(b, 1 - b)


def broadcast_tokens(r: ir.RoleBuilder, cfg, p, n_signal_sms: int, sm_id=None,
                     n_active_send_sms=None):
    """``copy_and_send_tokens``' P2P path when the send buffer is not needed afterwards (no
    role split, no final layout, no shared expert): the block stages token ``t`` once, in
    shared memory, and every thread then stores its 16-byte vectors of the message to all
    ``K`` destinations, so the token is read from global memory once and each message is
    written once (``ld.shared.v4`` then ``K`` x ``st.global.v4``), pipelined
    (``broadcast_tokens_pipelined``). Threads ``k < K`` write the header, reserve slot
    ``k``'s row (``atom.relaxed.gpu.add`` on the reserved counter) and publish its address in
    shared memory; after the broadcast's join they count their copy finished
    (``red.release.gpu.add``: the barrier orders every thread's stores before it). Same
    slots, counters and completion as the stock path. The joins are the send join, so
    ``ep_send_join_named`` moves each to ``bar.sync 3, <threads>``."""
    return broadcast_tokens_pipelined(r, cfg, p, n_signal_sms, sm_id, n_active_send_sms)


def active_role_split(r: ir.RoleBuilder, cfg):
    """``cfg.layout.role_split`` when ``ep_copy_role_split`` is on and the reference's
    geometry rule enables it (``H/8 == 3 * n_copy_threads``), else None (the stock copy and
    fan-out, also when the flag is set on a geometry that does not qualify)."""
    split = cfg.layout.role_split
    if not split.enabled:
        return None
    if r.n_threads != split.block_size:
        raise ValueError(f"ep_copy_role_split: the split geometry is defined on num_threads="
                         f"{split.block_size} threads, but role {r.name} has {r.n_threads} "
                         f"(n_comm_threads must equal num_threads for the split)")
    return split


def fan_out_slots(r: ir.RoleBuilder, cfg, split):
    """``(first, step)`` of this warp's top-k slots in the P2P fan-out: stock ``(warp,
    role warps)`` (the comm role's own warps, ``n_comm_threads / 32``); with the role split
    only publisher warps fan out, ``(publisher_idx, n_publisher_warps)``, and copy-role warps
    start at ``top_k`` (an empty range, ``selp``)."""
    if split is None:
        return r.warp, r.n_threads // 32
    is_pub = split.is_publisher(r.warp)
    first = ir.Select(is_pub, split.publisher_idx(r.warp), ir.as_expr(cfg.layout.top_k))
    return first, split.n_publisher_warps


def send_join(r: ir.RoleBuilder, cfg):
    """The join between staging a token and fanning it out: the role's barrier
    (``comm_sync``: ``bar.sync 0`` in the standalone kernel), or with ``ep_send_join_named`` the comm role's
    own named barrier ``NB_SEND`` (``bar.sync 3, <num_threads>``; reference
    ``named_barrier[num_threads](NB_SEND)``)."""
    if cfg.ep_send_join_named:
        r.bar_sync(r.barrier("send_join", cfg.layout.NB_SEND))
        return
    comm_sync(r)


__all__ = ["send_buffer_tokens", "broadcast_tokens", "broadcast_tokens_pipelined",
           "stage_token", "prefetch_topk_id", "begin_staging", "broadcast_staged_token",
           "count_staged_copies", "active_role_split", "fan_out_slots", "send_join"]
