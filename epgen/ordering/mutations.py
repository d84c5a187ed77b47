"""The ordered operations of a kernel and their weakened forms, at the IR level.

An *ordered operation* is a global-memory statement whose ordering or scope the protocol may
rely on: a ``spin_wait``, a fence, a load with ``.acquire`` or ``.sys``, a store with
``.release`` or ``.sys``, an atomic with an ordering other than ``.relaxed`` or with ``.sys``
(shared-memory atomics and ``.nc`` loads are not), and an NVSHMEM call that orders or
completes (``ir.nvshmem`` roles ``put_signal``, ``fence``, ``quiet``). Each has a stable id
``kernel:role:index:op`` (``index``: its position among the role's ordered operations in
statement order, nested bodies included; ``op``: its opcode, with the buffer of a
``spin_wait``; an NVSHMEM call's function name). Its *mutations* weaken one thing:

- ``relaxed``: ``.acquire``, ``.release``, ``.acq_rel`` or ``.sc`` becomes ``.relaxed``;
- ``gpu``: scope ``.sys`` becomes ``.gpu``;
- ``removed``: a fence, an ``nvshmem_fence`` or an ``nvshmem_quiet`` is deleted;
- ``unordered``: a put-with-signal (``nvshmemx_putmem_signal_nbi_warp``) becomes the same put
  (``nvshmemx_putmem_nbi_warp``) and, by lane 0, a plain ``nvshmemx_signal_op`` of the same
  signal, which NVSHMEM does not order after the put.

``mutate(module, op_id, kind)`` rebuilds the module with that one operation weakened; the
kernels are frozen ``ir`` nodes, so the statement's enclosing bodies are rebuilt around it.
A mutation the weak model cannot tell from the original (the scope of a relaxed access:
the model's relaxed accesses ignore scope) is marked ``modelled=False``.
"""

from __future__ import annotations

import attrs

from ir import nodes as N
from ir import nvshmem
from ir.enums import Scope, Sem, SReg, Space
from ir.printer import print_stmt

_ORDERING = (Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL, Sem.SC)
_ACCESS = (N.Load, N.Store, N.AtomicRMW, N.AtomicCAS, N.SpinWait)


@attrs.frozen
class Mutation:
    """One weakened form of one ordered operation."""

    op_id: str
    kind: str           # "relaxed", "gpu", "removed" or "unordered"
    modelled: bool      # whether the weak model can tell it from the original

    @property
    def name(self) -> str:
        return f"{self.op_id} -> {self.kind}"


def is_shared(s) -> bool:
    """Whether access ``s`` is to shared memory."""
    t = getattr(s.addr, "dtype", None)
    return getattr(t, "space", None) is Space.SHARED


#: the ``ir.nvshmem`` roles whose calls are ordered operations (the others move data or
#: query; a put's or a signal's ordering is what a put-with-signal, a fence or a quiet gives)
NVSHMEM_ORDERING_ROLES = ("put_signal", "fence", "quiet")


def is_nvshmem_ordering(s) -> bool:
    """Whether ``s`` is a call of an NVSHMEM function that orders or completes."""
    return (isinstance(s, N.Call) and nvshmem.is_nvshmem(s.name)
            and nvshmem.FUNCTIONS[s.name].role in NVSHMEM_ORDERING_ROLES)


def is_ordered(s) -> bool:
    """Whether statement ``s`` is an ordered operation (module docstring)."""
    if isinstance(s, N.Fence) or is_nvshmem_ordering(s):
        return True
    if not isinstance(s, _ACCESS) or is_shared(s):
        return False
    return isinstance(s, N.SpinWait) or s.sem in _ORDERING or s.scope is Scope.SYS


def op_text(s, kernel: N.Kernel) -> str:
    """The opcode of ``s`` as the IR prints it (a ``spin_wait`` with its buffer; an NVSHMEM
    call its function's name)."""
    if isinstance(s, N.Call):
        return s.name
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
    if isinstance(s, N.Call):
        role = nvshmem.FUNCTIONS[s.name].role
        return [Mutation(op_id, "unordered" if role == "put_signal" else "removed", True)]
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


def unordered_put_signal(s: N.Call) -> tuple:
    """``nvshmemx_putmem_signal_nbi_warp(dest, src, n, sig, value, op, pe)`` as the warp's
    ``nvshmemx_putmem_nbi_warp(dest, src, n, pe)`` then lane 0's ``nvshmemx_signal_op(sig,
    value, op, pe)``: the same data and signal, the signal no longer ordered after the data."""
    dest, src, n, sig, value, op, pe = s.args
    put = nvshmem.FUNCTIONS["nvshmemx_putmem_nbi_warp"]
    signal = nvshmem.FUNCTIONS["nvshmemx_signal_op"]
    lane0 = N.SRegRead(SReg.LANEID).eq(0)
    return (N.Call(None, put.name, (dest, src, n, pe), put.params),
            N.If(lane0, (N.Call(None, signal.name, (sig, value, op, pe), signal.params),)))


def _weakened(s, kind: str):
    if kind == "removed" and isinstance(s, N.Call):
        return N.Comment(f"removed by check-ordering: {s.name}")
    if kind == "unordered":
        if not (isinstance(s, N.Call) and nvshmem.FUNCTIONS[s.name].role == "put_signal"):
            raise ValueError(f"mutation 'unordered' applies to a put-with-signal, not {s}")
        return unordered_put_signal(s)
    if kind == "removed":
        return N.Comment(f"removed by check-ordering: fence.{s.sem.value}.{s.scope.value}")
    if kind == "relaxed":
        return attrs.evolve(s, sem=Sem.RELAXED)
    if kind == "gpu":
        return attrs.evolve(s, scope=Scope.GPU)
    raise ValueError(f"mutation kind must be relaxed, gpu, removed or unordered, got "
                     f"{kind!r}")


def _rebuild(stmts, state) -> tuple:
    out = []
    for s in stmts:
        if is_ordered(s):
            if state["i"] == state["target"]:
                s = state["fn"](s)
                state["hit"] = True
            state["i"] += 1
        if isinstance(s, tuple):        # one statement weakened into several
            out.extend(s)
            continue
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
