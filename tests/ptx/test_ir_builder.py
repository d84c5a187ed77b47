"""The builder produces the nodes its code reads like."""

from __future__ import annotations

import pytest

from ir import nodes as N
from ir import types as T
from ir.builder import KernelBuilder
from ir.enums import AtomOp, BinOpKind, CacheHint, CmpOp, Scope, Sem, SReg


def _one_role(body_fn, block_threads=128, **role_kw):
    kb = KernelBuilder("k", block_threads=block_threads)
    with kb.role("r", **role_kw) as r:
        body_fn(kb, r)
    return kb.build()


def test_kernel_parts_in_declaration_order():
    kb = KernelBuilder("k", block_threads=256, min_blocks_per_sm=2)
    a = kb.param("a", T.ptr_global, peer=True)
    n = kb.param("n", T.u32)
    tile = kb.shared_buffer("tile", 1024, align=8)
    dyn = kb.dynamic_shared_memory()
    with kb.role("first", blocks=(0, n), threads=(0, 64)):
        pass
    with kb.role("second"):
        pass
    k = kb.build()
    assert k.params == (N.Param("a", T.ptr_global, True), N.Param("n", T.u32))
    assert k.param("a") is a and k.min_blocks_per_sm == 2
    assert tile == N.SharedAddr("tile") and dyn == N.SharedAddr("dyn_smem")
    assert k.shared == (N.SharedBuffer("tile", 1024, 8),) and k.dynamic_shared
    first, second = k.roles
    assert first.blocks == N.BlockRange(N.Const(0, T.u32), n)
    assert first.threads == N.ThreadRange(0, 64)
    assert second.blocks == N.BlockRange() and second.threads is None


def test_duplicate_param_is_refused():
    kb = KernelBuilder("k", block_threads=32)
    kb.param("x", T.u32)
    with pytest.raises(ValueError, match="declared twice"):
        kb.param("x", T.u64)


def test_var_names_are_made_unique_per_kernel():
    def body(kb, r):
        r.let("i", 1)
        r.let("i", 2)
        r.var("i", T.u64)
        r.load(kb.param("p", T.ptr_global), T.u32)
        r.load(kb.params[0], T.u32)

    k = _one_role(body)
    names = [s.dst.name for s in k.roles[0].body]
    assert names == ["i", "i_1", "v", "v_1"]  # var() without init emits nothing


def test_let_assign_and_expression_operators():
    def body(kb, r):
        x = r.let("x", r.tid * 4 + 1)
        r.assign(x, x << 2)

    k = _one_role(body)
    let, assign = k.roles[0].body
    tid = N.SRegRead(SReg.TID_X)
    value = N.BinOp(BinOpKind.ADD, N.BinOp(BinOpKind.MUL, tid, N.Const(4, T.u32)),
                    N.Const(1, T.u32))
    x = N.Var("x", T.u32)
    assert let == N.Assign(x, value)
    assert assign == N.Assign(x, N.BinOp(BinOpKind.SHL, x, N.Const(2, T.u32)))


def test_role_local_thread_id_subtracts_the_base():
    def body(kb, r):
        r.let("t", r.tid)

    k = _one_role(body, threads=(64, 64))
    assert k.roles[0].body[0].value == N.BinOp(BinOpKind.SUB, N.SRegRead(SReg.TID_X),
                                               N.Const(64, T.u32))


def test_if_else_nesting():
    def body(kb, r):
        c = r.let("c", 3)
        with r.if_(c.eq(3)):
            r.comment("then")
            with r.if_(c > 1):
                r.trap()
        with r.else_():
            r.comment("else")
        r.return_()

    k = _one_role(body)
    _, stmt, ret = k.roles[0].body
    c = N.Var("c", T.u32)
    inner = N.If(N.Cmp(CmpOp.GT, c, N.Const(1, T.u32)), (N.Trap(),))
    assert stmt == N.If(N.Cmp(CmpOp.EQ, c, N.Const(3, T.u32)), (N.Comment("then"), inner),
                        (N.Comment("else"),))
    assert ret == N.Return()


def test_else_must_follow_an_if():
    def body(kb, r):
        with r.if_(r.tid.eq(0)):
            pass
        r.comment("between")
        with r.else_():
            pass

    with pytest.raises(ValueError, match="else_"):
        _one_role(body)


def test_loops_and_break():
    def body(kb, r):
        with r.for_range("i", 0, 10, 2) as i:
            with r.while_(i < 5):
                r.break_()

    k = _one_role(body)
    (loop,) = k.roles[0].body
    i = N.Var("i", T.u32)
    assert loop == N.For(i, N.Const(0, T.u32), N.Const(10, T.u32), N.Const(2, T.u32),
                         (N.While(N.Cmp(CmpOp.LT, i, N.Const(5, T.u32)), (N.Break(),)),))


def test_memory_statements():
    def body(kb, r):
        p = kb.param("p", T.ptr_global)
        v = r.load(p + 16, T.vec(T.u32, 4), cache=CacheHint.NC)
        r.store(p, 7, Sem.RELEASE, Scope.SYS)
        r.atomic(AtomOp.ADD, p, 1, Sem.ACQ_REL, Scope.GPU)
        r.red(AtomOp.ADD, p, 1)
        r.cas(p, 0, 1, dtype=T.u64)
        r.fence(Sem.ACQ_REL, Scope.SYS)
        assert v.dtype == T.vec(T.u32, 4)

    k = _one_role(body)
    p = k.param("p")
    ld, st, atom, red, cas, fence = k.roles[0].body
    assert ld == N.Load(N.Var("v", T.vec(T.u32, 4)), N.PtrAdd(p, N.Const(16, T.u64)),
                        cache=CacheHint.NC)
    assert st == N.Store(p, N.Const(7, T.u32), Sem.RELEASE, Scope.SYS)
    assert atom == N.AtomicRMW(N.Var("old", T.u32), AtomOp.ADD, p, N.Const(1, T.u32),
                               Sem.ACQ_REL, Scope.GPU)
    assert red.dst is None and red.sem is Sem.RELAXED and red.scope is Scope.GPU
    assert cas == N.AtomicCAS(N.Var("old_1", T.u64), p, N.Const(0, T.u64), N.Const(1, T.u64))
    assert fence == N.Fence(Sem.ACQ_REL, Scope.SYS)


def test_barriers_default_to_the_role_thread_count():
    def body(kb, r):
        b = r.named_barrier("sync", 3)
        r.bar_sync(b)
        r.bar_arrive(b)
        r.syncthreads()

    k = _one_role(body, threads=(32, 64))
    role = k.roles[0]
    assert role.barriers == (N.NamedBarrier("sync", 3, 64), N.NamedBarrier("cta", 0, None))
    assert role.body == (N.BarSync(role.barriers[0]), N.BarArrive(role.barriers[0]),
                         N.BarSync(role.barriers[1]))


def test_spin_wait_needs_diagnostics():
    kb = KernelBuilder("k", block_threads=32)
    flag = kb.param("flag", T.ptr_global)
    with pytest.raises(ValueError, match="diagnostics"):
        with kb.role("r") as r:
            r.spin_wait(flag, T.u32, CmpOp.GE, 1, buffer="flag", index=0)


def test_spin_wait_records_a_site():
    kb = KernelBuilder("k", block_threads=32)
    flag = kb.param("flag", T.ptr_global)
    diag = kb.diagnostics(rank=3)
    with kb.role("waiter") as r:
        r.spin_wait(flag, T.u32, CmpOp.GE, 1, buffer="flags", index=5, scope=Scope.SYS,
                    mask=0xFF, shift=8, backoff_ns=100)
        r.spin_wait(flag, T.u64, CmpOp.EQ, 2, buffer="flags", index=6)
    k = kb.build()
    assert [p.name for p in k.params] == ["flag", "err_buf", "timeout_ns"]
    assert k.sites == (N.SiteInfo(0, "waiter", "flags"), N.SiteInfo(1, "waiter", "flags"))
    w0, w1 = k.roles[0].body
    assert w0 == N.SpinWait(N.Var("seen", T.u32), flag, T.u32, CmpOp.GE, N.Const(1, T.u32),
                            N.DiagSite(0, "flags", N.Const(5, T.u64)), diag["timeout_ns"],
                            diag["err_buf"], N.Const(3, T.u32), Sem.ACQUIRE, Scope.SYS, 8,
                            0xFF, 100)
    assert w1.site.site_id == 1 and w1.dst == N.Var("seen_1", T.u64)


def test_warp_statements_and_calls():
    def body(kb, r):
        r.warp_sync(0xFFFF)
        r.ballot(r.lane.eq(0))
        r.warp_sum(r.tid)
        r.nanosleep(100)
        r.call("nvshmem_quiet", [])
        ret = r.call("nvshmem_my_pe", [], ret=T.s32)
        assert ret == N.Var("ret", T.s32)

    k = _one_role(body)
    ws, ballot, redux, sleep, quiet, pe = k.roles[0].body
    assert ws == N.WarpSync(0xFFFF)
    assert ballot.dst == N.Var("ballot", T.u32) and ballot.mask == 0xFFFFFFFF
    assert redux.dst.dtype == T.u32
    assert sleep == N.Nanosleep(N.Const(100, T.u32))
    assert quiet == N.Call(None, "nvshmem_quiet", (), ())
    assert pe.dst == N.Var("ret", T.s32)


def test_open_body_is_refused_on_build():
    kb = KernelBuilder("k", block_threads=32)
    with kb.role("r") as r:
        r._stack.append(object())  # simulate a body left open
        with pytest.raises(ValueError, match="still open"):
            r.build()
        r._stack.pop()
