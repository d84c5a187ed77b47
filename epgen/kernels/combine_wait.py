"""``combine_wait``: a source rank waits for every destination's arrival word, then reduces
its tokens' returned rows (docs/combine.md; BF16 over P2P).

Every block's threads ``d < R`` wait (bounded, ``ld.acquire.sys``) until arrival word ``d``
is non-zero, the block barrier, then the abort check. Thread ``i`` of the grid takes
elements ``i, i + grid, ...`` of ``[T, H]``; per element, in float32: ``acc = 0``; for ``k =
0 .. K-1`` in order, where ``topk_ids[t, k]`` is a valid expert (in ``[0, E)``: dispatch
sent that slot a row), ``acc = fma.rn.f32(w[t, k], y[t, k], acc)``; with ``has_residual``,
``acc = add.rn.f32(acc, residual[t])`` (BF16 widened); the result rounds to
BF16, nearest even, NaN quiet (integer rounding of the f32 bits: the same result as
``cvt.rn.bf16.f32``). ``weighted = 0``: the unreduced rows ``[T, K, H]`` are copied out
instead (slots without a row give zero).

Re-arming: after its wait each block adds one to the block counter (word 0 of the combine
wait region, ``atom.acq_rel.gpu.add``); the last block re-arms the arrival words and the
counter to 0, after every block of this call has seen them.

The arrival words are u32, or u64 under the SHMEM transport (a signal sets a u64 word:
``CombineLayout.arrival_word_bytes``).
"""

from __future__ import annotations

import attrs

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from ..combine_layout import CombineLayout
from .common import exit_if_aborted, word

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


def declare_params(kb: ir.KernelBuilder) -> CombineWaitParams:
    """combine_wait's parameters on ``kb`` and its diagnostics."""
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
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def bf16_to_f32(r: ir.RoleBuilder, bits, name: str):
    """BF16 bits (u16) widened to f32 exactly: ``cvt.u32.u16``, ``shl.b32 16``, ``mov.b32``."""
    return r.let(name, ir.Bitcast(T.f32, bits.cast(T.u32) << 16))


def f32_to_bf16(r: ir.RoleBuilder, x, name: str):
    """f32 to BF16 bits (u16), nearest even, NaN to a quiet NaN of the same sign: the integer
    form of ``cvt.rn.bf16.f32`` (``u + 0x7fff + ((u >> 16) & 1)``, then ``>> 16``)."""
    u = r.let(f"{name}_u", ir.Bitcast(T.u32, x))
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return r.let(name, ir.Select(nan, (u >> 16) | 0x40, rounded).cast(T.u16))


def wait_for_all_arrivals(r: ir.RoleBuilder, cfg, p: CombineWaitParams):
    """Threads ``d < R`` wait for arrival word ``d``; barrier; abort check; the last block to
    pass re-arms the words (module docstring)."""
    R = cfg.n_ranks
    clay = CombineLayout(cfg)
    ctr = word(p.counters, clay.wait_counter_offset)
    nbytes = clay.arrival_word_bytes          # u64 words under the SHMEM transport
    dtype = T.u64 if nbytes == 8 else T.u32
    with r.if_(r.tid < R):
        r.spin_wait(word(p.arrival, r.tid, nbytes), dtype, CmpOp.NE, 0,
                    buffer="combine_arrival", index=r.tid, sem=Sem.ACQUIRE, scope=Scope.SYS)
    r.syncthreads()
    exit_if_aborted(r, p.err_buf)
    with r.if_(r.tid.eq(0)):
        old = r.atomic(AtomOp.ADD, ctr, 1, Sem.ACQ_REL, Scope.GPU, name="wait_old")
        with r.if_((old + 1).eq(r.n_blocks)):
            for d in range(R):
                r.store(word(p.arrival, d, nbytes), ir.Const(0, dtype))
            r.store(ctr, 0)


def reduce_and_copy_to_output(r: ir.RoleBuilder, cfg, p: CombineWaitParams):
    """Per element of the source's tokens: the weighted sum in slot order, or the copy of the
    unreduced rows (module docstring)."""
    fmt = cfg.token_fmt
    K, H, E = fmt.top_k, fmt.hid_dim, cfg.n_experts
    total = r.let("n_elems", p.n_tokens * H)
    with r.for_range("i", r.global_thread_id(), total, r.grid_threads()) as i:
        t = r.let("t", i // H)
        h = r.let("h", i % H)
        acc = r.var("acc", T.f32, ir.Const(0.0, T.f32))
        for k in range(K):
            slot = r.let(f"slot{k}", t * K + k)
            gid = r.load(word(p.topk_ids, slot), T.s32, name=f"id{k}")
            valid = r.let(f"valid{k}", (gid >= ir.Const(0, T.s32)) & (gid < ir.Const(E, T.s32)))
            y = r.var(f"y{k}", T.u16, ir.Const(0, T.u16))
            elem = (slot * H + h).cast(T.u64) * 2
            with r.if_(valid):
                r.assign(y, r.load(p.combine_buf + elem, T.u16, name=f"y{k}_ld"))
            with r.if_(p.weighted.ne(0)):
                with r.if_(valid):
                    w = r.load(word(p.weights, slot), T.f32, name=f"w{k}")
                    r.assign(acc, ir.Fma(w, bf16_to_f32(r, y, f"yf{k}"), acc))
            with r.else_():
                r.store(p.out + elem, y)
        with r.if_(p.weighted.ne(0)):
            out_elem = (t * H + h).cast(T.u64) * 2
            with r.if_(p.has_residual.ne(0)):
                res = r.load(p.residual + out_elem, T.u16, name="res_ld")
                r.assign(acc, acc + bf16_to_f32(r, res, "resf"))
            r.store(p.out + out_elem, f32_to_bf16(r, acc, "o16"))


def build_combine_wait(cfg) -> ir.Kernel:
    """The combine_wait entry point: every block waits, then reduces its share."""
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb)
    with kb.role("reduce", blocks=(0, None)) as r:
        wait_for_all_arrivals(r, cfg, p)
        reduce_and_copy_to_output(r, cfg, p)
    return kb.build()


__all__ = ["build_combine_wait", "wait_for_all_arrivals", "reduce_and_copy_to_output",
           "KERNEL_NAME", "CombineWaitParams"]
