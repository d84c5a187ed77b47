"""``dispatch_wait``: the last block (aux) waits for every receive-count word, computes the
output offsets and raises the ready flag; the other blocks copy received messages into the
grouped output, claiming 128-token tiles per local expert (reference page:
``wait_for_arrivals_and_compute_offsets``, ``copy_received_tokens_to_output``)."""

from __future__ import annotations

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from . import final_layout, trace
from .common import (DATA_READY_FLAG, SENTINEL, block_inclusive_scan, comm_sync,
                     exit_if_aborted, lowest_set_bit, published_count_word, wait_ready_flag)
from .common import word as _word
from .schedule import claim_next_tile, fill_sm_schedule, first_expert, load_expert_tiles
from .scratch import Scratch
from .ord_r import acquire_rank_flags, rearm_rank_flags

KERNEL_NAME = "ep_dispatch_wait"


@attrs.frozen
class WaitParams:
    """Kernel parameters of dispatch_wait, named as the reference method arguments."""

    recv_buf_p: ir.Param
    recv_count_p: ir.Param
    atomic_counter: ir.Param
    output_tokens: ir.Param
    row_offsets: ir.Param
    expert_ids: ir.Param
    src_info: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param
    hdr_p: ir.Param | None = None
    prod_gen_word: ir.Param | None = None


def declare_params(kb: ir.KernelBuilder, cfg) -> WaitParams:
    peer = not cfg.skip_a2a
    p = WaitParams(
        recv_buf_p=kb.param("recv_buf_p", T.ptr_global, peer=peer),
        recv_count_p=kb.param("recv_count_p", T.ptr_global, peer=peer),
        atomic_counter=kb.param("atomic_counter", T.ptr_global),
        output_tokens=kb.param("output_tokens", T.ptr_global),
        row_offsets=kb.param("row_offsets", T.ptr_global),
        expert_ids=kb.param("expert_ids", T.ptr_global),
        src_info=kb.param("src_info", T.ptr_global),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
        hdr_p=final_layout.declare_wait_params(kb, cfg),
        prod_gen_word=final_layout.declare_wait_generation(kb, cfg),
    )
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def wait_for_arrivals_and_compute_offsets(r: ir.RoleBuilder, kb: ir.KernelBuilder, cfg,
                                          p: WaitParams, comm_barrier_id: int = -1, *,
                                          reserved_shared_expert_tokens=None,
                                          flag_readers_per_block: int = 1,
                                          n_active_offset_sms=None):
    """Aux block. Thread ``w < E`` waits (bounded, ``ld.acquire.sys``) until receive-count word
    ``w = e*R + src`` is published; a block-wide inclusive scan of the counts gives
    ``row_offsets`` (expert-major, source-major inside an expert), the within-expert rank
    prefixes (Region B), zeroed tile counters (Region C) and the SM schedule table
    (``fill_sm_schedule``); thread 0 stores the cleanup count (Region D: ``grid - 1`` times
    ``flag_readers_per_block``, the roles of a copy block that each lower it once) and raises
    the ready flag with ``st.release.gpu`` (Region E). After the flag: the per-pair row ranges
    (Region A) and the re-armed sentinels. ``n_active_offset_sms`` (a u32 IR value; default
    ``grid - 1``) is the number of copy blocks: the readers of the ready flag and the blocks
    the SM schedule spreads over, so a fused kernel that copies on fewer blocks passes it.

    With ``fused_shared_expert`` the shared expert is group 0 (``expert_ids[j] = j``, local
    expert ``e`` is group ``e + 1``) of ``reserved_shared_expert_tokens`` rows (a u32
    expression), so ``row_offsets[1]`` is that count and the routed rows follow it.
    Capacity-strided (``ep_final_layout`` alone): ``row_offsets[e] = e * R * max_tokens_per_rank``,
    each pair's end row from the block offset its count word carries, and the reservation
    cursors re-armed to 0 (``st.global.b64``). With ``ep_ord_r`` the
    block acquires the ``R`` rank flags instead of every count word, reads the counts with
    plain loads and re-arms the flags too (``ord_r.acquire_rank_flags``,
    ``ord_r.rearm_rank_flags``)."""
    lay = cfg.layout
    E, L, R = cfg.n_experts, lay.n_local_experts, cfg.n_ranks
    se = int(bool(cfg.fused_shared_expert))
    if se and reserved_shared_expert_tokens is None:
        raise ValueError("fused_shared_expert: wait_for_arrivals_and_compute_offsets needs "
                         "reserved_shared_expert_tokens (the shared expert's rows, group 0)")
    reserved = ir.as_expr(reserved_shared_expert_tokens) if se else None
    ctr = p.atomic_counter
    S = kb.shared_buffer("prefix_s", 4 * E)
    totals = kb.shared_buffer("warp_totals", 4 * 32)
    tid = r.tid
    with r.if_(tid < L + se):
        r.store(_word(p.expert_ids, tid), tid)
    with r.if_(tid.eq(0)):
        r.store(p.row_offsets, 0)
        if se:
            r.store(_word(p.row_offsets, 1), reserved)
    strided = lay.capacity_strided
    if cfg.ep_ord_r:   # (EPConfig refuses ep_ord_r with the capacity-strided layout)
        c, block_off = acquire_rank_flags(r, cfg, p.recv_count_p, p.err_buf,
                                          comm_barrier_id, p.my_rank), None
    else:
        c, block_off = wait_for_count_words(r, cfg, p, comm_barrier_id)
    trace.stamp(r, "aux.counts_seen")
    incl = block_inclusive_scan(r, c, totals, r.n_threads // 32, "incl", comm_barrier_id)
    e = r.let("e", tid // R)
    with r.if_(tid < E):
        r.store(_word(S, tid), incl)
        with r.if_((tid % R).eq(R - 1)):
            end = final_layout.group_end(cfg, e, incl)
            r.store(_word(p.row_offsets, e + (1 + se)), end + reserved if se else end)
    comm_sync(r, comm_barrier_id)
    if not strided:
        cfg.token_fmt.emit_pad_expert_offsets(r, p.row_offsets, L + se,
                                              comm_barrier_id=comm_barrier_id)
    raw_start = r.var("raw_start", T.u32, 0)
    with r.if_(tid < E):
        with r.if_(e > 0):
            r.assign(raw_start, r.load(_word(S, e * R - 1), T.u32, name="s_prev_e"))
        r.store(_word(ctr, lay.rank_prefix_offset + tid), incl - raw_start)
    with r.if_(tid < L):
        r.store(_word(ctr, lay.work_counter_offset + tid), 0)
    n_copy = r.n_blocks - 1 if n_active_offset_sms is None else ir.as_expr(n_active_offset_sms)
    fill_sm_schedule(r, cfg, ctr, S, totals, comm_barrier_id, n_copy)
    comm_sync(r, comm_barrier_id)
    with r.if_(tid.eq(0)):
        n_readers = n_copy
        if flag_readers_per_block != 1:
            n_readers = n_readers * flag_readers_per_block
        r.store(_word(ctr, lay.cleanup_counter_offset), n_readers)
        trace.stamp(r, "aux.flag_raised")      # before the store: no reader can precede it
        r.store(_word(ctr, lay.ready_flag_offset), DATA_READY_FLAG, Sem.RELEASE, Scope.GPU)
    with r.if_(tid < E):
        # incl and raw_start count routed rows only; aligned (the expert's padded start) also
        # counts the shared expert's rows, so the end row comes out in output rows
        aligned = r.load(_word(p.row_offsets, e + se if se else e), T.u32,
                         name="aligned_start")
        prev = r.var("prev_incl", T.u32, 0)
        with r.if_(tid > 0):
            r.assign(prev, r.load(_word(S, tid - 1), T.u32, name="s_prev"))
        if strided:  # blocks land in reservation order: the end comes from the count word
            r.store(_word(ctr, 2 * tid), DATA_READY_FLAG + aligned + block_off + c)
        else:
            r.store(_word(ctr, 2 * tid), DATA_READY_FLAG + incl + (aligned - raw_start))
        r.store(_word(ctr, 2 * tid + 1), incl - prev)
        r.store(_word(p.recv_count_p, tid, 8), ir.Const(SENTINEL, T.u64))
    final_layout.rearm_cursors(r, cfg, p.recv_count_p)
    if cfg.ep_ord_r:
        rearm_rank_flags(r, cfg, p.recv_count_p)



def copy_scratch_bytes(cfg) -> int:
    """Shared scratch bytes of ``copy_received_tokens_to_output`` (its dynamic shared memory
    past ``comm_smem_base`` when that is given): the rank prefixes, the tile values and the
    format's per-tile message addresses (``tile_smem_bytes``)."""
    fmt = cfg.token_fmt
    tile = -(-fmt.tile_smem_bytes(fmt.dispatch_wait_tile_shape[0]) // 16) * 16
    return -(-4 * max(cfg.n_ranks, 1) // 16) * 16 + 16 + tile


def check_l1_release(cfg, l1_arrival_ptr, token_block: int, atomic_pad: int, delta: int):
    """``emit_l1_release`` parameters: ``ValueError`` naming the parameter and the rule."""
    TT, KS = cfg.token_fmt.dispatch_wait_tile_shape
    if l1_arrival_ptr is None:
        raise ValueError("emit_l1_release needs l1_arrival_ptr (the L1 arrival counters)")
    if isinstance(token_block, bool) or not isinstance(token_block, int) or token_block < 1 \
            or TT % token_block:
        raise ValueError(f"l1_release_token_block must be a positive divisor of the "
                         f"dispatch_wait tile's {TT} tokens (a token block never straddles two "
                         f"tiles, which different blocks copy), got {token_block!r}")
    if isinstance(atomic_pad, bool) or not isinstance(atomic_pad, int) or atomic_pad < 1:
        raise ValueError(f"l1_release_atomic_pad must be a positive word count, got "
                         f"{atomic_pad!r}")
    if isinstance(delta, bool) or not isinstance(delta, int) or not 1 <= delta < 2**32:
        raise ValueError(f"l1_release_delta must be a u32 in [1, 2**32), got {delta!r}")
    if KS != 1:
        raise ValueError(f"emit_l1_release needs a format whose dispatch_wait tile has one k "
                         f"split (a row lands only when every split is copied), got "
                         f"{cfg.token_fmt.name} with {KS}")


def check_final_layout_copy(emit_l1_release: bool, scatter_sm_id) -> None:
    """``ep_final_layout``'s copy role (``final_layout.copy_received_headers``, one expert per
    block) publishes no L1 arrivals and takes its expert from the block index: refuse the
    arguments it would otherwise drop, naming them."""
    if emit_l1_release:
        raise ValueError("emit_l1_release is not implemented with ep_final_layout (the "
                         "final layout's header pass publishes no L1 arrival counters): "
                         "build without one of them")
    if scatter_sm_id is not None:
        raise ValueError("scatter_sm_id is not taken with ep_final_layout (its header pass "
                         "assigns experts by block index)")


def wait_for_count_words(r: ir.RoleBuilder, cfg, p: WaitParams, comm_barrier_id: int = -1):
    """Per-expert arrivals (legacy): thread ``w < E`` of a published word
    (``published_count_word``; the others count 0) waits (bounded, ``ld.acquire.sys``;
    ``gpu`` under ``skip_a2a``) until count word ``w`` is not the sentinel, then the comm
    barrier. Returns the u32 count of this thread and, capacity-strided (``ep_final_layout``
    alone), the block offset its count word carries in the high half (else None)."""
    c = r.var("c", T.u32, 0)
    strided = cfg.layout.capacity_strided
    block_off = r.var("block_off", T.u32, 0) if strided else None
    with r.if_(published_count_word(cfg, r.tid)):
        seen = r.spin_wait(_word(p.recv_count_p, r.tid, 8), T.u64, CmpOp.NE, SENTINEL,
                           buffer="recv_count", index=r.tid, sem=Sem.ACQUIRE,
                           scope=Scope.GPU if cfg.skip_a2a else Scope.SYS)
        r.assign(c, seen.cast(T.u32))
        if strided:
            r.assign(block_off, (seen >> 32).cast(T.u32))
    comm_sync(r, comm_barrier_id)
    exit_if_aborted(r, p.err_buf)
    return c, block_off


def copy_received_tokens_to_output(r: ir.RoleBuilder, kb: ir.KernelBuilder, cfg, p: WaitParams,
                                   comm_barrier_id: int = -1, *, comm_smem_base: int | None = None,
                                   emit_l1_release: bool = False, l1_release_token_block: int = 1,
                                   l1_release_atomic_pad: int = 1, l1_release_delta: int = 1,
                                   l1_arrival_ptr=None, scatter_sm_id=None,
                                   trace_scatter_release: bool = False,
                                   trace_rings_per_cta: int = 1, trace_ring_capacity: int = 1,
                                   trace_comm_ring_id: int = 0,
                                   trace_buf: trace.TraceBuf | trace.NullTrace = trace.NullTrace(),
                                   trace_ring_base=0):
    """Comm blocks. Thread 0 waits (bounded, ``ld.acquire.gpu``) for the ready flag. Block
    ``b`` starts on expert ``sm_schedule[b]`` and warp 0 claims tiles of 128 of the expert's
    tokens (``atom.acquire.gpu.add`` on its tile counter), moving on to later experts when it
    is exhausted (``schedule.claim_next_tile``). Warp ``w`` of the role copies tile tokens
    ``w, w + n_warps, ...``: the source rank of a token is the lowest lane ``r`` with ``token <
    rank_prefix[r]`` (``vote.sync.ballot``), its message sits in slot ``token - prefix[r-1]``
    of block ``[e, r]``; lanes ``k < K`` load the header's top-k id ``k`` and source index
    before the format copies the payload (so the two dependent round trips that would
    follow the copy hide behind it; measured neutral on the H200, kept as it costs nothing),
    then the lane whose top-k
    id is this expert writes ``src_info[row] = (source index, k)``. A format that copies
    scales per tile
    (``copies_scales_per_tile``: transposed scales) gets each message's address in shared
    memory (lane 0, ``st.shared.u64``) and, after the tile's barrier, the whole role copies
    the tile's scales (``emit_copy_tile_scales``). The last block to finish lowers the
    flag. With ``fused_shared_expert`` expert ``e``'s rows start at ``row_offsets[e + 1]``.

    Fused-kernel role parameters: the role's ``ThreadRange`` is ``comm_thread_base`` /
    ``n_comm_threads`` (``r.tid`` and ``r.warp`` are role-local), ``comm_barrier_id`` as in
    ``comm_sync``; ``comm_smem_base`` puts the scratch (``copy_scratch_bytes``) in dynamic
    shared memory from that byte offset instead of static buffers. ``emit_l1_release``: after
    each tile's rows have landed (the role's barrier), warp 0 publishes them on expert ``e``'s
    L1 arrival counter (u32 word ``l1_arrival_ptr + e * l1_release_atomic_pad``): one
    ``red.release.gpu.global.add.u32`` of ``l1_release_delta`` per ``l1_release_token_block``
    tokens (the last block of an expert may be partial), so expert ``e``'s counter ends at
    ``delta * ceil(count_e / token_block)``. ``scatter_sm_id`` (a u32 IR value, default the
    block index): the block's index among the copy blocks, which picks its entry of the SM
    schedule, so a fused kernel can run the role on remapped blocks (ids ``0 ..
    n_active_offset_sms - 1``, each once). ``ep_final_layout`` takes neither
    ``emit_l1_release`` nor ``scatter_sm_id`` (``check_final_layout_copy``).

    Trace (``epgen.kernels.trace``): ``trace_buf`` is the sink (``NullTrace``, the default,
    compiles every stamp out); the role writes ring ``trace_comm_ring_id`` of the
    ``trace_rings_per_cta`` rings of ``trace_ring_capacity`` events each block owns from ring
    ``trace_ring_base`` on: ``copy.flag_seen`` in each warp, ``copy.tile`` for each of warp 0's
    claims and, with ``trace_scatter_release``, ``copy.l1_release`` before each L1 release."""
    if not isinstance(trace_buf, (trace.TraceBuf, trace.NullTrace)):
        raise ValueError(f"trace_buf must be a trace.TraceBuf or trace.NullTrace, got "
                         f"{trace_buf!r}")
    if not isinstance(trace_scatter_release, bool):
        raise ValueError(f"trace_scatter_release must be a bool, got {trace_scatter_release!r}")
    ring = trace_buf.ring(rings_per_cta=trace_rings_per_cta, ring_capacity=trace_ring_capacity,
                          ring_id=trace_comm_ring_id, ring_base=trace_ring_base)
    if cfg.ep_final_layout:
        check_final_layout_copy(emit_l1_release, scatter_sm_id)
        return final_layout.copy_received_headers(r, kb, cfg, p, comm_barrier_id)
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R, K = lay.n_local_experts, cfg.n_ranks, lay.top_k
    se = int(bool(cfg.fused_shared_expert))
    TT, KS = fmt.dispatch_wait_tile_shape
    if emit_l1_release:
        check_l1_release(cfg, l1_arrival_ptr, l1_release_token_block, l1_release_atomic_pad,
                         l1_release_delta)
    n_warps = r.n_threads // 32
    ctr = p.atomic_counter
    scratch = Scratch(kb, comm_smem_base)
    prefix = scratch.buffer("rank_prefix", 4 * max(R, 1))
    vals = scratch.buffer("tile_vals", 16)          # [start row, tile id, expert (L: done)]
    tile_msgs = scratch.buffer("tile_msgs", fmt.tile_smem_bytes(TT)) \
        if fmt.copies_scales_per_tile else None
    wait_ready_flag(r, cfg, ctr, p.err_buf, comm_barrier_id)
    ring.stamp(r, "copy.flag_seen")
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
            if trace_buf.enabled:
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
        comm_sync(r, comm_barrier_id)
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
            rank_coord = 0 if cfg.skip_a2a else src_rank
            slot = ((e * R + rank_coord) * lay.block_capacity + (tok - base_r)).cast(T.u64)
            msg = r.let("msg", p.recv_buf_p + slot * lay.msg_bytes, peer=not cfg.skip_a2a)
            row = r.let("row", start + tok)
            gid = r.var("gid16", T.u16, ir.Const(0xFFFF, T.u16))
            src_idx = r.var("src_idx", T.u32, 0)

            def load_header():
                with r.if_(r.lane < K):
                    r.assign(gid, r.load(msg + fmt.topk_info_offset
                                         + (r.lane * 2).cast(T.u64), T.u16, name="gid16_ld"))
                    r.assign(src_idx, r.load(msg + fmt.src_info_offset, T.u32,
                                             name="src_idx_ld"))

            load_header()
            if tile_msgs is not None:
                with r.if_(r.lane.eq(0)):
                    r.store(tile_msgs + (j * 8).cast(T.u64), msg)
            extras = {"scales": False} if fmt.copies_scales_per_tile else {}
            fmt.emit_copy_msg_to_output(r, msg, row, p.output_tokens, **extras)
            with r.if_((r.lane < K) & gid.eq(g.cast(T.u16))):
                r.store(_word(p.src_info, row * 2), src_idx)
                r.store(_word(p.src_info, row * 2 + 1), r.lane)
        comm_sync(r, comm_barrier_id)
        if fmt.copies_scales_per_tile:
            # the next tile's addresses are stored only after warp 0's claim barrier
            fmt.emit_copy_tile_scales(r, tile_msgs, r.let("tile_row0", start + ts), n_in_tile,
                                      TT, r.tid, r.n_threads)
            if emit_l1_release:
                comm_sync(r, comm_barrier_id)
        if emit_l1_release:
            emit_l1_arrival_release(r, l1_arrival_ptr, e, n_in_tile, l1_release_token_block,
                                    l1_release_atomic_pad, l1_release_delta,
                                    ring if trace_scatter_release else trace.NullTrace(),
                                    ts // l1_release_token_block)
    with r.if_(r.tid.eq(0)):
        lower_ready_flag_if_last(r, cfg, ctr)


def emit_l1_arrival_release(r: ir.RoleBuilder, l1_arrival_ptr, e, n_in_tile, token_block: int,
                            atomic_pad: int, delta: int, ring=trace.NullTrace(),
                            first_block=0):
    """Warp 0, after the barrier that follows a tile's copy: ``ceil(n_in_tile / token_block)``
    ``red.release.gpu.global.add.u32`` of ``delta`` on expert ``e``'s L1 arrival counter
    (u32 word ``e * atomic_pad``), one per token block, spread over the lanes; each lane
    stamps ``copy.l1_release`` on ``ring`` just before each of its releases (payload: ``e <<
    32`` and the expert's token block, ``first_block`` that of the tile's first)."""
    n_rel = (n_in_tile + (token_block - 1)) // token_block if token_block > 1 else n_in_tile
    with r.if_(r.warp.eq(0)):
        with r.for_range("l1_rel", r.lane, n_rel, 32) as i:
            if ring.enabled:    # before the release: no consumer can precede the stamp
                ring.stamp(r, "copy.l1_release", (e.cast(T.u64) << 32)
                           | (first_block + i).cast(T.u64), leader=False)
            r.red(AtomOp.ADD, _word(l1_arrival_ptr, e * atomic_pad), delta, Sem.RELEASE,
                  Scope.GPU)


def lower_ready_flag_if_last(r: ir.RoleBuilder, cfg, ctr):
    """One reader of the ready flag is done (``atom.relaxed.gpu.add`` of -1 on Region D); the
    last one lowers the flag (Region E) for the next call."""
    lay = cfg.layout
    old = r.atomic(AtomOp.ADD, _word(ctr, lay.cleanup_counter_offset), 0xFFFFFFFF,
                   Sem.RELAXED, Scope.GPU, name="cleanup_old")
    with r.if_(old.eq(1)):
        r.store(_word(ctr, lay.ready_flag_offset), 0)


def build_dispatch_wait(cfg) -> ir.Kernel:
    """The dispatch_wait entry point: the last block is the aux block, the others copy."""
    if cfg.fused_shared_expert:
        raise ValueError("fused_shared_expert: the standalone dispatch_wait does not take the "
                         "shared expert (only the fused dispatch kernel packs "
                         "it); build the fused kernel (epgen.kernels.build_dispatch_fused)")
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb, cfg)
    trace.instrument(kb, cfg, p.my_rank)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last)) as r:
        copy_received_tokens_to_output(r, kb, cfg, p, **trace.copy_args(kb))
    with kb.role("aux", blocks=(last, None)) as r:
        if p.prod_gen_word is not None:
            final_layout.advance_generation(r, p.prod_gen_word)
        wait_for_arrivals_and_compute_offsets(r, kb, cfg, p)
    return kb.build()
