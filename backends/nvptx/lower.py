"""Lowering of the kernel IR to llvmlite IR for the NVPTX backend.

Two dispatch tables map node types to lowering functions: ``LOWERINGS`` for statements and
``EXPR_LOWERINGS`` for expressions. Each function's docstring names the PTX it produces.

Shape of a kernel: ``define ptx_kernel void @name(...)`` with named arguments; every ``Var`` is an
``alloca`` in the entry block (the O2 pipeline promotes them to registers); each role's body is
guarded by its block and thread ranges, in kernel order; then ``ret void``.
"""

from __future__ import annotations

import struct

from llvmlite import ir as L
from llvmlite.ir import instructions as LI

from ir import nodes as N
from ir import types as T
from ir.enums import (BinOpKind, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, Space, SReg,
                      UnOpKind)
from ir.types import PtrType, VecType

from . import atomics, rank_batch, spin_wait
from .errors import LoweringError
from .inline_asm import constraint
from .inline_asm import inline_ptx
from .intrinsics import I1, I32, I64, SREGS, VOID, call, type_suffix
from .target import TRIPLE, Target

I8, I16 = L.IntType(8), L.IntType(16)
ADDRSPACES = {Space.GENERIC: 0, Space.GLOBAL: 1, Space.SHARED: 3}
PTX_SPACES = {Space.GENERIC: "", Space.GLOBAL: ".global", Space.SHARED: ".shared"}
FLOATS = {16: L.HalfType(), 32: L.FloatType(), 64: L.DoubleType()}

# memory-model vocabulary -> LLVM: ordering of `load/store atomic`, `fence`; syncscope names
ORDERINGS = {Sem.RELAXED: "monotonic", Sem.ACQUIRE: "acquire", Sem.RELEASE: "release",
             Sem.ACQ_REL: "acq_rel", Sem.SC: "seq_cst"}
SYNCSCOPES = {Scope.CTA: "block", Scope.CLUSTER: "cluster", Scope.GPU: "device", Scope.SYS: None}

CMP_OPS = {CmpOp.EQ: "==", CmpOp.NE: "!=", CmpOp.LT: "<", CmpOp.LE: "<=", CmpOp.GT: ">",
           CmpOp.GE: ">="}

LOWERINGS: dict[type, callable] = {}
EXPR_LOWERINGS: dict[type, callable] = {}


def _lowers(table, node_type):
    def register(fn):
        table[node_type] = fn
        return fn
    return register


# ---------------------------------------------------------------------------------------------
# Types


def llvm_type(t: T.Type) -> L.Type:
    """pred -> i1, u/s/b<n> -> i<n>, bf16 -> i16 (bits), f16/f32/f64 -> half/float/double,
    v<n>.<t> -> <n x t>, ptr.<space> -> ptr addrspace(n)."""
    if isinstance(t, PtrType):
        if t.space not in ADDRSPACES:
            raise LoweringError(f"no LLVM address space for {t}")
        return L.PointerType(addrspace=ADDRSPACES[t.space])
    if isinstance(t, VecType):
        return L.VectorType(llvm_type(t.elem), t.n)
    if t.kind == "pred":
        return I1
    if t.kind == "f":
        return FLOATS[t.bits]
    return L.IntType(t.bits)


def _kind(t: T.Type) -> str:
    """Arithmetic class of a type (vectors by their lanes): int, float, pred, bf16 or ptr."""
    t = t.elem if isinstance(t, VecType) else t
    if isinstance(t, PtrType):
        return "ptr"
    return {"u": "int", "s": "int", "b": "int", "f": "float", "pred": "pred", "bf": "bf16"}[t.kind]


def _signed(t: T.Type) -> bool:
    return (t.elem if isinstance(t, VecType) else t).is_signed


def _bf16_bits(x: float) -> int:
    """IEEE f32 -> bf16 bits, rounding to nearest even (what ``cvt.rn.bf16.f32`` does)."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


# ---------------------------------------------------------------------------------------------
# Per-kernel state


class KernelLowering:
    """The llvmlite function of one kernel and the state of its lowering: variables, loops."""

    def __init__(self, module: L.Module, kernel: N.Kernel, target: Target):
        self.module, self.kernel, self.target = module, kernel, target
        if kernel.rank_batch is not None:
            rank_batch.check(kernel)
            fnty = rank_batch.function_type(kernel, VOID)
        else:
            fnty = L.FunctionType(VOID, [llvm_type(p.dtype) for p in kernel.params])
        self.fn = L.Function(module, fnty, kernel.name)
        self.fn.calling_convention = "ptx_kernel"
        self.allocas = L.IRBuilder(self.fn.append_basic_block("entry"))
        self.vars: dict[str, tuple[N.Var, L.Value]] = {}
        self.loop_exits: list[L.Block] = []
        self.b = L.IRBuilder(self.fn.append_basic_block("body"))
        self.allocas.branch(self.b.block)
        self.allocas.position_at_start(self.allocas.block)
        self.params, self.rank_row = {}, None
        if kernel.rank_batch is None:
            for arg, p in zip(self.fn.args, kernel.params):
                arg.name = p.name
                self.params[p.name] = arg
        else:
            table = self.fn.args[0]
            rank_batch.mark_table(table)
            self.rank_row = rank_batch.row_address(self.b, kernel, table)

    def lower(self) -> L.Function:
        for role in self.kernel.roles:
            lower_role(self, role)
        self.b.ret_void()
        return self.fn

    # -- helpers used by the lowering functions ------------------------------------------------
    def expr(self, e: N.Expr) -> L.Value:
        fn = EXPR_LOWERINGS.get(type(e))
        if fn is None:
            raise LoweringError(f"no lowering for {type(e).__name__}")
        return fn(self, e)

    def expr_as(self, e: N.Expr, dtype: T.Type) -> L.Value:
        """``e`` converted to ``dtype`` (see ``convert``)."""
        return convert(self, self.expr(e), e.dtype, dtype)

    def stmts(self, stmts) -> None:
        for s in stmts:
            fn = LOWERINGS.get(type(s))
            if fn is None:
                raise LoweringError(f"no lowering for {type(s).__name__}")
            fn(self, s)

    def block(self, name: str) -> L.Block:
        return self.fn.append_basic_block(name)

    def continue_at(self, block: L.Block) -> None:
        """Move ``block`` after every block created so far and emit into it (keeps the
        printed block order that of the source)."""
        self.fn.blocks.remove(block)
        self.fn.blocks.append(block)
        self.b.position_at_end(block)

    def branch_to(self, target: L.Block) -> None:
        """End the current block with ``br target`` unless it already ends."""
        if not self.b.block.is_terminated:
            self.b.branch(target)

    def var_slot(self, var: N.Var) -> L.Value:
        """The alloca of ``var`` (created in the entry block on first use)."""
        known = self.vars.get(var.name)
        if known is None:
            slot = self.allocas.alloca(llvm_type(var.dtype), name=f"{var.name}.addr")
            self.vars[var.name] = (var, slot)
            return slot
        if known[0].dtype != var.dtype:
            raise LoweringError(f"variable {var.name!r} used as {known[0].dtype} and as "
                                f"{var.dtype}")
        return known[1]

    def set_var(self, var: N.Var, value: L.Value) -> None:
        if value.type != llvm_type(var.dtype):
            raise LoweringError(f"cannot assign a {value.type} value to {var.name} ({var.dtype})")
        self.b.store(value, self.var_slot(var))

    def sreg(self, sreg: SReg) -> L.Value:
        if self.kernel.rank_batch is not None:
            local = rank_batch.virtual_sreg(self.b, self.kernel, sreg)
            if local is not None:
                return local
        intrinsic, _ = SREGS[sreg]
        return call(self.b, intrinsic, name=sreg.value)

    def ordering(self, sem: Sem, scope: Scope | None) -> str:
        """LLVM ordering string with syncscope: ``syncscope("device") acquire``; sys scope has
        no syncscope."""
        if scope is None:
            raise LoweringError(f"sem {sem.value} needs a scope")
        self.check_scope(scope)
        name = SYNCSCOPES[scope]
        return f'syncscope("{name}") {ORDERINGS[sem]}' if name else ORDERINGS[sem]

    def check_scope(self, scope: Scope) -> None:
        if scope is Scope.CLUSTER and not self.target.has_cluster_scope:
            raise LoweringError(f"scope cluster needs sm_90 or newer, not {self.target.arch}")

    def shared_global(self, name: str) -> L.GlobalVariable:
        """The ``addrspace(3)`` global of a shared buffer of this kernel (``dyn_smem``: the
        extern dynamic shared array)."""
        if name == "dyn_smem" and self.kernel.dynamic_shared:
            return self._shared_global("dyn_smem", 0, 16, extern=True)
        buf = next((s for s in self.kernel.shared if s.name == name), None)
        if buf is None:
            raise LoweringError(f"no shared buffer {name!r}")
        return self._shared_global(f"{self.kernel.name}_{name}", buf.nbytes, buf.align)

    def _shared_global(self, name: str, nbytes: int, align: int, extern: bool = False):
        g = self.module.globals.get(name)
        if g is None:
            g = L.GlobalVariable(self.module, L.ArrayType(I8, nbytes), name, addrspace=3)
            # llvmlite types globals as typed pointers; the lowering uses opaque ones
            g.type = L.PointerType(addrspace=3)
            g.align = align
            if extern:
                g.linkage = "external"
            else:
                # shared memory starts undefined (as clang's __shared__ variables)
                g.linkage = "internal"
                g.initializer = L.Constant(g.value_type, L.Undefined)
        return g


def lower_role(cx: KernelLowering, role: N.Role) -> None:
    """Guard ``role.body`` by ``ctaid.x in [start, stop)`` and ``tid.x in [base, base+count)``:
    ``setp.lt.u32``/``setp.ge.u32`` on ``%ctaid.x``/``%tid.x`` and a ``bra`` around the body."""
    b = cx.b
    conds = []
    start, stop = role.blocks.start, role.blocks.stop
    if not (isinstance(start, N.Const) and start.value == 0):
        conds.append(b.icmp_unsigned(">=", cx.sreg(SReg.CTAID_X), cx.expr_as(start, T.u32)))
    if stop is not None:
        conds.append(b.icmp_unsigned("<", cx.sreg(SReg.CTAID_X), cx.expr_as(stop, T.u32)))
    if role.threads is not None:
        base, count = role.threads.base, role.threads.count
        if base:
            conds.append(b.icmp_unsigned(">=", cx.sreg(SReg.TID_X), L.Constant(I32, base)))
        conds.append(b.icmp_unsigned("<", cx.sreg(SReg.TID_X), L.Constant(I32, base + count)))
    body, end = cx.block(f"role.{role.name}"), cx.block(f"role.{role.name}.end")
    if conds:
        cond = conds[0]
        for c in conds[1:]:
            cond = b.and_(cond, c)
        b.cbranch(cond, body, end)
    else:
        b.branch(body)
    b.position_at_end(body)
    try:
        cx.stmts(role.body)
    except LoweringError as e:
        raise LoweringError(f"kernel {cx.kernel.name}, role {role.name}: {e}") from e
    cx.branch_to(end)
    cx.continue_at(end)


# ---------------------------------------------------------------------------------------------
# Expressions


@_lowers(EXPR_LOWERINGS, N.Const)
def lower_const(cx, e: N.Const) -> L.Value:
    """An immediate operand (``mov``/folded into the using instruction); bf16 as its bits."""
    t = e.dtype
    if t.kind == "bf":
        return L.Constant(I16, _bf16_bits(float(e.value)))
    if t.kind == "f":
        return L.Constant(llvm_type(t), float(e.value))
    return L.Constant(llvm_type(t), int(e.value) & ((1 << t.bits) - 1))


@_lowers(EXPR_LOWERINGS, N.Param)
def lower_param(cx, e: N.Param) -> L.Value:
    """``ld.param`` of the kernel argument (of its slot in the rank row: ``rank_batch``)."""
    if cx.rank_row is not None:
        return rank_batch.load_param(cx.b, cx.kernel, cx.rank_row, e, llvm_type)
    if e.name not in cx.params:
        raise LoweringError(f"no parameter {e.name!r}")
    return cx.params[e.name]


@_lowers(EXPR_LOWERINGS, N.Var)
def lower_var(cx, e: N.Var) -> L.Value:
    """The variable's register (a load of its alloca before promotion)."""
    return cx.b.load(cx.var_slot(e), name=e.name, typ=llvm_type(e.dtype))


@_lowers(EXPR_LOWERINGS, N.SRegRead)
def lower_sreg(cx, e: N.SRegRead) -> L.Value:
    """``mov.u32 %r, %tid.x`` (``mov.u64`` for ``%globaltimer``/``%clock64``)."""
    return cx.sreg(e.sreg)


_INT_BINOPS = {BinOpKind.ADD: "add", BinOpKind.SUB: "sub", BinOpKind.MUL: "mul",
               BinOpKind.AND: "and_", BinOpKind.OR: "or_", BinOpKind.XOR: "xor",
               BinOpKind.SHL: "shl"}
_SIGNED_BINOPS = {BinOpKind.DIV: ("sdiv", "udiv"), BinOpKind.REM: ("srem", "urem"),
                  BinOpKind.SHR: ("ashr", "lshr")}
_INT_MINMAX = {BinOpKind.MIN: ("smin", "umin"), BinOpKind.MAX: ("smax", "umax")}
_FLOAT_BINOPS = {BinOpKind.ADD: "fadd", BinOpKind.SUB: "fsub", BinOpKind.MUL: "fmul",
                 BinOpKind.DIV: "fdiv", BinOpKind.REM: "frem"}
_FLOAT_MINMAX = {BinOpKind.MIN: "minnum", BinOpKind.MAX: "maxnum"}


@_lowers(EXPR_LOWERINGS, N.BinOp)
def lower_binop(cx, e: N.BinOp) -> L.Value:
    """``add/sub/mul.<t>``, ``div/rem.{s,u}<n>``, ``shl.b<n>``, ``shr.{s,u}<n>``,
    ``and/or/xor.b<n>``, ``min/max.{s,u}<n>``; floats ``add/sub/mul/div.f<n>``,
    ``min/max.f<n>``."""
    b, kind = cx.b, _kind(e.a.dtype)
    a, c = cx.expr(e.a), cx.expr(e.b)
    if a.type != c.type:
        raise LoweringError(f"{e.op.value}: operand types differ ({e.a.dtype} and {e.b.dtype})")
    name = e.op.value
    if kind == "int" or (kind == "pred" and e.op in (BinOpKind.AND, BinOpKind.OR, BinOpKind.XOR)):
        if e.op in _INT_BINOPS:
            return getattr(b, _INT_BINOPS[e.op])(a, c, name=name)
        signed = _signed(e.a.dtype)
        if e.op in _SIGNED_BINOPS:
            return getattr(b, _SIGNED_BINOPS[e.op][0 if signed else 1])(a, c, name=name)
        intrinsic = _INT_MINMAX[e.op][0 if signed else 1]
        return call(b, f"llvm.{intrinsic}.{type_suffix(a.type)}", (a, c), a.type, name)
    if kind == "float" and e.op in _FLOAT_BINOPS:
        return getattr(b, _FLOAT_BINOPS[e.op])(a, c, name=name)
    if kind == "float" and e.op in _FLOAT_MINMAX:
        return call(b, f"llvm.{_FLOAT_MINMAX[e.op]}.{type_suffix(a.type)}", (a, c), a.type, name)
    raise LoweringError(f"no {e.op.value} on {e.a.dtype}")


@_lowers(EXPR_LOWERINGS, N.UnOp)
def lower_unop(cx, e: N.UnOp) -> L.Value:
    """``neg.<t>``, ``not.b<n>``, ``popc.b<n>`` (-> u32), ``abs.<t>``."""
    b, kind = cx.b, _kind(e.a.dtype)
    a = cx.expr(e.a)
    name = e.op.value
    if kind == "int" and not (isinstance(e.a.dtype, VecType) and e.op is UnOpKind.POPC):
        if e.op is UnOpKind.NEG:
            return b.neg(a, name=name)
        if e.op is UnOpKind.NOT:
            return b.not_(a, name=name)
        if e.op is UnOpKind.ABS:
            return call(b, f"llvm.abs.{type_suffix(a.type)}", (a, L.Constant(I1, 0)), a.type, name)
        count = call(b, f"llvm.ctpop.{type_suffix(a.type)}", (a,), a.type)
        return convert(cx, count, T.DType("u", a.type.width), T.u32)
    if kind == "pred" and e.op is UnOpKind.NOT:
        return b.not_(a, name=name)
    if kind == "float" and e.op is UnOpKind.NEG:
        return b.fneg(a, name=name)
    if kind == "float" and e.op is UnOpKind.ABS:
        return call(b, f"llvm.fabs.{type_suffix(a.type)}", (a,), a.type, name)
    raise LoweringError(f"no {e.op.value} on {e.a.dtype}")


@_lowers(EXPR_LOWERINGS, N.Cmp)
def lower_cmp(cx, e: N.Cmp) -> L.Value:
    """``setp.<op>.{s,u}<n>`` by operand signedness; floats ordered ``setp.<op>.f<n>``."""
    b, kind = cx.b, _kind(e.a.dtype)
    if isinstance(e.a.dtype, VecType):
        raise LoweringError(f"compare {e.op.value}: vectors have no compare, {e.a.dtype}")
    a, c = cx.expr(e.a), cx.expr(e.b)
    if a.type != c.type:
        raise LoweringError(f"compare {e.op.value}: operand types differ "
                            f"({e.a.dtype} and {e.b.dtype})")
    op = CMP_OPS[e.op]
    if kind == "float":
        return b.fcmp_ordered(op, a, c, name=e.op.value)
    if kind == "int" and _signed(e.a.dtype):
        return b.icmp_signed(op, a, c, name=e.op.value)
    if kind in ("int", "ptr") or e.op in (CmpOp.EQ, CmpOp.NE):
        return b.icmp_unsigned(op, a, c, name=e.op.value)
    raise LoweringError(f"no compare {e.op.value} on {e.a.dtype}")


@_lowers(EXPR_LOWERINGS, N.Select)
def lower_select(cx, e: N.Select) -> L.Value:
    """``selp.<t> d, a, b, p``."""
    return cx.b.select(cx.expr(e.cond), cx.expr(e.a), cx.expr(e.b), name="sel")


def convert(cx, v: L.Value, src: T.Type, dst: T.Type) -> L.Value:
    """``v`` of IR type ``src`` as IR type ``dst`` (the ``Cast`` rules)."""
    b = cx.b
    if src == dst:
        return v
    ks, kd = _kind(src), _kind(dst)
    to = llvm_type(dst)
    if isinstance(src, VecType) or isinstance(dst, VecType):
        raise LoweringError(f"no conversion from {src} to {dst}")
    if ks == "ptr" and kd == "ptr":
        return b.addrspacecast(v, to, name="cvta")
    if ks == "ptr" and kd == "int":
        return b.ptrtoint(v, to, name="addr")
    if ks == "int" and kd == "ptr":
        return b.inttoptr(v, to, name="ptr")
    if ks == "pred" and kd == "int":
        return b.zext(v, to, name="zext")
    if ks == "pred" and kd == "float":
        return b.uitofp(v, to, name="cvt")
    if ks == "bf16" and kd == "float" and dst.bits >= 32:
        bits = b.shl(b.zext(v, I32), L.Constant(I32, 16))
        f = b.bitcast(bits, L.FloatType(), name="bf16.f32")
        return f if dst.bits == 32 else b.fpext(f, to, name="cvt")
    if ks == "float" and src.bits == 32 and kd == "bf16":
        return inline_ptx(b, "cvt.rn.bf16.f32 $0, $1;", [v], I16, ordered=False, name="f32.bf16")
    if ks == "int" and kd == "int":
        if src.bits == dst.bits:
            return v
        if src.bits < dst.bits:
            return (b.sext if src.is_signed else b.zext)(v, to, name="cvt")
        return b.trunc(v, to, name="cvt")
    if ks == "int" and kd == "float":
        return (b.sitofp if src.is_signed else b.uitofp)(v, to, name="cvt")
    if ks == "float" and kd == "int":
        return (b.fptosi if dst.is_signed else b.fptoui)(v, to, name="cvt")
    if ks == "float" and kd == "float":
        return (b.fpext if src.bits < dst.bits else b.fptrunc)(v, to, name="cvt")
    raise LoweringError(f"no conversion from {src} to {dst}")


@_lowers(EXPR_LOWERINGS, N.Cast)
def lower_cast(cx, e: N.Cast) -> L.Value:
    """``cvt.<dst>.<src>`` (``cvt.rn`` / ``cvt.rzi`` for float rounding), ``cvta`` between
    state spaces, ``cvt.rn.bf16.f32`` (inline PTX) to bf16; bf16 -> f32 is ``shl`` + ``mov``."""
    return convert(cx, cx.expr(e.a), e.a.dtype, e.dtype)


@_lowers(EXPR_LOWERINGS, N.Bitcast)
def lower_bitcast(cx, e: N.Bitcast) -> L.Value:
    """``mov.b<n>``: the same bits as another type of the same width."""
    v = cx.expr(e.a)
    if e.a.dtype.bits != e.dtype.bits:
        raise LoweringError(f"bitcast from {e.a.dtype} to {e.dtype}: widths differ")
    to = llvm_type(e.dtype)
    if v.type == to:
        return v
    if isinstance(e.a.dtype, PtrType):
        v = cx.b.ptrtoint(v, I64)
        return v if to == I64 else cx.b.bitcast(v, to, name="bits")
    if isinstance(e.dtype, PtrType):
        return cx.b.inttoptr(cx.b.bitcast(v, I64) if v.type != I64 else v, to, name="ptr")
    return cx.b.bitcast(v, to, name="bits")


@_lowers(EXPR_LOWERINGS, N.PtrAdd)
def lower_ptradd(cx, e: N.PtrAdd) -> L.Value:
    """``add.s64 %rd, base, offset`` (a byte ``getelementptr``); the state space is kept."""
    if not isinstance(e.base.dtype, PtrType) or _kind(e.offset.dtype) != "int":
        raise LoweringError(f"pointer add needs a pointer and an integer, not {e.base.dtype} "
                            f"and {e.offset.dtype}")
    signed = T.s64 if e.offset.dtype.is_signed else T.u64
    offset = cx.expr_as(e.offset, signed)
    return cx.b.gep(cx.expr(e.base), [offset], name="addr", source_etype=I8)


@_lowers(EXPR_LOWERINGS, N.SharedAddr)
def lower_shared_addr(cx, e: N.SharedAddr) -> L.Value:
    """``mov.u64 %rd, <kernel>_<buf>`` (``.shared .align a .b8 <kernel>_<buf>[n]``;
    ``.extern .shared .align 16 .b8 dyn_smem[]`` for the dynamic buffer)."""
    return cx.shared_global(e.name)


@_lowers(EXPR_LOWERINGS, N.Extract)
def lower_extract(cx, e: N.Extract) -> L.Value:
    """A lane of a vector register (``mov.b64 {lo, hi}`` / direct use of a ``.v4`` result)."""
    return cx.b.extract_element(cx.expr(e.vec), L.Constant(I32, e.index), name=f"lane{e.index}")


@_lowers(EXPR_LOWERINGS, N.Pack)
def lower_pack(cx, e: N.Pack) -> L.Value:
    """A vector value from its lanes (the operand list ``{a, b, c, d}`` of a ``.v4`` store)."""
    if len(e.lanes) != e.dtype.n:
        raise LoweringError(f"pack of {len(e.lanes)} lanes into {e.dtype}")
    v = L.Constant(llvm_type(e.dtype), L.Undefined)
    for i, lane in enumerate(e.lanes):
        v = cx.b.insert_element(v, cx.expr(lane), L.Constant(I32, i), name="pack")
    return v


@_lowers(EXPR_LOWERINGS, N.CvtE4M3x2)
def lower_cvt_e4m3x2(cx, e: N.CvtE4M3x2) -> L.Value:
    """``cvt.rn.satfinite.e4m3x2.f32 %rs, a, b`` (inline PTX: LLVM 22 has no intrinsic for
    it); pure, so no side effect and no memory clobber. Needs sm_89 or newer."""
    if not cx.target.has_fp8_cvt:
        raise LoweringError(f"cvt.rn.satfinite.e4m3x2.f32 needs sm_89 or newer, not "
                            f"{cx.target.arch}")
    if e.a.dtype != T.f32 or e.b.dtype != T.f32:
        raise LoweringError(f"cvt.rn.satfinite.e4m3x2.f32 takes two f32, not {e.a.dtype} and "
                            f"{e.b.dtype}")
    return inline_ptx(cx.b, "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;",
                      [cx.expr(e.a), cx.expr(e.b)], I16, ordered=False, name="e4m3x2")


@_lowers(EXPR_LOWERINGS, N.CvtE4M3ToF32)
def lower_cvt_e4m3_to_f32(cx, e: N.CvtE4M3ToF32) -> L.Value:
    """``cvt.rn.f16x2.e4m3x2`` of the u16 operand into a scoped ``.b32``, ``mov.b32 {lo, hi}``,
    ``cvt.f32.f16`` of ``lo`` (inline PTX: LLVM 22 has no fp8 intrinsic); pure. Needs sm_89
    or newer."""
    if not cx.target.has_fp8_cvt:
        raise LoweringError(f"cvt.rn.f16x2.e4m3x2 needs sm_89 or newer, not {cx.target.arch}")
    if e.a.dtype != T.u16:
        raise LoweringError(f"cvt.rn.f16x2.e4m3x2 takes a u16, not {e.a.dtype}")
    return inline_ptx(cx.b, "{ .reg .b32 f16x2; .reg .b16 lo, hi; "
                            "cvt.rn.f16x2.e4m3x2 f16x2, $1; mov.b32 {lo, hi}, f16x2; "
                            "cvt.f32.f16 $0, lo; }",
                      [cx.expr(e.a)], L.FloatType(), ordered=False, name="e4m3_f32")


@_lowers(EXPR_LOWERINGS, N.Fma)
def lower_fma(cx, e: N.Fma) -> L.Value:
    """``fma.rn.f32`` / ``fma.rn.f64`` (``llvm.fma``)."""
    if e.dtype not in (T.f32, T.f64):
        raise LoweringError(f"fma takes f32 or f64 operands, not {e.dtype}")
    a, b, c = (cx.expr(x) for x in (e.a, e.b, e.c))
    if not a.type == b.type == c.type:
        raise LoweringError(f"fma operand types differ ({e.a.dtype}, {e.b.dtype}, {e.c.dtype})")
    return call(cx.b, f"llvm.fma.{type_suffix(a.type)}", (a, b, c), a.type, "fma")


# ---------------------------------------------------------------------------------------------
# Memory


def _address(cx, addr: N.Expr, what: str) -> tuple[L.Value, Space]:
    if not isinstance(addr.dtype, PtrType) or addr.dtype.space not in PTX_SPACES:
        raise LoweringError(f"{what}: address must be a global, shared or generic pointer, "
                            f"not {addr.dtype}")
    return cx.expr(addr), addr.dtype.space


def _check_memory_type(dtype: T.Type, sem: Sem, what: str) -> None:
    if dtype.kind == "pred":
        raise LoweringError(f"{what}: a pred has no memory representation")
    if isinstance(dtype, VecType) and sem is not Sem.WEAK:
        raise LoweringError(f"{what}: vector accesses are weak only, not {sem.value}")
    if dtype.nbytes > 16 or dtype.nbytes & (dtype.nbytes - 1):
        raise LoweringError(f"{what}: {dtype} is not a 1, 2, 4, 8 or 16-byte access")


def load(cx, addr: N.Expr, dtype: T.Type, sem: Sem, scope: Scope | None,
         cache: CacheHint = CacheHint.NONE, name: str = "v") -> L.Value:
    """One load of ``dtype`` from ``addr`` with semantics ``sem`` (see ``lower_load``)."""
    what = f"load of {name}"
    ptr, space = _address(cx, addr, what)
    _check_memory_type(dtype, sem, what)
    ty = llvm_type(dtype)
    if cache is not CacheHint.NONE and sem is not Sem.WEAK:
        raise LoweringError(f"{what}: the nc hint needs a weak load, not {sem.value}")
    if cache is CacheHint.NC_L2_256:
        return _load_nc_l2_prefetch(cx, ptr, dtype, name)
    if sem is Sem.WEAK:
        ld = cx.b.load(ptr, name=name, align=dtype.nbytes, typ=ty)
        if cache is CacheHint.NC:
            ld.set_metadata("invariant.load", cx.module.add_metadata([]))
        return ld
    if sem is Sem.VOLATILE:
        return inline_ptx(cx.b, f"ld.volatile{PTX_SPACES[space]}.b{dtype.bits} $0, [$1];",
                          [ptr], ty, name=name)
    if sem in (Sem.RELAXED, Sem.ACQUIRE):
        return cx.b.load_atomic(ptr, cx.ordering(sem, scope), dtype.nbytes, name=name, typ=ty)
    raise LoweringError(f"{what}: sem {sem.value} is not a load semantics")


def _load_nc_l2_prefetch(cx, ptr, dtype: T.Type, name: str) -> L.Value:
    """``ld.global.nc.L2::256B{.v2,.v4}.b<n>`` (inline PTX: LLVM has no L2 prefetch-size
    hint); read-only data, so no side effect and no memory clobber."""
    elem = dtype.elem if isinstance(dtype, VecType) else dtype
    n = dtype.n if isinstance(dtype, VecType) else 1
    ety = llvm_type(elem)
    outs = ", ".join(f"${i}" for i in range(n))
    vec = f".v{n}" if n > 1 else ""
    template = (f"ld.global.nc.L2::256B{vec}.b{elem.bits} " + (f"{{{outs}}}" if n > 1 else "$0")
                + f", [${n}];")
    ret = L.LiteralStructType([ety] * n) if n > 1 else ety
    cons = ",".join([f"={constraint(ety)}"] * n + ["l"])
    val = cx.b.asm(L.FunctionType(ret, [ptr.type]), template, cons, [ptr], side_effect=False,
                   name=name)
    if n == 1:
        return val
    out = L.Constant(llvm_type(dtype), None)
    for i in range(n):
        out = cx.b.insert_element(out, cx.b.extract_value(val, i), L.Constant(L.IntType(32), i))
    return out


def store(cx, addr: N.Expr, value: N.Expr, sem: Sem, scope: Scope | None) -> None:
    """One store of ``value`` to ``addr`` with semantics ``sem`` (see ``lower_store``)."""
    what = f"store of {value.dtype}"
    ptr, space = _address(cx, addr, what)
    _check_memory_type(value.dtype, sem, what)
    v = cx.expr(value)
    nbytes = value.dtype.nbytes
    if sem is Sem.WEAK:
        cx.b.store(v, ptr, align=nbytes)
    elif sem is Sem.VOLATILE:
        inline_ptx(cx.b, f"st.volatile{PTX_SPACES[space]}.b{value.dtype.bits} [$0], $1;", [ptr, v])
    elif sem in (Sem.RELAXED, Sem.RELEASE):
        # IRBuilder.store_atomic needs a typed pointer; build the instruction directly.
        cx.b._insert(LI.StoreAtomicInstr(cx.b.block, v, ptr, cx.ordering(sem, scope), nbytes))
    else:
        raise LoweringError(f"{what}: sem {sem.value} is not a store semantics")


@_lowers(LOWERINGS, N.Assign)
def lower_assign(cx, s: N.Assign) -> None:
    """A register move (``mov``), usually folded away."""
    cx.set_var(s.dst, cx.expr(s.value))


@_lowers(LOWERINGS, N.Load)
def lower_load(cx, s: N.Load) -> None:
    """weak: ``ld.<space>.b<n>`` (``ld.<space>.v2/.v4.b<n>`` up to 16 bytes; ``nc`` hint:
    ``ld.global.nc``); volatile: ``ld.volatile.<space>.b<n>`` (inline PTX); relaxed/acquire:
    ``ld.<sem>.<scope>.<space>.b<n>``."""
    cx.set_var(s.dst, load(cx, s.addr, s.dst.dtype, s.sem, s.scope, s.cache, s.dst.name))


@_lowers(LOWERINGS, N.Store)
def lower_store(cx, s: N.Store) -> None:
    """weak: ``st.<space>{.v2,.v4}.b<n>``; volatile: ``st.volatile.<space>.b<n>`` (inline
    PTX); relaxed/release: ``st.<sem>.<scope>.<space>.b<n>``."""
    store(cx, s.addr, s.value, s.sem, s.scope)


@_lowers(LOWERINGS, N.AtomicRMW)
def lower_atomic_rmw(cx, s: N.AtomicRMW) -> None:
    """``atom.<sem>.<scope>.<space>.<op>.<type>`` or ``red...`` (inline PTX; atomics.py)."""
    cx.check_scope(s.scope)
    ptr, _ = _address(cx, s.addr, f"atomic {s.op.value}")
    old = atomics.emit(cx.b, s, ptr, [cx.expr(s.value)], name=s.dst.name if s.dst else "")
    if s.dst is not None:
        cx.set_var(s.dst, old)


@_lowers(LOWERINGS, N.AtomicCAS)
def lower_atomic_cas(cx, s: N.AtomicCAS) -> None:
    """``atom.<sem>.<scope>.<space>.cas.b<n>`` (inline PTX; atomics.py)."""
    cx.check_scope(s.scope)
    ptr, _ = _address(cx, s.addr, "atomic cas")
    old = atomics.emit(cx.b, s, ptr, [cx.expr(s.compare), cx.expr(s.value)], name=s.dst.name)
    cx.set_var(s.dst, old)


@_lowers(LOWERINGS, N.Fence)
def lower_fence(cx, s: N.Fence) -> None:
    """``fence.<sem>.<scope>``: sm_90 spells acquire/release ``fence.acquire``/
    ``fence.release``, sm_80 ``fence.acq_rel``; sc is ``fence.sc``."""
    if s.sem not in (Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL, Sem.SC):
        raise LoweringError(f"fence: sem {s.sem.value} is not a fence semantics")
    cx.check_scope(s.scope)
    cx.b.fence(ORDERINGS[s.sem], SYNCSCOPES[s.scope])


# ---------------------------------------------------------------------------------------------
# Barriers and warps


@_lowers(LOWERINGS, N.BarSync)
def lower_bar_sync(cx, s: N.BarSync) -> None:
    """``bar.sync id, n`` (``bar.sync id`` when the barrier counts the whole CTA)."""
    bar = s.barrier
    if bar.count is None:
        call(cx.b, "llvm.nvvm.barrier.cta.sync.aligned.all", [L.Constant(I32, bar.id)])
    else:
        call(cx.b, "llvm.nvvm.barrier.cta.sync.aligned.count",
             [L.Constant(I32, bar.id), L.Constant(I32, bar.count)])


@_lowers(LOWERINGS, N.BarArrive)
def lower_bar_arrive(cx, s: N.BarArrive) -> None:
    """``bar.arrive id, n`` (PTX requires the count: a whole-CTA barrier uses the block size)."""
    bar = s.barrier
    count = cx.kernel.block_threads if bar.count is None else bar.count
    call(cx.b, "llvm.nvvm.barrier.cta.arrive.aligned.count",
         [L.Constant(I32, bar.id), L.Constant(I32, count)])


@_lowers(LOWERINGS, N.WarpSync)
def lower_warp_sync(cx, s: N.WarpSync) -> None:
    """``bar.warp.sync mask``."""
    call(cx.b, "llvm.nvvm.bar.warp.sync", [L.Constant(I32, s.mask)])


def _words32(cx, v: L.Value, dtype: T.Type) -> list[L.Value]:
    """``v`` as one or two i32 words (low first), for 32-bit-only warp operations."""
    b = cx.b
    if isinstance(dtype, (VecType, PtrType)) or dtype.bits > 64:
        raise LoweringError(f"shuffle of {dtype}: scalars of at most 64 bits only")
    if dtype.bits == 64:
        bits = b.bitcast(v, I64) if v.type != I64 else v
        return [b.trunc(bits, I32), b.trunc(b.lshr(bits, L.Constant(I64, 32)), I32)]
    if v.type != L.IntType(dtype.bits):
        v = b.bitcast(v, L.IntType(dtype.bits))
    return [v if dtype.bits == 32 else b.zext(v, I32)]


def _from_words32(cx, words: list[L.Value], dtype: T.Type) -> L.Value:
    b, to = cx.b, llvm_type(dtype)
    if dtype.bits == 64:
        lo, hi = (b.zext(w, I64) for w in words)
        bits = b.or_(lo, b.shl(hi, L.Constant(I64, 32)))
    else:
        bits = words[0] if dtype.bits == 32 else b.trunc(words[0], L.IntType(dtype.bits))
    return bits if bits.type == to else b.bitcast(bits, to)


@_lowers(LOWERINGS, N.Shuffle)
def lower_shuffle(cx, s: N.Shuffle) -> None:
    """``shfl.sync.<mode>.b32 d, v, lane, c, mask`` with ``c = ((32 - width) << 8) | 0x1f``
    (``up``: no lane clamp); 64-bit values are two shuffles."""
    clamp = ((32 - s.width) << 8) | (0 if s.mode is ShflMode.UP else 0x1F)
    lane = cx.expr_as(s.lane, T.u32)
    words = [call(cx.b, f"llvm.nvvm.shfl.sync.{s.mode.value}.i32",
                  [L.Constant(I32, s.mask), w, lane, L.Constant(I32, clamp)], name="shfl")
             for w in _words32(cx, cx.expr(s.value), s.value.dtype)]
    cx.set_var(s.dst, _from_words32(cx, words, s.value.dtype))


def _pred(cx, e: N.Expr, what: str) -> L.Value:
    if e.dtype != T.pred:
        raise LoweringError(f"{what}: needs a pred, not {e.dtype}")
    return cx.expr(e)


@_lowers(LOWERINGS, N.Ballot)
def lower_ballot(cx, s: N.Ballot) -> None:
    """``vote.sync.ballot.b32 d, p, mask``."""
    cx.set_var(s.dst, call(cx.b, "llvm.nvvm.vote.ballot.sync",
                           [L.Constant(I32, s.mask), _pred(cx, s.pred, "ballot")], name="ballot"))


@_lowers(LOWERINGS, N.Vote)
def lower_vote(cx, s: N.Vote) -> None:
    """``vote.sync.<any|all|uni>.pred d, p, mask``."""
    cx.set_var(s.dst, call(cx.b, f"llvm.nvvm.vote.{s.mode.value}.sync",
                           [L.Constant(I32, s.mask), _pred(cx, s.pred, "vote")], name="vote"))


@_lowers(LOWERINGS, N.Redux)
def lower_redux(cx, s: N.Redux) -> None:
    """``redux.sync.<op>.<u32|s32|b32> d, v, mask`` (min/max signed or unsigned by type)."""
    dtype = s.value.dtype
    if _kind(dtype) != "int" or isinstance(dtype, VecType) or dtype.bits != 32:
        raise LoweringError(f"redux.sync {s.op.value}: 32-bit integers only, not {dtype}")
    op = s.op.value
    if s.op in (ReduxOp.MIN, ReduxOp.MAX) and not dtype.is_signed:
        op = "u" + op
    cx.set_var(s.dst, call(cx.b, f"llvm.nvvm.redux.sync.{op}",
                           [cx.expr(s.value), L.Constant(I32, s.mask)], name="redux"))


@_lowers(LOWERINGS, N.Nanosleep)
def lower_nanosleep(cx, s: N.Nanosleep) -> None:
    """``nanosleep.u32 ns``."""
    call(cx.b, "llvm.nvvm.nanosleep", [cx.expr_as(s.ns, T.u32)])


# ---------------------------------------------------------------------------------------------
# Control flow


@_lowers(LOWERINGS, N.If)
def lower_if(cx, s: N.If) -> None:
    """``@!p bra else`` around the then body (and ``bra end`` over the else body)."""
    b = cx.b
    cond = _pred(cx, s.cond, "if")
    then, end = cx.block("if.then"), cx.block("if.end")
    orelse = cx.block("if.else") if s.orelse else end
    b.cbranch(cond, then, orelse)
    b.position_at_end(then)
    cx.stmts(s.then)
    cx.branch_to(end)
    if s.orelse:
        cx.continue_at(orelse)
        cx.stmts(s.orelse)
        cx.branch_to(end)
    cx.continue_at(end)


def _loop(cx, prefix: str, test, body, step=None) -> None:
    """The loop skeleton: ``cond`` block (``@!p bra end``), body, optional step, back edge."""
    b = cx.b
    cond_bb, body_bb = cx.block(f"{prefix}.cond"), cx.block(f"{prefix}.body")
    step_bb = cx.block(f"{prefix}.step") if step else cond_bb
    end_bb = cx.block(f"{prefix}.end")
    b.branch(cond_bb)
    b.position_at_end(cond_bb)
    b.cbranch(test(), body_bb, end_bb)
    b.position_at_end(body_bb)
    cx.loop_exits.append(end_bb)
    cx.stmts(body)
    cx.loop_exits.pop()
    cx.branch_to(step_bb)
    if step:
        b.position_at_end(step_bb)
        step()
        b.branch(cond_bb)
    cx.continue_at(end_bb)


@_lowers(LOWERINGS, N.For)
def lower_for(cx, s: N.For) -> None:
    """``for var = start; var < stop; var += step``: ``setp.lt`` + ``@p bra`` loop."""
    cx.set_var(s.var, cx.expr(s.start))
    _loop(cx, "for", lambda: cx.expr(N.Cmp(CmpOp.LT, s.var, s.stop)), s.body,
          step=lambda: cx.set_var(s.var, cx.expr(N.BinOp(BinOpKind.ADD, s.var, s.step))))


@_lowers(LOWERINGS, N.While)
def lower_while(cx, s: N.While) -> None:
    """``while cond``: the condition tested before each iteration, ``@p bra`` back edge."""
    _loop(cx, "while", lambda: _pred(cx, s.cond, "while"), s.body)


def _unreachable_continuation(cx, name: str) -> None:
    cx.b.position_at_end(cx.block(name))


@_lowers(LOWERINGS, N.Break)
def lower_break(cx, s: N.Break) -> None:
    """``bra`` to the innermost loop's exit."""
    if not cx.loop_exits:
        raise LoweringError("break outside a loop")
    cx.b.branch(cx.loop_exits[-1])
    _unreachable_continuation(cx, "after.break")


@_lowers(LOWERINGS, N.Return)
def lower_return(cx, s: N.Return) -> None:
    """``ret`` from the kernel (PTX ``ret``/``exit`` of the entry)."""
    cx.b.ret_void()
    _unreachable_continuation(cx, "after.return")


@_lowers(LOWERINGS, N.Trap)
def lower_trap(cx, s: N.Trap) -> None:
    """``trap``."""
    call(cx.b, "llvm.trap")


@_lowers(LOWERINGS, N.Call)
def lower_call(cx, s: N.Call) -> None:
    """``call.uni (ret), name, (args)`` of an ``.extern .func`` declared by name."""
    if len(s.args) != len(s.arg_types):
        raise LoweringError(f"call {s.name}: {len(s.args)} arguments for "
                            f"{len(s.arg_types)} parameter types")
    ret = llvm_type(s.dst.dtype) if s.dst is not None else VOID
    fnty = L.FunctionType(ret, [llvm_type(t) for t in s.arg_types])
    fn = cx.module.globals.get(s.name)
    if fn is None:
        fn = L.Function(cx.module, fnty, s.name)
    elif fn.function_type != fnty:
        raise LoweringError(f"call {s.name}: signature {fnty} differs from its earlier use "
                            f"{fn.function_type}")
    args = [cx.expr_as(a, t) for a, t in zip(s.args, s.arg_types)]
    result = cx.b.call(fn, args, name=s.dst.name if s.dst is not None else "")
    if s.dst is not None:
        cx.set_var(s.dst, result)


@_lowers(LOWERINGS, N.Comment)
def lower_comment(cx, s: N.Comment) -> None:
    """Nothing."""


@_lowers(LOWERINGS, N.SpinWait)
def lower_spin_wait(cx, s: N.SpinWait) -> None:
    """The bounded poll loop of spin_wait.py: ``mov.u64 %rd, %globaltimer``,
    ``ld.<sem>.<scope>.<space>.b<n>`` (the poll), ``ld.relaxed.sys.global.b32`` (abort word),
    ``nanosleep.u32``; on expiry ``atom.relaxed.gpu.global.add.u32`` (claim a record),
    ``st.global.b32`` (record words), ``st.relaxed.sys.global.b32`` (abort word) and ``ret``."""
    cx.stmts(spin_wait.expand(cx.kernel.name, s))


# ---------------------------------------------------------------------------------------------
# Modules


def lower_module(module: N.Module, target: Target) -> L.Module:
    """The llvmlite module of ``module``'s kernels for ``target`` (before optimisation)."""
    out = L.Module(name=module.name)
    out.triple = TRIPLE
    out.data_layout = target.data_layout
    for kernel in module.kernels:
        fn = KernelLowering(out, kernel, target).lower()
        # llvmlite rejects string function attributes ("nvvm.maxntid"); LLVM 22 upgrades these
        # annotations to them (.maxntid, .minnctapersm).
        annotations = {"maxntidx": kernel.block_threads, "minctasm": kernel.min_blocks_per_sm}
        for key, value in annotations.items():
            if value:
                out.add_named_metadata("nvvm.annotations",
                                       [fn, L.MetaDataString(out, key), L.Constant(I32, value)])
    return out
