"""dispatch_async's monitor role: the monitor (aux) blocks count tokens per expert, reserve
through the destination strategy (``p.dest``), wait for their comm warps' copies and publish each
expert's receive count (reference page: ``monitor_and_signal_completion``). On the send
paths where the monitor blocks send too, the work is split around the sends:
``count_and_reserve`` (role ``monitor``) and ``signal_after_sends`` (role ``signal``).
"""

from __future__ import annotations

import ir
from ir import AtomOp, CacheHint, CmpOp, ReduxOp, Scope, Sem
from ir import types as T

from .common import load_pointer, signal_scope
from .common import word as _word
from .ord_r import signal_rank_completion
from .rank_mask import if_live
from .shmem_send import in_group, is_remote, signal_remote_count


def monitor_and_signal_completion(r: ir.RoleBuilder, cfg, p, sm_id=None):
    """Aux blocks: warp ``w`` of block ``b`` owns global expert ``b*n_warps + w``. The warp
    counts that expert's ``(token, k)`` pairs (``count_routed``: ``redux.sync.add``); lane 0
    waits (bounded, ``ld.acquire.gpu``) until the comm warps have finished that many copies,
    publishes the count into the destination's receive-count word with ``st.release.sys``
    (per-expert completion), and re-arms its two counters (``signal_completion``). With
    ``ep_final_layout`` the warp first reserves its block of the destination's output
    (``p.dest.reserve``: the cursor's ``atom.relaxed.sys.global.add.u64`` and the
    ``st.release.gpu`` base hand-off, or with ``ep_prod_reserve`` the
    ``st.release.sys.global.b64`` early count and the reserver), and the count word carries
    the block's offset when the layout is capacity-strided. With ``ep_ord_r`` the count word
    is a plain store and completion is published per destination rank
    (``ord_r.signal_rank_completion``: ``atom.acq_rel.gpu`` election, one ``st.release.sys``
    rank flag). Under ``skip_a2a`` the warps ``expert_idx < L`` (``n_monitored_experts``) own
    global experts ``expert_idx + L * my_rank`` (``layout.monitored_expert``), the others
    idle, the rank coordinates are 0 (``layout.rank_coord``) and the release is
    ``st.release.gpu`` (``signal_scope``).

    This is the staged send paths' monitor. On the warp send path the standard kernels split
    it around the sends (``add_send_phase``): ``count_and_reserve`` before, in role
    ``monitor``, and ``signal_after_sends`` after, in role ``signal``, so the monitor blocks
    send too.

    The reference's ``comm_warp_base`` (the absolute warp id of the comm class's first warp)
    is the role's ``r.warp_base``: ``r.warp`` is already role-local, and a block's monitor
    warps are the role's warps, so block ``b`` owns experts ``b * role_warps + w``. ``sm_id``
    (a u32 IR value, default the block index) is that ``b``: a fused kernel that runs the
    role on remapped blocks passes each block's index among the monitor blocks
    (``monitor_expert``)."""
    E, K = cfg.layout.n_monitored_experts, cfg.layout.top_k
    dest = p.dest
    expert_idx, g = monitor_expert(r, cfg, p, sm_id)
    count = r.var("count", T.u32, 0)
    fl_off = dest.offset_var(r)
    with r.if_(expert_idx < E):
        r.assign(count, count_routed(r, p.topk_ids, p.n_tokens * K, g))
        dest.reserve(r, g, count, fl_off)
    signal_completion(r, cfg, p, expert_idx, g, count, fl_off)


def monitor_expert(r: ir.RoleBuilder, cfg, p, sm_id=None):
    """``(expert_idx, g)`` of this monitor warp: ``sm_id * role_warps + warp`` (``sm_id``: the
    block's index among the monitor blocks, default the block index), and the global expert
    it owns (``layout.monitored_expert``: ``+ L * my_rank`` under ``skip_a2a``)."""
    sm = r.block if sm_id is None else ir.as_expr(sm_id)
    expert_idx = r.let("expert_idx", sm * (r.n_threads // 32) + r.warp)
    g = r.let("g", cfg.layout.monitored_expert(expert_idx, p.my_rank))
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


def count_and_reserve(r: ir.RoleBuilder, cfg, p, sm_id=None):
    """Role ``monitor`` of the warp send path (whole monitor blocks, before the sends): the
    counts from one shared histogram per block (``count_block_experts``) into the monitor
    state, then the destination's reservation (``p.dest.reserve_counted``: with
    ``ep_final_layout`` the final rows' reservation) and, capacity-strided, the block offset
    into the monitor state. Counting and reserving come before every send: the final layout's sends wait for
    the block bases published here. ``sm_id`` as in ``monitor_expert``."""
    E, K = cfg.layout.n_monitored_experts, cfg.layout.top_k
    dest = p.dest
    expert_idx, g = monitor_expert(r, cfg, p, sm_id)
    count_block_experts(r, p.topk_ids, p.n_tokens * K, g - r.warp, monitor_state(r))

    def keep_offset(off):
        with r.if_(r.lane.eq(0)):
            r.store(monitor_state(r, 1), off)

    dest.reserve_counted(r, expert_idx < E, g,
                         lambda: r.load(monitor_state(r, 0), T.u32, name="count"), keep_offset)


def signal_after_sends(r: ir.RoleBuilder, cfg, p, token_warps: int = 1, sm_id=None):
    """Role ``signal`` of the warp send path (the monitor blocks, after their own sends):
    ``signal_completion`` with the count and offset the role ``monitor`` left in the
    monitor state; ``token_warps`` as the sends'; ``sm_id`` as ``count_and_reserve``'s."""
    expert_idx, g = monitor_expert(r, cfg, p, sm_id)
    count = r.let("count", r.load(monitor_state(r, 0), T.u32, name="count_ld"))
    fl_off = p.dest.carried_offset(
        r, lambda: r.load(monitor_state(r, 1), T.u32, name="fl_off_ld"))
    signal_completion(r, cfg, p, expert_idx, g, count, fl_off, token_warps)


def signal_completion(r: ir.RoleBuilder, cfg, p, expert_idx, g, count, fl_off,
                      token_warps: int = 1):
    """The monitor warp's lane 0, for its expert (``expert_idx < n_monitored_experts``: ``E``,
    ``L`` under ``skip_a2a``): bounded wait until the finished counter reaches ``count``
    (``ld.acquire.gpu``; ``token_warps * count`` when that many warps share each token and each
    counts its share of a copy), publish the count word (``p.dest.count_word``; or the ORD-R
    rank completion), re-arm the counters (and the destination's words: ``p.dest.rearm``). A
    destination outside the P2P group (``cfg.needs_shmem``) gets the count word through
    ``nvshmemx_signal_op`` and a ``nvshmem_quiet`` (``shmem_send.signal_remote_count``)
    instead, with or without ORD-R: the poll then only says every slot of the block was
    reserved and its put issued; the messages' own signals tell the destination they
    landed. With ``ep_rank_mask`` (which refuses the SHMEM transport) nothing is published
    to a destination this rank masks (``rank_mask.if_live``); the wait still counts every
    copy, sent or skipped."""
    dest = p.dest
    lay = cfg.layout
    E, L, R = cfg.n_experts, lay.n_local_experts, cfg.n_ranks
    reserved, finished = p.counters, _word(p.counters, E)
    with r.if_(expert_idx < lay.n_monitored_experts):
        with r.if_(r.lane.eq(0)):
            dst_rank = r.let("dst_rank", g // L)
            e = r.let("e", g % L)
            signal_offset = r.let("signal_offset", e * R + lay.rank_coord(p.my_rank))
            counter_offset = r.let("counter_offset", e * R + lay.rank_coord(dst_rank))
            r.spin_wait(_word(finished, counter_offset), T.u32, CmpOp.EQ,
                        count * token_warps if token_warps > 1 else count,
                        buffer="expert_finished_counter", index=counter_offset,
                        sem=Sem.ACQUIRE, scope=Scope.GPU)
            counts = load_pointer(r, p.recv_count_ptrs, lay.peer_index(dst_rank),
                                  "recv_count_dst", peer=lay.crosses_devices)
            published = dest.count_word(count, fl_off)

            def signal_in_group():
                if cfg.ep_ord_r:
                    signal_rank_completion(r, cfg, counts, signal_offset, published,
                                           lay.peer_index(dst_rank), p.counters, p.my_rank)
                else:
                    r.store(_word(counts, signal_offset, 8), published.cast(T.u64),
                            Sem.RELEASE, signal_scope(cfg))
            if cfg.needs_shmem:    # remote: the count word through NVSHMEM
                with r.if_(in_group(cfg, dst_rank, p.my_rank)):
                    signal_in_group()
                with r.if_(is_remote(cfg, dst_rank, p.my_rank)):
                    signal_remote_count(r, cfg, p, signal_offset, published, dst_rank)
            else:
                with if_live(r, p.mask, dst_rank):     # ep_rank_mask: nothing to a masked rank
                    signal_in_group()
            r.store(_word(reserved, counter_offset), 0)
            r.store(_word(finished, counter_offset), 0)
            dest.rearm(r, counter_offset)


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


__all__ = ["monitor_and_signal_completion", "monitor_expert", "monitor_state", "MONITOR_STATE",
           "count_and_reserve", "signal_after_sends", "signal_completion", "count_routed",
           "count_block_experts"]
