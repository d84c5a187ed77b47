"""``dispatch_async``: the monitor (aux) blocks count tokens per expert and publish the
receive counts; the comm blocks copy each token to every destination's receive buffer
(reference page: ``monitor_and_signal_completion``, ``copy_and_send_tokens``).

Send paths (``copy_and_send_tokens`` picks one; ``uses_warp_send`` is the rule):

- the warp path (``warp_broadcast_tokens``, the stock one): each warp reads a token once and
  stores it from registers to its ``K`` destinations, no block-wide join; the monitor blocks
  send too, their work split into roles around the sends (``add_send_phase``: ``monitor``,
  ``comm`` over every block, ``signal``);
- the block-staged paths, kept where a flag needs them: ``broadcast_tokens`` (shared-memory
  staging, ``ep_send_join_named``) and the send-buffer staging with a warp per destination
  (``ep_copy_role_split``, the shared expert, the quantising formats' final layout).
"""

from __future__ import annotations

import functools

import attrs

import ir
from ir import AtomOp, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode
from ir import types as T

from . import final_layout, trace
from .common import VEC, comm_sync, copy_vectors, load_pointer
from .common import word as _word
from .ord_r import signal_rank_completion

KERNEL_NAME = "ep_dispatch_async"


@attrs.frozen
class AsyncParams:
    """Kernel parameters of dispatch_async, named as the reference method arguments."""

    input_tokens: ir.Param
    topk_ids: ir.Param
    n_tokens: ir.Param
    send_buf_p: ir.Param
    recv_buf_ptrs: ir.Param
    recv_count_ptrs: ir.Param
    counters: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param
    final: final_layout.FinalAsyncParams | None = None


def declare_params(kb: ir.KernelBuilder, cfg=None) -> AsyncParams:
    p = AsyncParams(
        input_tokens=kb.param("input_tokens", T.ptr_global),
        topk_ids=kb.param("topk_ids", T.ptr_global),
        n_tokens=kb.param("n_tokens", T.u32),
        send_buf_p=kb.param("send_buf_p", T.ptr_global),
        recv_buf_ptrs=kb.param("recv_buf_ptrs", T.ptr_global),
        recv_count_ptrs=kb.param("recv_count_ptrs", T.ptr_global),
        counters=kb.param("counters", T.ptr_global),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
        final=final_layout.declare_async_params(kb, cfg) if cfg is not None else None,
    )
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def monitor_and_signal_completion(r: ir.RoleBuilder, cfg, p: AsyncParams, comm_warp_base: int = 0):
    """Aux blocks: warp ``w`` of block ``b`` owns global expert ``b*n_warps + w``. The warp
    counts that expert's ``(token, k)`` pairs (``count_routed``: ``redux.sync.add``); lane 0
    waits (bounded, ``ld.acquire.gpu``) until the comm warps have finished that many copies,
    publishes the count into the destination's receive-count word with ``st.release.sys``
    (per-expert completion), and re-arms its two counters (``signal_completion``). With
    ``ep_final_layout`` the warp first reserves its block of the destination's output
    (``final_layout.reserve_rows``: the cursor's ``atom.relaxed.sys.global.add.u64`` and the
    ``st.release.gpu`` base hand-off, or with ``ep_prod_reserve`` the
    ``st.release.sys.global.b64`` early count and the reserver), and the count word carries
    the block's offset when the layout is capacity-strided. With ``ep_ord_r`` the count word
    is a plain store and completion is published per destination rank
    (``ord_r.signal_rank_completion``: ``atom.acq_rel.gpu`` election, one ``st.release.sys``
    rank flag). Under ``skip_a2a`` the warp owns global expert ``expert_idx + L * my_rank``,
    the rank coordinates are 0 and the release is ``st.release.gpu``.

    This is the staged send paths' monitor. On the warp send path the standard kernels split
    it around the sends (``add_send_phase``): ``count_and_reserve`` before, in role
    ``monitor``, and ``signal_after_sends`` after, in role ``signal``, so the monitor blocks
    send too.

    ``comm_warp_base`` (reference: the absolute warp id of the comm class's first warp) must
    be the role's first warp (``ThreadRange.base // 32``): ``r.warp`` is already comm-local,
    and a block's monitor warps are the role's warps, so block ``b`` owns experts
    ``b * role_warps + w``."""
    if r.thread_base % 32 or comm_warp_base != r.thread_base // 32:
        raise ValueError(f"comm_warp_base={comm_warp_base} must be the monitor role's first "
                         f"warp (its thread range starts at thread {r.thread_base}, warp-"
                         f"aligned)")
    E, K = cfg.n_experts, cfg.layout.top_k
    expert_idx, g = monitor_expert(r, cfg, p)
    count = r.var("count", T.u32, 0)
    fl_off = r.var("fl_off", T.u32, 0) if p.final and not cfg.ep_prod_reserve else None
    with r.if_(expert_idx < E):
        r.assign(count, count_routed(r, p.topk_ids, p.n_tokens * K, g))
        if p.final:
            off = final_layout.reserve_rows(r, cfg, p, p.final, g, count)
            if fl_off is not None:
                r.assign(fl_off, off)
    signal_completion(r, cfg, p, expert_idx, g, count, fl_off)


def monitor_expert(r: ir.RoleBuilder, cfg, p: AsyncParams):
    """``(expert_idx, g)`` of this monitor warp: ``block * role_warps + warp``, and the
    global expert it owns (``+ L * my_rank`` under ``skip_a2a``)."""
    expert_idx = r.let("expert_idx", r.block * (r.n_threads // 32) + r.warp)
    g = r.let("g", expert_idx + cfg.layout.n_local_experts * p.my_rank if cfg.skip_a2a
              else expert_idx)
    return expert_idx, g


MONITOR_STATE = "monitor_state"   # shared: per monitor warp its count, then its block offset


def monitor_state(r: ir.RoleBuilder, field: int | None = None):
    """The monitor blocks' shared state (declared once per kernel: ``2 * role_warps`` u32,
    the counts then the capacity-strided block offsets), which carries them from role
    ``monitor`` to role ``signal``: its base, or this warp's word ``field`` (0: count, 1:
    offset)."""
    warps = r.n_threads // 32
    if not any(b.name == MONITOR_STATE for b in r.kb.shared):
        r.kb.shared_buffer(MONITOR_STATE, 8 * warps)
    base = ir.SharedAddr(MONITOR_STATE)
    return base if field is None else _word(base, r.warp + field * warps)


def count_and_reserve(r: ir.RoleBuilder, cfg, p: AsyncParams):
    """Role ``monitor`` of the warp send path (whole monitor blocks, before the sends): the
    counts from one shared histogram per block (``count_block_experts``) into the monitor
    state, then with ``ep_final_layout`` the reservation (``final_layout.reserve_rows``) and,
    capacity-strided, the block offset into the monitor state. Counting and reserving come
    before every send: the final layout's sends wait for the block bases published here."""
    E, K = cfg.n_experts, cfg.layout.top_k
    expert_idx, g = monitor_expert(r, cfg, p)
    count_block_experts(r, p.topk_ids, p.n_tokens * K, g - r.warp, monitor_state(r))
    if p.final:
        with r.if_(expert_idx < E):
            off = final_layout.reserve_rows(
                r, cfg, p, p.final, g, r.load(monitor_state(r, 0), T.u32, name="count"))
            if off is not None:
                with r.if_(r.lane.eq(0)):
                    r.store(monitor_state(r, 1), off)


def signal_after_sends(r: ir.RoleBuilder, cfg, p: AsyncParams, token_warps: int = 1):
    """Role ``signal`` of the warp send path (the monitor blocks, after their own sends):
    ``signal_completion`` with the count and offset the role ``monitor`` left in the
    monitor state; ``token_warps`` as the sends'."""
    expert_idx, g = monitor_expert(r, cfg, p)
    count = r.let("count", r.load(monitor_state(r, 0), T.u32, name="count_ld"))
    fl_off = None
    if p.final and not cfg.ep_prod_reserve:
        fl_off = r.let("fl_off", r.load(monitor_state(r, 1), T.u32, name="fl_off_ld"))
    signal_completion(r, cfg, p, expert_idx, g, count, fl_off, token_warps)


def signal_completion(r: ir.RoleBuilder, cfg, p: AsyncParams, expert_idx, g, count, fl_off,
                      token_warps: int = 1):
    """The monitor warp's lane 0, for its expert (``expert_idx < E``): bounded wait until the
    finished counter reaches ``count`` (``ld.acquire.gpu``; ``token_warps * count`` when
    that many warps share each token and each counts its share of a copy), publish the
    count word (or the ORD-R rank completion), re-arm the counters (and the final layout's
    hand-off)."""
    lay = cfg.layout
    E, L, R = cfg.n_experts, lay.n_local_experts, cfg.n_ranks
    reserved, finished = p.counters, _word(p.counters, E)
    with r.if_(expert_idx < E):
        with r.if_(r.lane.eq(0)):
            dst_rank = r.let("dst_rank", g // L)
            e = r.let("e", g % L)
            signal_offset = r.let("signal_offset", e * R + (0 if cfg.skip_a2a else p.my_rank))
            counter_offset = r.let("counter_offset", e * R + (0 if cfg.skip_a2a else dst_rank))
            r.spin_wait(_word(finished, counter_offset), T.u32, CmpOp.EQ,
                        count * token_warps if token_warps > 1 else count,
                        buffer="expert_finished_counter", index=counter_offset,
                        sem=Sem.ACQUIRE, scope=Scope.GPU)
            dst_p2p = dst_rank % cfg.p2p_world_size
            scope = Scope.GPU if cfg.skip_a2a else Scope.SYS
            counts = load_pointer(r, p.recv_count_ptrs, 0 if cfg.skip_a2a else dst_p2p,
                                  "recv_count_dst", peer=not cfg.skip_a2a)
            published = count.min(lay.block_capacity) if lay.block_capacity < cfg.max_tokens_per_rank else count
            if p.final:
                published = final_layout.count_word(cfg, count, fl_off)
            if cfg.ep_ord_r:
                signal_rank_completion(r, cfg, counts, signal_offset, published,
                                       0 if cfg.skip_a2a else dst_p2p, p.counters, p.my_rank)
            else:
                r.store(_word(counts, signal_offset, 8), published.cast(T.u64), Sem.RELEASE, scope)
            r.store(_word(reserved, counter_offset), 0)
            r.store(_word(finished, counter_offset), 0)
            if p.final:
                final_layout.rearm_handoff(r, cfg, p.final, counter_offset)


def count_routed(r: ir.RoleBuilder, topk_ids, n_ids, g, unroll: int = 8) -> ir.Var:
    """The warp's count of ``topk_ids[0:n_ids]`` entries equal to ``g``: lane-strided
    ``ld.global.nc.b32``, ``unroll`` in flight, then ``redux.sync.add``."""
    n_ids = r.let("n_ids", n_ids)
    cnt = r.var("cnt", T.u32, 0)
    i = r.var("cnt_i", T.u32, r.lane)
    with r.while_(i + 32 * (unroll - 1) < n_ids):
        ids = [r.load(_word(topk_ids, i + 32 * u), T.u32, cache=CacheHint.NC, name="id")
               for u in range(unroll)]
        for v in ids:
            r.assign(cnt, cnt + ir.Cast(T.u32, v.eq(g)))
        r.assign(i, i + 32 * unroll)
    with r.while_(i < n_ids):
        v = r.load(_word(topk_ids, i), T.u32, cache=CacheHint.NC, name="id_t")
        r.assign(cnt, cnt + ir.Cast(T.u32, v.eq(g)))
        r.assign(i, i + 32)
    return r.redux(ReduxOp.ADD, cnt, name="counted")


def count_block_experts(r: ir.RoleBuilder, topk_ids, n_ids, first_g, hist):
    """Each warp's count of ``topk_ids[0:n_ids]`` entries equal to its expert, the block's
    warps owning experts ``first_g + w``, into ``hist[w]`` (a shared array of one u32 per
    warp): the block reads the ids once (thread-strided ``ld.global.nc.b32``, 8 in flight)
    into that histogram (``red.shared.add``), one ``bar.sync 0`` after zeroing it and one
    after counting. The role must be the whole block (``bar.sync 0``). A sixteenth of the
    reads of every warp counting alone (``count_routed``), so the monitor warps start
    sending early."""
    warps = r.n_threads // 32
    with r.if_(r.tid < warps):
        r.store(_word(hist, r.tid), 0)
    r.syncthreads()
    n_ids = r.let("n_ids", n_ids)
    i = r.var("cnt_i", T.u32, r.tid)
    stride = r.n_threads

    def tally(v):
        rel = r.let("rel", v - first_g)
        with r.if_(rel < warps):
            r.red(AtomOp.ADD, _word(hist, rel), 1, Sem.RELAXED, Scope.CTA)

    with r.while_(i + stride * 7 < n_ids):
        ids = [r.load(_word(topk_ids, i + stride * u), T.u32, cache=CacheHint.NC, name="id")
               for u in range(8)]
        for v in ids:
            tally(v)
        r.assign(i, i + stride * 8)
    with r.while_(i < n_ids):
        tally(r.load(_word(topk_ids, i), T.u32, cache=CacheHint.NC, name="id_t"))
        r.assign(i, i + stride)
    r.syncthreads()


#: Formats whose block-staged broadcast (every block sending) moves prefill-sized calls
#: faster than the warp send path, so the staged variants take it (``prefers_block_broadcast``).
#: Measured on the H200 at prefill, default variant, round trip against the warp path
#: (docs/PERF.md's tuning table): BF16 0.898 / 0.882, MXFP8 0.880 / 0.846, BlockwiseFP8
#: 0.869 / 0.835; NVFP4 (as ``ep_send_join_named``) 0.828 against the warp path's 0.848
#: stays on the warp path. The threshold is ``cfg.tuning.block_broadcast_min_tokens_per_block``
#: (a full call gives every block at least that many tokens: prefill, not decode).
BLOCK_BROADCAST_FORMATS = ("BF16", "MXFP8", "BlockwiseFP8")


def prefers_block_broadcast(cfg) -> bool:
    """Whether a staged variant that could take the warp send path takes the block-staged
    broadcast instead: its format in ``BLOCK_BROADCAST_FORMATS``, a prefill-sized
    ``max_tokens_per_rank`` (``cfg.tuning.block_broadcast_min_tokens_per_block`` per block),
    not the final layout (the block-staged broadcast writes receive buffers only)."""
    # TODO(merge): fmt.prefers_block_staged_broadcast
    return (cfg.token_fmt.name in BLOCK_BROADCAST_FORMATS and not cfg.ep_final_layout
            and cfg.max_tokens_per_rank
            >= cfg.tuning.block_broadcast_min_tokens_per_block * cfg.n_sms)


def uses_warp_send(cfg) -> bool:
    """Whether ``copy_and_send_tokens`` takes the warp send path (``warp_broadcast_tokens``):
    no role split, no shared expert (both read the staged send buffer), no
    ``ep_send_join_named`` (it names the staged paths' block-wide join), under
    ``ep_final_layout`` only formats whose payload is the output row, and not where the
    block-staged broadcast is faster (``prefers_block_broadcast``)."""
    return (not cfg.layout.role_split.enabled and not cfg.fused_shared_expert
            and not cfg.ep_send_join_named
            and (not cfg.ep_final_layout or writes_final_rows_by_warp(cfg.token_fmt))
            and not prefers_block_broadcast(cfg))


def writes_final_rows_by_warp(fmt) -> bool:
    """Whether the warp send path can write ``fmt``'s ``ep_final_layout`` rows: its payload
    is the output row (BF16), or its broadcast also writes the rows' scales
    (``broadcasts_final_rows``: NVFP4, MXFP8, BlockwiseFP8's transposed scales): each warp
    quantizes its token once and writes the payload to the K output rows and the scales to
    those rows' places. Measured on the H200, final+prod at prefill, against the staged path
    (docs/PERF.md's tuning table): NVFP4 0.212 -> 0.643 of copy, MXFP8 0.299 -> 0.686,
    BlockwiseFP8 0.225 -> 0.328. Other formats (scale rows not whole 16-byte vectors) take
    the staged path."""
    return fmt.payload_is_output_row or fmt.broadcasts_final_rows


def uses_block_broadcast(cfg) -> bool:
    """Whether ``copy_and_send_tokens`` takes the block-staged broadcast
    (``broadcast_tokens``): a staged path (``uses_warp_send`` false) without the role split,
    the final layout or the shared expert, which read the staged send buffer."""
    return (not uses_warp_send(cfg) and not cfg.layout.role_split.enabled
            and not cfg.ep_final_layout and not cfg.fused_shared_expert)


def sends_from_every_block(cfg) -> bool:
    """Whether the monitor blocks send too (``add_send_phase`` splits their work around the
    sends): the warp send path and the block-staged broadcast (``ep_send_join_named``). The
    monitor blocks count their experts and reserve first (``count_and_reserve``), send their
    share of the tokens, then signal (``signal_after_sends``), instead of leaving the sends to
    the ``grid - n_signal_sms`` comm blocks. For the block-staged broadcast, measured on the
    H200 at prefill (docs/PERF.md's tuning table): round trip BF16 0.817 -> 0.896 of copy,
    NVFP4 0.536 -> 0.770."""
    return uses_warp_send(cfg) or uses_block_broadcast(cfg)


def copy_and_send_tokens(r: ir.RoleBuilder, cfg, p: AsyncParams, n_signal_sms: int,
                         comm_barrier_id: int = -1, token_warps: int = 1):
    """Comm blocks: block-strided over tokens. All threads stage token ``t`` (payload by the
    format, then the header: source index and top-k ids) in send-buffer row ``t``, join
    (``send_join``), then warp ``k`` (strided) reserves a slot on destination expert
    ``topk_ids[t, k]`` (``atom.relaxed.gpu.add``), copies the message to the destination's
    receive buffer with 16-byte stores, and counts the copy finished with
    ``red.release.gpu.add``. With ``ep_final_layout`` the header also carries the source rank
    and the copy goes straight to the destination's output row and header row
    (``final_layout.copy_to_final_row``). With ``ep_copy_role_split`` (when its geometry qualifies) the
    format's copy runs on the copy-role threads only and just the publisher warps fan out
    (``fan_out_slots``); ``ep_send_join_named`` moves the join to ``bar.sync 3, <threads>``.
    Under ``skip_a2a`` destinations other than ``my_rank`` are skipped and only this device's
    own receive buffer (pointer-table entry 0) is written."""
    lay, fmt = cfg.layout, cfg.token_fmt
    E, L, R, K = cfg.n_experts, lay.n_local_experts, cfg.n_ranks, lay.top_k
    msg_bytes = lay.msg_bytes
    reserved, finished = p.counters, _word(p.counters, E)
    split = active_role_split(r, cfg)
    if uses_warp_send(cfg):
        return warp_broadcast_tokens(r, cfg, p, n_signal_sms, token_warps)
    if uses_block_broadcast(cfg):
        return broadcast_tokens(r, cfg, p, n_signal_sms, comm_barrier_id)
    n_comm = r.let("n_comm", r.n_blocks - n_signal_sms)
    with r.for_range("t", r.block - n_signal_sms, p.n_tokens, n_comm) as t:
        msg = r.let("msg", p.send_buf_p + t.cast(T.u64) * msg_bytes)
        src_row = p.input_tokens + t.cast(T.u64) * fmt.input_row_bytes
        if split is None:
            fmt.emit_copy_token_to_send_buf(r, src_row, msg, r.tid, r.n_threads)
        else:
            fmt.emit_copy_token_to_send_buf_split(r, src_row, msg, r.tid, split)
        with r.if_(r.tid < K):
            gid = r.load(_word(p.topk_ids, t * K + r.tid), T.u32, cache=CacheHint.NC, name="gid")
            r.store(msg + fmt.topk_info_offset + (r.tid * 2).cast(T.u64), gid.cast(T.u16))
        with r.if_(r.tid.eq(0)):
            r.store(msg + fmt.src_info_offset, t)
            if p.final:
                final_layout.stage_source_rank(r, cfg, p, msg)
        send_join(r, cfg, comm_barrier_id)
        k_first, k_step = fan_out_slots(r, cfg, split)
        with r.for_range("k", k_first, K, k_step) as k:
            g = r.load(_word(p.topk_ids, t * K + k), T.u32, cache=CacheHint.NC, name="g")
            dst_rank = r.let("dst_rank", g // L)
            e = r.let("e", g % L)
            with r.if_(dst_rank.eq(p.my_rank) if cfg.skip_a2a else ir.Const(1, T.pred)):
                co = r.let("co", e * R + (0 if cfg.skip_a2a else dst_rank))
                slot = r.var("slot", T.u32, 0)
                with r.if_(r.lane.eq(0)):
                    r.assign(slot, r.atomic(AtomOp.ADD, _word(reserved, co), 1, Sem.RELAXED,
                                            Scope.GPU, name="slot0"))
                slot_b = r.shfl(ShflMode.IDX, slot, 0, name="slot_b")
                if p.final:
                    final_layout.copy_to_final_row(r, cfg, p.final, msg, dst_rank, co, slot_b)
                else:
                    rank_coord = 0 if cfg.skip_a2a else p.my_rank
                    dst_p2p = 0 if cfg.skip_a2a else dst_rank % cfg.p2p_world_size
                    recv = load_pointer(r, p.recv_buf_ptrs, dst_p2p, "recv_dst",
                                        peer=not cfg.skip_a2a)
                    # device guard: a slot past the block's capacity is never written (the host
                    # refuses such routings; the monitor publishes the clamped count)
                    with r.if_(slot_b < lay.block_capacity):
                        row = ((e * R + rank_coord) * lay.block_capacity + slot_b).cast(T.u64)
                        dst = r.let("dst", recv + row * msg_bytes, peer=not cfg.skip_a2a)
                        copy_vectors(r, dst, msg, msg_bytes // 16, r.lane, 32, tag="fan")
                r.warp_sync()
                with r.if_(r.lane.eq(0)):
                    r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)


NO_SLOT = 0xFFFFFFFF   # a top-k slot that sends nothing (skip_a2a: not this device's expert)

def stage_token(r: ir.RoleBuilder, cfg, p: AsyncParams, t, msg, dsts, cos):
    """The whole block stages token ``t`` in the shared message ``msg`` (the format's payload,
    then its header: threads ``k < K`` write top-k id ``k``, reserve slot ``k``'s row
    (``reserve_slot``) and leave its address in ``dsts[k]`` and its counter in ``cos[k]``,
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
        reserve_slot(r, cfg, p, g, dst_rank, co_word, r.var("slot", T.u32, 0), addr)
        r.store(_word(dsts, r.tid, 8), addr)
        r.store(_word(cos, r.tid), co_word)
    with r.if_(r.tid.eq(0)):
        r.store(msg + fmt.src_info_offset, t)


def prefetch_topk_id(r: ir.RoleBuilder, cfg, p: AsyncParams, t) -> ir.Var:
    """The prefetching pipeline (``splits_staging`` formats): threads ``k < K`` load top-k
    id ``k`` of token ``t`` (when
    ``t < n_tokens``) into a u32 var that ``begin_staging`` consumes and reloads."""
    K = cfg.layout.top_k
    g = r.var("g_ahead", T.u32, 0)
    with r.if_((r.tid < K) & (t < p.n_tokens)):
        r.assign(g, r.load(_word(p.topk_ids, t * K + r.tid), T.u32, cache=CacheHint.NC,
                           name="g_pf"))
    return g


def begin_staging(r: ir.RoleBuilder, cfg, p: AsyncParams, t, n_comm, g_ahead):
    """The prefetching pipeline (``splits_staging`` formats: BF16): ``stage_token`` for token
    ``t`` in two halves around the current token's broadcast, so the round trips of the
    input loads and reservations that preceded each broadcast run under it (measured on the
    H200 at prefill, ``ep_send_join_named`` BF16 round trip 0.802 -> 0.822 of copy;
    docs/PERF.md's tuning table). Now: the block's loads of ``t``'s input row (row ``min(t,
    n_tokens - 1)``: always a valid address), and threads ``k < K`` reserve slot ``k``
    (``reserve_slot``) with the top-k id ``g_ahead`` holds, then load the id of token ``t +
    n_comm`` into it. Returns ``finish(msg, dsts, cos)``: when ``t < n_tokens``, the payload
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
        reserve_slot(r, cfg, p, g, r.let("dst_rank", g // L), co_word,
                     r.var("slot", T.u32, 0), addr)
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


def count_staged_copies(r: ir.RoleBuilder, cfg, p: AsyncParams, cos):
    """After the join that follows a broadcast: threads ``k < K`` count copy ``k`` finished
    (``red.release.gpu.add``; the barrier orders every thread's stores before it)."""
    finished = _word(p.counters, cfg.n_experts)
    with r.if_(r.tid < cfg.layout.top_k):
        co = r.load(_word(cos, r.tid), T.u32, name="co_done")
        with r.if_(co.ne(NO_SLOT)):
            r.red(AtomOp.ADD, _word(finished, co), 1, Sem.RELEASE, Scope.GPU)


def broadcast_tokens_pipelined(r: ir.RoleBuilder, cfg, p: AsyncParams, n_signal_sms: int,
                               comm_barrier_id: int = -1):
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
    msgs = r.kb.shared_buffer("send_msg", 2 * msg_stride)
    dsts = r.kb.shared_buffer("send_dst", 2 * 8 * K)
    cos = r.kb.shared_buffer("send_co", 2 * 4 * K)

    def buffers(b):
        return (msgs + (b * msg_stride).cast(T.u64), dsts + (b * 8 * K).cast(T.u64),
                cos + (b * 4 * K).cast(T.u64))

    n_comm = r.let("n_comm", r.n_blocks - n_signal_sms)
    first = r.let("t_first", r.block - n_signal_sms)
    with r.if_(first < p.n_tokens):
        stage_token(r, cfg, p, first, *buffers(ir.Const(0, T.u32)))
    prefetch = cfg.token_fmt.splits_staging
    g_ahead = prefetch_topk_id(r, cfg, p, first + n_comm) if prefetch else None
    send_join(r, cfg, comm_barrier_id)
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
        send_join(r, cfg, comm_barrier_id)
        count_staged_copies(r, cfg, p, co)
        r.assign(b, 1 - b)


def broadcast_tokens(r: ir.RoleBuilder, cfg, p: AsyncParams, n_signal_sms: int,
                     comm_barrier_id: int = -1):
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
    return broadcast_tokens_pipelined(r, cfg, p, n_signal_sms, comm_barrier_id)


#: The first hardware barrier id of the token groups' barriers (one id per group of a block:
#: ids ``[TOKEN_GROUP_BARRIER_BASE, 16)``; ids below it are the kernels' other barriers).
TOKEN_GROUP_BARRIER_BASE = 4


def send_warps_per_token(cfg) -> int:
    """Warps per token on the warp send path: the largest power of two up to
    ``cfg.tuning.send_warps_per_token_max`` that divides a block's warps, leaves at most
    ``cfg.tuning.max_token_groups`` groups per block, and still gives every token of a full
    call (``max_tokens_per_rank``) a group of its own over the grid's ``n_sms`` blocks; 1
    under ``ep_final_layout`` (its rows come from the monitors' hand-off, per warp). When the
    sending warps outnumber a call's tokens (decode), a token's quantising loop or copy runs
    on that many warps of one block at once. Measured on the H200 at decode, 1 -> 4 warps,
    fused graph round trip (docs/PERF.md's tuning table): NVFP4 0.464 -> 0.543 of copy, MXFP8
    0.596 -> 0.655, BlockwiseFP8 0.560 -> 0.635. Each group's barrier is a branch of its own
    (``token_group_sync``), so more groups mean more code and a slower generation."""
    warps = cfg.num_threads // 32
    if cfg.ep_final_layout:
        return 1
    tuning = cfg.tuning
    fits = [n for n in (2 ** i for i in range(1, 6)) if n <= tuning.send_warps_per_token_max
            and warps % n == 0
            and warps // n <= min(tuning.max_token_groups, 16 - TOKEN_GROUP_BARRIER_BASE)
            and cfg.n_sms * warps // n >= cfg.max_tokens_per_rank]
    return max(fits, default=1)


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


def warp_broadcast_tokens(r: ir.RoleBuilder, cfg, p: AsyncParams, first_block: int,
                          token_warps: int = 1):
    """The stock P2P send path: each warp sends its tokens alone, no block-wide join, so
    each block has as many tokens in flight as it has warps. The sending warps are those of
    blocks ``[first_block, grid)`` (0 when the monitor blocks send too), numbered
    block-fastest (``warp * n_send_blocks + block``: a few tokens still reach every block);
    warp ``w`` takes tokens ``w, w + n_send_warps, ...`` in rounds of ``min(32 // K, 4)``, one top-k
    slot per lane. Per round:

    - lane ``l < rounds * K`` holds slot ``l % K`` of the round's token ``l // K``: it loads
      ``topk_ids[t, k]``, reserves the slot's row on its destination
      (``atom.relaxed.gpu.add`` on the reserved counter) and computes its address (0 when
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

    With ``ep_final_layout`` (formats whose message payload is the output row) the
    destinations are the final output rows (``final_layout.warp_final_rows`` waits for each
    slot's block base) and each lane writes its header row, source rank included, into the
    destination's header array.

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
    finished = _word(p.counters, E)
    warps = r.n_threads // 32
    split = token_warps > 1
    if split and (warps % token_warps or p.final):
        raise ValueError(f"token_warps={token_warps} must divide the role's {warps} warps, "
                         f"and the final layout keeps one warp per token")
    per_round = min(32 // K, 4)               # tokens per round: one top-k slot per lane
    n_send_blocks = r.let("n_send_blocks", r.n_blocks - first_block)
    # block-fastest numbering: few tokens (decode) still spread over every sending block
    if split:
        part = r.let("token_part", r.warp % token_warps)
        group = r.let("token_group", r.warp // token_warps)
        n_send_warps = r.let("n_send_groups", n_send_blocks * (warps // token_warps))
        first = r.let("first_token", group * n_send_blocks + (r.block - first_block))
    else:
        n_send_warps = r.let("n_send_warps", n_send_blocks * warps)
        first = r.let("first_token", r.warp * n_send_blocks + (r.block - first_block))
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
            reserve_slot(r, cfg, p, g, dst_rank, co_word, slot, None if p.final else addr)
        scale_addr = None
        if p.final:
            out_addr, hdr_addr, scale_addr = final_layout.warp_final_rows(
                r, cfg, p.final, co_word, slot, dst_rank, NO_SLOT)
            r.assign(addr, out_addr)
            hdr, src_rank = hdr_addr, p.my_rank
        else:
            hdr, src_rank = addr + fmt.src_info_offset, None
        ids = [r.shfl(ShflMode.IDX, g, lane_tok * K + k, name=f"id{k}") for k in range(K)]
        with r.if_(addr.ne(ir.Const(0, T.u64))):
            write_header(r, fmt, ir.Cast(T.ptr_global, hdr), t, ids, src_rank)
        # the round's tokens: a data-dependent trip count, so LLVM keeps one copy of the
        # broadcast loop (code size and compile time) instead of unrolling per token
        n_in_round = r.let("n_in_round", ((p.n_tokens - t0 - 1) // n_send_warps + 1)
                           .min(per_round))
        if split:      # part 0's addresses and counter offsets, to the group's other warps
            table = r.kb.shared_buffer("send_dsts", 8 * r.n_threads)
            cos = r.kb.shared_buffer("send_cos", 4 * r.n_threads)
            with r.if_(part.eq(0)):
                r.store(table + (r.tid * 8).cast(T.u64), addr)
                r.store(_word(cos, r.tid), co_word)
            token_group_sync(r, group, token_warps)
            lead = r.let("lead_lane", (r.warp - part) * 32 + r.lane)
            r.assign(co_word, r.load(_word(cos, lead), T.u32, name="co_lead"))
            warp_dsts = r.let("warp_dsts", table + ((r.warp - part) * 256).cast(T.u64))
        else:
            table = r.kb.shared_buffer("send_dsts", 8 * r.n_threads)
            r.store(table + (r.tid * 8).cast(T.u64), addr)
            if scale_addr is not None:
                scale_table = r.kb.shared_buffer("send_scale_dsts", 8 * r.n_threads)
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
                fmt.emit_broadcast_token(r, src, dsts, part=(part, token_warps))
            else:
                fmt.emit_broadcast_token(r, src, dsts, **scales)
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


def reserve_slot(r: ir.RoleBuilder, cfg, p: AsyncParams, g, dst_rank, co_word, slot, addr):
    """One top-k slot of a token routed to global expert ``g`` (on ``dst_rank``): unless
    ``skip_a2a`` leaves it to another device, set ``co_word`` to its counter offset ``e * R +
    dst`` and ``slot`` to the row reserved on it (``atom.relaxed.gpu.add`` on the reserved
    counter); with ``addr`` (a u64 var; None under the final layout, whose rows come from
    the hand-off) set it to the staged message's address in the destination's receive
    buffer. Vars not set keep their values (``NO_SLOT``, 0: nothing sent)."""
    lay = cfg.layout
    L, R = lay.n_local_experts, cfg.n_ranks
    e = r.let("e", g % L)
    with r.if_(dst_rank.eq(p.my_rank) if cfg.skip_a2a else ir.Const(1, T.pred)):
        co = r.let("co", e * R + (0 if cfg.skip_a2a else dst_rank))
        r.assign(co_word, co)
        r.assign(slot, r.atomic(AtomOp.ADD, _word(p.counters, co), 1, Sem.RELAXED,
                                Scope.GPU, name="slot0"))
        if addr is None:
            return
        recv = load_pointer(r, p.recv_buf_ptrs,
                            0 if cfg.skip_a2a else dst_rank % cfg.p2p_world_size,
                            "recv_dst", peer=not cfg.skip_a2a)
        # device guard: a slot past the block's capacity is never written (the host refuses
        # such routings; the monitor publishes the clamped count)
        with r.if_(slot < lay.block_capacity):
            row = ((e * R + (0 if cfg.skip_a2a else p.my_rank)) * lay.block_capacity
                   + slot).cast(T.u64)
            r.assign(addr, ir.Cast(T.u64, recv + row * lay.msg_bytes))


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


def send_join(r: ir.RoleBuilder, cfg, comm_barrier_id: int = -1):
    """The join between staging a token and fanning it out: the comm barrier
    (``bar.sync 0`` in the standalone kernel), or with ``ep_send_join_named`` the comm role's
    own named barrier ``NB_SEND`` (``bar.sync 3, <num_threads>``; reference
    ``named_barrier[num_threads](NB_SEND)``)."""
    if cfg.ep_send_join_named:
        r.bar_sync(r.barrier("send_join", cfg.layout.NB_SEND))
        return
    comm_sync(r, comm_barrier_id)


def add_send_phase(kb: ir.KernelBuilder, cfg, p: AsyncParams, comm_tail=None):
    """The dispatch_async roles of a kernel (the standalone kernel, and phase 1 of the fused
    one). Staged send paths: ``monitor`` blocks ``[0, n_signal_sms)``
    (``monitor_and_signal_completion``) and ``comm`` blocks ``[n_signal_sms, grid)``
    (``copy_and_send_tokens``, then ``comm_tail(r)`` if given). Warp send path
    (``uses_warp_send``): the monitor blocks send too, so their work is split around the
    sends: ``monitor`` ``[0, n_signal_sms)`` (``count_and_reserve``), ``comm`` ``[0, grid)``
    (``copy_and_send_tokens`` over every block), ``signal`` ``[0, n_signal_sms)``
    (``signal_after_sends``); a thread runs its roles in that order. The block-staged
    broadcast does the same (``sends_from_every_block``)."""
    n_sig = cfg.layout.n_signal_sms
    if sends_from_every_block(cfg):
        if comm_tail is not None:
            raise ValueError("add_send_phase: comm_tail needs comm blocks that do not "
                             "monitor (the shared expert's staged path)")
        with kb.role("monitor", blocks=(0, n_sig)) as r:
            count_and_reserve(r, cfg, p)
        token_warps = send_warps_per_token(cfg) if uses_warp_send(cfg) else 1
        with kb.role("comm", blocks=(0, None)) as r:
            copy_and_send_tokens(r, cfg, p, 0, token_warps=token_warps)
        with kb.role("signal", blocks=(0, n_sig)) as r:
            signal_after_sends(r, cfg, p, token_warps)
        return
    with kb.role("monitor", blocks=(0, n_sig)) as r:
        monitor_and_signal_completion(r, cfg, p)
    with kb.role("comm", blocks=(n_sig, None)) as r:
        copy_and_send_tokens(r, cfg, p, n_sig)
        if comm_tail is not None:
            comm_tail(r)


def build_dispatch_async(cfg) -> ir.Kernel:
    """The dispatch_async entry point (``add_send_phase``)."""
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb, cfg)
    trace.instrument(kb, cfg, p.my_rank)
    add_send_phase(kb, cfg, p)
    return kb.build()


__all__ = ["build_dispatch_async", "monitor_and_signal_completion", "copy_and_send_tokens",
           "warp_broadcast_tokens", "broadcast_tokens", "uses_warp_send", "uses_block_broadcast",
           "sends_from_every_block", "send_warps_per_token", "prefers_block_broadcast",
           "count_routed",
           "count_block_experts", "count_and_reserve", "signal_after_sends", "signal_completion",
           "add_send_phase",
           "AsyncParams", "KERNEL_NAME"]
