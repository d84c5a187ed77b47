"""``ep_check_ids``: the device-side check of one rank's top-k ids, for callers whose ids
never reach the host (``epgen.torch``); it runs before ``dispatch_async`` on the same stream.

Thread ``t`` of the grid (grid-strided over tokens) loads the token's ``K`` ids (``s32``, or
``s64`` when ``ids_wide``: what ``torch.topk`` gives) and writes them as ``s32`` to
``ids_out`` (the rank's own id buffer, which dispatch reads). An id is *valid* when it is
``-1`` (a masked slot: it selects no expert, and may repeat) or when it is in ``[0, bound)``
(``bound = n_experts``; under ``skip_a2a``, where ids are global, 65535) and differs from
the token's earlier ids. A valid id is written unchanged. An invalid id is written as
``bound`` and reported as an input record (``ir.diag.IDS_MAGIC``: token, slot, id) that the host
raises as ``EPInputError`` at the next check. So a bad id drops that one slot of its token
and nothing is written out of bounds. The dispatch kernels never count and never send
``-1`` nor ``bound`` (each reservation requires ``g < n_experts`` with ``g`` read as u32;
under ``skip_a2a`` a destination equal to this device, which ``-1 // L`` never is), and
combine skips both.

``build_check_ids(cfg, n_ranks)`` with ``n_ranks > 1`` builds ``ep_check_ids_ranks{n}``: the
same check of ``n`` ranks of one GPU in one launch (what a torch-API handle of several ranks
launches once per call instead of once per rank). Rank ``j``'s parameters carry the suffix
``_{j}`` (``ids_in_0``, ...); its blocks are ``[j * B, (j + 1) * B)`` of a grid of ``n * B``
(``B = blocks_per_rank(cfg)``), each rank's values picked by a chain of ``selp`` on the
block's rank.
"""

from __future__ import annotations

import ir
from ir import diag
from ir import types as T

from ..primitives import report_record, word

KERNEL_NAME = "ep_check_ids"
#: threads per block
BLOCK_THREADS = 128
#: ids are stored as u16 in message headers; under skip_a2a the largest is the sentinel
SKIP_A2A_BOUND = (1 << 16) - 1
#: a masked slot's id (``epgen.reference.MASKED``): valid, copied unchanged
MASKED = -1


def id_bound(cfg) -> int:
    """The first invalid id (and the sentinel an invalid id becomes)."""
    return SKIP_A2A_BOUND if cfg.skip_a2a else cfg.n_experts


#: the per-rank parameters, in order
RANK_PARAMS = (("ids_in", T.ptr_global), ("ids_wide", T.u32), ("ids_out", T.ptr_global),
               ("n_tokens", T.u32), ("my_rank", T.u32))


def kernel_name(n_ranks: int = 1) -> str:
    """The entry point checking ``n_ranks`` ranks in one launch."""
    return KERNEL_NAME if n_ranks == 1 else f"{KERNEL_NAME}_ranks{n_ranks}"


def blocks_per_rank(cfg) -> int:
    """Blocks one rank's tokens take: one thread per token of ``max_tokens_per_rank``."""
    return -(-cfg.max_tokens_per_rank // BLOCK_THREADS)


def param_name(name: str, j: int, n_ranks: int) -> str:
    """Rank ``j``'s parameter ``name`` in the ``n_ranks`` form (``ids_in_2``)."""
    return name if n_ranks == 1 else f"{name}_{j}"


def build_check_ids(cfg, n_ranks: int = 1) -> ir.Kernel:
    """The ``ep_check_ids`` entry point (module docstring), or its ``n_ranks`` form: per id
    ``ld.global.s32`` or ``.s64``, range and repeat compares (``setp``), ``selp`` of the id
    or the sentinel, ``st.global.b32``; a record (``report_record``) per invalid id."""
    if n_ranks < 1:
        raise ValueError(f"build_check_ids: n_ranks={n_ranks} must be >= 1")
    K, bound = cfg.token_fmt.top_k, id_bound(cfg)
    kb = ir.KernelBuilder(kernel_name(n_ranks), BLOCK_THREADS)
    per_rank = [{name: kb.param(param_name(name, j, n_ranks), ty) for name, ty in RANK_PARAMS}
                for j in range(n_ranks)]
    err_buf = kb.param("err_buf", T.ptr_global)
    kb.diagnostics(err_buf=err_buf, rank=per_rank[0]["my_rank"])
    with kb.role("check", blocks=(0, None)) as r:
        if n_ranks == 1:
            p, first, stride = per_rank[0], r.global_thread_id(), r.grid_threads()
        else:
            B = blocks_per_rank(cfg)
            j = r.let("rank_j", r.block // B)
            p = {name: r.let(f"{name}_j", _pick(j, [pr[name] for pr in per_rank]))
                 for name, _ in RANK_PARAMS}
            first = (r.block % B) * BLOCK_THREADS + r.tid
            stride = ir.Const(B * BLOCK_THREADS, T.u32)
        ids_in, wide, ids_out = p["ids_in"], p["ids_wide"], p["ids_out"]
        n_tokens, my_rank = p["n_tokens"], p["my_rank"]
        with r.for_range("t", first, n_tokens, stride) as t:
            seen = []
            for k in range(K):
                i = t * K + k
                v = r.var(f"id{k}", T.s64, ir.Const(0, T.s64))
                with r.if_(wide.ne(0)):
                    r.assign(v, r.load(word(ids_in, i, 8), T.s64, name=f"id{k}_64"))
                with r.else_():
                    r.assign(v, r.load(word(ids_in, i), T.s32, name=f"id{k}_32").cast(T.s64))
                ok = (v >= ir.Const(0, T.s64)) & (v < ir.Const(bound, T.s64))
                for j, prev in enumerate(seen):
                    ok = ok & v.ne(prev)
                ok = r.let(f"ok{k}", ok | v.eq(ir.Const(MASKED, T.s64)))
                r.store(word(ids_out, i), ir.Select(ok, v.cast(T.s32), ir.Const(bound, T.s32)))
                with r.if_(~ok):
                    report_record(r, err_buf, my_rank, KERNEL_NAME, diag.IDS_MAGIC, t, k,
                                  v.cast(T.s32))
                seen.append(v)
    return kb.build()


def _pick(j, values):
    """``values[j]`` as a chain of ``selp`` on ``j == i`` (the last one the default)."""
    out = values[-1]
    for i in range(len(values) - 2, -1, -1):
        out = ir.Select(j.eq(i), values[i], out)
    return out


def build_check_ids_module(cfg, n_ranks: int = 1) -> ir.Module:
    """``ep_check_ids`` (or its ``n_ranks`` form) in a module of its own (the dispatch
    module is unchanged)."""
    return ir.Module(kernel_name(n_ranks), (build_check_ids(cfg, n_ranks),))


__all__ = ["build_check_ids", "build_check_ids_module", "id_bound", "kernel_name",
           "blocks_per_rank", "param_name", "RANK_PARAMS", "KERNEL_NAME", "BLOCK_THREADS"]
