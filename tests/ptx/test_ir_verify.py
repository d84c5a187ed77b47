"""Every verifier rule: a failing example whose message names kernel, role and node, and a
passing counterpart."""

from __future__ import annotations

import attrs
import pytest

from ir import nodes as N
from ir import types as T
from ir.builder import KernelBuilder
from ir.enums import AtomOp, BinOpKind, CacheHint, CmpOp, Scope, Sem
from ir.verify import Issue, VerifyError, check, check_role, verify

C = N.Const
P = N.Param("p", T.ptr_global)
PEER = N.Param("recv", T.ptr_global, peer=True)
NP = N.Param("n", T.u32)
ERR, TMO = N.Param("err_buf", T.ptr_global), N.Param("timeout_ns", T.u64)
PARAMS = (P, PEER, NP, ERR, TMO)
V = N.Var("v", T.u32)
V64 = N.Var("w", T.u64)
OK = N.Var("ok", T.pred)
VEC = N.Var("vec", T.vec(T.u32, 4))
ONE = C(1, T.u32)


def K(*body, barriers=(), threads=None, block_threads=256, roles=(), shared=(), sites=(),
      dynamic=False, params=PARAMS, blocks=N.BlockRange()) -> N.Kernel:
    """Kernel ``k`` whose role ``r`` runs ``body``, followed by ``roles``."""
    main = N.Role("r", tuple(body), blocks, threads, tuple(barriers))
    return N.Kernel("k", params, block_threads, (main, *roles), shared, dynamic, None, sites)


def role(name, *body, blocks=N.BlockRange(), threads=None, barriers=()):
    return N.Role(name, tuple(body), blocks, threads, tuple(barriers))


def spin(addr=P, dtype=T.u32, sem=Sem.ACQUIRE, scope=Scope.GPU, expected=None, dst=V, site=0,
         **kw):
    expected = expected if expected is not None else C(1, dtype)
    return N.SpinWait(dst, addr, dtype, CmpOp.GE, expected, N.DiagSite(site, "flags", C(0, T.u64)),
                      TMO, ERR, C(0, T.u32), sem, scope, **kw)


SITES = (N.SiteInfo(0, "r", "flags"),)


def expect_issue(k, node_text: str, fragment: str, role: str | None = "r"):
    """``verify(k)`` fails with a line naming the kernel, ``role``, the node and the rule."""
    with pytest.raises(VerifyError) as info:
        verify(k)
    where = f"kernel {k.name}" + (f", role {role}: " if role else ": ")
    lines = str(info.value).splitlines()
    assert any(line.startswith(where) and f"`{node_text}`" in line and fragment in line
               for line in lines), "\n".join(lines)
    assert len(lines) == len(info.value.issues)


# (id, failing kernel, passing kernel, node text, rule fragment, role)
CASES = [
    # -- barriers ---------------------------------------------------------------------------
    ("barrier-id", K(barriers=[N.NamedBarrier("b", 16, 256)]),
     K(barriers=[N.NamedBarrier("b", 15, 256)]),
     "barrier b id=16 count=256", "outside 0..15", "r"),
    ("barrier-id-negative", K(barriers=[N.NamedBarrier("b", -1, 256)]),
     K(barriers=[N.NamedBarrier("b", 0, 256)]),
     "barrier b id=-1 count=256", "outside 0..15", "r"),
    ("barrier-count-multiple",
     K(barriers=[N.NamedBarrier("b", 1, 48)], threads=N.ThreadRange(0, 48)),
     K(barriers=[N.NamedBarrier("b", 1, 64)], threads=N.ThreadRange(0, 64)),
     "barrier b id=1 count=48", "not a multiple of 32", "r"),
    ("barrier-count-role",
     K(barriers=[N.NamedBarrier("b", 1, 64)], threads=N.ThreadRange(0, 128)),
     K(barriers=[N.NamedBarrier("b", 1, 128)], threads=N.ThreadRange(0, 128)),
     "barrier b id=1 count=64", "differs from the role's thread count 128", "r"),
    ("barrier-count-block", K(barriers=[N.NamedBarrier("b", 1, 128)]),
     K(barriers=[N.NamedBarrier("b", 1, 256)]),
     "barrier b id=1 count=128", "differs from the role's thread count 256", "r"),
    ("barrier-group-divisor",
     K(barriers=[N.NamedBarrier("g", 4, 96, True)]),
     K(barriers=[N.NamedBarrier("g", 4, 128, True)]),
     "barrier g id=4 count=96 group=true", "proper divisor of the role's thread count 256", "r"),
    ("barrier-group-whole-role",
     K(barriers=[N.NamedBarrier("g", 4, 256, True)]),
     K(barriers=[N.NamedBarrier("g", 4, 64, True)]),
     "barrier g id=4 count=256 group=true", "proper divisor", "r"),
    ("barrier-group-needs-count",
     K(barriers=[N.NamedBarrier("g", 4, None, True)]),
     K(barriers=[N.NamedBarrier("g", 4, 32, True)]),
     "barrier g id=4 count=all group=true", "needs a thread count", "r"),
    ("barrier-whole-cta",
     K(barriers=[N.NamedBarrier("cta", 0, None)], threads=N.ThreadRange(0, 128)),
     K(barriers=[N.NamedBarrier("cta", 0, None)], threads=N.ThreadRange(0, 256)),
     "barrier cta id=0 count=all", "needs a role covering the whole block", "r"),
    ("barrier-undeclared-sync", K(N.BarSync(N.NamedBarrier("b", 1, 256))),
     K(N.BarSync(N.NamedBarrier("b", 1, 256)), barriers=[N.NamedBarrier("b", 1, 256)]),
     "bar.sync b id=1 count=256", "is not declared by role r", "r"),
    ("barrier-undeclared-arrive", K(N.BarArrive(N.NamedBarrier("b", 1, 256)),
                                    barriers=[N.NamedBarrier("b", 2, 256)]),
     K(N.BarArrive(N.NamedBarrier("b", 2, 256)), barriers=[N.NamedBarrier("b", 2, 256)]),
     "bar.arrive b id=1 count=256", "is not declared by role r", "r"),
    # -- concurrent roles sharing a barrier id -----------------------------------------------
    ("barrier-conflict",
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       roles=[role("s", threads=N.ThreadRange(128, 128), barriers=[N.NamedBarrier("b", 3, 128)])]),
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       roles=[role("s", threads=N.ThreadRange(128, 128), barriers=[N.NamedBarrier("b", 4, 128)])]),
     "barrier b id=3 count=128", "also used by role r", "s"),
    ("barrier-conflict-symbolic-blocks",
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       blocks=N.BlockRange(C(0, T.u32), NP),
       roles=[role("s", threads=N.ThreadRange(128, 128), blocks=N.BlockRange(C(1, T.u32), None),
                   barriers=[N.NamedBarrier("b", 3, 128)])]),
     # one ends where the other starts: provably disjoint
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       blocks=N.BlockRange(C(0, T.u32), NP),
       roles=[role("s", threads=N.ThreadRange(128, 128), blocks=N.BlockRange(NP, None),
                   barriers=[N.NamedBarrier("b", 3, 128)])]),
     "barrier b id=3 count=128", "can run in the same block at the same time", "s"),
    ("barrier-conflict-constant-blocks",
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       blocks=N.BlockRange(C(0, T.u32), C(4, T.u32)),
       roles=[role("s", threads=N.ThreadRange(128, 128), blocks=N.BlockRange(C(3, T.u32), None),
                   barriers=[N.NamedBarrier("b", 3, 128)])]),
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       blocks=N.BlockRange(C(0, T.u32), C(4, T.u32)),
       roles=[role("s", threads=N.ThreadRange(128, 128), blocks=N.BlockRange(C(4, T.u32), None),
                   barriers=[N.NamedBarrier("b", 3, 128)])]),
     "barrier b id=3 count=128", "also used by role r", "s"),
    ("barrier-conflict-same-threads-run-in-turn",
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       roles=[role("s", threads=N.ThreadRange(64, 128), barriers=[N.NamedBarrier("b", 3, 128)]),
              role("t", threads=N.ThreadRange(128, 128), barriers=[N.NamedBarrier("c", 3, 128)])]),
     # overlapping thread ranges run one after the other: no conflict
     K(threads=N.ThreadRange(0, 128), barriers=[N.NamedBarrier("a", 3, 128)],
       roles=[role("s", threads=N.ThreadRange(64, 128), barriers=[N.NamedBarrier("b", 3, 128)])]),
     "barrier c id=3 count=128", "also used by role r", "t"),
    # -- ordering and scopes ----------------------------------------------------------------
    ("store-acquire", K(N.Store(P, ONE, Sem.ACQUIRE, Scope.GPU)),
     K(N.Store(P, ONE, Sem.RELEASE, Scope.GPU)),
     "st.acquire.gpu.global [$p], 1:u32", "acquire is not allowed on a store", "r"),
    ("store-acq-rel", K(N.Store(P, ONE, Sem.ACQ_REL, Scope.GPU)),
     K(N.Store(P, ONE, Sem.RELAXED, Scope.GPU)),
     "st.acq_rel.gpu.global [$p], 1:u32", "acq_rel is not allowed on a store", "r"),
    ("store-sc", K(N.Store(P, ONE, Sem.SC, Scope.GPU)), K(N.Store(P, ONE)),
     "st.sc.gpu.global [$p], 1:u32", "sc is not allowed on a store", "r"),
    ("load-release", K(N.Load(V, P, Sem.RELEASE, Scope.GPU)),
     K(N.Load(V, P, Sem.ACQUIRE, Scope.GPU)),
     "%v:u32 = ld.release.gpu.global [$p]", "release is not allowed on a load", "r"),
    ("load-acq-rel", K(N.Load(V, P, Sem.ACQ_REL, Scope.GPU)),
     K(N.Load(V, P, Sem.RELAXED, Scope.GPU)),
     "%v:u32 = ld.acq_rel.gpu.global [$p]", "acq_rel is not allowed on a load", "r"),
    ("load-sc", K(N.Load(V, P, Sem.SC, Scope.SYS)), K(N.Load(V, P, Sem.VOLATILE)),
     "%v:u32 = ld.sc.sys.global [$p]", "sc is not allowed on a load", "r"),
    ("relaxed-needs-scope", K(N.Load(V, P, Sem.RELAXED)), K(N.Load(V, P, Sem.RELAXED, Scope.CTA)),
     "%v:u32 = ld.relaxed.global [$p]", "relaxed needs a scope", "r"),
    ("acquire-needs-scope", K(N.Load(V, P, Sem.ACQUIRE)), K(N.Load(V, P, Sem.ACQUIRE, Scope.SYS)),
     "%v:u32 = ld.acquire.global [$p]", "acquire needs a scope", "r"),
    ("release-needs-scope", K(N.Store(P, ONE, Sem.RELEASE)),
     K(N.Store(P, ONE, Sem.RELEASE, Scope.CLUSTER)),
     "st.release.global [$p], 1:u32", "release needs a scope", "r"),
    ("weak-takes-no-scope", K(N.Store(P, ONE, Sem.WEAK, Scope.GPU)), K(N.Store(P, ONE, Sem.WEAK)),
     "st.gpu.global [$p], 1:u32", "weak takes no scope", "r"),
    ("volatile-takes-no-scope", K(N.Load(V, P, Sem.VOLATILE, Scope.SYS)),
     K(N.Load(V, P, Sem.VOLATILE)),
     "%v:u32 = ld.volatile.sys.global [$p]", "volatile takes no scope", "r"),
    ("vector-load-weak", K(N.Load(VEC, P, Sem.RELAXED, Scope.GPU)), K(N.Load(VEC, P)),
     "%vec:v4.u32 = ld.relaxed.gpu.global [$p]", "vector load of v4.u32 must be weak", "r"),
    ("vector-store-weak", K(N.Store(P, N.Pack(T.vec(T.u32, 2), (ONE, ONE)), Sem.VOLATILE)),
     K(N.Store(P, N.Pack(T.vec(T.u32, 2), (ONE, ONE)))),
     "st.volatile.global [$p], pack.v2.u32(1:u32, 1:u32)", "must be weak, not volatile", "r"),
    ("width", K(N.Load(N.Var("big", T.vec(T.u32, 8)), P)), K(N.Load(VEC, P)),
     "%big:v8.u32 = ld.global [$p]", "32 bytes, wider than 16", "r"),
    ("atomic-sc", K(N.AtomicRMW(V, AtomOp.ADD, P, ONE, Sem.SC, Scope.GPU)),
     K(N.AtomicRMW(V, AtomOp.ADD, P, ONE, Sem.ACQ_REL, Scope.GPU)),
     "%v:u32 = atom.sc.gpu.global.add [$p], 1:u32", "sc is not allowed on an atomic", "r"),
    ("atomic-weak", K(N.AtomicRMW(None, AtomOp.ADD, P, ONE, Sem.WEAK, None)),
     K(N.AtomicRMW(None, AtomOp.ADD, P, ONE, Sem.RELEASE, Scope.GPU)),
     "red.weak.global.add [$p], 1:u32", "weak is not allowed on an atomic", "r"),
    ("cas-volatile", K(N.AtomicCAS(V, P, ONE, ONE, Sem.VOLATILE, None)),
     K(N.AtomicCAS(V, P, ONE, ONE, Sem.ACQUIRE, Scope.CTA)),
     "%v:u32 = atom.volatile.global.cas [$p], 1:u32, 1:u32", "volatile is not allowed", "r"),
    ("atomic-needs-scope", K(N.AtomicRMW(V, AtomOp.ADD, P, ONE, Sem.RELAXED, None)),
     K(N.AtomicRMW(V, AtomOp.ADD, P, ONE, Sem.RELAXED, Scope.SYS)),
     "%v:u32 = atom.relaxed.global.add [$p], 1:u32", "relaxed needs a scope", "r"),
    ("fence-relaxed", K(N.Fence(Sem.RELAXED, Scope.GPU)), K(N.Fence(Sem.SC, Scope.GPU)),
     "fence.relaxed.gpu", "relaxed is not allowed on a fence", "r"),
    ("nc-needs-weak-global", K(N.Load(V, N.SharedAddr("t"), cache=CacheHint.NC),
                               shared=[N.SharedBuffer("t", 64)]),
     K(N.Load(V, P, cache=CacheHint.NC), shared=[N.SharedBuffer("t", 64)]),
     "%v:u32 = ld.shared.nc [&t]", "ld.global.nc needs a weak load through a global", "r"),
    # -- peer memory needs sys ----------------------------------------------------------------
    ("peer-store", K(N.Store(PEER, ONE, Sem.RELEASE, Scope.GPU)),
     K(N.Store(PEER, ONE, Sem.RELEASE, Scope.SYS)),
     "st.release.gpu.global [$recv], 1:u32", "peer memory needs sys scope", "r"),
    ("peer-relaxed-is-not-ordering", K(N.Store(PEER, ONE, Sem.ACQUIRE, Scope.GPU)),
     K(N.Store(PEER, ONE, Sem.RELAXED, Scope.GPU)),
     "st.acquire.gpu.global [$recv], 1:u32", "(from $recv)", "r"),
    ("peer-load-through-ptradd", K(N.Load(V, N.PtrAdd(PEER, C(8, T.u64)), Sem.ACQUIRE, Scope.GPU)),
     K(N.Load(V, N.PtrAdd(P, C(8, T.u64)), Sem.ACQUIRE, Scope.GPU)),
     "%v:u32 = ld.acquire.gpu.global [ptradd($recv, 8:u64)]", "(from $recv)", "r"),
    ("peer-through-cast-and-select",
     K(N.AtomicRMW(V, AtomOp.ADD, N.Cast(T.ptr_global, N.Select(OK, N.Cast(T.u64, P),
                                                                N.Cast(T.u64, PEER))),
                   ONE, Sem.ACQ_REL, Scope.CTA)),
     K(N.AtomicRMW(V, AtomOp.ADD, N.Cast(T.ptr_global, N.Select(OK, N.Cast(T.u64, P),
                                                                N.Cast(T.u64, P))),
                   ONE, Sem.ACQ_REL, Scope.CTA)),
     "%v:u32 = atom.acq_rel.cta.global.add [cvt.ptr.global(selp(%ok:pred, cvt.u64($p), "
     "cvt.u64($recv)))], 1:u32", "peer-visible address (from $recv)", "r"),
    ("peer-var", K(N.AtomicCAS(V, N.Var("q", T.ptr_global, peer=True), ONE, ONE, Sem.ACQUIRE,
                               Scope.GPU)),
     K(N.AtomicCAS(V, N.Var("q", T.ptr_global, peer=True), ONE, ONE, Sem.ACQUIRE, Scope.SYS)),
     "%v:u32 = atom.acquire.gpu.global.cas [%q:ptr.global peer], 1:u32, 1:u32", "(from %q)", "r"),
    ("peer-var-by-assignment",
     K(N.Assign(N.Var("q", T.ptr_global), N.PtrAdd(PEER, C(4, T.u64))),
       N.Store(N.Var("q", T.ptr_global), ONE, Sem.RELEASE, Scope.GPU)),
     K(N.Assign(N.Var("q", T.ptr_global), N.PtrAdd(P, C(4, T.u64))),
       N.Store(N.Var("q", T.ptr_global), ONE, Sem.RELEASE, Scope.GPU)),
     "st.release.gpu.global [%q:ptr.global], 1:u32", "(from %q)", "r"),
    ("peer-spin-wait", K(spin(PEER), sites=SITES), K(spin(PEER, scope=Scope.SYS), sites=SITES),
     "%v:u32 = spin_wait.acquire.gpu.global.u32 [$recv] ge 1:u32 site=0 buffer=flags index=0:u64 "
     "timeout_ns=$timeout_ns err_buf=$err_buf rank=0:u32 shift=0 mask=none backoff_ns=0",
     "peer memory needs sys scope", "r"),
    # -- types ----------------------------------------------------------------------------------
    ("assign-type", K(N.Assign(V, C(1, T.u64))), K(N.Assign(V, C(1, T.u32))),
     "%v:u32 = 1:u64", "has type u64, expected u32", "r"),
    ("binop-types", K(N.Assign(V, N.BinOp(BinOpKind.ADD, V, C(1, T.s32)))),
     K(N.Assign(V, N.BinOp(BinOpKind.ADD, V, ONE))),
     "add(%v:u32, 1:s32)", "operands of add must have one type, found u32, s32", "r"),
    ("cmp-types", K(N.Assign(OK, N.Cmp(CmpOp.LT, V64, ONE))),
     K(N.Assign(OK, N.Cmp(CmpOp.LT, V64, C(1, T.u64)))),
     "lt(%w:u64, 1:u32)", "operands of lt must have one type", "r"),
    ("select-types", K(N.Assign(V, N.Select(V, V, ONE))), K(N.Assign(V, N.Select(OK, V, ONE))),
     "selp(%v:u32, %v, 1:u32)", "selp condition has type u32, not pred", "r"),
    ("load-through-non-pointer", K(N.Load(V, V64)), K(N.Load(V, N.Cast(T.ptr_global, V64))),
     "%v:u32 = ld [%w:u64]", "load address has type u64, not a pointer", "r"),
    ("load-pred", K(N.Load(OK, P)), K(N.Load(V, P)),
     "%ok:pred = ld.global [$p]", "a load cannot move a pred", "r"),
    ("store-to-non-pointer", K(N.Store(V64, ONE)), K(N.Store(N.Cast(T.ptr_global, V64), ONE)),
     "st [%w:u64], 1:u32", "store address has type u64, not a pointer", "r"),
    ("if-cond", K(N.If(V, ())), K(N.If(N.Cmp(CmpOp.NE, V, ONE), ())),
     "if %v:u32 { ... }", "if condition has type u32, not pred", "r"),
    ("while-cond", K(N.While(V64, (N.Break(),))), K(N.While(OK, (N.Break(),))),
     "while %w:u64 { ... }", "while condition has type u64, not pred", "r"),
    ("for-bounds", K(N.For(V, C(0, T.u32), NP, C(1, T.u64), ())),
     K(N.For(V, C(0, T.u32), NP, ONE, ())),
     "for %v:u32 in [0:u32, $n) step=1:u64 { ... }", "for step has type u64, expected u32", "r"),
    ("break-outside-loop", K(N.If(OK, (N.Break(),))),
     K(N.While(OK, (N.If(OK, (N.Break(),)),))),
     "break", "break outside a loop", "r"),
    ("shared-undeclared", K(N.Store(N.SharedAddr("tile"), ONE)),
     K(N.Store(N.SharedAddr("tile"), ONE), shared=[N.SharedBuffer("tile", 64)]),
     "&tile", "shared buffer 'tile' is not declared", "r"),
    ("dynamic-shared-undeclared", K(N.Store(N.SharedAddr("dyn_smem"), ONE)),
     K(N.Store(N.SharedAddr("dyn_smem"), ONE), dynamic=True),
     "&dyn_smem", "shared buffer 'dyn_smem' is not declared", "r"),
    ("ptradd-base", K(N.Store(N.PtrAdd(V64, C(4, T.u64)), ONE)),
     K(N.Store(N.PtrAdd(P, C(4, T.u64)), ONE)),
     "ptradd(%w:u64, 4:u64)", "ptradd base has type u64, not a pointer", "r"),
    ("extract-lane", K(N.Assign(V, N.Extract(VEC, 4))), K(N.Assign(V, N.Extract(VEC, 3))),
     "extract(%vec:v4.u32, 4)", "lane 4 is outside v4.u32", "r"),
    ("pack-lanes", K(N.Store(P, N.Pack(T.vec(T.u32, 2), (ONE, C(1, T.u16))))),
     K(N.Store(P, N.Pack(T.vec(T.u32, 2), (ONE, ONE)))),
     "pack.v2.u32(1:u32, 1:u16)", "pack lanes must have one type (u32)", "r"),
    ("cvt-e4m3x2-operands",
     K(N.Assign(N.Var("h", T.u16), N.CvtE4M3x2(N.Bitcast(T.f32, V), V))),
     K(N.Assign(N.Var("h", T.u16), N.CvtE4M3x2(N.Bitcast(T.f32, V), C(0.0, T.f32)))),
     "cvt.rn.satfinite.e4m3x2.f32(bitcast.f32(%v:u32), %v)",
     "cvt.rn.satfinite.e4m3x2.f32 operands must have one type (f32), found f32, u32", "r"),
    ("cvt-e4m3-to-f32-operand",
     K(N.Assign(N.Var("f", T.f32), N.CvtE4M3ToF32(V))),
     K(N.Assign(N.Var("f", T.f32), N.CvtE4M3ToF32(N.Cast(T.u16, V)))),
     "cvt.f32.e4m3(%v:u32)",
     "cvt.rn.f16x2.e4m3x2 operand must have one type (u16), found u32", "r"),
    ("fma-integer", K(N.Assign(V, N.Fma(V, V, V))),
     K(N.Assign(N.Var("f", T.f32), N.Fma(N.Bitcast(T.f32, V), C(2.0, T.f32), C(1.0, T.f32)))),
     "fma(%v:u32, %v, %v)", "fma operands have type u32, not f32 or f64", "r"),
    ("fma-mixed", K(N.Assign(N.Var("f", T.f32),
                             N.Fma(N.Bitcast(T.f32, V), C(2.0, T.f32), C(1.0, T.f64)))),
     K(N.Assign(N.Var("f", T.f32), N.Fma(N.Bitcast(T.f32, V), C(2.0, T.f32), C(1.0, T.f32)))),
     "fma(bitcast.f32(%v:u32), 2.0:f32, 1.0:f64)",
     "fma operands must have one type, found f32, f32, f64", "r"),
    ("bitcast-width", K(N.Assign(V, N.Bitcast(T.u32, V64))),
     K(N.Assign(V64, N.Bitcast(T.u64, N.Cast(T.f64, V64)))),
     "bitcast.u32(%w:u64)", "from u64 (64 bits) to u32 (32 bits)", "r"),
    ("atomic-add-type", K(N.AtomicRMW(None, AtomOp.ADD, P, C(1, T.s64), Sem.RELAXED, Scope.GPU)),
     K(N.AtomicRMW(None, AtomOp.ADD, P, C(1, T.f64), Sem.RELAXED, Scope.GPU)),
     "red.relaxed.gpu.global.add [$p], 1:s64", "atom.add has no s64 form", "r"),
    ("atomic-min-type", K(N.AtomicRMW(None, AtomOp.MIN, P, C(1.0, T.f32), Sem.RELAXED, Scope.GPU)),
     K(N.AtomicRMW(None, AtomOp.MIN, P, C(1, T.s64), Sem.RELAXED, Scope.GPU)),
     "red.relaxed.gpu.global.min [$p], 1.0:f32", "atom.min has no f32 form", "r"),
    ("atomic-xor-type", K(N.AtomicRMW(None, AtomOp.XOR, P, C(1, T.u16), Sem.RELAXED, Scope.GPU)),
     K(N.AtomicRMW(None, AtomOp.XOR, P, C(1, T.b64), Sem.RELAXED, Scope.GPU)),
     "red.relaxed.gpu.global.xor [$p], 1:u16", "atom.xor has no u16 form", "r"),
    ("atomic-inc-type", K(N.AtomicRMW(None, AtomOp.INC, P, C(1, T.u64), Sem.RELAXED, Scope.GPU)),
     K(N.AtomicRMW(None, AtomOp.INC, P, ONE, Sem.RELAXED, Scope.GPU)),
     "red.relaxed.gpu.global.inc [$p], 1:u64", "atom.inc has no u64 form (PTX has u32)", "r"),
    ("atomic-dst-type", K(N.AtomicRMW(V64, AtomOp.ADD, P, ONE, Sem.RELAXED, Scope.GPU)),
     K(N.AtomicRMW(V, AtomOp.ADD, P, ONE, Sem.RELAXED, Scope.GPU)),
     "%w:u64 = atom.relaxed.gpu.global.add [$p], 1:u32", "destination %w has type u64", "r"),
    ("cas-type", K(N.AtomicCAS(N.Var("f", T.f32), P, C(0.0, T.f32), C(1.0, T.f32))),
     K(N.AtomicCAS(N.Var("f", T.b32), P, C(0, T.b32), C(1, T.b32))),
     "%f:f32 = atom.relaxed.gpu.global.cas [$p], 0.0:f32, 1.0:f32", "atom.cas has no f32 form",
     "r"),
    ("cas-operand-types", K(N.AtomicCAS(V, P, C(0, T.u64), ONE)),
     K(N.AtomicCAS(V, P, C(0, T.u32), ONE)),
     "%v:u32 = atom.relaxed.gpu.global.cas [$p], 0:u64, 1:u32",
     "cas destination, compare and value must have one type", "r"),
    ("spin-type", K(spin(dtype=T.u16, dst=N.Var("h", T.u16)), sites=SITES),
     K(spin(dtype=T.s64, dst=N.Var("h", T.s64)), sites=SITES),
     "%h:u16 = spin_wait.acquire.gpu.global.u16 [$p] ge 1:u16 site=0 buffer=flags index=0:u64 "
     "timeout_ns=$timeout_ns err_buf=$err_buf rank=0:u32 shift=0 mask=none backoff_ns=0",
     "spin_wait polls u16; it needs s32/s64/u32/u64", "r"),
    ("spin-sem", K(spin(sem=Sem.RELEASE), sites=SITES), K(spin(sem=Sem.RELAXED), sites=SITES),
     "%v:u32 = spin_wait.release.gpu.global.u32 [$p] ge 1:u32 site=0 buffer=flags index=0:u64 "
     "timeout_ns=$timeout_ns err_buf=$err_buf rank=0:u32 shift=0 mask=none backoff_ns=0",
     "release is not allowed on a spin wait", "r"),
    ("spin-expected-type", K(spin(expected=C(1, T.u64)), sites=SITES), K(spin(), sites=SITES),
     "%v:u32 = spin_wait.acquire.gpu.global.u32 [$p] ge 1:u64 site=0 buffer=flags index=0:u64 "
     "timeout_ns=$timeout_ns err_buf=$err_buf rank=0:u32 shift=0 mask=none backoff_ns=0",
     "spin_wait expected value has type u64, expected u32", "r"),
    ("spin-site-listed", K(spin(site=1), sites=SITES), K(spin(site=0), sites=SITES),
     "%v:u32 = spin_wait.acquire.gpu.global.u32 [$p] ge 1:u32 site=1 buffer=flags index=0:u64 "
     "timeout_ns=$timeout_ns err_buf=$err_buf rank=0:u32 shift=0 mask=none backoff_ns=0",
     "site 1 (role r, buffer flags) is not listed", "r"),
    # -- kernel-level ----------------------------------------------------------------------------
    ("duplicate-param", K(params=(P, N.Param("p", T.u32))), K(params=(P, N.Param("q", T.u32))),
     "param $p:u32", "parameter name 'p' is declared twice", None),
    ("block-threads-multiple", K(block_threads=100), K(block_threads=96),
     "kernel k block_threads=100", "must be a multiple of 32 in 32..1024", None),
    ("block-threads-range", K(block_threads=2048), K(block_threads=1024),
     "kernel k block_threads=2048", "must be a multiple of 32 in 32..1024", None),
    ("role-threads-inside-block", K(threads=N.ThreadRange(192, 128)),
     K(threads=N.ThreadRange(128, 128)),
     "role r blocks=[0:u32, end) threads=[192, 320)", "inside the block's 256 threads", "r"),
]


@pytest.mark.parametrize("name, bad, good, node_text, fragment, role", CASES,
                         ids=[c[0] for c in CASES])
def test_rule(name, bad, good, node_text, fragment, role):
    expect_issue(bad, node_text, fragment, role)
    assert check(good) == [], "\n".join(map(str, check(good)))
    verify(good)


def test_issue_fields_and_rendering():
    st = N.Store(PEER, ONE, Sem.RELEASE, Scope.GPU)
    (issue,) = check(K(st))
    assert issue == Issue("k", "r", st, issue.message)
    assert str(issue) == ("kernel k, role r: `st.release.gpu.global [$recv], 1:u32`: release at "
                          "gpu scope on a peer-visible address (from $recv): peer memory needs "
                          "sys scope")


def test_error_lists_every_issue_one_per_line():
    k = K(N.Store(P, ONE, Sem.ACQUIRE, Scope.GPU), N.Break(), N.Load(V, P, Sem.RELEASE, Scope.GPU),
          barriers=[N.NamedBarrier("b", 20, 256)])
    with pytest.raises(VerifyError) as info:
        verify(k)
    lines = str(info.value).splitlines()
    assert len(lines) == len(info.value.issues) == 4
    assert all(line.startswith("kernel k, role r: `") for line in lines)


def test_module_checks_each_kernel_and_unique_names():
    good = K()
    bad = attrs.evolve(K(N.Break()), name="j")
    issues = check(N.Module("m", (good, bad, good)))
    assert [str(i).split(":")[0] for i in issues] == ["kernel j, role r", "kernel k"]
    assert "kernel name 'k' appears twice in module m" in str(issues[1])
    verify(N.Module("m", (good,)))


def test_check_role_alone():
    k = K(N.Break())
    assert [i.message for i in check_role(k, k.roles[0])] == ["break outside a loop"]


def test_verify_rejects_other_objects():
    with pytest.raises(TypeError, match="Kernel or a Module"):
        verify(N.Break())


def test_a_realistic_builder_kernel_verifies():
    kb = KernelBuilder("copy16", block_threads=256)
    dst = kb.param("dst", T.ptr_global, peer=True)
    src, n = kb.param("src", T.ptr_global), kb.param("n_vec", T.u64)
    flag = kb.param("flag", T.ptr_global)
    tile = kb.shared_buffer("tile", 4096)
    kb.diagnostics(rank=1)
    with kb.role("copy", blocks=(0, 8), threads=(0, 128)) as r:
        b = r.named_barrier("copy", 1)
        i = r.let("i", r.global_thread_id(T.u64))
        with r.while_(i < n):
            v = r.load(src + i * 16, T.vec(T.u32, 4), cache=CacheHint.NC)
            r.store(dst + i * 16, v)
            r.assign(i, i + r.grid_threads(T.u64))
        r.bar_sync(b)
        with r.if_(r.tid.eq(0)):
            r.red(AtomOp.ADD, flag, 1, Sem.RELEASE, Scope.SYS)
    with kb.role("wait", blocks=(0, 8), threads=(128, 128)) as r:
        r.named_barrier("wait", 2)
        r.spin_wait(flag, T.u32, CmpOp.GE, 1, buffer="flag", index=0)
        r.store(tile, 1)
    with kb.role("all") as r:
        r.syncthreads()
    verify(kb.build())
