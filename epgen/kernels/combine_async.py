"""``combine_async``: every destination sends each row its experts produced back to the
source rank and top-k slot it came from (docs/combine.md; over P2P, every dispatch format:
the expert outputs are BF16 ``[rows, H]`` whatever the dispatch carried).

The rows of block ``(e, s)`` (local expert ``e``, source rank ``s``) are ``[start, start +
count)`` of the grouped output, read from dispatch_wait's Region A (pair ``w = e * R + s``:
``[2w] = 1024 + end row``, ``[2w + 1] = count``). Region A has that form in every layout:
the staged one, ``ep_final_layout`` (capacity-strided: the block where its source reserved
it; with ``ep_prod_reserve``: source-rank order) and ``fused_shared_expert`` (the blocks
start after the shared expert's group 0, whose rows are nobody's to send back). For each
source in turn, the warps with ``gwarp % L == e`` share pair ``(e, s)`` (with fewer warps
than experts, a warp takes pairs ``gwarp, gwarp + n_warps, ...``): each reads the pair's
two Region A words once and strides over its rows, so a warp's dependent reads per source
are one pair's, not every pair's. A pair with fewer rows than its warps may split each row
among up to ``row_shares`` warps (``setp`` of the row count against the warps; a row's
share ``i`` moves its vectors ``32 i + lane`` in steps of ``32 * shares``); a pair with as
many rows as warps or more keeps one warp a row. Each row's ``src_info[row]
= (t, k)`` (written by dispatch_wait in every layout) is bounds-checked (``0 <= t <
max_tokens_per_rank``, ``0 <= k < K``) and a row outside is reported into the error buffer
(a ``diag.BOUNDS_MAGIC`` record: the row, ``t`` and ``k``) and not written; else its ``H *
2`` bytes go, in 16-byte vectors, to slot ``(t, k)`` of source ``s``'s combine receive
buffer ``[max_tokens_per_rank, K, H]`` through the peer pointer table (under the SHMEM
transport, to a source outside the P2P group, by NVSHMEM: ``combine_shmem``).

Completion, per source ``s``: each warp, after its rows to ``s`` (``bar.warp.sync``), adds
one to this rank's done counter ``s`` (``atom.acq_rel.sys.add``, combine rank-completion
region); the warp that brings it to the number of warps re-arms it to 0, sums Region A's
counts of source ``s`` (``rows_to_source``) and publishes ``rows + 1`` into this rank's word of source ``s``'s arrival words (``st.release.sys``):
word ``my_rank``, or under ``skip_a2a`` (the device is its own only source and destination:
``n_sources = 1``, pairs ``(e, 0)`` only) word 0. Under the SHMEM transport a remote source's
rows and arrival word go by NVSHMEM, and each warp completes its operations once at the end
(``combine_shmem``).

``ep_rank_mask``: a source this rank masks gets no row and no arrival word (each warp reads
the mask once per source before its rows, and the last warp again before the arrival); the
done counters count every warp as before.
"""

from __future__ import annotations

import contextlib

import attrs

import ir
from ir import AtomOp, Scope, Sem, ShflMode, diag
from ir import types as T

from ..combine_layout import CombineLayout
from ..primitives import copy_vectors, warp_inclusive_scan
from .combine_shmem import (arrival_signal, complete_puts, issued_flag, publish_arrival,
                            send_row, skip_row)
from . import combine_partial, rank_mask, trace
from .common import load_pointer, word

KERNEL_NAME = "ep_combine_async"


@attrs.frozen
class CombineAsyncParams:
    """Kernel parameters of combine_async."""

    expert_out: ir.Param
    src_info: ir.Param
    counters: ir.Param
    combine_buf_ptrs: ir.Param
    arrival_ptrs: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param
    #: ``ep_rank_mask``: the rank mask's parameters (``rank_mask.declare``)
    mask: rank_mask.MaskParams | None = None


def declare_params(kb: ir.KernelBuilder, cfg=None) -> CombineAsyncParams:
    """combine_async's parameters on ``kb`` and its diagnostics (``err_buf``, ``my_rank``).
    ``counters``: this rank's counter array (word 0 of it; Region A and the combine
    rank-completion region are found from the layout). With ``cfg.ep_rank_mask`` the rank
    mask's (``rank_mask``; the fused ``ep_combine`` passes no ``cfg``: it does not take the
    mask)."""
    p = CombineAsyncParams(
        expert_out=kb.param("expert_out", T.ptr_global),
        src_info=kb.param("src_info", T.ptr_global),
        counters=kb.param("counters", T.ptr_global),
        combine_buf_ptrs=kb.param("combine_buf_ptrs", T.ptr_global),
        arrival_ptrs=kb.param("arrival_ptrs", T.ptr_global),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
    )
    if cfg is not None:
        p = attrs.evolve(p, mask=rank_mask.declare(kb, cfg, waits=False))
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def report_bounds(r: ir.RoleBuilder, err_buf, rank, row, t, k):
    """Lane 0: claim a record of the error buffer (``atom.relaxed.sys.add`` on its count
    word) and, if one is left, store a ``BOUNDS_MAGIC`` record: kernel tag, rank, block,
    warp, ``index`` = the row, ``expected`` = ``t``, ``last_seen`` = ``k``. The abort word
    is not raised: the kernel goes on (the row is skipped)."""
    with r.if_(r.lane.eq(0)):
        slot = r.atomic(AtomOp.ADD, word(err_buf, diag.COUNT_WORD), 1, Sem.RELAXED,
                        Scope.SYS, name="bounds_slot")
        with r.if_(slot < diag.MAX_RECORDS):
            base = r.let("bounds_rec", slot * diag.RECORD_WORDS + diag.HEADER_WORDS)
            F = diag.FIELDS
            vals = {"magic": ir.Const(diag.BOUNDS_MAGIC, T.u32),
                    "kernel_tag": ir.Const(diag.kernel_tag(KERNEL_NAME), T.u32),
                    "rank": ir.as_expr(rank), "block": r.block, "warp": r.warp,
                    "index": row, "expected": t.cast(T.u32), "last_seen": k.cast(T.u32)}
            for name, v in vals.items():
                r.store(word(err_buf, base + F[name]), v)


def send_tokens_back(r: ir.RoleBuilder, cfg, p: CombineAsyncParams, wire=None):
    """Every row of every block to its source's combine receive buffer, then the per-source
    completion (module docstring). ``wire``: how a row goes into its slot (None: the BF16
    row's copy, ``send_row``; the FP8 combine's ``combine_fp8.Fp8Wire`` quantises it; the
    partial-reduce combine's ``combine_partial.PartialWire`` sends one summed row per
    (token, source) and counts the rows it sent in the done counter)."""
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R, K = lay.n_local_experts, cfg.n_ranks, fmt.top_k
    max_tpr = cfg.max_tokens_per_rank
    region_a = lay.dispatch_wait_region.offset
    done_base = CombineLayout(cfg).done_counter_offset
    sender = ir.as_expr(lay.rank_coord(p.my_rank))     # 0 under skip_a2a
    gwarp = r.let("gwarp", r.block * (r.n_threads // 32) + r.warp)
    nwarps = r.let("nwarps", r.n_blocks * (r.n_threads // 32))
    # the warps with gwarp % L == e share pair (e, s): one Region A read per pair and warp
    e_first = r.let("e_first", gwarp % L)
    sub = r.let("pair_sub", gwarp // L)
    n_sub = r.let("pair_n_sub", ((nwarps - e_first + (L - 1)) // L).max(1))
    issued = issued_flag(r) if cfg.needs_shmem else None
    partial = wire is not None and wire.reduces_at_destination
    shares = row_shares(cfg, wire)
    for s in range(lay.n_sources):
        dst_buf = load_pointer(r, p.combine_buf_ptrs, s, f"cbuf{s}")
        sig = arrival_signal(r, cfg, p, s)
        to_s = None if p.mask is None else r.let(f"live_{s}", rank_mask.live(r, p.mask, s))
        sent = r.var(f"sent_{s}", T.u32, 0) if partial else None
        with r.for_range(f"e_{s}", e_first, L, nwarps) as e:
            w = r.let(f"pair_{s}", e * R + s)
            end = r.load(word(p.counters, region_a + 2 * w), T.u32, name="blk_end")
            cnt = r.let(f"cnt_{s}", r.load(word(p.counters, region_a + 2 * w + 1), T.u32,
                                           name="blk_cnt"))
            start = r.let(f"start_{s}", end - 1024 - cnt)
            def send_row_of_block(j, share):
                """Row ``j`` of block ``(e, s)``, or this warp's ``share`` of it."""
                row = r.let("row", start + j)
                t = r.let("src_t", r.load(word(p.src_info, row * 2), T.s32, name="t_ld"))
                k = r.let("src_k", r.load(word(p.src_info, row * 2 + 1), T.s32, name="k_ld"))
                bad = (t < ir.Const(0, T.s32)) | (t >= ir.Const(max_tpr, T.s32)) \
                    | (k < ir.Const(0, T.s32)) | (k >= ir.Const(K, T.s32))
                with r.if_(bad if share is None else bad & share.eq(0)):
                    report_bounds(r, p.err_buf, p.my_rank, row, t, k)
                    skip_row(r, cfg, p, s, sig, issued)
                    if partial and cfg.needs_shmem:      # its 1 was signalled: counted
                        r.assign(sent, sent + 1)
                with r.if_(~bad) if share is not None else r.else_():
                    part = None if share is None else (share, shares)
                    if partial:
                        with r.if_(to_s) if to_s is not None else contextlib.nullcontext():
                            wire.send_token_row(r, p, s, dst_buf, row, t, k, sent, sig,
                                                issued, part=part)
                    else:
                        send_slot_row(r, cfg, p, s, dst_buf, row, t, k, to_s, sig, issued,
                                      wire, part=part)

            def one_warp_a_row():
                with r.for_range(f"j_{s}", sub, cnt, n_sub) as j:
                    send_row_of_block(j, None)

            if shares == 1:
                one_warp_a_row()
            else:
                # shared rows only where the block has fewer rows than warps: with as many
                # rows as warps every warp already has one (prefill), and sharing them adds
                # rounds of split work instead of filling idle warps
                lg = shares.bit_length() - 1
                with r.if_(cnt < n_sub):
                    with r.for_range(f"ji_{s}", sub, cnt * shares, n_sub) as item:
                        send_row_of_block(r.let("j_row", item >> lg),
                                          r.let("row_share", item & (shares - 1)))
                with r.else_():
                    one_warp_a_row()
        r.warp_sync()
        old = r.var(f"done_old_{s}", T.u32, 0)
        add = 1 if not partial else combine_partial.done_increment(sent)
        with r.if_(r.lane.eq(0)):
            r.assign(old, r.atomic(AtomOp.ADD, word(p.counters, done_base + s), add,
                                   Sem.ACQ_REL, Scope.SYS, name="done_add"))
        last = r.shfl(ShflMode.IDX, old, 0, name=f"done_b_{s}")
        if partial:       # the rows actually sent, counted in the done counter
            warps_done, rows_sent = combine_partial.done_split(last + add)
        with r.if_((last + 1).eq(nwarps) if not partial else warps_done.eq(nwarps)):
            rows_to_s = rows_to_source(r, cfg, p, s) if not partial \
                else r.let(f"rows_to_{s}", rows_sent)
            with r.if_(r.lane.eq(0)):
                r.store(word(p.counters, done_base + s), 0)
                trace.stamp(r, "send.arrival_raised", s, leader=False)  # before the signal
                with rank_mask.if_live(r, p.mask, s):
                    publish_arrival(r, cfg, p, s, rows_to_s, sender, issued)
    complete_puts(r, cfg, issued)


def row_shares(cfg, wire=None) -> int:
    """The most warps that share one returned row: ``Tuning.combine_send_warps_per_row`` for
    the BF16 copy (``wire`` None), ``Tuning.combine_fp8_partial_send_warps_per_row`` for the
    FP8 quantise and the partial reduce's destination sum; 1 under the SHMEM transport,
    where a remote row is one put-with-signal. A block shares its rows only when it has
    fewer rows than the warps on it (``send_tokens_back``)."""
    if cfg.needs_shmem:
        return 1
    if wire is None:
        return cfg.tuning.combine_send_warps_per_row
    return cfg.tuning.combine_fp8_partial_send_warps_per_row


def send_slot_row(r: ir.RoleBuilder, cfg, p, s: int, dst_buf, row, t, k, to_s, sig, issued,
                  wire=None, part=None):
    """Grouped-output row ``row`` (``src_info = (t, k)``, in bounds) into slot ``(t, k)``
    of ``dst_buf`` (source ``s``'s receive buffer) unless ``to_s`` is false: the BF16
    row's ``send_row``, or the FP8 ``wire``'s. ``part = (share, shares)``: this warp's
    share of the row (``row_shares``; P2P only): the BF16 copy's vectors ``32 share +
    lane`` in steps of ``32 shares``, the FP8 quantise's items the same way."""
    K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    row_bytes = H * 2
    slot_bytes = row_bytes if wire is None else wire.slot_bytes
    slot = (t.cast(T.u32) * K + k.cast(T.u32)).cast(T.u64)
    dst = r.let("dst_row", dst_buf + slot * slot_bytes, peer=True)
    src = r.let("src_row", p.expert_out + row.cast(T.u64) * row_bytes)
    with r.if_(to_s) if to_s is not None else contextlib.nullcontext():
        if wire is not None:
            wire.send_row(r, cfg, p, s, dst, src, row, sig, issued, part=part)
        elif part is None:
            send_row(r, cfg, p, s, dst, src, row_bytes, row_bytes // 16, sig, issued)
        else:
            share, shares = part
            copy_vectors(r, dst, src, row_bytes // 16, r.lane + (share << 5), 32 * shares,
                         tag="cbs")


def rows_to_source(r: ir.RoleBuilder, cfg, p, s: int) -> ir.Var:
    """The whole (last) warp: the rows this rank returns to source ``s``, the sum of Region
    A's counts of pairs ``(e, s)``: lane ``l`` loads those of ``e = l, l + 32, ...``
    (``ld.global.u32``), then a warp scan (``shfl.sync.up``) and lane 31's total
    (``shfl.sync.idx``)."""
    lay = cfg.layout
    L, R = lay.n_local_experts, cfg.n_ranks
    region_a = lay.dispatch_wait_region.offset
    mine = r.var(f"rows_lane_{s}", T.u32, 0)
    with r.for_range(f"re_{s}", r.lane, L, 32) as e:
        r.assign(mine, mine + r.load(word(p.counters, region_a + 2 * (e * R + s) + 1), T.u32,
                                     name="cnt_sum"))
    total = warp_inclusive_scan(r, mine, name=f"rows_scan_{s}")
    return r.shfl(ShflMode.IDX, total, 31, name=f"rows_to_{s}")


def build_combine_async(cfg, wire=None) -> ir.Kernel:
    """The combine_async entry point (``send_tokens_back`` over the whole grid); with the
    FP8 combine's ``wire`` (``combine_fp8.Fp8Wire``) its FP8 twin ``ep_combine_async_fp8``."""
    if (cfg.token_fmt.hid_dim * 2) % 16:
        raise ValueError("combine_async: a row must be a whole number of 16-byte vectors")
    kb = ir.KernelBuilder(KERNEL_NAME if wire is None else wire.name(KERNEL_NAME),
                          cfg.num_threads)
    p = declare_params(kb, cfg)
    trace.instrument(kb, cfg, p.my_rank)
    with kb.role("send", blocks=(0, None)) as r:
        send_tokens_back(r, cfg, p, wire)
    return kb.build()


__all__ = ["build_combine_async", "send_tokens_back", "report_bounds", "row_shares",
           "KERNEL_NAME", "CombineAsyncParams"]
