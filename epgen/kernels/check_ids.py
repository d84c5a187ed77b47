"""``ep_check_ids``: the device-side check of one rank's top-k ids, for callers whose ids
never reach the host (``epgen.torch``); it runs before ``dispatch_async`` on the same stream.

Thread ``t`` of the grid (grid-strided over tokens) loads the token's ``K`` ids (``s32``, or
``s64`` when ``ids_wide``: what ``torch.topk`` gives) and writes them as ``s32`` to
``ids_out`` (the rank's own id buffer, which dispatch reads). An id is *valid* when it is
in ``[0, bound)`` (``bound = n_experts``; under ``skip_a2a``, where ids are global, 65535)
and differs from the token's earlier ids. An invalid id is written as ``bound`` (which the
dispatch kernels never count and never send: each reservation requires ``g < n_experts``)
and reported as an input record (``ir.diag.IDS_MAGIC``: token, slot, id) that the host
raises as ``EPInputError`` at the next check. So a bad id drops that one slot of its token
and nothing is written out of bounds.
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


def id_bound(cfg) -> int:
    """The first invalid id (and the sentinel an invalid id becomes)."""
    return SKIP_A2A_BOUND if cfg.skip_a2a else cfg.n_experts


def build_check_ids(cfg) -> ir.Kernel:
    """The ``ep_check_ids`` entry point (module docstring): per id ``ld.global.s32`` or
    ``.s64``, range and repeat compares (``setp``), ``selp`` of the id or the sentinel,
    ``st.global.b32``; a record (``report_record``) per invalid id."""
    K, bound = cfg.token_fmt.top_k, id_bound(cfg)
    kb = ir.KernelBuilder(KERNEL_NAME, BLOCK_THREADS)
    ids_in = kb.param("ids_in", T.ptr_global)
    wide = kb.param("ids_wide", T.u32)
    ids_out = kb.param("ids_out", T.ptr_global)
    n_tokens = kb.param("n_tokens", T.u32)
    my_rank = kb.param("my_rank", T.u32)
    err_buf = kb.param("err_buf", T.ptr_global)
    kb.diagnostics(err_buf=err_buf, rank=my_rank)
    with kb.role("check", blocks=(0, None)) as r:
        with r.for_range("t", r.global_thread_id(), n_tokens, r.grid_threads()) as t:
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
                ok = r.let(f"ok{k}", ok)
                r.store(word(ids_out, i), ir.Select(ok, v.cast(T.s32), ir.Const(bound, T.s32)))
                with r.if_(~ok):
                    report_record(r, err_buf, my_rank, KERNEL_NAME, diag.IDS_MAGIC, t, k,
                                  v.cast(T.s32))
                seen.append(v)
    return kb.build()


def build_check_ids_module(cfg) -> ir.Module:
    """``ep_check_ids`` in a module of its own (the dispatch module is unchanged)."""
    return ir.Module("ep_check_ids", (build_check_ids(cfg),))


__all__ = ["build_check_ids", "build_check_ids_module", "id_bound", "KERNEL_NAME",
           "BLOCK_THREADS"]
