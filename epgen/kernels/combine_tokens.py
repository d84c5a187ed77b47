"""``ep_combine_async_tokens``: the destination half of DeepEP's normal-mode combine on the
partial-reduce combine's transport (docs/deepep.md, "Normal mode"; docs/combine.md,
"Partial reduce").

The engine hands each destination its token-major rows ``x`` ``[N, H]`` BF16 (one row per
received token, the rows of ``ep_dispatch_wait_tokens``: its local experts already weighted
and reduced by the engine). This kernel sends each row, as it is, into the slot the
partial-reduce combine sends a destination's partial sum to: source ``s``'s combine
receive slot ``(t, k_lead)``, ``(s, t)`` the row's ``out_src`` and ``k_lead`` the lowest
top-k slot of the token whose expert lives on this rank (the lowest ``k`` with
``out_topk[row, k] != -1``). The source half is the partial-reduce combine's
``ep_combine_wait_partial`` unchanged: it waits for every destination's arrival word and
adds the lead slots in ``k`` order (``add.rn.f32``), then the residual (the bias), and
rounds to BF16.

Warp ``w`` of the grid takes rows ``w, w + warps, ...`` below the row count (``meta``'s
``N_ROWS``: the padding rows of ``num_worst_tokens`` are not read): lanes ``k < K`` load the
row's local ids (``ld.global.s64``), ``vote.sync.ballot`` of the valid ones gives ``k_lead``
(``popc``); the row is copied through the source's entry of ``combine_buf_ptrs``
(``ld.global.v4`` / ``st.global.v4``, lane-strided 16-byte vectors). With ``has_weights``
lanes ``k < K`` also copy ``in_weights[row, k]`` (float32) into entry ``(t * K + k_lead) * K
+ k`` of the source's weight slots (``weight_buf_ptrs``: ``[max_tokens_per_rank, K, K]``
float32 per rank), which the source sums over the lead slots in ``k`` order
(``runtime.token_major_combine``). A row whose ``(s, t)`` is out of range, or without a local
slot, is not sent (the token-major receive never writes one; only a caller who overwrote
the handle's tensors could).

Completion: each warp, after its rows (``bar.warp.sync``), adds one to this rank's done
counter 0 (``atom.acq_rel.sys.add``); the warp that brings it to the number of warps
re-arms it and publishes, for every source ``s``, ``rows_s + 1`` into this rank's arrival
word at ``s`` (``st.release.sys``; ``rows_s`` from ``meta``'s per-source prefix), what
``ep_combine_wait_partial`` waits for.
"""

from __future__ import annotations

import attrs

import ir
from ir import AtomOp, Scope, Sem, ShflMode
from ir import types as T

from ..combine_layout import CombineLayout
from ..primitives import warp_copy
from . import dispatch_tokens
from .combine_partial import PartialWire
from .combine_shmem import publish_arrival
from .combine_wait import build_combine_wait
from .common import load_pointer, lowest_set_bit, word
from .dispatch_tokens import TokensLayout

KERNEL_NAME = "ep_combine_async_tokens"


@attrs.frozen
class TokensCombineParams:
    """Kernel parameters of ``ep_combine_async_tokens``."""

    x_rows: ir.Param
    in_weights: ir.Param
    has_weights: ir.Param
    out_src: ir.Param
    out_topk: ir.Param
    meta: ir.Param
    counters: ir.Param
    combine_buf_ptrs: ir.Param
    weight_buf_ptrs: ir.Param
    arrival_ptrs: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param


def check_supported(cfg) -> None:
    """``ValueError`` naming the parameter for a configuration this kernel does not take:
    the token-major receive's (``dispatch_tokens.check_supported``, whose buffers it reads)
    and a ``hid_dim`` whose BF16 row is not whole 16-byte vectors."""
    dispatch_tokens.check_supported(cfg)
    if (cfg.token_fmt.hid_dim * 2) % 16:
        raise ValueError(f"{KERNEL_NAME}: hid_dim={cfg.token_fmt.hid_dim}: a BF16 row must be "
                         f"a whole number of 16-byte vectors")


def declare_params(kb: ir.KernelBuilder) -> TokensCombineParams:
    """The kernel's parameters on ``kb`` and its diagnostics (``err_buf``, ``my_rank``)."""
    p = TokensCombineParams(
        x_rows=kb.param("x_rows", T.ptr_global),
        in_weights=kb.param("in_weights", T.ptr_global),
        has_weights=kb.param("has_weights", T.u32),
        out_src=kb.param("out_src", T.ptr_global),
        out_topk=kb.param("out_topk", T.ptr_global),
        meta=kb.param("meta", T.ptr_global),
        counters=kb.param("counters", T.ptr_global),
        combine_buf_ptrs=kb.param("combine_buf_ptrs", T.ptr_global),
        weight_buf_ptrs=kb.param("weight_buf_ptrs", T.ptr_global),
        arrival_ptrs=kb.param("arrival_ptrs", T.ptr_global),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
    )
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def send_token_rows(r: ir.RoleBuilder, cfg, p: TokensCombineParams) -> None:
    """Every received row to its source's lead slot, then the arrival words (module
    docstring)."""
    fmt, tl = cfg.token_fmt, TokensLayout(cfg)
    K, H, R = fmt.top_k, fmt.hid_dim, cfg.n_ranks
    row_bytes = H * 2
    gwarp = r.let("gwarp", r.block * (r.n_threads // 32) + r.warp)
    nwarps = r.let("nwarps", r.n_blocks * (r.n_threads // 32))
    n_rows = r.let("n_rows", r.load(word(p.meta, tl.N_ROWS), T.u32, name="n_rows_ld"))
    with r.for_range("row", gwarp, n_rows, nwarps) as i:
        s = r.let("src_rank", r.load(word(p.out_src, i * 2), T.u32, name="s_ld"))
        t = r.let("src_tok", r.load(word(p.out_src, i * 2 + 1), T.u32, name="t_ld"))
        lid = r.var("lid", T.s64, ir.Const(-1, T.s64))
        with r.if_(r.lane < K):
            r.assign(lid, r.load(word(p.out_topk, i * K + r.lane, 8), T.s64, name="lid_ld"))
        local = r.ballot((r.lane < K) & lid.ne(ir.Const(-1, T.s64)), name="local_slots")
        ok = (s < R) & (t < cfg.max_tokens_per_rank) & local.ne(0)
        with r.if_(ok):
            k_lead = lowest_set_bit(r, local, "k_lead")
            slot = r.let("slot", t * K + k_lead)
            dst_buf = load_pointer(r, p.combine_buf_ptrs, s, "cbuf")
            dst = r.let("dst_row", dst_buf + slot.cast(T.u64) * row_bytes, peer=True)
            src = r.let("src_row", p.x_rows + i.cast(T.u64) * row_bytes)
            warp_copy(r, dst, src, row_bytes // 16, tag="ct")
            with r.if_(p.has_weights.ne(0) & (r.lane < K)):
                wbuf = load_pointer(r, p.weight_buf_ptrs, s, "wbuf")
                wt = r.load(word(p.in_weights, i * K + r.lane), T.f32, name="w_ld")
                r.store(word(wbuf, slot * K + r.lane), wt)
    r.warp_sync()
    done = word(p.counters, CombineLayout(cfg).done_counter_offset)
    old = r.var("done_old", T.u32, 0)
    with r.if_(r.lane.eq(0)):
        r.assign(old, r.atomic(AtomOp.ADD, done, 1, Sem.ACQ_REL, Scope.SYS, name="done_add"))
    last = r.shfl(ShflMode.IDX, old, 0, name="done_b")
    with r.if_((last + 1).eq(nwarps) & r.lane.eq(0)):
        r.store(done, 0)
        prev = ir.Const(0, T.u32)
        for s in range(R):
            end = r.let(f"prefix_{s}", r.load(word(p.meta, tl.rank_prefix_offset + s), T.u32,
                                              name=f"prefix_ld{s}"))
            publish_arrival(r, cfg, p, s, end - prev)
            prev = end


def build_combine_async_tokens(cfg) -> ir.Kernel:
    """The ``ep_combine_async_tokens`` entry point (``send_token_rows`` over the whole
    grid). ``ValueError`` for a configuration it does not take (``check_supported``)."""
    check_supported(cfg)
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb)
    with kb.role("send", blocks=(0, None)) as r:
        send_token_rows(r, cfg, p)
    return kb.build()


def build_combine_tokens_module(cfg) -> ir.Module:
    """The normal-mode combine's module: ``ep_combine_async_tokens`` and the partial-reduce
    combine's source half ``ep_combine_wait_partial`` (``combine_wait.build_combine_wait``
    with ``combine_partial.PartialWire``, unchanged), so the other modules and their goldens
    stay as they are."""
    check_supported(cfg)
    return ir.Module("ep_combine_tokens",
                     (build_combine_async_tokens(cfg), build_combine_wait(cfg, PartialWire(cfg))))


__all__ = ["KERNEL_NAME", "build_combine_async_tokens", "build_combine_tokens_module",
           "check_supported", "TokensCombineParams"]
