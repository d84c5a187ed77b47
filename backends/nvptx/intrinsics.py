"""LLVM intrinsics the lowering calls: special registers, barriers, warp-level operations.

``SREGS`` is the one table of special registers; ``NVVM`` names the fixed-signature NVVM
intrinsics by the PTX they produce. ``call`` declares an intrinsic on first use
(``get_or_insert``) and calls it.
"""

from __future__ import annotations

from llvmlite import ir as L

from ir.enums import SReg

VOID, I1, I32, I64 = L.VoidType(), L.IntType(1), L.IntType(32), L.IntType(64)

# SReg -> (intrinsic, bits): `mov.u32 %r, %tid.x`, `mov.u64 %rd, %globaltimer`
SREGS = {s: (f"llvm.nvvm.read.ptx.sreg.{s.value}", s.bits) for s in SReg}

# intrinsic -> (return type, argument types)
NVVM = {
    "llvm.nvvm.barrier.cta.sync.aligned.all": (VOID, (I32,)),             # bar.sync id
    "llvm.nvvm.barrier.cta.sync.aligned.count": (VOID, (I32, I32)),       # bar.sync id, n
    "llvm.nvvm.barrier.cta.arrive.aligned.count": (VOID, (I32, I32)),     # bar.arrive id, n
    "llvm.nvvm.bar.warp.sync": (VOID, (I32,)),                            # bar.warp.sync mask
    "llvm.nvvm.vote.ballot.sync": (I32, (I32, I1)),                       # vote.sync.ballot.b32
    "llvm.nvvm.nanosleep": (VOID, (I32,)),                                # nanosleep.u32
    "llvm.trap": (VOID, ()),                                              # trap
    **{f"llvm.nvvm.shfl.sync.{m}.i32": (I32, (I32, I32, I32, I32))        # shfl.sync.<m>.b32
       for m in ("idx", "up", "down", "bfly")},
    **{f"llvm.nvvm.vote.{m}.sync": (I1, (I32, I1))                        # vote.sync.<m>.pred
       for m in ("any", "all", "uni")},
    **{f"llvm.nvvm.redux.sync.{op}": (I32, (I32, I32))                    # redux.sync.<op>
       for op in ("add", "umin", "umax", "min", "max", "and", "or", "xor")},
    **{name: (I32 if bits == 32 else I64, ()) for name, bits in SREGS.values()},
}


def get_or_insert(module: L.Module, name: str, ret: L.Type, args) -> L.Function:
    """The function ``name`` of ``module``, declared with this signature if absent."""
    fn = module.globals.get(name)
    if fn is None:
        fn = L.Function(module, L.FunctionType(ret, tuple(args)), name)
    return fn


def call(b: L.IRBuilder, intrinsic: str, args=(), ret: L.Type | None = None,
         name: str = "") -> L.Value:
    """Call ``intrinsic``: an ``NVVM`` entry, or an overloaded LLVM intrinsic
    (``llvm.smin.i32``) whose signature follows from ``ret`` and the arguments."""
    if intrinsic in NVVM:
        rtype, atypes = NVVM[intrinsic]
    else:
        rtype, atypes = ret, tuple(a.type for a in args)
    fn = get_or_insert(b.module, intrinsic, rtype, atypes)
    return b.call(fn, list(args), name=name)


def type_suffix(t: L.Type) -> str:
    """The overload suffix of an LLVM intrinsic for type ``t``: ``i32``, ``f32``, ``v4i32``."""
    if isinstance(t, L.VectorType):
        return f"v{t.count}{type_suffix(t.element)}"
    if isinstance(t, L.IntType):
        return f"i{t.width}"
    return {L.HalfType: "f16", L.FloatType: "f32", L.DoubleType: "f64"}[type(t)]
