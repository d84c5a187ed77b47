"""Atomics: every ``AtomicRMW`` and ``AtomicCAS`` lowers to one inline PTX instruction.

Why inline PTX: LLVM before 23 (``target.NATIVE_SCOPED_ATOMICRMW`` is False) drops both the
ordering and the syncscope of ``atomicrmw``: ``atomicrmw add ... syncscope("device") release``
becomes ``atom.global.add.u32``, i.e. relaxed at gpu scope, silently weakening the protocol.
``cmpxchg`` is honoured, but keeping RMW and CAS in one table spelled exactly as PTX spells it
(``atom.<sem>.<scope>.<space>.<op>.<type>``, the semantics always explicit, ``relaxed``
included) gives one place to read and one test matrix pinning every line, whatever LLVM does.
tests/ptx/test_atomics_matrix.py also checks that the flag matches what the linked LLVM emits, so
an upgrade that honours ``atomicrmw`` shows up as a failing test, not as silent drift.

``red`` (no result) exists only with ``.relaxed``/``.release`` and without ``exch``; other
result-less RMWs stay ``atom`` with the result discarded.
"""

from __future__ import annotations

from llvmlite import ir as L

from ir import nodes as N
from ir.enums import AtomOp, Sem, Space
from ir.types import DType, PtrType

from .errors import LoweringError
from .inline_asm import inline_ptx

SEMS = (Sem.RELAXED, Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL)
RED_SEMS = (Sem.RELAXED, Sem.RELEASE)
SPACES = {Space.GLOBAL: ".global", Space.SHARED: ".shared", Space.GENERIC: ""}

_BITS32 = {"u32": "b32", "s32": "b32", "b32": "b32", "u64": "b64", "s64": "b64", "b64": "b64"}
_MINMAX = {t: t for t in ("u32", "s32", "u64", "s64")}

# op -> {IR value type: PTX instruction type}
RMW_TYPES = {
    AtomOp.ADD: {"u32": "u32", "s32": "s32", "u64": "u64", "s64": "u64",
                 "f32": "f32", "f64": "f64"},
    AtomOp.MIN: _MINMAX,
    AtomOp.MAX: _MINMAX,
    AtomOp.EXCH: _BITS32,
    AtomOp.AND: _BITS32,
    AtomOp.OR: _BITS32,
    AtomOp.XOR: _BITS32,
    AtomOp.INC: {"u32": "u32"},
    AtomOp.DEC: {"u32": "u32"},
}
CAS_TYPES = _BITS32


def _qualifiers(node, what: str) -> str:
    if node.sem not in SEMS:
        raise LoweringError(f"{what}: sem {node.sem.value!r} is not an atomic semantics; "
                            f"use one of {', '.join(s.value for s in SEMS)}")
    dtype = node.addr.dtype
    if not isinstance(dtype, PtrType) or dtype.space not in SPACES:
        raise LoweringError(f"{what}: address must be a global, shared or generic pointer, "
                            f"not {dtype}")
    return f"{node.sem.value}.{node.scope.value}{SPACES[dtype.space]}"


def _ptx_type(table: dict, dtype: DType, what: str) -> str:
    if dtype.name not in table:
        raise LoweringError(f"{what}: no PTX form for type {dtype}; "
                            f"supported: {', '.join(table)}")
    return table[dtype.name]


def uses_red(node: N.AtomicRMW) -> bool:
    """True when the RMW's result is unused and ``red`` can express it."""
    return node.dst is None and node.sem in RED_SEMS and node.op is not AtomOp.EXCH


def instruction(node: N.AtomicRMW | N.AtomicCAS) -> str:
    """The PTX instruction of an atomic node: ``atom.release.sys.global.add.u32``,
    ``red.relaxed.gpu.shared.or.b32``, ``atom.acq_rel.gpu.global.cas.b64``."""
    if isinstance(node, N.AtomicCAS):
        what = "atomic cas"
        ty = _ptx_type(CAS_TYPES, node.value.dtype, what)
        return f"atom.{_qualifiers(node, what)}.cas.{ty}"
    what = f"atomic {node.op.value}"
    ty = _ptx_type(RMW_TYPES[node.op], node.value.dtype, what)
    mnemonic = "red" if uses_red(node) else "atom"
    return f"{mnemonic}.{_qualifiers(node, what)}.{node.op.value}.{ty}"


def emit(b: L.IRBuilder, node: N.AtomicRMW | N.AtomicCAS, ptr: L.Value, operands,
         name: str = "") -> L.Value | None:
    """Emit the node's instruction on the lowered address and operands (``[value]`` or
    ``[compare, value]``); returns the old value, or None for ``red``."""
    instr = instruction(node)
    if isinstance(node, N.AtomicRMW) and uses_red(node):
        return inline_ptx(b, f"{instr} [$0], $1;", [ptr, *operands])
    args = ", ".join(f"${i + 2}" for i in range(len(operands)))
    return inline_ptx(b, f"{instr} $0, [$1], {args};", [ptr, *operands],
                      ret=operands[-1].type, name=name)
