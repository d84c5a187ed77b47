"""The ordered operations of a kernel and their weakened forms, at the IR level.

An *ordered operation* is a global-memory statement whose ordering or scope the protocol may
rely on: a ``spin_wait``, a fence, a load with ``.acquire`` or ``.sys``, a store with
``.release`` or ``.sys``, an atomic with an ordering other than ``.relaxed`` or with ``.sys``
(shared-memory atomics and ``.nc`` loads are not). Each has a stable id
``kernel:role:index:op`` (``index``: its position among the role's ordered operations in
statement order, nested bodies included; ``op``: its opcode, with the buffer of a
``spin_wait``). Its *mutations* weaken one thing:

- ``relaxed``: ``.acquire``, ``.release``, ``.acq_rel`` or ``.sc`` becomes ``.relaxed``;
- ``gpu``: scope ``.sys`` becomes ``.gpu``;
- ``removed``: a fence is deleted.

``mutate(module, op_id, kind)`` rebuilds the module with that one operation weakened; the
kernels are frozen ``ir`` nodes, so the statement's enclosing bodies are rebuilt around it.
A mutation the weak model cannot tell from the original (the scope of a relaxed access:
the model's relaxed accesses ignore scope) is marked ``modelled=False``.
"""

from __future__ import annotations

import attrs

from ir import nodes as N
from ir.enums import Scope, Sem, Space
from ir.printer import print_stmt

_ORDERING = (Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL, Sem.SC)
_ACCESS = (N.Load, N.Store, N.AtomicRMW, N.AtomicCAS, N.SpinWait)


@attrs.frozen
class Mutation:
    """One weakened form of one ordered operation."""

    op_id: str
    kind: str           # "relaxed", "gpu" or "removed"
    modelled: bool      # whether the weak model can tell it from the original

    @property
    def name(self) -> str:
        return f"{self.op_id} -> {self.kind}"


def is_shared(s) -> bool:
    """Whether access ``s`` is to shared memory."""
    t = getattr(s.addr, "dtype", None)
    return getattr(t, "space", None) is Space.SHARED


def is_ordered(s) -> bool:
    """Whether statement ``s`` is an ordered operation (module docstring)."""
    if isinstance(s, N.Fence):
        return True
    if not isinstance(s, _ACCESS) or is_shared(s):
        return False
    return isinstance(s, N.SpinWait) or s.sem in _ORDERING or s.scope is Scope.SYS


def op_text(s, kernel: N.Kernel) -> str:
    """The opcode of ``s`` as the IR prints it (a ``spin_wait`` with its buffer)."""
    line = print_stmt(s, kernel).strip()
    if " = " in line.split("[")[0]:
        line = line.split(" = ", 1)[1]
    op = line.split()[0]
    if isinstance(s, N.SpinWait):
        op += f" {s.site.buffer}"
    return op


def ordered_ops(kernel: N.Kernel) -> list[tuple[str, object]]:
    """``(op id, statement)`` of every ordered operation of ``kernel``, in statement order."""
    out = []
    for role in kernel.roles:
        i = 0
        for s in N.walk(role.body):
            if is_ordered(s):
                out.append((f"{kernel.name}:{role.name}:{i}:{op_text(s, kernel)}", s))
                i += 1
    return out


def mutations_of(s, op_id: str) -> list[Mutation]:
    """The mutations of ordered operation ``s``."""
    if isinstance(s, N.Fence):
        out = [Mutation(op_id, "removed", True)]
        if s.scope is Scope.SYS:
            out.append(Mutation(op_id, "gpu", s.sem is not Sem.ACQUIRE))
        return out
    out = []
    ordering = s.sem in _ORDERING
    if ordering:
        out.append(Mutation(op_id, "relaxed", True))
    if s.scope is Scope.SYS:
        out.append(Mutation(op_id, "gpu", ordering))
    return out


def _weakened(s, kind: str):
    if kind == "removed":
        return N.Comment(f"removed by check-ordering: fence.{s.sem.value}.{s.scope.value}")
    if kind == "relaxed":
        return attrs.evolve(s, sem=Sem.RELAXED)
    if kind == "gpu":
        return attrs.evolve(s, scope=Scope.GPU)
    raise ValueError(f"mutation kind must be relaxed, gpu or removed, got {kind!r}")


def _rebuild(stmts, state) -> tuple:
    out = []
    for s in stmts:
        if is_ordered(s):
            if state["i"] == state["target"]:
                s = state["fn"](s)
                state["hit"] = True
            state["i"] += 1
        fields = N.CHILD_BODIES.get(type(s), ())
        if fields:
            s = attrs.evolve(s, **{f: _rebuild(getattr(s, f), state) for f in fields})
        out.append(s)
    return tuple(out)


def mutate_kernel(kernel: N.Kernel, op_id: str, kind: str) -> N.Kernel:
    """``kernel`` with ordered operation ``op_id`` weakened by ``kind``."""
    name, role_name, index, _ = op_id.split(":", 3)
    if name != kernel.name:
        return kernel
    roles = []
    found = False
    for role in kernel.roles:
        if role.name == role_name:
            state = {"i": 0, "target": int(index), "fn": lambda s: _weakened(s, kind),
                     "hit": False}
            role = attrs.evolve(role, body=_rebuild(role.body, state))
            found = state["hit"]
        roles.append(role)
    if not found:
        raise KeyError(f"no ordered operation {op_id} in kernel {kernel.name}")
    return attrs.evolve(kernel, roles=tuple(roles))


def mutate(module: N.Module, op_id: str, kind: str) -> N.Module:
    """``module`` with ordered operation ``op_id`` weakened by ``kind`` (kernels without it
    unchanged)."""
    return attrs.evolve(module, kernels=tuple(mutate_kernel(k, op_id, kind)
                                              for k in module.kernels))
