"""Phase timestamps in the dispatch kernels: where a round trip's time goes, block by block.

Off by default (``cfg.tuning.trace`` False): no parameter is declared, no statement is added,
the PTX is unchanged. With ``tuning.trace`` every kernel ``build_module`` makes declares one
more parameter, ``trace_buf`` (u64 words), and records each trace point of ``POINTS``: every
role's ``<role>.begin`` and ``<role>.end`` (``KernelBuilder.role_hooks``) and the
points the builders mark with ``stamp``. Lane 0 of each warp that reaches a point runs::

    mov.u64 %t, %globaltimer;
    red.relaxed.gpu.global.min.u64 [slot],     %t;   // the block's first warp there
    red.relaxed.gpu.global.max.u64 [slot + 8], %t;   // the block's last warp there

    slot = trace_buf + ((my_rank * nctaid.x + ctaid.x) * len(POINTS) + point) * 16

so one call leaves, per rank, block and point, the first and last time a warp of the block
got there. The host side (``epgen.runtime.trace``) arms the buffer before a call (first
slots ~0, last slots 0) and decodes it; ``epgen run --trace`` prints the timeline.
``%globaltimer`` is one clock for the whole GPU (nanoseconds), so emulated ranks compare
directly; the stamps cost two ``red`` per warp and point, a perturbation the timeline shows
against an untraced bench.
"""

from __future__ import annotations

import weakref

import ir
from ir import AtomOp, Scope, Sem
from ir import types as T

ROLES = ("monitor", "comm", "signal", "aux", "pack", "copy")
#: the trace points, in the order a round trip reaches them: each role's begin and end, and
#: the protocol's hand-offs inside dispatch_wait's roles
POINTS = tuple(f"{role}.{edge}" for role in ROLES for edge in ("begin", "end")) + (
    "aux.counts_seen",      # every receive-count word (or ORD-R rank flag) seen
    "aux.flag_raised",      # just before the ready flag's st.release.gpu
    "copy.flag_seen",       # the ready flag seen by the block
    "copy.tile",            # a tile claimed (first: the block's first, last: its last claim)
)
PARAM = "trace_buf"

_state: "weakref.WeakKeyDictionary[ir.KernelBuilder, tuple]" = weakref.WeakKeyDictionary()


def instrument(kb: ir.KernelBuilder, cfg, my_rank) -> None:
    """With ``cfg.tuning.trace``: declare ``trace_buf`` on ``kb`` and stamp every role's
    begin and end from now on; without it, nothing."""
    if not cfg.tuning.trace:
        return
    _state[kb] = (kb.param(PARAM, T.ptr_global), ir.as_expr(my_rank, T.u32))
    kb.role_hooks.append(lambda r, edge: stamp(r, f"{r.name}.{edge}"))


def stamp(r: ir.RoleBuilder, point: str) -> None:
    """Trace point ``point`` (one of ``POINTS``) here, in lane 0 of each warp that reaches it
    (module docstring); nothing when the kernel is not instrumented."""
    if point not in POINTS:
        raise ValueError(f"trace point {point!r} is not one of trace.POINTS")
    state = _state.get(r.kb)
    if state is None:
        return
    buf, rank = state
    index = (rank * r.n_blocks + r.block) * len(POINTS) + POINTS.index(point)
    slot = r.let("trace_slot", buf + index.cast(T.u64) * 16)
    with r.if_(r.lane.eq(0)):
        now = r.let("trace_now", r.sreg(ir.SReg.GLOBALTIMER))
        r.red(AtomOp.MIN, slot, now, Sem.RELAXED, Scope.GPU, dtype=T.u64)
        r.red(AtomOp.MAX, slot + 8, now, Sem.RELAXED, Scope.GPU, dtype=T.u64)


__all__ = ["POINTS", "PARAM", "instrument", "stamp"]
