"""``dispatch_wait``: the last block (aux) waits for every receive-count word, computes the
output offsets and raises the ready flag; the other blocks copy received messages into the
grouped output, claiming 128-token tiles per local expert (reference page:
``wait_for_arrivals_and_compute_offsets``, ``copy_received_tokens_to_output``)."""

from __future__ import annotations

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from .common import (DATA_READY_FLAG, SENTINEL, block_inclusive_scan, comm_sync,
                     exit_if_aborted,
                     lowest_set_bit)
from .common import word as _word
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
    )
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def wait_for_arrivals_and_compute_offsets(r: ir.RoleBuilder, kb: ir.KernelBuilder, cfg,
                                          p: WaitParams, comm_barrier_id: int = -1):
    """Aux block. Thread ``w < E`` waits (bounded, ``ld.acquire.sys``) until receive-count word
    ``w = e*R + src`` is published; a block-wide inclusive scan of the counts gives
    ``row_offsets`` (expert-major, source-major inside an expert), the within-expert rank
    prefixes (Region B) and zeroed tile counters (Region C); thread 0 stores the cleanup count
    (Region D) and raises the ready flag with ``st.release.gpu`` (Region E). After the flag:
    the per-pair row ranges (Region A) and the re-armed sentinels. With ``ep_ord_r`` the
    block acquires the ``R`` rank flags instead of every count word, reads the counts with
    plain loads and re-arms the flags too (``ord_r.acquire_rank_flags``,
    ``ord_r.rearm_rank_flags``)."""
    lay = cfg.layout
    E, L, R = cfg.n_experts, lay.n_local_experts, cfg.n_ranks
    ctr = p.atomic_counter
    S = kb.shared_buffer("prefix_s", 4 * E)
    totals = kb.shared_buffer("warp_totals", 4 * 32)
    tid = r.tid
    with r.if_(tid < L):
        r.store(_word(p.expert_ids, tid), tid)
    with r.if_(tid.eq(0)):
        r.store(p.row_offsets, 0)
    if cfg.ep_ord_r:
        c = acquire_rank_flags(r, cfg, p.recv_count_p, p.err_buf, comm_barrier_id)
    else:
        c = wait_for_count_words(r, cfg, p, comm_barrier_id)
    incl = block_inclusive_scan(r, c, totals, r.n_threads // 32, "incl", comm_barrier_id)
    e = r.let("e", tid // R)
    with r.if_(tid < E):
        r.store(_word(S, tid), incl)
        with r.if_((tid % R).eq(R - 1)):
            r.store(_word(p.row_offsets, e + 1), incl)
    comm_sync(r, comm_barrier_id)
    cfg.token_fmt.emit_pad_expert_offsets(r, p.row_offsets, L)
    raw_start = r.var("raw_start", T.u32, 0)
    with r.if_(tid < E):
        with r.if_(e > 0):
            r.assign(raw_start, r.load(_word(S, e * R - 1), T.u32, name="s_prev_e"))
        r.store(_word(ctr, lay.rank_prefix_offset + tid), incl - raw_start)
    with r.if_(tid < L):
        r.store(_word(ctr, lay.work_counter_offset + tid), 0)
    comm_sync(r, comm_barrier_id)
    with r.if_(tid.eq(0)):
        r.store(_word(ctr, lay.cleanup_counter_offset), r.n_blocks - 1)
        r.store(_word(ctr, lay.ready_flag_offset), DATA_READY_FLAG, Sem.RELEASE, Scope.GPU)
    with r.if_(tid < E):
        aligned = r.load(_word(p.row_offsets, e), T.u32, name="aligned_start")
        prev = r.var("prev_incl", T.u32, 0)
        with r.if_(tid > 0):
            r.assign(prev, r.load(_word(S, tid - 1), T.u32, name="s_prev"))
        r.store(_word(ctr, 2 * tid), DATA_READY_FLAG + incl + (aligned - raw_start))
        r.store(_word(ctr, 2 * tid + 1), incl - prev)
        r.store(_word(p.recv_count_p, tid, 8), ir.Const(SENTINEL, T.u64))
    if cfg.ep_ord_r:
        rearm_rank_flags(r, cfg, p.recv_count_p)


def wait_for_count_words(r: ir.RoleBuilder, cfg, p: WaitParams, comm_barrier_id: int = -1):
    """Per-expert arrivals (legacy): thread ``w < E`` waits (bounded, ``ld.acquire.sys``;
    ``gpu`` under ``skip_a2a``) until count word ``w`` is not the sentinel, then the comm
    barrier. Returns the u32 count of this thread."""
    c = r.var("c", T.u32, 0)
    with r.if_(r.tid < cfg.n_experts):
        seen = r.spin_wait(_word(p.recv_count_p, r.tid, 8), T.u64, CmpOp.NE, SENTINEL,
                           buffer="recv_count", index=r.tid, sem=Sem.ACQUIRE,
                           scope=Scope.GPU if cfg.skip_a2a else Scope.SYS)
        r.assign(c, seen.cast(T.u32))
    comm_sync(r, comm_barrier_id)
    exit_if_aborted(r, p.err_buf)
    return c


def copy_received_tokens_to_output(r: ir.RoleBuilder, kb: ir.KernelBuilder, cfg, p: WaitParams,
                                   comm_barrier_id: int = -1):
    """Comm blocks: block ``b`` serves local expert ``b % L``. Thread 0 waits (bounded,
    ``ld.acquire.gpu``) for the ready flag, then claims tiles of 128 of the expert's tokens
    (``atom.acquire.gpu.add`` on its tile counter). Warp ``w`` copies tile tokens ``w, w +
    n_warps, ...``: the source rank of a token is the lowest lane ``r`` with ``token <
    rank_prefix[r]`` (``vote.sync.ballot``), its message sits in slot ``token - prefix[r-1]`` of
    block ``[e, r]``; the format copies the payload and the lane whose top-k id is this expert
    writes ``src_info[row] = (source index, k)``. The last block to finish lowers the flag."""
    lay, fmt = cfg.layout, cfg.token_fmt
    E, L, R, K = cfg.n_experts, lay.n_local_experts, cfg.n_ranks, lay.top_k
    tile_tokens = fmt.dispatch_wait_tile_shape[0]
    ctr = p.atomic_counter
    prefix = kb.shared_buffer("rank_prefix", 4 * max(R, 1))
    vals = kb.shared_buffer("tile_vals", 8)
    e = r.let("e", r.block % L)
    g = r.let("g", p.my_rank * L + e)
    with r.if_(r.tid.eq(0)):
        r.spin_wait(_word(ctr, lay.ready_flag_offset), T.u32, CmpOp.EQ, DATA_READY_FLAG,
                    buffer="ready_flag", index=lay.ready_flag_offset, sem=Sem.ACQUIRE,
                    scope=Scope.GPU, backoff_ns=32)
    comm_sync(r, comm_barrier_id)
    exit_if_aborted(r, p.err_buf)
    with r.if_(r.tid.eq(0)):
        r.store(vals, r.load(_word(p.row_offsets, e), T.u32, name="expert_start"))
        r.store(vals + 4, r.atomic(AtomOp.ADD, _word(ctr, lay.work_counter_offset + e), 1,
                                   Sem.ACQUIRE, Scope.GPU, name="claim0"))
    with r.if_(r.tid < R):
        r.store(_word(prefix, r.tid),
                r.load(_word(ctr, lay.rank_prefix_offset + e * R + r.tid), T.u32, name="pfx"))
    comm_sync(r, comm_barrier_id)
    start = r.let("start", r.load(vals, T.u32, name="start_ld"))
    tile = r.let("tile", r.load(vals + 4, T.u32, name="tile_ld"))
    total = r.let("total", r.load(_word(prefix, R - 1), T.u32, name="total_ld"))
    with r.while_(ir.Const(1, T.pred)):
        ts = r.let("ts", tile * tile_tokens)
        with r.if_(ts >= total):
            r.break_()
        n_in_tile = r.let("n_in_tile", (total - ts).min(tile_tokens))
        with r.for_range("j", r.warp, n_in_tile, lay.n_warps) as j:
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
            fmt.emit_copy_msg_to_output(r, msg, row, p.output_tokens)
            with r.if_(r.lane < K):
                gid = r.load(msg + fmt.topk_info_offset + (r.lane * 2).cast(T.u64), T.u16,
                             name="gid16")
                with r.if_(gid.eq(g.cast(T.u16))):
                    src_idx = r.load(msg + fmt.src_info_offset, T.u32, name="src_idx")
                    r.store(_word(p.src_info, row * 2), src_idx)
                    r.store(_word(p.src_info, row * 2 + 1), r.lane)
        comm_sync(r, comm_barrier_id)
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


def build_dispatch_wait(cfg) -> ir.Kernel:
    """The dispatch_wait entry point: the last block is the aux block, the others copy."""
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb, cfg)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last)) as r:
        copy_received_tokens_to_output(r, kb, cfg, p)
    with kb.role("aux", blocks=(last, None)) as r:
        wait_for_arrivals_and_compute_offsets(r, kb, cfg, p)
    return kb.build()
