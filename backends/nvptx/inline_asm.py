"""Inline PTX: the one place that spells operand constraints and memory clobbers.

Used where LLVM 22 has no faithful lowering (scoped atomics, volatile accesses) or no
instruction selection for what we need (``cvt.rn.bf16.f32``).
"""

from __future__ import annotations

from llvmlite import ir as L

from .errors import LoweringError

# NVPTX register classes by value width; i8 lives in a 16-bit register ('c').
INT_CONSTRAINTS = {8: "c", 16: "h", 32: "r", 64: "l"}
FLOAT_CONSTRAINTS = {L.HalfType: "h", L.FloatType: "f", L.DoubleType: "d"}


def constraint(t: L.Type) -> str:
    """The operand constraint of an LLVM value type: ``h``/``r``/``l`` for 16/32/64-bit integers,
    ``h``/``f``/``d`` for f16/f32/f64, ``l`` for pointers."""
    if isinstance(t, L.PointerType):
        return "l"
    if isinstance(t, L.IntType) and t.width in INT_CONSTRAINTS:
        return INT_CONSTRAINTS[t.width]
    if type(t) in FLOAT_CONSTRAINTS:
        return FLOAT_CONSTRAINTS[type(t)]
    raise LoweringError(f"no inline PTX register class for LLVM type {t}")


def inline_ptx(b: L.IRBuilder, template: str, args, ret: L.Type | None = None,
               ordered: bool = True, name: str = "") -> L.Value:
    """Emit ``template`` (``$0`` is the result when ``ret`` is given, then the arguments).
    ``ordered`` (every memory access) makes it a side effect with a ``~{memory}`` clobber, so
    LLVM neither drops it nor moves other memory operations across it."""
    cons = ([f"={constraint(ret)}"] if ret is not None else []) + [constraint(a.type) for a in args]
    if ordered:
        cons.append("~{memory}")
    fty = L.FunctionType(ret if ret is not None else L.VoidType(), [a.type for a in args])
    return b.asm(fty, template, ",".join(cons), list(args), side_effect=ordered, name=name)
