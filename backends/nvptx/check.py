"""PTX checker: every ordered IR operation must survive into the PTX with
its exact qualifiers, so no regeneration can silently drop a ``.release`` or a ``.sys``.

``ordered_ops`` maps each ordered IR operation to the one PTX instruction it must produce;
this mapping is written here independently of the lowering (for loads, stores, fences and
barriers it is what LLVM 22 emits, confirmed by tests/ptx/test_ptx_checker.py). ``check_ptx``
counts those instructions in each kernel's ``.entry`` body: LLVM may duplicate an operation
(unrolling) but must not drop one, so each distinct instruction must occur at least as often
as IR operations expect it.

Calls of NVSHMEM (``ir.nvshmem``) with an ordering role (put, put_signal, fence, quiet,
signal) are ordered operations too: each must appear as its ``call.uni <name>`` line, linked
or not. Their order is checked as well, since it is their meaning (a fence between two puts,
a quiet before the signal): wherever two operations adjacent in a role's IR, one of them an
NVSHMEM call, meet in one straight-line run of the PTX, they must appear there in IR order
(LLVM cannot move memory operations across a call it cannot see into; across blocks, text
order is only layout).
"""

from __future__ import annotations

import collections
import re

import attrs

from ir import nodes as N
from ir import nvshmem as ir_nvshmem
from ir.enums import Scope, Sem, Space
from ir.types import PtrType

from . import atomics
from .errors import LoweringError

SPACES = {Space.GLOBAL: ".global", Space.SHARED: ".shared", Space.GENERIC: ""}
SCOPES = tuple(s.value for s in Scope)


class PtxCheckError(Exception):
    """Ordered IR operations whose PTX instruction is missing; ``missing`` lists
    ``(ops, found)`` per expected instruction; ``misordered`` lists ``(op, after)``: an
    operation with no PTX instruction after that of ``after`` (an NVSHMEM call or an ordered
    operation before it in the IR)."""

    def __init__(self, missing, misordered=()):
        self.missing = missing
        self.misordered = tuple(misordered)
        lines = []
        if missing:
            lines.append("PTX lacks the instructions of these ordered IR operations:")
        for ops, found in missing:
            op = ops[0]
            lines.append(f"  kernel {op.kernel}: `{op.expected}` expected {len(ops)}x, found "
                         f"{found}x, for " + "; ".join(f"role {o.role}: {_describe(o.node)}"
                                                       for o in ops))
        if self.misordered:
            lines.append("PTX breaks the IR order of these operations around NVSHMEM calls:")
        for op, after in self.misordered:
            lines.append(f"  kernel {op.kernel}, role {op.role}: `{op.expected}` "
                         f"({_describe(op.node)}) is not after `{after.expected}` "
                         f"(role {after.role}) in the PTX")
        super().__init__("\n".join(lines))


@attrs.frozen
class OrderedOp:
    """An ordered IR operation and the PTX instruction it must produce (``expected``;
    ``pattern`` matches it in PTX text, e.g. a generic access LLVM may have made ``.global``)."""

    kernel: str
    role: str
    node: object
    expected: str
    pattern: str


@attrs.frozen
class CheckReport:
    """``ops``: every ordered IR operation; ``found``: occurrences of each expected instruction
    per ``(kernel, expected)``; ``by_scope``: per kernel, PTX ``atomics``, ``releases`` and
    ``acquires`` counted by scope (``fence.sc`` and ``acq_rel`` count as both)."""

    ops: tuple
    found: dict
    by_scope: dict


def _describe(node) -> str:
    parts = [type(node).__name__]
    if isinstance(node, N.Call):
        parts.append(node.name)
    for field in ("op", "sem", "scope"):
        value = getattr(node, field, None)
        if value is not None:
            parts.append(value.value)
    if isinstance(node, (N.BarSync, N.BarArrive)):
        parts.append(f"{node.barrier.name} id {node.barrier.id}")
    return " ".join(parts)


def _mnemonic_pattern(expected: str) -> str:
    return r"(?<![\w.])" + re.escape(expected) + r"(?=\s)"


def _access(kind: str, sem: Sem, scope: Scope | None, addr: N.Expr, bits: int) -> tuple[str, str]:
    """``ld``/``st`` with semantics: ``ld.acquire.gpu.global.b32``, ``st.volatile.shared.b64``.
    LLVM may give a generic atomic access a state space it inferred."""
    space = addr.dtype.space if isinstance(addr.dtype, PtrType) else Space.GENERIC
    if scope is None and sem is not Sem.VOLATILE:
        raise LoweringError(f"{kind} {sem.value} without a scope")
    qual = sem.value if sem is Sem.VOLATILE else f"{sem.value}.{scope.value}"
    head, tail = f"{kind}.{qual}", f".b{bits}"
    expected = f"{head}{SPACES[space]}{tail}"
    if space is Space.GENERIC and sem is not Sem.VOLATILE:
        pattern = re.escape(head) + r"(?:\.global|\.shared)?" + re.escape(tail)
        return expected, r"(?<![\w.])" + pattern + r"(?=\s)"
    return expected, _mnemonic_pattern(expected)


def _fence(sem: Sem, scope: Scope, sm: int) -> str:
    """``fence.sc.<scope>``, ``fence.acq_rel.<scope>``; acquire/release have their own
    lightweight fences from sm_90 (PTX 8.6), before that they are ``fence.acq_rel``."""
    if sem is Sem.SC:
        return f"fence.sc.{scope.value}"
    if sem in (Sem.ACQUIRE, Sem.RELEASE) and sm >= 90:
        return f"fence.{sem.value}.{scope.value}"
    return f"fence.acq_rel.{scope.value}"


def _barrier(kind: str, bar: N.NamedBarrier, block_threads: int) -> tuple[str, str]:
    count = bar.count
    if kind == "bar.arrive" and count is None:
        count = block_threads
    expected = f"{kind} {bar.id}" if count is None else f"{kind} {bar.id}, {count}"
    pattern = rf"(?<![\w.]){re.escape(kind)}\s+{bar.id}"
    if count is not None:
        pattern += rf",\s*{count}"
    return expected, pattern + r"\s*;"


def is_ordered_call(node) -> bool:
    """An ``ir.Call`` of an NVSHMEM function whose role orders memory (not ``query``)."""
    return (isinstance(node, N.Call) and ir_nvshmem.is_nvshmem(node.name)
            and ir_nvshmem.FUNCTIONS[node.name].role != "query")


def _call(name: str) -> tuple[str, str]:
    """``call.uni <name>``, with or without a return value: ``call.uni (retval0), <name>, (...)``."""
    return (f"call.uni {name}",
            r"(?<![\w.])call\.uni\s+(?:\([^()]*\)\s*,\s*)?" + re.escape(name) + r"\s*,")


def _expectations(kernel: N.Kernel, node, sm: int) -> list[tuple[str, str]]:
    if is_ordered_call(node):
        return [_call(node.name)]
    if isinstance(node, N.Load) and node.sem in (Sem.RELAXED, Sem.ACQUIRE, Sem.VOLATILE):
        return [_access("ld", node.sem, node.scope, node.addr, node.dst.dtype.bits)]
    if isinstance(node, N.Store) and node.sem in (Sem.RELAXED, Sem.RELEASE, Sem.VOLATILE):
        return [_access("st", node.sem, node.scope, node.addr, node.value.dtype.bits)]
    if isinstance(node, N.SpinWait):
        return [_access("ld", node.sem, node.scope, node.addr, node.dtype.bits)]
    if isinstance(node, (N.AtomicRMW, N.AtomicCAS)):
        expected = atomics.instruction(node)
        return [(expected, _mnemonic_pattern(expected))]
    if isinstance(node, N.Fence):
        expected = _fence(node.sem, node.scope, sm)
        return [(expected, r"(?<![\w.])" + re.escape(expected) + r"\s*;")]
    if isinstance(node, N.BarSync) and node.barrier.id != 0:
        return [_barrier("bar.sync", node.barrier, kernel.block_threads)]
    if isinstance(node, N.BarArrive) and node.barrier.id != 0:
        return [_barrier("bar.arrive", node.barrier, kernel.block_threads)]
    return []


def _kernels(m) -> tuple:
    return (m,) if isinstance(m, N.Kernel) else tuple(m.kernels)


def ordered_ops(m: N.Kernel | N.Module, arch: str = "sm_90") -> list[OrderedOp]:
    """Every ordered operation of a kernel or module (relaxed/acquire/release/volatile loads and
    stores, atomics, fences, spin-wait polls, named barriers other than 0, NVSHMEM calls with
    an ordering role) with its PTX, in IR order."""
    sm = int(arch.removeprefix("sm_"))
    out = []
    for kernel in _kernels(m):
        for role in kernel.roles:
            for node in N.walk(role.body):
                for expected, pattern in _expectations(kernel, node, sm):
                    out.append(OrderedOp(kernel.name, role.name, node, expected, pattern))
    return out


_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")


def _body_end(text: str, start: int) -> int:
    """The end of the ``{ ... }`` body that opens after ``start`` (the text's end if none)."""
    depth, i = 0, text.find("{", start)
    if i < 0:
        return len(text)
    for m in re.compile(r"[{}]").finditer(text, i):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.end()
    return len(text)


def entry_bodies(ptx: str) -> dict[str, str]:
    """Each ``.entry``'s text (its header and body up to the closing brace: not the
    ``.func`` definitions a linked module puts after it), comments removed."""
    text = re.sub(r"//[^\n]*", "", ptx)
    return {m.group(1): text[m.start():_body_end(text, m.end())]
            for m in _ENTRY.finditer(text)}


_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:atom|red|ld|st|fence)\.[\w.]+)", re.M)


def scope_counts(body: str) -> dict[str, dict[str, int]]:
    """PTX atomics, releases and acquires of one entry body, by scope (``atom`` without a scope
    is ``gpu``, PTX's default; ``fence.sc`` and ``acq_rel`` count as release and acquire)."""
    counts = {k: collections.Counter() for k in ("atomics", "releases", "acquires")}
    for mnemonic in _INSTR.findall(body):
        quals = mnemonic.split(".")
        scope = next((q for q in quals if q in SCOPES), "gpu")
        if quals[0] in ("atom", "red"):
            counts["atomics"][scope] += 1
        strong = quals[0] == "fence" and "sc" in quals
        if strong or {"release", "acq_rel"} & set(quals):
            counts["releases"][scope] += 1
        if strong or {"acquire", "acq_rel"} & set(quals):
            counts["acquires"][scope] += 1
    return {k: dict(sorted(c.items())) for k, c in counts.items()}


def check_ptx(m: N.Kernel | N.Module, ptx: str) -> CheckReport:
    """Check that ``ptx`` (emitted from ``m``) holds every ordered operation's instruction at
    least as often as the IR expects it; raises PtxCheckError listing what is missing."""
    target = re.search(r"^\s*\.target\s+(sm_\d+)", ptx, re.M)
    if target is None:
        raise ValueError("PTX text has no .target directive")
    ops = ordered_ops(m, target.group(1))
    bodies = entry_bodies(ptx)
    groups: dict[tuple[str, str], list[OrderedOp]] = {}
    for op in ops:
        groups.setdefault((op.kernel, op.pattern), []).append(op)
    found, missing = {}, []
    for (kernel, pattern), group in groups.items():
        n = len(re.findall(pattern, bodies.get(kernel, "")))
        found[(kernel, group[0].expected)] = n
        if n < len(group):
            missing.append((tuple(group), n))
    misordered = [] if missing else _misordered(ops, bodies)
    if missing or misordered:
        raise PtxCheckError(missing, misordered)
    by_scope = {k.name: scope_counts(bodies.get(k.name, "")) for k in _kernels(m)}
    return CheckReport(tuple(ops), found, by_scope)


_BLOCK_END = re.compile(r"^\$L__BB\w+:|^\s*(?:@%p\w+\s+)?(?:bra|ret|exit)\b", re.M)


def _basic_blocks(body: str) -> list[tuple[int, int]]:
    """``(start, end)`` text spans of ``body``'s straight-line runs: split at every label and
    after every branch, return or exit (within one, text order is execution order)."""
    cuts = sorted({0, len(body)} | {m.start() for m in _BLOCK_END.finditer(body)})
    return list(zip(cuts, cuts[1:]))


def _misordered(ops, bodies) -> list[tuple[OrderedOp, OrderedOp]]:
    """``(op, after)`` pairs breaking the order around NVSHMEM calls (module docstring): for
    each two operations next to each other in a role's IR sequence, one of them an NVSHMEM
    call, a straight-line run of the PTX that holds both must hold one of ``after`` before
    one of ``op``. Text order means execution order only inside such a run (LLVM lays blocks
    out freely and roles are separate regions), so pairs in different runs are not compared:
    the check is sound, and it catches a call or an operation moved across another inside
    its block."""
    out = []
    by_role: dict[tuple[str, str], list[OrderedOp]] = {}
    for op in ops:
        by_role.setdefault((op.kernel, op.role), []).append(op)
    for (kernel, _role), seq in by_role.items():
        if not any(is_ordered_call(op.node) for op in seq):
            continue
        body = bodies.get(kernel, "")
        blocks = _basic_blocks(body)
        where = {p: [m.start() for m in re.finditer(p, body)] for p in {o.pattern for o in seq}}
        for before, op in zip(seq, seq[1:]):
            if not (is_ordered_call(before.node) or is_ordered_call(op.node)):
                continue
            if before.pattern == op.pattern:
                continue
            for lo, hi in blocks:
                a = [x for x in where[before.pattern] if lo <= x < hi]
                b = [x for x in where[op.pattern] if lo <= x < hi]
                if a and b and min(a) > max(b):
                    out.append((op, before))
                    break
    return out
