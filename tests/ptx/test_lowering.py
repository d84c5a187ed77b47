"""Lowering of the IR to LLVM IR and PTX: memory semantics, fences, barriers, special
registers, warp operations, arithmetic, control flow, spin-waits, kernel shape, determinism and
target selection. Expected PTX is spelled out literally."""

from __future__ import annotations

import re

import pytest

from backends.nvptx import ARCHES, LoweringError, Target, emit_llvm_ir, emit_ptx
from backends.nvptx.target import PTX_VERSIONS
from ir import (CacheHint, CmpOp, KernelBuilder, ReduxOp, Scope, Sem, ShflMode, SReg,
                VoteMode, diag)
from ir import nodes as N
from ir import types as T


def build(body, name="k", block_threads=128, **kernel_kw):
    """A one-role kernel; ``body(kb, r)`` declares parameters and emits statements."""
    kb = KernelBuilder(name, block_threads=block_threads, **kernel_kw)
    with kb.role("main") as r:
        body(kb, r)
    return kb.build()


def instr_re(mnemonic: str, operands: str) -> str:
    """An LLVM-printed PTX line: ``\\t<mnemonic> \\t<operands>;`` (operands: a regex)."""
    return rf"(?m)^\t{re.escape(mnemonic)} \t{operands};$"


def asm_re(instruction: str, operands: str) -> str:
    """An inline-asm PTX line: ``\\t<instruction> <operands>;``."""
    return rf"(?m)^\t{re.escape(instruction)} {operands};$"


REG32, REG64, ADDR = r"%r\d+", r"%rd\d+", r"\[%rd\d+\]"


# ---------------------------------------------------------------------------------------------
# Loads and stores


MEM_TYPES = [(T.u32, 32, REG32), (T.s64, 64, REG64)]
by_space = pytest.mark.parametrize("space", ["global", "shared"])
by_type = pytest.mark.parametrize("dtype,bits,reg", MEM_TYPES, ids=["u32", "s64"])
by_scope = pytest.mark.parametrize("scope", list(Scope), ids=lambda s: s.value)


def _copy_kernel(load_sem, store_sem, scope, dtype, space):
    """Load a value with ``load_sem`` and store it with ``store_sem`` (so it stays a register)."""
    def body(kb, r):
        base = kb.param("p", T.ptr_global if space == "global" else T.ptr_shared)
        v = r.load(base, dtype, sem=load_sem, scope=scope)
        r.store(base + 8, v, sem=store_sem, scope=scope)
    return build(body)


@pytest.mark.parametrize("sem", ["relaxed", "acquire"])
@by_space
@by_type
@by_scope
def test_ordered_load_line(sem, scope, dtype, bits, reg, space):
    ptx = emit_ptx(_copy_kernel(Sem(sem), Sem.WEAK, scope, dtype, space))
    assert re.search(instr_re(f"ld.{sem}.{scope.value}.{space}.b{bits}", f"{reg}, {ADDR}"), ptx)


@pytest.mark.parametrize("sem", ["relaxed", "release"])
@by_space
@by_type
@by_scope
def test_ordered_store_line(sem, scope, dtype, bits, reg, space):
    ptx = emit_ptx(_copy_kernel(Sem.WEAK, Sem(sem), scope, dtype, space))
    assert re.search(instr_re(f"st.{sem}.{scope.value}.{space}.b{bits}",
                              rf"\[%rd\d+\+8\], {reg}"), ptx)


@pytest.mark.parametrize("space", ["global", "shared"])
@pytest.mark.parametrize("dtype,bits,reg", [(T.u32, 32, REG32), (T.u64, 64, REG64),
                                            (T.f32, 32, REG32), (T.u16, 16, r"%rs\d+")])
def test_volatile_load_and_store_lines(space, dtype, bits, reg):
    ptx = emit_ptx(_copy_kernel(Sem.VOLATILE, Sem.VOLATILE, None, dtype, space))
    assert re.search(asm_re(f"ld.volatile.{space}.b{bits}", f"{reg}, {ADDR}"), ptx)
    assert re.search(asm_re(f"st.volatile.{space}.b{bits}", f"{ADDR}, {reg}"), ptx)


def test_weak_access_lines():
    def body(kb, r):
        g = kb.param("g", T.ptr_global)
        v = r.load(g, T.u32)
        r.store(g + 4, v)
        w = r.load(g + 16, T.vec(T.u32, 4))
        r.store(g + 32, w)
        x = r.load(g + 64, T.vec(T.u64, 2), cache=CacheHint.NC)
        r.store(g + 96, x)
    ptx = emit_ptx(build(body))
    assert re.search(instr_re("ld.global.b32", f"{REG32}, {ADDR}"), ptx)
    assert re.search(instr_re("st.global.b32", rf"\[%rd\d+\+4\], {REG32}"), ptx)
    quad = r"\{%r\d+, %r\d+, %r\d+, %r\d+\}"
    assert re.search(instr_re("ld.global.v4.b32", rf"{quad}, \[%rd\d+\+16\]"), ptx)
    assert re.search(instr_re("st.global.v4.b32", rf"\[%rd\d+\+32\], {quad}"), ptx)
    assert re.search(instr_re("ld.global.nc.v2.b64", r"\{%rd\d+, %rd\d+\}, \[%rd\d+\+64\]"), ptx)


def test_atomic_load_uses_syncscope_in_llvm_ir():
    k = _copy_kernel(Sem.ACQUIRE, Sem.RELEASE, Scope.GPU, T.u32, "global")
    text = emit_llvm_ir(k)
    assert 'load atomic i32, ptr addrspace(1) %"p" syncscope("device") acquire, align 4' in text
    assert 'syncscope("device") release, align 4' in text


@pytest.mark.parametrize("sem,scope,msg", [
    (Sem.RELEASE, Scope.GPU, "not a load semantics"),
    (Sem.ACQUIRE, None, "needs a scope"),
])
def test_bad_load_semantics_raise(sem, scope, msg):
    def body(kb, r):
        r.load(kb.param("g", T.ptr_global), T.u32, sem=sem, scope=scope)
    with pytest.raises(LoweringError, match=msg):
        emit_ptx(build(body))


def test_acquire_store_raises():
    def body(kb, r):
        r.store(kb.param("g", T.ptr_global), 1, sem=Sem.ACQUIRE, scope=Scope.GPU)
    with pytest.raises(LoweringError, match="not a store semantics"):
        emit_ptx(build(body))


def test_ordered_vector_access_raises():
    def body(kb, r):
        r.load(kb.param("g", T.ptr_global), T.vec(T.u32, 4), sem=Sem.ACQUIRE, scope=Scope.GPU)
    with pytest.raises(LoweringError, match="vector accesses are weak only"):
        emit_ptx(build(body))


# ---------------------------------------------------------------------------------------------
# Fences and barriers


@pytest.mark.parametrize("arch,sem,expected", [
    ("sm_90", Sem.ACQUIRE, "fence.acquire"), ("sm_90", Sem.RELEASE, "fence.release"),
    ("sm_90", Sem.ACQ_REL, "fence.acq_rel"), ("sm_90", Sem.SC, "fence.sc"),
    ("sm_80", Sem.ACQUIRE, "fence.acq_rel"), ("sm_80", Sem.RELEASE, "fence.acq_rel"),
    ("sm_80", Sem.SC, "fence.sc"), ("sm_100", Sem.RELEASE, "fence.release"),
])
@pytest.mark.parametrize("scope", [Scope.CTA, Scope.GPU, Scope.SYS])
def test_fence_line(arch, sem, expected, scope):
    ptx = emit_ptx(build(lambda kb, r: r.fence(sem, scope)), arch)
    assert re.search(rf"(?m)^\t{re.escape(expected)}\.{scope.value};$", ptx)


def test_cluster_fence_on_sm90():
    ptx = emit_ptx(build(lambda kb, r: r.fence(Sem.RELEASE, Scope.CLUSTER)))
    assert "\tfence.release.cluster;" in ptx


def test_named_barriers():
    def body(kb, r):
        r.syncthreads()
        r.bar_sync(r.named_barrier("pair", 1, 128))
        r.bar_sync(r.named_barrier("whole", 2, None))
        r.bar_arrive(r.named_barrier("producer", 3, 64))
        r.bar_arrive(r.named_barrier("all", 4, None))
        r.warp_sync()
        r.warp_sync(0x0000FFFF)
    ptx = emit_ptx(build(body, block_threads=256))
    for line in ("bar.sync \t0;", "bar.sync \t1, 128;", "bar.sync \t2;", "bar.arrive \t3, 64;",
                 "bar.arrive \t4, 256;", "bar.warp.sync \t-1;", "bar.warp.sync \t65535;"):
        assert f"\t{line}\n" in ptx, line


# ---------------------------------------------------------------------------------------------
# Special registers and warp operations


@pytest.mark.parametrize("sreg", list(SReg), ids=lambda s: s.value)
def test_special_register(sreg):
    def body(kb, r):
        r.store(kb.param("out", T.ptr_global), r.sreg(sreg))
    ptx = emit_ptx(build(body))
    if sreg.bits == 64:
        assert re.search(instr_re("mov.u64", rf"{REG64}, %{sreg.value}"), ptx)
    else:
        assert re.search(instr_re("mov.u32", rf"{REG32}, %{sreg.value}"), ptx)


def test_volatile_special_registers_are_read_each_time():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        t0 = r.let("t0", r.sreg(SReg.GLOBALTIMER))
        r.store(out, r.sreg(SReg.GLOBALTIMER) - t0)
    assert emit_ptx(build(body)).count("%globaltimer;") == 2


@pytest.mark.parametrize("mode,clamp", [(ShflMode.IDX, 31), (ShflMode.UP, 0), (ShflMode.DOWN, 31),
                                        (ShflMode.BFLY, 31)])
def test_shuffle_32(mode, clamp):
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        v = r.load(out, T.u32)
        r.store(out, r.shfl(mode, v, kb.param("lane", T.u32)))
    ptx = emit_ptx(build(body))
    assert re.search(instr_re(f"shfl.sync.{mode.value}.b32",
                              rf"{REG32}, {REG32}, {REG32}, {clamp}, -1"), ptx)


def test_shuffle_of_f32_keeps_its_bits():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        v = r.load(out, T.f32)
        r.store(out, v.max(r.shfl(ShflMode.BFLY, v, 4)))
    ptx = emit_ptx(build(body))
    assert re.search(instr_re("shfl.sync.bfly.b32", rf"{REG32}, {REG32}, 4, 31, -1"), ptx)
    assert re.search(r"\tmax\.f32 \t", ptx) and "cvt." not in ptx


def test_shuffle_width_and_64_bit_values():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        v = r.load(out, T.f64)
        dst = kb.new_var("sh", T.f64)
        r._emit(N.Shuffle(dst, ShflMode.DOWN, v, N.Const(1, T.u32), 0xFFFFFFFF, 8))
        r.store(out, dst)
    ptx = emit_ptx(build(body))
    # width 8: c = ((32 - 8) << 8) | 0x1f = 6175; a 64-bit value is two 32-bit shuffles
    assert len(re.findall(r"\tshfl\.sync\.down\.b32 \t%r\d+, %r\d+, 1, 6175, -1;", ptx)) == 2


def test_ballot_vote_redux_nanosleep():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        v = r.load(out, T.u32)
        s = r.load(out + 4, T.s32)
        p = v > 3
        r.store(out, r.ballot(p))
        for mode in VoteMode:
            r.store(out + 8, r.vote(mode, p).cast(T.u32))
        for op in ReduxOp:
            r.store(out + 12, r.redux(op, v))
        r.store(out + 16, r.redux(ReduxOp.MIN, s))
        r.store(out + 16, r.redux(ReduxOp.MAX, s))
        r.nanosleep(250)
    ptx = emit_ptx(build(body))
    assert re.search(instr_re("vote.sync.ballot.b32", rf"{REG32}, %p\d+, -1"), ptx)
    for mode in ("any", "all", "uni"):
        assert re.search(instr_re(f"vote.sync.{mode}.pred", r"%p\d+, %p\d+, -1"), ptx), mode
    for op in ("add.s32", "min.u32", "max.u32", "and.b32", "or.b32", "xor.b32", "min.s32",
               "max.s32"):
        assert re.search(instr_re(f"redux.sync.{op}", rf"{REG32}, {REG32}, {REG32}"), ptx), op
    assert "\tnanosleep.u32 \t250;\n" in ptx


# ---------------------------------------------------------------------------------------------
# Arithmetic, comparisons, conversions


def _unary_kernel(src_type, make):
    """out[0] = make(in) where ``in`` is loaded as ``src_type``."""
    def body(kb, r):
        src, out = kb.param("src", T.ptr_global), kb.param("out", T.ptr_global)
        x = r.load(src, src_type, name="x")
        y = r.load(src + 8, src_type, name="y")
        r.store(out, make(x, y))
    return build(body)


@pytest.mark.parametrize("dtype,make,expected", [
    (T.s32, lambda x, y: x / y, "div.s32"),
    (T.u32, lambda x, y: x / y, "div.u32"),
    (T.s32, lambda x, y: x % y, "rem.s32"),
    (T.u64, lambda x, y: x % y, "rem.u64"),
    (T.s32, lambda x, y: x >> y, "shr.s32"),
    (T.u32, lambda x, y: x >> y, "shr.u32"),
    (T.u32, lambda x, y: x << y, "shl.b32"),
    (T.s32, lambda x, y: x.min(y), "min.s32"),
    (T.u32, lambda x, y: x.max(y), "max.u32"),
    (T.s64, lambda x, y: x.max(y), "max.s64"),
    (T.u32, lambda x, y: x ^ y, "xor.b32"),
    (T.f32, lambda x, y: x * y, "mul.rn.f32"),
    (T.f64, lambda x, y: x + y, "add.rn.f64"),
    (T.f32, lambda x, y: x.min(y), "min.f32"),
    (T.f32, lambda x, y: x.max(y), "max.f32"),
    (T.f32, lambda x, y: x / y, "div.rn.f32"),        # IEEE, not div.approx / div.full
    (T.u32, lambda x, y: N.UnOp(N.UnOpKind.POPC, x), "popc.b32"),
    (T.u64, lambda x, y: N.UnOp(N.UnOpKind.POPC, x), "popc.b64"),
    (T.s32, lambda x, y: N.UnOp(N.UnOpKind.ABS, x), "abs.s32"),
    (T.f32, lambda x, y: N.UnOp(N.UnOpKind.ABS, x), "abs.f32"),
    (T.f32, lambda x, y: -x, "neg.f32"),
    (T.u32, lambda x, y: ~x, "not.b32"),
    (T.u32, lambda x, y: N.Select(x.eq(5), y, N.Const(9, T.u32)), "selp.b32"),
])
def test_arithmetic(dtype, make, expected):
    ptx = emit_ptx(_unary_kernel(dtype, make))
    assert re.search(rf"\t{re.escape(expected)} \t", ptx), ptx


@pytest.mark.parametrize("dtype,expected", [(T.s32, "setp.lt.s32"), (T.u32, "setp.lt.u32"),
                                            (T.f32, "setp.lt.f32"), (T.u64, "setp.lt.u64")])
def test_compare_signedness(dtype, expected):
    k = _unary_kernel(dtype, lambda x, y: N.Select(x < y, N.Const(7, T.u32), N.Const(9, T.u32)))
    assert f"\t{expected} \t" in emit_ptx(k)


@pytest.mark.parametrize("src,dst,expected", [
    (T.s32, T.s64, "cvt.s64.s32"),
    (T.u32, T.u64, "cvt.u64.u32"),
    (T.s32, T.u64, "cvt.s64.s32"),           # widening follows the source's signedness
    (T.u64, T.u32, "cvt.u32.u64"),
    (T.s32, T.f32, "cvt.rn.f32.s32"),
    (T.u32, T.f64, "cvt.rn.f64.u32"),
    (T.f32, T.s32, "cvt.rzi.s32.f32"),
    (T.f64, T.u32, "cvt.rzi.u32.f64"),
    (T.f32, T.f64, "cvt.f64.f32"),
    (T.f64, T.f32, "cvt.rn.f32.f64"),
    (T.f16, T.f32, "cvt.f32.f16"),
])
def test_casts(src, dst, expected):
    # cast a quotient: a loaded value's conversion would be folded into the load
    assert f"\t{expected} \t" in emit_ptx(_unary_kernel(src, lambda x, y: (x / y).cast(dst)))


def test_bf16_conversions():
    to_bf16 = emit_ptx(_unary_kernel(T.f32, lambda x, y: x.cast(T.bf16)))
    assert re.search(asm_re("cvt.rn.bf16.f32", r"%rs\d+, %r\d+"), to_bf16)
    to_f32 = emit_ptx(_unary_kernel(T.bf16, lambda x, y: x.cast(T.f32)))
    assert "\tld.global.b16 \t" in to_f32
    assert re.search(r"\tshl\.b32 \t%r\d+, %r\d+, 16;", to_f32)
    with pytest.raises(LoweringError, match="no conversion from f64 to bf16"):
        emit_ptx(_unary_kernel(T.f64, lambda x, y: x.cast(T.bf16)))


def test_constants_are_masked_and_bf16_rounded():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        r.store(out, N.Const(-1, T.u32))
        r.store(out + 4, N.Const(-2, T.s16))
        r.store(out + 8, N.Const(1.0, T.bf16))
        r.store(out + 10, N.Const(1.00390625, T.bf16))   # halfway: rounds to even (1.0)
        r.store(out + 12, N.Const(0.5, T.f16))
    text = emit_llvm_ir(build(body))
    assert "store i32 4294967295" in text
    assert "store i16 65534" in text
    assert text.count("store i16 16256") == 2      # 0x3F80
    ptx = emit_ptx(build(body))
    assert "\tst.global.b32 \t[%rd1], -1;" in ptx


def test_pointer_casts_and_bitcasts():
    def body(kb, r):
        g = kb.param("g", T.ptr_global)
        sh = kb.shared_buffer("buf", 64)
        r.store(g, sh.cast(T.ptr_generic).cast(T.u64))
        f = r.load(g + 8, T.f32)
        r.store(g + 12, N.Bitcast(T.u32, f) | 1)
        v = r.load(g + 16, T.vec(T.u32, 2))
        r.store(g + 24, N.Bitcast(T.u64, v) + N.Extract(v, 1).cast(T.u64))
        r.store(g + 32, N.Pack(T.vec(T.u32, 2), (N.Extract(v, 1), N.Extract(v, 0))))
    ptx = emit_ptx(build(body))
    assert re.search(r"\tcvta\.shared\.u64 \t%rd\d+, %rd\d+;", ptx)
    assert "\tor.b32 \t" in ptx
    assert "\tst.global.v2.b32 \t" in ptx


@pytest.mark.parametrize("make,msg", [
    (lambda x, y: x + N.Const(1, T.u64), "operand types differ"),
    (lambda x, y: x.cast(T.bf16), "no conversion from u32 to bf16"),
    (lambda x, y: N.Bitcast(T.u64, x), "widths differ"),
])
def test_expression_errors(make, msg):
    with pytest.raises(LoweringError, match=msg):
        emit_ptx(_unary_kernel(T.u32, make))


def test_unknown_nodes_raise():
    class Mystery:
        pass

    k = build(lambda kb, r: r._emit(Mystery()))
    with pytest.raises(LoweringError, match="kernel k, role main: no lowering for Mystery"):
        emit_ptx(k)


def test_variable_used_with_two_types_raises():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        r.assign(N.Var("x", T.u32), 1)
        r.store(out, N.Var("x", T.u64))
    with pytest.raises(LoweringError, match="variable 'x' used as u32 and as u64"):
        emit_ptx(build(body))


# ---------------------------------------------------------------------------------------------
# Control flow


def test_control_flow_compiles():
    def body(kb, r):
        out, n, m = kb.param("out", T.ptr_global), kb.param("n", T.u32), kb.param("m", T.s32)
        acc = r.var("acc", T.u32, 0)
        with r.for_range("i", 0, n) as i:
            with r.if_(i.eq(7)):
                r.break_()
            with r.else_():
                r.assign(acc, acc + i)
        j = r.var("j", T.s32, m)
        with r.while_(j > 0):
            r.assign(j, j - 3)
            with r.if_(j.eq(4)):
                r.return_()
        with r.if_(acc > 100):
            r.trap()
        r.comment("done")
        r.store(out, acc + j.cast(T.u32))
    ptx = emit_ptx(build(body))
    assert "\ttrap;" in ptx
    assert ptx.count("\tret;") >= 1
    assert re.search(r"\tsetp\.[a-z]+\.(s|u)32 ", ptx)


def test_break_outside_loop_raises():
    with pytest.raises(LoweringError, match="break outside a loop"):
        emit_ptx(build(lambda kb, r: r.break_()))


def test_roles_are_guarded_by_block_and_thread_ranges():
    kb = KernelBuilder("roles", block_threads=256)
    out = kb.param("out", T.ptr_global)
    n_sig = kb.param("n_sig", T.u32)
    with kb.role("signal", blocks=(0, n_sig), threads=(0, 64)) as r:
        r.store(out, 1)
    with kb.role("comm", blocks=(2, None), threads=(64, 128)) as r:
        r.store(out + 4, 2)
    with kb.role("everyone") as r:
        r.store(out + 8, 3)
    text = emit_llvm_ir(kb.build())
    signal = text[text.index("body:"):text.index("role.signal:")]
    assert 'icmp ult i32 %"ctaid.x", %"n_sig"' in signal
    assert 'icmp ult i32 %"tid.x", 64' in signal
    assert "icmp uge" not in signal                       # start 0 and base 0 need no test
    comm = text[text.index("role.signal.end:"):text.index("role.comm:")]
    assert 'icmp uge i32 %"ctaid.x.1", 2' in comm
    assert 'icmp uge i32 %"tid.x.1", 64' in comm
    assert 'icmp ult i32 %"tid.x.2", 192' in comm
    assert "icmp ult i32 %\"ctaid" not in comm           # stop None: no upper bound
    everyone = text[text.index("role.comm.end:"):text.index("role.everyone:")]
    assert "icmp" not in everyone
    assert text.rstrip().count("ret void") == 1
    assert emit_ptx(kb.build()).count("%ctaid.x;") >= 1


def test_extern_call():
    def body(kb, r):
        out = kb.param("out", T.ptr_global)
        pe = r.call("nvshmem_my_pe", (), ret=T.s32)
        r.call("nvshmem_quiet", ())
        r.store(out, pe + r.call("nvshmem_my_pe", (), ret=T.s32))
        r.call("nvshmem_quiet", (1,))
    with pytest.raises(LoweringError, match=r"call nvshmem_quiet: signature void \(i32\) differs"):
        emit_ptx(build(body))

    def body_ok(kb, r):
        out = kb.param("out", T.ptr_global)
        pe = r.call("nvshmem_my_pe", (), ret=T.s32)
        r.call("nvshmem_quiet", ())
        r.store(out, pe + r.call("nvshmem_my_pe", (), ret=T.s32))
    ptx = emit_ptx(build(body_ok))
    assert ".extern .func  (.param .b32 func_retval0) nvshmem_my_pe" in ptx
    assert ptx.count("\tcall.uni (retval0), nvshmem_my_pe, ();") == 2
    assert "\tcall.uni nvshmem_quiet, ();" in ptx


# ---------------------------------------------------------------------------------------------
# Spin-wait


def _spin_kernel(timeout=True, backoff=200, dtype=T.u32, sem=Sem.ACQUIRE, scope=Scope.SYS, **kw):
    kb = KernelBuilder("waiter", block_threads=128)
    flags = kb.param("flags", T.ptr_global)
    out = kb.param("out", T.ptr_global)
    if timeout:
        kb.diagnostics(rank=3)
    else:
        kb.diagnostics(timeout_ns=N.Const(0, T.u64), rank=3)
    with kb.role("recv") as r:
        seen = r.spin_wait(flags + 8, dtype, CmpOp.EQ, 1, buffer="flags", index=1, sem=sem,
                           scope=scope, backoff_ns=backoff, **kw)
        r.store(out, seen)
    return kb.build()


def test_spin_wait_emits_poll_timer_abort_check_and_record():
    k = _spin_kernel()
    ptx = emit_ptx(k)
    assert re.search(instr_re("ld.acquire.sys.global.b32", rf"{REG32}, \[%rd\d+\+8\]"), ptx)
    assert ptx.count("%globaltimer;") >= 2
    assert re.search(instr_re("ld.relaxed.sys.global.b32", rf"{REG32}, {ADDR}"), ptx)  # abort word
    assert re.search(instr_re("st.relaxed.sys.global.b32", r"\[%rd\d+\], 1"), ptx)     # raise it
    assert re.search(asm_re("atom.relaxed.gpu.global.add.u32", rf"{REG32}, \[%rd\d+\], {REG32}"),
                     ptx)
    assert "\tnanosleep.u32 \t200;" in ptx

    # one store per record word, at the offsets of ir.diag
    base = 4 * diag.HEADER_WORDS
    offsets = {int(m) for m in re.findall(r"\tst\.global\.b32 \t\[%rd\d+\+(\d+)\]", ptx)}
    assert offsets == {base + 4 * w for w in range(diag.RECORD_WORDS)}
    magic = diag.RECORD_MAGIC - (1 << 32)
    assert f"+{base}], {magic};" in ptx
    tag = diag.kernel_tag("waiter")
    assert f"+{base + 4}], {tag if tag < 1 << 31 else tag - (1 << 32)};" in ptx
    assert f"+{base + 4 * diag.FIELDS['rank']}], 3;" in ptx
    assert f"+{base + 4 * diag.FIELDS['index']}], 1;" in ptx
    assert f"+{base + 4 * diag.FIELDS['expected']}], 1;" in ptx
    assert "%smid;" in ptx


def test_spin_wait_without_deadline_has_no_timer_and_no_record():
    ptx = emit_ptx(_spin_kernel(timeout=False, backoff=0))
    assert "%globaltimer" not in ptx
    assert "atom." not in ptx
    assert "nanosleep" not in ptx
    assert "ld.relaxed.sys.global.b32" in ptx                              # still aborts
    assert "ld.acquire.sys.global.b32" in ptx


def test_spin_wait_shift_mask_and_64_bit_poll():
    ptx = emit_ptx(_spin_kernel(dtype=T.u64, sem=Sem.RELAXED, scope=Scope.GPU, shift=32,
                                mask=0xFF))
    assert re.search(instr_re("ld.relaxed.gpu.global.b64", rf"{REG64}, \[%rd\d+\+8\]"), ptx)


def test_spin_wait_on_float_raises():
    with pytest.raises(LoweringError, match="polls an integer word"):
        emit_ptx(_spin_kernel(dtype=T.f32))


# ---------------------------------------------------------------------------------------------
# Kernel shape, determinism, targets


def _shaped_kernel():
    kb = KernelBuilder("shaped", block_threads=384, min_blocks_per_sm=2)
    g = kb.param("g", T.ptr_global)
    kb.param("s", T.ptr_shared)
    kb.param("gen", T.ptr_generic)
    kb.param("n", T.u64)
    buf = kb.shared_buffer("stage", 1024, align=128)
    dyn = kb.dynamic_shared_memory()
    with kb.role("main") as r:
        r.store(buf + r.tid.cast(T.u64) * 4, r.tid)
        r.store(dyn, r.tid)
        r.syncthreads()
        r.store(g, r.load(buf + 4, T.u32))
    return kb.build()


def test_llvm_ir_shape():
    text = emit_llvm_ir(_shaped_kernel())
    assert 'target triple = "nvptx64-nvidia-cuda"' in text
    assert f'target datalayout = "{Target().data_layout}"' in text
    assert ('define ptx_kernel void @"shaped"(ptr addrspace(1) %"g", ptr addrspace(3) %"s", '
            'ptr %"gen", i64 %"n")') in text
    assert '!"maxntidx", i32 384' in text
    assert '!"minctasm", i32 2' in text
    assert '@"shaped_stage" = internal addrspace(3) global [1024 x i8] undef, align 128' \
        in text
    assert '@"dyn_smem" = external addrspace(3) global [0 x i8], align 16' in text


def test_ptx_shape_and_normalisation():
    ptx = emit_ptx(_shaped_kernel())
    assert ptx.startswith(".version 8.6\n.target sm_90\n.address_size 64\n")
    assert "Generated by" not in ptx and "\r" not in ptx
    assert ptx.endswith("}\n") and not ptx.endswith("\n\n")
    assert ".maxntid 384" in ptx and ".minnctapersm 2" in ptx
    assert ".shared .align 128 .b8 shaped_stage[1024];" in ptx
    assert ".extern .shared .align 16 .b8 dyn_smem[];" in ptx
    assert ".param .u64 .ptr .global .align 1 shaped_param_0" in ptx
    assert ".param .u64 .ptr .shared .align 1 shaped_param_1" in ptx


def test_determinism():
    a = emit_ptx(_spin_kernel())
    b = emit_ptx(_spin_kernel())
    assert a == b
    assert emit_llvm_ir(_spin_kernel()) == emit_llvm_ir(_spin_kernel())


def test_module_with_two_kernels():
    m = N.Module("pair", (_spin_kernel(), _shaped_kernel()))
    ptx = emit_ptx(m)
    assert ".visible .entry waiter(" in ptx and ".visible .entry shaped(" in ptx


@pytest.mark.parametrize("arch", ARCHES)
def test_arch_selection(arch):
    ptx = emit_ptx(_spin_kernel(), arch)
    assert f"\n.target {arch}\n" in ptx
    assert ptx.startswith(".version 8.6\n")


@pytest.mark.parametrize("ptx", PTX_VERSIONS)
def test_ptx_version_selection(ptx):
    text = emit_ptx(_spin_kernel(), Target("sm_90", ptx=ptx))
    assert text.startswith(f".version {ptx // 10}.{ptx % 10}\n")


@pytest.mark.parametrize("arch", ["sm_70", "sm_90a", "compute_90", ""])
def test_bad_arch_raises(arch):
    with pytest.raises(ValueError, match="arch="):
        emit_ptx(_spin_kernel(), arch)


def test_bad_ptx_version_raises():
    with pytest.raises(ValueError, match="ptx=91"):
        Target("sm_90", ptx=91)


def test_load_with_l2_prefetch_hint_emits_exact_line():
    import ir as _ir
    from ir import types as _T
    from backends.nvptx import emit_ptx as _emit
    kb = _ir.KernelBuilder("l2hint", 128)
    a, b = kb.param("a", _T.ptr_global), kb.param("b", _T.ptr_global)
    with kb.role("r") as r:
        v = r.load(a, _T.vec(_T.u32, 4), cache=_ir.CacheHint.NC_L2_256)
        w = r.load(a + 64, _T.u64, cache=_ir.CacheHint.NC_L2_256)
        r.store(b, v)
        r.store(b + 64, w)
    k = kb.build()
    _ir.verify(k)
    assert _ir.parse_kernel(_ir.print_kernel(k)) == k
    lines = [ln.strip() for ln in _emit(k).splitlines()]
    assert any(ln.startswith("ld.global.nc.L2::256B.v4.b32 {") for ln in lines)
    assert any(ln.startswith("ld.global.nc.L2::256B.b64 ") for ln in lines)


def test_fma_line():
    """``Fma(a, b, c)`` is one ``fma.rn.f32`` (``.f64`` for f64) with the operands in order."""
    ptx = emit_ptx(_unary_kernel(T.f32, lambda x, y: N.Fma(x, y, N.Const(0.5, T.f32))))
    m = re.search(r"(?m)^\tld\.global\.b32 \t(%r\d+), \[%rd\d+\];$", ptx)
    line = re.search(r"(?m)^\tfma\.rn\.f32 \t%r\d+, (%r\d+), (%r\d+), 0f3F000000;$", ptx)
    assert m and line and line.group(1) == m.group(1), ptx
    ptx64 = emit_ptx(_unary_kernel(T.f64, lambda x, y: N.Fma(x, y, x)))
    assert re.search(r"(?m)^\tfma\.rn\.f64 \t%rd\d+, %rd\d+, %rd\d+, %rd\d+;$", ptx64), ptx64


def test_cvt_e4m3_to_f32_lines():
    """``CvtE4M3ToF32(code)`` is one inline block: ``cvt.rn.f16x2.e4m3x2`` of the u16 into a
    scoped register, its low half by ``mov.b32 {lo, hi}``, then ``cvt.f32.f16`` into the f32
    result; sm_80 has no such instruction."""
    k = _unary_kernel(T.u16, lambda x, y: N.CvtE4M3ToF32(x))
    ptx = emit_ptx(k)
    ld = re.search(r"(?m)^\tld\.global\.b16 \t(%rs\d+), \[%rd\d+\];$", ptx)
    blk = re.search(r"\{ \.reg \.b32 f16x2; \.reg \.b16 lo, hi; cvt\.rn\.f16x2\.e4m3x2 f16x2, "
                    r"(%rs\d+); mov\.b32 \{lo, hi\}, f16x2; cvt\.f32\.f16 (%r\d+), lo; \}", ptx)
    assert ld and blk and blk.group(1) == ld.group(1), ptx
    assert re.search(rf"(?m)^\tst\.global\.b32 \t\[%rd\d+\], {re.escape(blk.group(2))};$", ptx)
    with pytest.raises(LoweringError, match="e4m3x2 needs sm_89 or newer, not sm_80"):
        emit_ptx(k, arch="sm_80")


def test_cvt_e4m3x2_line():
    """``CvtE4M3x2(a, b)`` is one inline ``cvt.rn.satfinite.e4m3x2.f32`` with ``a`` the first
    source operand (the upper byte) and ``b`` the second (the lower byte), its b16 result
    stored as a u16; sm_80 has no such instruction."""
    k = _unary_kernel(T.f32, lambda x, y: N.CvtE4M3x2(x / y, y))
    ptx = emit_ptx(k)
    div = re.search(r"(?m)^\tdiv\.rn\.f32 \t(%r\d+), (%r\d+), (%r\d+);$", ptx)
    assert div, ptx
    q, y = div.group(1), div.group(3)
    line = re.search(asm_re("cvt.rn.satfinite.e4m3x2.f32", r"(%rs\d+), (%r\d+), (%r\d+)"), ptx)
    assert line and (line.group(2), line.group(3)) == (q, y), ptx
    assert re.search(rf"(?m)^\tst\.global\.b16 \t\[%rd\d+\], {re.escape(line.group(1))};$", ptx)
    with pytest.raises(LoweringError, match="e4m3x2.f32 needs sm_89 or newer, not sm_80"):
        emit_ptx(k, arch="sm_80")
