"""``dispatch_wait``: the last block (aux) waits for every receive-count word, computes the
output offsets and raises the ready flag; the other blocks copy received messages into the
grouped output, claiming 128-token tiles per local expert (reference page:
``wait_for_arrivals_and_compute_offsets``, ``copy_received_tokens_to_output``)."""

from __future__ import annotations

import attrs

import ir
from ir import CmpOp, Scope, Sem
from ir import types as T

from . import destination, rank_mask, trace, wait_time
from .common import (DATA_READY_FLAG, SENTINEL, block_inclusive_scan, comm_sync,
                     exit_if_aborted, published_count_word, signal_scope)
from .common import word as _word
from .ord_r import acquire_rank_flags, rearm_rank_flags
from .schedule import fill_sm_schedule
from .shmem_send import is_remote, rearm_arrivals, wait_remote_arrivals
from .staged import StagedDestination
from .staged_copy import L1Release

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
    #: the destination strategy (``destination.declare_wait``), with its own parameters
    dest: StagedDestination | None = None
    #: ``ep_rank_mask``: the rank mask's parameters (``rank_mask.declare``)
    mask: rank_mask.MaskParams | None = None
    #: ``Tuning.wait_times``: the ``wait_time`` words (``wait_time.declare``), else None
    wait_time: ir.Param | None = None


def declare_params(kb: ir.KernelBuilder, cfg) -> WaitParams:
    """dispatch_wait's parameters on ``kb``, then the rank mask's (``ep_rank_mask``:
    ``rank_mask``, ``rank_mask_ptrs``), its destination strategy's
    (``destination.declare_wait``: the final layout's ``hdr_p``, ...), and its diagnostics
    (``err_buf``, ``my_rank``)."""
    peer = cfg.layout.crosses_devices
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
    p = attrs.evolve(p, mask=rank_mask.declare(kb, cfg, waits=True))
    p = attrs.evolve(p, dest=destination.declare_wait(kb, cfg, p))
    p = attrs.evolve(p, wait_time=wait_time.declare(kb, cfg))
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def wait_for_arrivals_and_compute_offsets(r: ir.RoleBuilder, cfg, p: WaitParams, *,
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
    What depends on the layout is the destination strategy's (``p.dest``): what the block
    does at entry (``start_arrivals``: ``ep_prod_reserve`` advances the generation), the
    offset a count word carries, the groups' ends and padding, each pair's end row and the
    re-arm of its own words (capacity-strided, ``ep_final_layout`` alone: ``row_offsets[e] =
    e * R * max_tokens_per_rank``, each pair's end row from the block offset its count word
    carries, the reservation cursors re-armed to 0). With ``ep_ord_r`` the
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
    ctr, dest = p.atomic_counter, p.dest
    dest.start_arrivals(r)
    S = r.scratch("prefix_s", 4 * E)
    totals = r.scratch("warp_totals", 4 * 32)
    tid = r.tid
    with r.if_(tid < L + se):
        r.store(_word(p.expert_ids, tid), tid)
    with r.if_(tid.eq(0)):
        r.store(p.row_offsets, 0)
        if se:
            r.store(_word(p.row_offsets, 1), reserved)
    if cfg.ep_ord_r:   # (EPConfig refuses ep_ord_r with the capacity-strided layout)
        c, block_off = acquire_rank_flags(r, cfg, p.recv_count_p, p.err_buf, p.my_rank), None
    else:
        c, block_off = wait_for_count_words(r, cfg, p)
    trace.stamp(r, "aux.counts_seen")
    incl = block_inclusive_scan(r, c, totals, r.n_threads // 32, "incl")
    e = r.let("e", tid // R)
    with r.if_(tid < E):
        r.store(_word(S, tid), incl)
        with r.if_((tid % R).eq(R - 1)):
            end = dest.group_end(e, incl)
            r.store(_word(p.row_offsets, e + (1 + se)), end + reserved if se else end)
    comm_sync(r)
    dest.pad_groups(r, p.row_offsets, L + se)
    raw_start = r.var("raw_start", T.u32, 0)
    with r.if_(tid < E):
        with r.if_(e > 0):
            r.assign(raw_start, r.load(_word(S, e * R - 1), T.u32, name="s_prev_e"))
        r.store(_word(ctr, lay.rank_prefix_offset + tid), incl - raw_start)
    with r.if_(tid < L):
        r.store(_word(ctr, lay.work_counter_offset + tid), 0)
    n_copy = r.n_blocks - 1 if n_active_offset_sms is None else ir.as_expr(n_active_offset_sms)
    fill_sm_schedule(r, cfg, ctr, S, totals, n_copy)
    comm_sync(r)
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
        r.store(_word(ctr, 2 * tid),
                dest.pair_end_word(DATA_READY_FLAG, incl, raw_start, aligned, block_off, c))
        r.store(_word(ctr, 2 * tid + 1), incl - prev)
        r.store(_word(p.recv_count_p, tid, 8), ir.Const(SENTINEL, T.u64))
    if cfg.needs_shmem:
        rearm_arrivals(r, cfg, p.recv_count_p)
    dest.rearm_arrivals(r)
    if cfg.ep_ord_r:
        rearm_rank_flags(r, cfg, p.recv_count_p)


def copy_scratch_bytes(cfg, n_threads: int | None = None) -> int:
    """Shared scratch bytes of ``copy_received_tokens_to_output`` on a role of ``n_threads``
    threads (default ``num_threads``): its dynamic shared memory past the role's
    ``smem_base`` when it has one (the destination strategy's ``copy_scratch_bytes``)."""
    n = cfg.num_threads if n_threads is None else n_threads
    return destination.strategy_class(cfg).copy_scratch_bytes(cfg, n)


def wait_for_count_words(r: ir.RoleBuilder, cfg, p: WaitParams):
    """Per-expert arrivals (legacy): thread ``w < E`` of a published word
    (``published_count_word``; the others count 0) waits (bounded, ``ld.acquire.sys``;
    ``gpu`` under ``skip_a2a``: ``signal_scope``) until count word ``w`` is not the sentinel,
    then the role's barrier; under the SHMEM transport the thread of a remote source's word
    then also waits for the word's arrival count (``shmem_send.wait_remote_arrivals``).
    Returns the u32 count of this thread and the block offset its count word carries
    (``p.dest.count_offset_var``: capacity-strided only, else None). With
    ``ep_rank_mask`` (which refuses the SHMEM transport) the wait is
    ``rank_mask.wait_for_rank`` on the word's source rank ``w % R``: a masked source counts
    0, unwaited for, and so does one masked by the wait (shrink); after the barrier every
    word of a source with a word missing counts 0 (``source_missing``), so a source that
    stopped half-way contributes nothing rather than some experts' rows. With
    ``Tuning.wait_times`` each thread ``w < E`` stores how long it waited into
    ``wait_time[w]`` (``wait_time.WaitClock``; 0 for a word that is not published)."""
    c = r.var("c", T.u32, 0)
    block_off = p.dest.count_offset_var(r)
    if p.mask is not None:
        missing = source_missing(r, cfg)
    clock = wait_time.WaitClock(r, p.wait_time, "count_wait")
    with r.if_(published_count_word(cfg, r.tid)):
        clock.start()
        if p.mask is None:
            seen = r.spin_wait(_word(p.recv_count_p, r.tid, 8), T.u64, CmpOp.NE, SENTINEL,
                               buffer="recv_count", index=r.tid, sem=Sem.ACQUIRE,
                               scope=signal_scope(cfg))
            r.assign(c, seen.cast(T.u32))
            p.dest.read_count_offset(r, seen, block_off)
            if cfg.needs_shmem:
                with r.if_(is_remote(cfg, r.tid % cfg.n_ranks, p.my_rank)):
                    wait_remote_arrivals(r, cfg, p.recv_count_p, r.tid, c)
        else:
            src = r.let("src", r.tid % cfg.n_ranks)
            seen, arrived = rank_mask.wait_for_rank(
                r, cfg, p.mask, _word(p.recv_count_p, r.tid, 8), T.u64, CmpOp.NE, SENTINEL,
                buffer="recv_count", index=r.tid, rank=src, my_rank=p.my_rank,
                err_buf=p.err_buf, kernel_name=r.kb.name, scope=signal_scope(cfg))
            with r.if_(arrived.ne(0)):
                r.assign(c, seen.cast(T.u32))
                p.dest.read_count_offset(r, seen, block_off)
            with r.else_():
                r.store(_word(missing, src), 1)
        clock.stop()
    if p.wait_time is not None:
        with r.if_(r.tid < cfg.n_experts):
            clock.store(r.tid)
    comm_sync(r)
    exit_if_aborted(r, p.err_buf)
    if p.mask is not None:      # a source missing one word counts nothing at all
        with r.if_(published_count_word(cfg, r.tid)):
            with r.if_(r.load(_word(missing, r.tid % cfg.n_ranks), T.u32,
                              name="src_missing").ne(0)):
                r.assign(c, 0)
    return c, block_off


def source_missing(r: ir.RoleBuilder, cfg) -> ir.Expr:
    """``ep_rank_mask``: the aux block's shared ``R`` words, source ``q``'s set when a count
    word of ``q`` did not come (masked before or during the wait), zeroed by threads
    ``q < R`` before a role barrier that precedes every wait."""
    missing = r.scratch("source_missing", 4 * cfg.n_ranks)
    with r.if_(r.tid < cfg.n_ranks):
        r.store(_word(missing, r.tid), 0)
    comm_sync(r)
    return missing


def copy_received_tokens_to_output(r: ir.RoleBuilder, cfg, p: WaitParams, *,
                                   l1_release: L1Release | None = None, scatter_sm_id=None,
                                   copy_trace: trace.CopyTrace = trace.CopyTrace()):
    """Copy blocks: the destination strategy's copy pass (``p.dest.copy_pass``): the staged
    layout moves every received message into its grouped output row
    (``staged_copy.copy_staged_messages``), the final layout builds ``src_info`` from the
    header rows (``header_pass.copy_headers``). The last block to finish lowers the
    ready flag.

    The role's context (``kb.role(..., threads=, barrier_id=, smem_base=)``) carries the
    reference's fused-kernel parameters ``comm_thread_base`` / ``n_comm_threads`` (``r.tid``
    and ``r.warp`` are role-local), ``comm_barrier_id`` (``comm_sync``) and
    ``comm_smem_base`` (the scratch, ``copy_scratch_bytes``, in dynamic shared memory from
    that byte), on every path. ``l1_release`` (``staged_copy.L1Release``: the reference's
    ``emit_l1_release`` and its ``l1_*`` arguments), ``scatter_sm_id`` (a u32 IR value,
    default the block index: the block's index among the copy blocks, which picks its entry
    of the SM schedule) and ``copy_trace`` (``trace.CopyTrace``: its ``copy.*`` stamps) as
    ``copy_staged_messages`` takes them; ``ep_final_layout`` takes neither ``l1_release``
    nor ``scatter_sm_id`` (a ``ValueError`` naming it)."""
    p.dest.copy_pass(r, l1_release=l1_release, scatter_sm_id=scatter_sm_id,
                     copy_trace=copy_trace)


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
        copy_received_tokens_to_output(r, cfg, p, copy_trace=trace.copy_trace(kb))
    with kb.role("aux", blocks=(last, None)) as r:
        wait_for_arrivals_and_compute_offsets(r, cfg, p)
    return kb.build()
