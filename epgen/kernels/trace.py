"""Trace rings: per-event ``%globaltimer`` records of every role's phases, block by block.

A kernel's trace sink is ``NullTrace`` (the default: every stamp compiles to nothing, no
parameter is declared, the PTX is that of a build without tracing) or ``TraceBuf``, the
``trace_buf`` kernel parameter (u64 aligned) with this rank's number. ``TraceBuf`` holds
rings of fixed-size events; ring ``q`` of a kernel with ``rings_per_cta`` rings per block is::

    q = trace_ring_base + ctaid.x * rings_per_cta + ring_id
    ring = trace_buf + q * ring_bytes(capacity)       // a 32-byte header, then the events
    header: u32 cursor (events claimed this call; the host zeroes it before a call)
    event i at ring + 32 + 32 * i:
        u64 %globaltimer | u32 event (index in EVENTS) | u32 rank
        u32 block (ctaid.x) | u32 warp (role-local) | u64 payload

A stamp in one thread (lane 0 of each warp that reaches the point, or each thread that does
the work, ``leader=False``) runs::

    mov.u64 %t, %globaltimer;
    atom.relaxed.gpu.global.add.u32 %i, [ring], 1;
    @%i < capacity: st.global.u64 / .u32 of the event's six fields

so the ring keeps the first ``capacity`` events of a call, and the cursor counts every claim:
the host reports ``cursor - capacity`` events dropped when a ring overflows. Several roles may
share a ring (the claim is atomic); more rings per block only spread the claims.

``instrument`` gives a kernel built with ``cfg.tuning.trace`` its ``TraceBuf`` (geometry from
the tuning: ``trace_rings_per_cta``, ``trace_ring_capacity``), stamps every role's
``<role>.begin`` / ``<role>.end`` (``KernelBuilder.role_hooks``), and ``stamp`` records the
hand-offs the builders mark. ``copy_received_tokens_to_output`` takes its sink and ring
geometry as one argument, a ``CopyTrace`` (``copy_trace`` gives the kernel's). ``epgen.runtime.trace`` arms and
decodes the rings; ``%globaltimer`` is one clock for the whole GPU (ns), so emulated ranks
compare directly.
"""

from __future__ import annotations

import weakref

import attrs

import ir
from ir import AtomOp, Scope, Sem
from ir import types as T

ROLES = ("monitor", "comm", "signal", "aux", "pack", "copy", "ffn", "send", "reduce")
#: every event a ring records, by index: each role's begin and end, then the hand-offs inside
#: the roles (payload in brackets; 0 when none is named)
EVENTS = tuple(f"{role}.{edge}" for role in ROLES for edge in ("begin", "end")) + (
    "aux.counts_seen",      # every receive-count word (or ORD-R rank flag) seen
    "aux.flag_raised",      # just before the ready flag's st.release.gpu
    "copy.flag_seen",       # the ready flag seen by the warp
    "copy.tile",            # warp 0 claimed a tile [expert << 32 | tile]
    "copy.l1_release",      # just before one L1 release [expert << 32 | token block]
    "ffn.l1_seen",          # an expert's L1 arrival counter complete [expert]
    "send.arrival_raised",      # combine: just before a source's arrival word is [source]
    "reduce.arrivals_seen",     # combine: every destination's arrival word seen
)
PARAM = "trace_buf"
EVENT_BYTES = 32
HEADER_BYTES = 32


def ring_bytes(capacity: int) -> int:
    """Bytes of one ring of ``capacity`` events (its header, then the events)."""
    return HEADER_BYTES + capacity * EVENT_BYTES


def _event_id(event: str) -> int:
    if event not in EVENTS:
        raise ValueError(f"trace event {event!r} is not one of trace.EVENTS")
    return EVENTS.index(event)


def check_geometry(rings_per_cta, ring_capacity, ring_id, ring_base=0,
                   prefix: str = "trace_") -> None:
    """``ValueError`` naming the parameter and the rule for a ring geometry that cannot be
    laid out (``<prefix>rings_per_cta`` etc.: the builder's argument names)."""
    def positive(name, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{prefix}{name} must be a positive integer, got {v!r}")
    positive("rings_per_cta", rings_per_cta)
    positive("ring_capacity", ring_capacity)
    if ring_capacity >= 2**31:
        raise ValueError(f"{prefix}ring_capacity must be below 2**31 (a u32 cursor), got "
                         f"{ring_capacity}")
    if isinstance(ring_id, bool) or not isinstance(ring_id, int) \
            or not 0 <= ring_id < rings_per_cta:
        raise ValueError(f"{prefix}{'comm_' if prefix else ''}ring_id must be in [0, "
                         f"{prefix}rings_per_cta={rings_per_cta}), got {ring_id!r}")
    if isinstance(ring_base, bool) or (isinstance(ring_base, int) and ring_base < 0) \
            or not isinstance(ring_base, (int, ir.ExprOps)):
        raise ValueError(f"{prefix}ring_base must be an integer >= 0 or a u32 IR value, got "
                         f"{ring_base!r}")


class NullTrace:
    """The sink that records nothing: ``ring`` and ``stamp`` check their arguments and add
    no statement, so a build with it is a build without tracing."""

    enabled = False

    def ring(self, *, rings_per_cta: int = 1, ring_capacity: int = 1, ring_id: int = 0,
             ring_base=0) -> NullTrace:
        check_geometry(rings_per_cta, ring_capacity, ring_id, ring_base)
        return self

    def stamp(self, r: ir.RoleBuilder, event: str, payload=0, *, leader: bool = True) -> None:
        _event_id(event)


@attrs.frozen
class TraceBuf:
    """A kernel's trace rings: ``buf`` the ``trace_buf`` parameter, ``rank`` this rank's
    number (a u32 expression). ``ring(...)`` is the ring one role writes."""

    buf: ir.ExprOps
    rank: ir.ExprOps

    enabled = True

    def ring(self, *, rings_per_cta: int = 1, ring_capacity: int = 1, ring_id: int = 0,
             ring_base=0) -> Ring:
        check_geometry(rings_per_cta, ring_capacity, ring_id, ring_base)
        return Ring(self, rings_per_cta, ring_capacity, ring_id, ring_base)


@attrs.frozen
class Ring:
    """Ring ``ring_base + ctaid.x * rings_per_cta + ring_id`` of ``sink`` (module docstring)."""

    sink: TraceBuf
    rings_per_cta: int
    capacity: int
    ring_id: int
    ring_base: object = 0

    enabled = True

    def stamp(self, r: ir.RoleBuilder, event: str, payload=0, *, leader: bool = True) -> None:
        """Event ``event`` (one of ``EVENTS``) with ``payload`` (u64) here: ``mov.u64
        %globaltimer``, ``atom.relaxed.gpu.global.add.u32`` on the ring's cursor and, when
        the claimed index is below the capacity, the event's ``st.global`` stores; in lane 0
        of each warp that reaches it (``leader``) or in every thread that does."""
        eid = _event_id(event)
        if leader:
            with r.if_(r.lane.eq(0)):
                self._record(r, eid, payload)
        else:
            self._record(r, eid, payload)

    def _record(self, r: ir.RoleBuilder, eid: int, payload) -> None:
        now = r.let("trace_now", r.sreg(ir.SReg.GLOBALTIMER))
        q = r.block * self.rings_per_cta if self.rings_per_cta != 1 else r.block
        if self.ring_id:
            q = q + self.ring_id
        if not (isinstance(self.ring_base, int) and self.ring_base == 0):
            q = ir.as_expr(self.ring_base, T.u32) + q
        ring = r.let("trace_ring", self.sink.buf + q.cast(T.u64) * ring_bytes(self.capacity))
        idx = r.atomic(AtomOp.ADD, ring, 1, Sem.RELAXED, Scope.GPU, name="trace_idx")
        with r.if_(idx < self.capacity):
            ev = r.let("trace_ev", ring + HEADER_BYTES + idx.cast(T.u64) * EVENT_BYTES)
            r.store(ev, now)
            r.store(ev + 8, ir.Const(eid, T.u32))
            r.store(ev + 12, self.sink.rank)
            r.store(ev + 16, r.block)
            r.store(ev + 20, r.warp)
            r.store(ev + 24, ir.as_expr(payload, T.u64).cast(T.u64))


@attrs.frozen
class CopyTrace:
    """The trace arguments of ``copy_received_tokens_to_output``: the sink ``buf``
    (``NullTrace``, the default, compiles every stamp out) and the ring the role writes, ring
    ``comm_ring_id`` of the ``rings_per_cta`` rings of ``ring_capacity`` events each block
    owns from ring ``ring_base`` on; ``scatter_release`` stamps ``copy.l1_release`` before
    each L1 release. Checked at construction (``ValueError`` naming the reference's
    ``trace_*`` argument)."""

    buf: object = NullTrace()
    rings_per_cta: int = 1
    ring_capacity: int = 1
    comm_ring_id: int = 0
    ring_base: object = 0
    scatter_release: bool = False

    def __attrs_post_init__(self):
        if not isinstance(self.buf, (TraceBuf, NullTrace)):
            raise ValueError(f"trace_buf must be a trace.TraceBuf or trace.NullTrace, got "
                             f"{self.buf!r}")
        if not isinstance(self.scatter_release, bool):
            raise ValueError(f"trace_scatter_release must be a bool, got "
                             f"{self.scatter_release!r}")
        check_geometry(self.rings_per_cta, self.ring_capacity, self.comm_ring_id,
                       self.ring_base)

    def ring(self):
        """The role's ring (a ``Ring``), or the ``NullTrace`` itself."""
        return self.buf.ring(rings_per_cta=self.rings_per_cta,
                             ring_capacity=self.ring_capacity, ring_id=self.comm_ring_id,
                             ring_base=self.ring_base)


@attrs.frozen
class _KernelTrace:
    sink: TraceBuf | NullTrace
    rings_per_cta: int
    capacity: int
    role_rings: dict
    scatter_release: bool

    def ring(self, role: str):
        return self.sink.ring(rings_per_cta=self.rings_per_cta, ring_capacity=self.capacity,
                              ring_id=self.role_rings.get(role, 0) % self.rings_per_cta)


_state: "weakref.WeakKeyDictionary[ir.KernelBuilder, _KernelTrace]" = \
    weakref.WeakKeyDictionary()


def instrument(kb: ir.KernelBuilder, cfg, my_rank, role_rings: dict | None = None) -> None:
    """With ``cfg.tuning.trace``: declare ``trace_buf`` on ``kb``, make it the kernel's
    ``TraceBuf`` and stamp every role's begin and end from now on, role ``name`` on ring
    ``role_rings.get(name, 0) % trace_rings_per_cta``; without it, nothing."""
    tuning = cfg.tuning
    if not tuning.trace:
        return
    sink = TraceBuf(kb.param(PARAM, T.ptr_global), ir.as_expr(my_rank, T.u32))
    _state[kb] = state = _KernelTrace(sink, tuning.trace_rings_per_cta,
                                      tuning.trace_ring_capacity, dict(role_rings or {}),
                                      tuning.trace_scatter_release)
    kb.role_hooks.append(lambda r, edge: state.ring(r.name).stamp(r, f"{r.name}.{edge}"))


def stamp(r: ir.RoleBuilder, event: str, payload=0, *, leader: bool = True) -> None:
    """Event ``event`` (one of ``EVENTS``) on the ring of ``r``'s role in the kernel's sink
    (``instrument``); nothing when the kernel is not instrumented."""
    state = _state.get(r.kb)
    if state is None:
        _event_id(event)
        return
    state.ring(r.name).stamp(r, event, payload, leader=leader)


def copy_trace(kb: ir.KernelBuilder, role: str = "copy") -> CopyTrace:
    """The ``CopyTrace`` of role ``role`` in kernel ``kb``: its sink and geometry
    (``instrument``); the default (``NullTrace``) when the kernel is not instrumented."""
    state = _state.get(kb)
    if state is None:
        return CopyTrace()
    return CopyTrace(state.sink, state.rings_per_cta, state.capacity,
                     state.role_rings.get(role, 0) % state.rings_per_cta,
                     scatter_release=state.scatter_release)


__all__ = ["EVENTS", "ROLES", "PARAM", "EVENT_BYTES", "HEADER_BYTES", "ring_bytes",
           "NullTrace", "TraceBuf", "Ring", "CopyTrace", "check_geometry", "instrument", "stamp",
           "copy_trace"]
