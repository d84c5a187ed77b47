"""``combine_wait``: a source rank waits for every destination's arrival word, then reduces
its tokens' returned rows (docs/combine.md).

Every block's threads ``d < n_sources`` (``R``; 1 under ``skip_a2a``) wait (bounded,
``ld.acquire.sys``) until arrival word ``d`` is non-zero, the block barrier, then the abort
check. Warp ``w`` of the grid takes tokens ``w, w + warps, ...`` and its lanes the row's
16-byte chunks (8 BF16 elements each); per element, in float32: ``acc = 0``; for ``k = 0 ..
K-1`` in order, where ``topk_ids[t, k]`` is a slot dispatch sent a row (an expert in ``[0,
E)``; under ``skip_a2a`` one of this device's experts), ``acc = fma.rn.f32(w[t, k], y[t, k],
acc)``; with the shared expert (the fused kernel only) ``acc = add.rn.f32(acc, s[t])``; with
``has_residual``, ``acc = add.rn.f32(acc, residual[t])`` (BF16 widened); the result rounds to
BF16, nearest even, NaN quiet (integer rounding of the f32 bits: the same result as
``cvt.rn.bf16.f32``).
``weighted = 0``: the unreduced rows ``[T, K, H]`` are copied out instead (slots without a
row give zero).

Re-arming: after its wait each block adds one to the block counter (word 0 of the combine
wait region, ``atom.acq_rel.gpu.add``); the last block re-arms the arrival words and the
counter to 0, after every block of this call has seen them.

The arrival words are u32, or u64 under the SHMEM transport (signals update u64 words:
``CombineLayout.arrival_word_bytes``), where a word is published (high half ``rows + 1``)
and counts its landed rows (low half): the wait is for both (``combine_shmem.wait_arrival``).
"""

from __future__ import annotations

import contextlib

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from ..combine_layout import CombineLayout
from . import rank_mask, trace, wait_time
from .combine_shmem import wait_arrival
from .common import VEC, exit_if_aborted, word

KERNEL_NAME = "ep_combine_wait"


@attrs.frozen
class CombineWaitParams:
    """Kernel parameters of combine_wait."""

    combine_buf: ir.Param
    arrival: ir.Param
    topk_ids: ir.Param
    weights: ir.Param
    weighted: ir.Param
    residual: ir.Param
    has_residual: ir.Param
    out: ir.Param
    n_tokens: ir.Param
    counters: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param
    #: ``ep_rank_mask``: the rank mask's parameters (``rank_mask.declare``)
    mask: rank_mask.MaskParams | None = None
    #: ``Tuning.wait_times``: the ``wait_time`` words (``wait_time.declare``), else None
    wait_time: ir.Param | None = None


def declare_params(kb: ir.KernelBuilder, cfg=None) -> CombineWaitParams:
    """combine_wait's parameters on ``kb`` and its diagnostics; with ``cfg.ep_rank_mask`` the
    rank mask's (``rank_mask``, ``rank_mask_ptrs``; the fused ``ep_combine`` passes no
    ``cfg``: it does not take the mask)."""
    p = CombineWaitParams(
        combine_buf=kb.param("combine_buf", T.ptr_global, peer=True),
        arrival=kb.param("arrival", T.ptr_global, peer=True),
        topk_ids=kb.param("topk_ids", T.ptr_global),
        weights=kb.param("weights", T.ptr_global),
        weighted=kb.param("weighted", T.u32),
        residual=kb.param("residual", T.ptr_global),
        has_residual=kb.param("has_residual", T.u32),
        out=kb.param("out", T.ptr_global),
        n_tokens=kb.param("n_tokens", T.u32),
        counters=kb.param("counters", T.ptr_global),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
    )
    if cfg is not None:
        p = attrs.evolve(p, mask=rank_mask.declare(kb, cfg, waits=True),
                         wait_time=wait_time.declare(kb, cfg))
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def bf16_pair_to_f32(r: ir.RoleBuilder, w, name: str):
    """The two BF16 elements of a u32 (element ``2j`` in the low half, as in memory) widened
    to f32 exactly: ``shl.b32 16`` of the word, ``and.b32 0xffff0000`` of it, ``mov.b32``."""
    w = ir.as_expr(w)
    return (r.let(f"{name}_lo", ir.Bitcast(T.f32, w << 16)),
            r.let(f"{name}_hi", ir.Bitcast(T.f32, w & 0xFFFF0000)))


def f32_to_bf16(r: ir.RoleBuilder, x, name: str):
    """f32 to BF16 bits (in the low half of a u32), nearest even, NaN to a quiet NaN of the
    same sign: the integer form of ``cvt.rn.bf16.f32`` (``u + 0x7fff + ((u >> 16) & 1)``,
    then ``>> 16``)."""
    u = r.let(f"{name}_u", ir.Bitcast(T.u32, x))
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return r.let(name, ir.Select(nan, (u >> 16) | 0x40, rounded))


def add_chunk(r: ir.RoleBuilder, acc: list, vec, name: str, weight=None, valid=None):
    """``acc[j] = fma.rn.f32(weight, y[j], acc[j])`` (``add.rn.f32`` without a weight) for
    the 8 BF16 elements ``y`` of one 16-byte vector; with ``valid``, only where it holds
    (``selp``: the vector was loaded either way)."""
    for q in range(4):
        for j, y in enumerate(bf16_pair_to_f32(r, ir.Extract(vec, q), f"{name}{q}")):
            a = acc[2 * q + j]
            new = ir.Fma(weight, y, a) if weight is not None else a + y
            r.assign(a, new if valid is None else ir.Select(valid, new, a))


def wait_for_all_arrivals(r: ir.RoleBuilder, cfg, p: CombineWaitParams):
    """Threads ``d < n_sources`` (``R``; 1 under ``skip_a2a``) wait for arrival word ``d``;
    barrier; abort check; the last block to pass re-arms the words (module docstring). With
    ``ep_rank_mask`` the wait is ``rank_mask.wait_for_rank`` on destination ``d``: none for a
    masked one, and under shrink an expired one is masked. With ``Tuning.wait_times``
    block 0's thread ``d`` stores how long it waited into ``wait_time[d]``
    (``wait_time.WaitClock``)."""
    R = cfg.layout.n_sources
    clay = CombineLayout(cfg)
    ctr = word(p.counters, clay.wait_counter_offset)
    nbytes = clay.arrival_word_bytes          # u64 words under the SHMEM transport
    dtype = T.u64 if nbytes == 8 else T.u32
    clock = wait_time.WaitClock(r, p.wait_time, "arrival_wait")
    with r.if_(r.tid < R):
        clock.start()
        if cfg.needs_shmem:          # (ep_rank_mask refuses the SHMEM transport)
            wait_arrival(r, cfg, p.arrival, r.tid)
        elif p.mask is None:
            r.spin_wait(word(p.arrival, r.tid, nbytes), dtype, CmpOp.NE, 0,
                        buffer="combine_arrival", index=r.tid, sem=Sem.ACQUIRE,
                        scope=Scope.SYS)
        else:
            rank_mask.wait_for_rank(r, cfg, p.mask, word(p.arrival, r.tid, nbytes), dtype,
                                    CmpOp.NE, 0, buffer="combine_arrival", index=r.tid,
                                    rank=r.tid, my_rank=p.my_rank, err_buf=p.err_buf,
                                    kernel_name=r.kb.name)
        clock.stop()
        if p.wait_time is not None:
            with r.if_(r.block.eq(0)):
                clock.store(r.tid)
    r.syncthreads()
    exit_if_aborted(r, p.err_buf)
    trace.stamp(r, "reduce.arrivals_seen")
    with r.if_(r.tid.eq(0)):
        old = r.atomic(AtomOp.ADD, ctr, 1, Sem.ACQ_REL, Scope.GPU, name="wait_old")
        with r.if_((old + 1).eq(r.n_blocks)):
            for d in range(R):
                r.store(word(p.arrival, d, nbytes), ir.Const(0, dtype))
            r.store(ctr, 0)


def valid_slot(cfg, gid, my_rank):
    """Whether a top-k id is a slot dispatch sent a row for: an expert in ``[0, E)``, or under
    ``skip_a2a`` one of this device's experts ``[my_rank * L, my_rank * L + L)`` (global ids;
    the others stay on their own devices)."""
    if not cfg.skip_a2a:
        return (gid >= ir.Const(0, T.s32)) & (gid < ir.Const(cfg.n_experts, T.s32))
    rel = gid - (ir.as_expr(my_rank) * cfg.layout.n_local_experts).cast(T.s32)
    return (rel >= ir.Const(0, T.s32)) & (rel < ir.Const(cfg.layout.n_local_experts, T.s32))


def live_ranks(r: ir.RoleBuilder, cfg, mp) -> ir.Var:
    """``ep_rank_mask``, the whole warp after the arrival waits: a u32 whose bit ``q`` is set
    when this rank does not mask rank ``q`` (lane ``q < R`` reads its mask word,
    ``vote.sync.ballot``)."""
    m = r.var("lane_masked", T.u32, 1)
    with r.if_(r.lane < cfg.n_ranks):
        r.assign(m, rank_mask.masked(r, mp, r.lane, name="lane_mask"))
    return r.ballot(m.eq(0), name="live_ranks")


def from_live_rank(cfg, live_bits, gid) -> ir.Expr:
    """Whether expert ``gid``'s rank is live in ``live_bits`` (``live_ranks``); only
    meaningful for a ``valid_slot`` (the shift is clamped to 31 for the others)."""
    rank = (gid.cast(T.u32) // cfg.layout.n_local_experts).min(31)
    return ((live_bits >> rank) & 1).ne(0)


class Bf16SlotReader:
    """How the reduce reads the BF16 combine's slots: slot ``(t, k)`` a ``[H]`` BF16 row,
    chunk ``c`` (8 elements) one 16-byte vector (``ld.global.v4.b32``). The FP8 combine's
    twin is ``combine_fp8.Fp8SlotReader``."""

    def __init__(self, cfg):
        self.row_bytes = cfg.token_fmt.hid_dim * 2

    def load(self, r: ir.RoleBuilder, buf, slot, c, name: str):
        """Chunk ``c`` of ``slot``'s row: one ``v4.u32``."""
        return r.load(buf + (ir.as_expr(slot).cast(T.u64) * self.row_bytes
                             + c.cast(T.u64) * 16), VEC, name=name)

    def add(self, r: ir.RoleBuilder, acc: list, loaded, k: int, weight, valid):
        """``acc[j] = fma.rn.f32(weight, y[j], acc[j])`` where ``valid`` (``add_chunk``)."""
        add_chunk(r, acc, loaded, f"yf{k}_", weight, valid)

    def bf16_words(self, r: ir.RoleBuilder, loaded, k: int) -> tuple:
        """The chunk as 4 u32 words of BF16 pairs (the unreduced form's): as loaded."""
        return tuple(ir.Extract(loaded, q) for q in range(4))


def reduce_and_copy_to_output(r: ir.RoleBuilder, cfg, p: CombineWaitParams,
                              shared_expert=None, reader=None, partial: bool = False):
    """Warp ``w`` of the grid takes tokens ``w, w + warps, ...``; its lanes load the token's
    top-k ids (and weights) once, then take the 16-byte chunks ``lane, lane + 32, ...`` of the
    row: per chunk, the ``K`` slots' ``ld.global.v4.b32`` issued together (every slot of a
    token lies inside the receive buffer; a slot without a row is read and discarded), then
    for ``k`` in order over the valid slots 8 ``fma.rn.f32`` (one chain per element, a
    ``selp`` keeping the old value for the others); then the shared expert's chunk
    (``shared_expert = (rows, row0, t_se)``: expert-output row ``t - row0`` for the tokens
    ``[row0, row0 + t_se)``) and the residual's (``add.rn.f32``); rounding, one
    ``st.global.v4.b32``. ``weighted = 0``: each slot's chunk is copied to the unreduced
    ``[T, K, H]`` output (``ld``/``st.global.v4.b32``, the loads issued together; zero for a
    slot without a row). With ``ep_rank_mask`` a slot whose expert is on a rank this rank
    masks (read once per warp after the waits: ``live_ranks``) has no row either: weight 0,
    zero unreduced. ``reader``: how a slot's chunk is loaded and widened (default
    ``Bf16SlotReader``; the FP8 combine's ``combine_fp8.Fp8SlotReader`` dequantises).
    ``partial`` (the partial-reduce combine, ``combine_partial``): each slot holds a
    destination's weighted partial sum, in the slot that leads its rank (``lead_slots``):
    only those are read, and added (``add.rn.f32``), without weights; no unreduced form."""
    reader = Bf16SlotReader(cfg) if reader is None else reader
    fmt = cfg.token_fmt
    K, H = fmt.top_k, fmt.hid_dim
    n_chunks = H // 8
    row_bytes = H * 2
    gwarp = r.let("gwarp", r.block * (r.n_threads // 32) + r.warp)
    nwarps = r.let("nwarps", r.n_blocks * (r.n_threads // 32))
    zero = ir.Const(0.0, T.f32)
    live_bits = None if p.mask is None else live_ranks(r, cfg, p.mask)
    with token_shares(r, cfg, gwarp, nwarps, p.n_tokens) as (t, first_chunk, chunk_step):
        slots = [r.let(f"slot{k}", t * K + k) for k in range(K)]
        valid, gids = [], []
        for k in range(K):
            gid = r.load(word(p.topk_ids, slots[k]), T.s32, name=f"id{k}")
            ok = valid_slot(cfg, gid, p.my_rank)
            if live_bits is not None:
                ok = ok & from_live_rank(cfg, live_bits, gid)
            valid.append(r.let(f"valid{k}", ok))
            gids.append(gid)
        if partial:
            valid = lead_slots(r, cfg, gids, valid)

        def chunk(base, row, c):
            return base + (ir.as_expr(row).cast(T.u64) * row_bytes + c.cast(T.u64) * 16)

        with r.if_(p.weighted.ne(0)) if not partial else contextlib.nullcontext():
            ws = [r.load(word(p.weights, slots[k]), T.f32, name=f"w{k}") for k in range(K)] \
                if not partial else [None] * K
            if shared_expert is not None:
                se_rows, row0, t_se = shared_expert
                se_row = r.let("se_row", t - row0)
                in_se = r.let("in_se", (t >= row0) & (se_row < t_se))
            with r.for_range("c", first_chunk, n_chunks, chunk_step) as c:
                acc = [r.var(f"acc{j}", T.f32, zero) for j in range(8)]
                ys = [reader.load(r, p.combine_buf, slots[k], c, f"y{k}") for k in range(K)]
                for k in range(K):
                    reader.add(r, acc, ys[k], k, ws[k], valid[k])
                if shared_expert is not None:
                    with r.if_(in_se):
                        add_chunk(r, acc, r.load(chunk(se_rows, se_row, c), VEC, name="se"),
                                  "sef")
                with r.if_(p.has_residual.ne(0)):
                    add_chunk(r, acc, r.load(chunk(p.residual, t, c), VEC, name="res"), "resf")
                o = [f32_to_bf16(r, a, f"o{j}") for j, a in enumerate(acc)]
                words = tuple(o[2 * q] | (o[2 * q + 1] << 16) for q in range(4))
                r.store(chunk(p.out, t, c), ir.Pack(VEC, words))
        if not partial:          # the partial sums have no unreduced form
            with r.else_():
                with r.for_range("c", first_chunk, n_chunks, chunk_step) as c:
                    us = [reader.load(r, p.combine_buf, slots[k], c, f"u{k}")
                          for k in range(K)]
                    for k in range(K):
                        words = tuple(ir.Select(valid[k], w, ir.Const(0, T.u32))
                                      for w in reader.bf16_words(r, us[k], k))
                        r.store(chunk(p.out, slots[k], c), ir.Pack(VEC, words))


@contextlib.contextmanager
def token_shares(r: ir.RoleBuilder, cfg, gwarp, nwarps, n_tokens):
    """``with token_shares(...) as (t, first_chunk, chunk_step):`` the body once per token
    ``t`` this warp reduces, its lanes taking the row's 16-byte chunks ``first_chunk,
    first_chunk + chunk_step, ...``. With ``cfg.tuning.reduce_warps_per_token_max`` 1: warp
    ``w`` takes tokens ``w, w + warps, ...`` and chunks ``lane, lane + 32, ...``. Above 1,
    ``S`` warps share a token: ``S`` the largest power of two up to the knob with ``S *
    n_tokens <= warps`` (1 when the tokens are as many as the warps; per call, from the
    ``n_tokens`` argument: a ladder of ``setp``), work item ``i = w, w + warps, ...`` is
    token ``i >> log2 S``, share ``i & (S - 1)``, chunks ``32 * share + lane`` in steps of
    ``32 S``."""
    most = cfg.tuning.reduce_warps_per_token_max
    if most == 1:
        with r.for_range("t", gwarp, n_tokens, nwarps) as t:
            yield t, r.lane, 32
        return
    room = r.let("red_room", nwarps // ir.as_expr(n_tokens).max(1))
    lg = r.var("red_lg", T.u32, 0)
    for i in range(1, most.bit_length()):
        with r.if_(room >= (1 << i)):
            r.assign(lg, i)
    with r.for_range("t_share", gwarp, ir.as_expr(n_tokens) << lg, nwarps) as item:
        t = r.let("t", item >> lg)
        share = r.let("red_share", item & ((ir.Const(1, T.u32) << lg) - 1))
        yield t, r.lane + (share << 5), ir.Const(32, T.u32) << lg


def lead_slots(r: ir.RoleBuilder, cfg, gids, valid) -> list:
    """The partial-reduce combine's slots to read: ``valid[k]`` and no earlier valid slot
    ``j < k`` whose expert lives on the same rank (``gid // L``), the one slot per (token,
    rank) the destination sent its partial sum to."""
    L = cfg.layout.n_local_experts
    ranks = [r.let(f"rank{k}", g.cast(T.u32) // L) for k, g in enumerate(gids)]
    out = []
    for k in range(len(gids)):
        lead = valid[k]
        for j in range(k):
            lead = lead & ~(valid[j] & ranks[j].eq(ranks[k]))
        out.append(r.let(f"lead{k}", lead))
    return out


def check_hid_dim(cfg):
    """``ValueError`` unless ``hid_dim`` is a multiple of 8 (the reduce moves 16-byte chunks
    of 8 BF16 elements)."""
    H = cfg.token_fmt.hid_dim
    if H % 8:
        raise ValueError(f"combine: hid_dim must be a multiple of 8 (the reduce reads 16-byte "
                         f"chunks of 8 BF16 elements), got hid_dim={H}")


def build_combine_wait(cfg, wire=None) -> ir.Kernel:
    """The combine_wait entry point: every block waits, then reduces its share; with the
    FP8 combine's ``wire`` (``combine_fp8.Fp8Wire``) its FP8 twin ``ep_combine_wait_fp8``,
    which reads the slots through ``wire.reader``."""
    check_hid_dim(cfg)
    kb = ir.KernelBuilder(KERNEL_NAME if wire is None else wire.name(KERNEL_NAME),
                          cfg.num_threads)
    p = declare_params(kb, cfg)
    trace.instrument(kb, cfg, p.my_rank)
    with kb.role("reduce", blocks=(0, None)) as r:
        wait_for_all_arrivals(r, cfg, p)
        reduce_and_copy_to_output(r, cfg, p, reader=None if wire is None else wire.reader,
                                  partial=wire is not None and wire.reduces_at_destination)
    return kb.build()


__all__ = ["build_combine_wait", "wait_for_all_arrivals", "reduce_and_copy_to_output",
           "check_hid_dim", "valid_slot", "lead_slots", "token_shares", "f32_to_bf16",
           "Bf16SlotReader",
           "KERNEL_NAME", "CombineWaitParams"]
