"""The exact PTX line of every atomic: op x type x sem x scope, atom and red forms, global and
shared space, and CAS. Expected spellings are written out here, independently of atomics.py."""

from __future__ import annotations

import itertools
import re

import pytest

from backends.nvptx import LoweringError, emit_ptx
from backends.nvptx.target import NATIVE_SCOPED_ATOMICRMW, Target
from ir import AtomOp, KernelBuilder, Scope, Sem
from ir import types as T

# (op, IR type) -> PTX type
RMW_PTX_TYPE = {
    **{("add", t): t for t in ("u32", "s32", "u64", "f32", "f64")},
    ("add", "s64"): "u64",
    **{(op, t): t for op in ("min", "max") for t in ("u32", "s32", "u64", "s64")},
    **{(op, t): f"b{t[1:]}" for op in ("exch", "and", "or", "xor")
       for t in ("u32", "s32", "b32", "u64", "s64", "b64")},
    ("inc", "u32"): "u32",
    ("dec", "u32"): "u32",
}
CAS_PTX_TYPE = {t: f"b{t[1:]}" for t in ("u32", "s32", "b32", "u64", "s64", "b64")}
SEMS = ("relaxed", "acquire", "release", "acq_rel")
SCOPES = ("cta", "cluster", "gpu", "sys")
SPACES = ("global", "shared")

RMW_CASES = [(op, t, sem, scope, space, form)
             for (op, t), space, form in itertools.product(RMW_PTX_TYPE, SPACES, ("atom", "red"))
             for sem, scope in itertools.product(SEMS, SCOPES)]
CAS_CASES = [(t, sem, scope, space) for t, space in itertools.product(CAS_PTX_TYPE, SPACES)
             for sem, scope in itertools.product(SEMS, SCOPES)]


def _addr(kb, space):
    return kb.param("g", T.ptr_global) if space == "global" else kb.shared_buffer("buf", 64)


def _inline_asm_lines(ptx: str) -> list[str]:
    """The single instruction of every inline-asm block, in program order."""
    return re.findall(r"// begin inline asm\n(.*)\n\s*// end inline asm", ptx)


@pytest.fixture(scope="module")
def rmw_lines():
    """One kernel per space holding every RMW case in order; its inline-asm lines by case."""
    lines = {}
    for space in SPACES:
        kb = KernelBuilder(f"rmw_{space}", block_threads=32)
        addr = _addr(kb, space)
        cases = [c for c in RMW_CASES if c[4] == space]
        with kb.role("all") as r:
            for op, t, sem, scope, _, form in cases:
                dtype = T.SCALARS[t]
                one = 1.0 if dtype.is_float else 1
                args = (AtomOp(op), addr, one, Sem(sem), Scope(scope), dtype)
                r.atomic(*args) if form == "atom" else r.red(*args)
        found = _inline_asm_lines(emit_ptx(kb.build()))
        assert len(found) == len(cases)
        lines.update(zip(cases, found))
    return lines


@pytest.fixture(scope="module")
def cas_lines():
    lines = {}
    for space in SPACES:
        kb = KernelBuilder(f"cas_{space}", block_threads=32)
        addr = _addr(kb, space)
        cases = [c for c in CAS_CASES if c[3] == space]
        with kb.role("all") as r:
            for t, sem, scope, _ in cases:
                r.cas(addr, 0, 1, Sem(sem), Scope(scope), T.SCALARS[t])
        found = _inline_asm_lines(emit_ptx(kb.build()))
        assert len(found) == len(cases)
        lines.update(zip(cases, found))
    return lines


def _reg(ptx_type: str) -> str:
    return r"%rd\d+" if ptx_type.endswith("64") else r"%r\d+"


@pytest.mark.parametrize("case", RMW_CASES, ids=lambda c: "-".join(c))
def test_rmw_line(rmw_lines, case):
    op, t, sem, scope, space, form = case
    ty = RMW_PTX_TYPE[(op, t)]
    # red exists only as relaxed/release and has no exch: otherwise atom with an unused result
    red = form == "red" and sem in ("relaxed", "release") and op != "exch"
    instr = f"{'red' if red else 'atom'}.{sem}.{scope}.{space}.{op}.{ty}"
    reg = _reg(ty)
    operands = rf"\[%rd\d+\], {reg};" if red else rf"{reg}, \[%rd\d+\], {reg};"
    line = rmw_lines[case]
    assert re.fullmatch(rf"\t{re.escape(instr)} {operands}", line), (instr, line)


@pytest.mark.parametrize("case", CAS_CASES, ids=lambda c: "-".join(c))
def test_cas_line(cas_lines, case):
    t, sem, scope, space = case
    ty = CAS_PTX_TYPE[t]
    instr = f"atom.{sem}.{scope}.{space}.cas.{ty}"
    reg = _reg(ty)
    line = cas_lines[case]
    assert re.fullmatch(rf"\t{re.escape(instr)} {reg}, \[%rd\d+\], {reg}, {reg};", line), \
        (instr, line)


def test_generic_space_has_no_space_qualifier():
    kb = KernelBuilder("generic", block_threads=32)
    p = kb.param("p", T.ptr_generic)
    with kb.role("all") as r:
        r.red(AtomOp.OR, p, 4, Sem.RELEASE, Scope.SYS)
    assert re.search(r"\tred\.release\.sys\.or\.b32 \[%rd\d+\], %r\d+;", emit_ptx(kb.build()))


@pytest.mark.parametrize("sem", [Sem.SC, Sem.WEAK, Sem.VOLATILE])
def test_rejects_non_atomic_semantics(sem):
    kb = KernelBuilder("bad_sem", block_threads=32)
    g = kb.param("g", T.ptr_global)
    with kb.role("all") as r:
        r.atomic(AtomOp.ADD, g, 1, sem=sem)
    with pytest.raises(LoweringError, match=f"sem '{sem.value}'"):
        emit_ptx(kb.build())


@pytest.mark.parametrize("op,dtype", [(AtomOp.INC, T.u64), (AtomOp.MIN, T.f32),
                                      (AtomOp.ADD, T.u16), (AtomOp.AND, T.f64)])
def test_rejects_types_without_ptx_form(op, dtype):
    kb = KernelBuilder("bad_type", block_threads=32)
    g = kb.param("g", T.ptr_global)
    with kb.role("all") as r:
        r.atomic(op, g, 1, dtype=dtype)
    with pytest.raises(LoweringError, match=f"no PTX form for type {dtype}"):
        emit_ptx(kb.build())


def test_cluster_scope_needs_sm90():
    kb = KernelBuilder("cluster", block_threads=32)
    g = kb.param("g", T.ptr_global)
    with kb.role("all") as r:
        r.red(AtomOp.ADD, g, 1, scope=Scope.CLUSTER)
    with pytest.raises(LoweringError, match="cluster needs sm_90"):
        emit_ptx(kb.build(), "sm_80")


def test_native_atomicrmw_capability_matches_llvm():
    """The reason atomics go through inline PTX: LLVM < 23 drops an atomicrmw's ordering and
    scope. When an LLVM upgrade honours them, NATIVE_SCOPED_ATOMICRMW must flip with it."""
    import llvmlite.binding as llvm

    target = Target("sm_90")
    src = f"""
    target triple = "nvptx64-nvidia-cuda"
    target datalayout = "{target.data_layout}"
    define ptx_kernel void @k(ptr addrspace(1) %p) {{
      %old = atomicrmw add ptr addrspace(1) %p, i32 1 syncscope("device") release
      store i32 %old, ptr addrspace(1) %p
      ret void
    }}"""
    ptx = target.machine.emit_assembly(llvm.parse_assembly(src))
    assert ("atom.release.gpu" in ptx) == NATIVE_SCOPED_ATOMICRMW, ptx
