"""Lowering of a rank-batched kernel (``ir.RankBatch``): one by-value table parameter, each IR
parameter read from its rank's row, and the rank-local block index.

    .param .align 8 .b8 <kernel>_param_0[ranks * n * 8]        // the table, by value
    mov.u32 %r, %ctaid.x;  div %rank = %r / blocks              // this block's rank
    mov.b64 %t, <kernel>_param_0;                               // the table's param address
    ld.param.b64 %v, [%t + (rank * n + i) * 8];                 // IR parameter i
    (cvt / mov to the parameter's type)
    %ctaid.x  -> rem.u32 %r, blocks;   %nctaid.x -> blocks

LLVM lowers loads from a ``byval`` kernel argument that nothing writes to ``ld.param`` at a
register address (PTX: the address of a kernel parameter may be taken with ``mov`` and used by
``ld.param``), so the table stays in the constant bank: no copy to local memory.
"""

from __future__ import annotations

from llvmlite import ir as L

from ir import nodes as N
from ir import types as T
from ir.enums import SReg

from .errors import LoweringError
from .intrinsics import I32, I64, SREGS, call

I8 = L.IntType(8)
#: CUDA's limit on a kernel's parameter bytes below PTX ISA 8.1 (the table is the only one)
MAX_TABLE_BYTES = 4096


class _TablePtr(L.PointerType):
    """An opaque ``ptr`` that knows the array it points to, which llvmlite prints in the
    argument's ``byval(<type>)`` attribute."""

    def __init__(self, pointee: L.Type):
        super().__init__()
        self.pointee = pointee


def table_bytes(kernel: N.Kernel) -> int:
    """Bytes of ``kernel``'s by-value table: ``ranks`` rows of one slot per parameter."""
    return kernel.rank_batch.ranks * len(kernel.params) * N.RANK_ARG_BYTES


def check(kernel: N.Kernel) -> None:
    """``LoweringError`` unless every parameter fits a slot and the table fits CUDA's limit."""
    batch = kernel.rank_batch     # (ranks and blocks are checked by RankBatch itself)
    for p in kernel.params:
        if isinstance(p.dtype, T.VecType) or (not isinstance(p.dtype, T.PtrType)
                                               and p.dtype.bits > 8 * N.RANK_ARG_BYTES):
            raise LoweringError(f"kernel {kernel.name}: parameter {p.name} ({p.dtype}) does not "
                                f"fit a {N.RANK_ARG_BYTES}-byte slot of the rank table")
    if table_bytes(kernel) > MAX_TABLE_BYTES:
        raise LoweringError(f"kernel {kernel.name}: its rank table takes {table_bytes(kernel)} "
                            f"bytes ({batch.ranks} ranks x {len(kernel.params)} parameters x "
                            f"{N.RANK_ARG_BYTES}); a kernel's parameters may take at most "
                            f"{MAX_TABLE_BYTES}")


def function_type(kernel: N.Kernel, void: L.Type) -> L.FunctionType:
    """``void (ptr byval([bytes x i8]) align 8)``."""
    return L.FunctionType(void, [_TablePtr(L.ArrayType(I8, table_bytes(kernel)))])


def mark_table(arg: L.Argument) -> None:
    arg.name = "rank_args"
    arg.add_attribute("byval")
    arg.attributes.align = N.RANK_ARG_BYTES


def raw_ctaid(b: L.IRBuilder) -> L.Value:
    intrinsic, _ = SREGS[SReg.CTAID_X]
    return call(b, intrinsic, name="ctaid.batched")


def row_address(b: L.IRBuilder, kernel: N.Kernel, table: L.Value) -> L.Value:
    """At the kernel's start: the address of this block's rank row in the table."""
    batch, n = kernel.rank_batch, len(kernel.params)
    rank = b.udiv(raw_ctaid(b), L.Constant(I32, batch.blocks), name="rank")
    row = b.mul(b.zext(rank, I64), L.Constant(I64, n * N.RANK_ARG_BYTES), name="rank_row")
    return b.gep(table, [row], source_etype=I8, name="rank_args.row")


def load_param(b: L.IRBuilder, kernel: N.Kernel, row: L.Value, p: N.Param,
               llvm_type) -> L.Value:
    """Parameter ``p`` where it is used: ``ld.param`` of its slot in the rank row (loaded at
    each use, as the constant-bank operands of an ordinary kernel are, so no register holds
    it across the kernel)."""
    i = _index(kernel, p.name)
    slot = b.gep(row, [L.Constant(I64, i * N.RANK_ARG_BYTES)], source_etype=I8,
                 name=f"{p.name}.slot")
    word = b.load(slot, typ=I64, name=f"{p.name}.word")
    word.align = N.RANK_ARG_BYTES
    return _as_type(b, word, llvm_type(p.dtype), p.name)


def _index(kernel: N.Kernel, name: str) -> int:
    for i, p in enumerate(kernel.params):
        if p.name == name:
            return i
    raise LoweringError(f"no parameter {name!r}")


def _as_type(b: L.IRBuilder, word: L.Value, ty: L.Type, name: str) -> L.Value:
    if isinstance(ty, L.PointerType):
        return b.inttoptr(word, ty, name=name)
    if isinstance(ty, L.IntType):
        return word if ty.width == 64 else b.trunc(word, ty, name=name)
    if isinstance(ty, L.DoubleType):
        return b.bitcast(word, ty, name=name)
    if isinstance(ty, (L.FloatType, L.HalfType)):
        bits = 32 if isinstance(ty, L.FloatType) else 16
        return b.bitcast(b.trunc(word, L.IntType(bits)), ty, name=name)
    raise LoweringError(f"parameter {name}: no rank-table slot for LLVM type {ty}")


def virtual_sreg(b: L.IRBuilder, kernel: N.Kernel, sreg: SReg) -> L.Value | None:
    """The rank-local ``%ctaid.x`` / ``%nctaid.x``; None for every other register."""
    blocks = L.Constant(I32, kernel.rank_batch.blocks)
    if sreg is SReg.CTAID_X:
        return b.urem(raw_ctaid(b), blocks, name="ctaid.x")
    if sreg is SReg.NCTAID_X:
        return blocks
    return None
