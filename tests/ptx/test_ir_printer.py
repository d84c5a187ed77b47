"""The text form: deterministic, readable, and read back exactly by the parser."""

from __future__ import annotations

import math
import re
import typing

import attrs
import pytest

from ir import nodes as N
from ir import types as T
from ir.builder import KernelBuilder
from ir.enums import (AtomOp, BinOpKind, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, SReg,
                      UnOpKind, VoteMode)
from ir.parser import ParseError, parse_kernel, parse_module
from ir.printer import print_expr, print_kernel, print_module, print_node, print_stmt

C = N.Const


def kitchen_sink() -> N.Kernel:
    """A kernel using every node type, every enum value and every optional field."""
    p = N.Param("p", T.ptr_global)
    peer = N.Param("recv", T.ptr_global, peer=True)
    n = N.Param("n", T.u32)
    f = N.Param("scale", T.f32)
    err, tmo = N.Param("err_buf", T.ptr_global), N.Param("timeout_ns", T.u64)
    i, j = N.Var("i", T.u32), N.Var("j", T.u64)
    x64 = N.Var("x", T.u64)
    x32 = N.Var("x", T.u32)  # the same name with another type
    vec = N.Var("v", T.vec(T.u32, 4))
    q = N.Var("q", T.ptr_global, peer=True)
    pr = N.Var("ok", T.pred)
    weird = N.Var("a b", T.s32)  # not an identifier: printed quoted
    tile, dyn = N.SharedAddr("tile"), N.SharedAddr("dyn_smem")
    off = N.Cast(T.u64, i)

    exprs = [C(-5, T.s32), C(1.5, T.f32), C(-0.0, T.f64), C(math.inf, T.f32),
             C(-math.inf, T.f64), C(1e20, T.f64), C(2.5e-07, T.f32), C(1, T.f32),
             C(0xFFFFFFFFFFFFFFFF, T.u64), C(1, T.pred), C(3, T.bf16)]
    exprs += [N.SRegRead(r) for r in SReg]
    exprs += [N.BinOp(op, i, C(3, T.u32)) for op in BinOpKind]
    exprs += [N.UnOp(op, N.Cast(T.s32, i)) for op in UnOpKind]
    exprs += [N.Cmp(op, i, n) for op in CmpOp]
    exprs += [N.Select(pr, i, n), N.Bitcast(T.f32, i), N.Cast(T.f32, f),
              N.Extract(vec, 3), N.Pack(T.vec(T.u32, 2), (i, n)),
              N.CvtE4M3x2(f, C(-0.5, T.f32)), N.CvtE4M3ToF32(N.Cast(T.u16, i)),
              N.Fma(f, C(-0.5, T.f32), f),
              N.Cast(T.u64, tile), N.Cast(T.u64, dyn),
              N.Param("undeclared", T.s64, peer=True), N.Param("n", T.u64)]

    body = [N.Comment("every expression"), N.Assign(x64, C(0, T.u64))]
    body += [N.Assign(N.Var(f"e{k}", e.dtype), e) for k, e in enumerate(exprs)]
    body += [
        N.Assign(x32, C(7, T.u32)),
        N.Assign(weird, C(-1, T.s32)),
        N.Assign(q, N.PtrAdd(peer, off)),
        N.Load(vec, N.PtrAdd(p, j), cache=CacheHint.NC),
        N.Load(i, N.PtrAdd(p, C(4, T.u64)), Sem.VOLATILE),
        N.Load(i, q, Sem.ACQUIRE, Scope.SYS),
        N.Load(i, N.PtrAdd(tile, C(8, T.u64)), Sem.RELAXED, Scope.CTA),
        N.Load(x64, N.Cast(T.ptr_generic, j), Sem.ACQUIRE, Scope.CLUSTER),
        N.Store(p, vec),
        N.Store(q, i, Sem.RELEASE, Scope.SYS),
        N.Store(tile, i, Sem.VOLATILE),
        N.Store(p, i, Sem.RELAXED, Scope.GPU),
    ]
    for op in AtomOp:
        body.append(N.AtomicRMW(N.Var(f"old_{op.value}", T.u32), op, p, C(1, T.u32),
                                Sem.ACQ_REL, Scope.GPU))
    body += [
        N.AtomicRMW(None, AtomOp.ADD, q, C(1, T.u32), Sem.RELEASE, Scope.SYS),
        N.AtomicRMW(None, AtomOp.MAX, tile, C(2, T.u32), Sem.RELAXED, Scope.CTA),
        N.AtomicCAS(N.Var("old", T.u64), p, C(0, T.u64), C(1, T.u64), Sem.ACQUIRE, Scope.SYS),
        N.AtomicCAS(N.Var("old", T.u64), p, C(0, T.u64), C(1, T.u64)),
    ]
    body += [N.Fence(s, sc) for s in (Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL, Sem.SC)
             for sc in Scope]
    b_sync, b_all = N.NamedBarrier("sync", 1, 256), N.NamedBarrier("cta", 0, None)
    body += [
        N.BarSync(b_sync), N.BarArrive(b_sync), N.BarSync(b_all),
        N.BarSync(N.NamedBarrier("stranger", 7, 64)),  # undeclared: kept as written
        N.WarpSync(), N.WarpSync(0x0000FFFF),
    ]
    body += [N.Shuffle(N.Var("sh", T.u32), m, i, C(1, T.u32), 0xF0F0F0F0, 16) for m in ShflMode]
    body += [N.Ballot(N.Var("bal", T.u32), pr), N.Ballot(N.Var("bal", T.u32), pr, 0x1)]
    body += [N.Vote(N.Var("vt", T.pred), m, pr, 0xFF) for m in VoteMode]
    body += [N.Redux(N.Var("rx", T.u32), op, i) for op in ReduxOp]
    body += [
        N.Nanosleep(C(100, T.u32)),
        N.If(pr, (N.Trap(),)),
        N.If(N.Cmp(CmpOp.EQ, i, C(0, T.u32)), (N.Comment("then"),),
             (N.If(pr, (), (N.Return(),)),)),
        N.If(pr, ()),
        N.For(N.Var("k", T.u32), C(0, T.u32), n, C(2, T.u32), (
            N.While(N.Cmp(CmpOp.LT, j, C(8, T.u64)), (N.Assign(j, N.BinOp(BinOpKind.ADD, j,
                                                                           C(1, T.u64))),
                                                         N.Break())),
            N.Break(),
        )),
        N.While(pr, ()),
        N.Call(None, "nvshmem_quiet", (), ()),
        N.Call(N.Var("ret", T.s32), "nvshmem_my_pe", (), ()),
        N.Call(None, "nvshmemx_signal_op", (q, j, C(1, T.s32)), (T.u64, T.u64, T.s32)),
        N.Call(None, "weird.name", (i,), (T.b32,)),
        N.Comment(""), N.Comment(" leading space"), N.Comment("trailing space "),
        N.Comment("two\nlines"), N.Comment('quotes " and // and { braces }'),
        N.SpinWait(N.Var("seen", T.u32), q, T.u32, CmpOp.GE, C(5, T.u32),
                   N.DiagSite(0, "recv_count", j), tmo, err, C(2, T.u32), Sem.ACQUIRE,
                   Scope.SYS, 8, 0xFF, 200),
        N.SpinWait(None, N.PtrAdd(p, j), T.s64, CmpOp.NE, C(-1, T.s64),
                   N.DiagSite(1, "flag", C(0, T.u64)), C(0, T.u64), err, C(0, T.u32),
                   Sem.RELAXED, Scope.GPU),
    ]
    main = N.Role("main", tuple(body), N.BlockRange(), None, (b_sync, b_all))
    side = N.Role("side", (N.Comment("side"),), N.BlockRange(n, None), N.ThreadRange(32, 64),
                  (N.NamedBarrier("side bar", 2, 64),))
    tail = N.Role("tail", (), N.BlockRange(C(0, T.u32), N.BinOp(BinOpKind.ADD, n, C(1, T.u32))),
                  N.ThreadRange(0, 32))
    return N.Kernel(
        "sink", (p, peer, n, f, err, tmo), 256, (main, side, tail),
        (N.SharedBuffer("tile", 4096), N.SharedBuffer("odd", 12, 4)), True, 2,
        (N.SiteInfo(0, "main", "recv_count"), N.SiteInfo(1, "main", "flag")))


def _all_nodes(k: N.Kernel):
    seen = set()
    for r in k.roles:
        for e in (r.blocks.start, r.blocks.stop):
            seen.update(type(x) for x in N.walk_expr(e))
        for s in N.walk(r.body):
            seen.add(type(s))
            for f in attrs.fields(type(s)):
                v = getattr(s, f.name)
                for x in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(x, N.DiagSite):
                        x = x.index
                    seen.update(type(e) for e in N.walk_expr(x))
    return seen


def test_kitchen_sink_uses_every_node_type():
    expected = set(typing.get_args(N.Stmt)) | set(typing.get_args(N.Expr))
    assert expected - _all_nodes(kitchen_sink()) == set()


def test_round_trip_kernel():
    k = kitchen_sink()
    text = print_kernel(k)
    back = parse_kernel(text)
    for r0, r1 in zip(k.roles, back.roles):  # a readable failure: the first differing statement
        for s0, s1 in zip(r0.body, r1.body):
            assert s1 == s0, print_stmt(s0)
    assert back == k
    assert print_kernel(back) == text


def test_round_trip_module():
    k = kitchen_sink()
    small = KernelBuilder("small", block_threads=32)
    with small.role("r") as r:
        r.comment("hi")
    m = N.Module("both", (k, small.build()))
    text = print_module(m)
    assert parse_module(text) == m
    assert print_module(parse_module(text)) == text
    assert "\n\n  kernel small block_threads=32 {\n" in text


def test_printing_is_deterministic():
    assert print_kernel(kitchen_sink()) == print_kernel(kitchen_sink())


def test_nan_constant_round_trips_textually():
    k = _kernel_with([N.Assign(N.Var("x", T.f32), C(math.nan, T.f32))])
    text = print_kernel(k)
    assert "%x:f32 = nan:f32" in text
    assert print_kernel(parse_kernel(text)) == text
    assert math.isnan(parse_kernel(text).roles[0].body[0].value.value)


def _kernel_with(body, **kw) -> N.Kernel:
    params = (N.Param("dst", T.ptr_global), N.Param("recv", T.ptr_global, peer=True))
    return N.Kernel("k", params, 256, (N.Role("r", tuple(body)),), **kw)


def _lines(k):
    return [line.strip() for line in print_kernel(k).splitlines()]


# -- exact lines: the text reads like PTX ------------------------------------------------------


def test_memory_lines():
    dst, recv = N.Param("dst", T.ptr_global), N.Param("recv", T.ptr_global, peer=True)
    v = N.Var("v", T.u32)
    body = [N.Load(v, dst, Sem.ACQUIRE, Scope.GPU),
            N.Store(recv, v, Sem.RELEASE, Scope.SYS),
            N.Store(N.PtrAdd(dst, C(16, T.u64)), v),
            N.AtomicRMW(None, AtomOp.ADD, recv, C(1, T.u32), Sem.RELEASE, Scope.SYS),
            N.AtomicCAS(N.Var("old", T.u32), dst, v, C(0, T.u32)),
            N.Fence(Sem.ACQ_REL, Scope.SYS)]
    lines = _lines(_kernel_with(body))
    assert lines[:4] == ["kernel k block_threads=256 {", "param $dst:ptr.global",
                         "param $recv:ptr.global peer", "role r blocks=[0:u32, end) threads=all {"]
    assert lines[4:10] == [
        "%v:u32 = ld.acquire.gpu.global [$dst]",
        "st.release.sys.global [$recv], %v",
        "st.global [ptradd($dst, 16:u64)], %v",
        "red.release.sys.global.add [$recv], 1:u32",
        "%old:u32 = atom.relaxed.gpu.global.cas [$dst], %v, 0:u32",
        "fence.acq_rel.sys",
    ]


def test_kernel_header_and_declarations():
    k = N.Kernel("k", (), 128, (N.Role("w", (), N.BlockRange(C(1, T.u32), C(3, T.u32)),
                                       N.ThreadRange(32, 64), (N.NamedBarrier("b", 4, 64),)),),
                 (N.SharedBuffer("tile", 4096, 16),), True, 1, (N.SiteInfo(0, "w", "flags"),))
    assert _lines(k) == [
        "kernel k block_threads=128 min_blocks_per_sm=1 dynamic_shared=true {",
        "shared tile[4096] align=16",
        "site 0 role=w buffer=flags",
        "role w blocks=[1:u32, 3:u32) threads=[32, 96) {",
        "barrier b id=4 count=64",
        "}",
        "}",
    ]


def test_statement_lines():
    i, p = N.Var("i", T.u32), N.Var("ok", T.pred)
    cta = N.NamedBarrier("cta", 0, None)
    assert print_stmt(N.BarSync(cta)) == "bar.sync cta id=0 count=all"
    assert print_stmt(N.WarpSync()) == "bar.warp.sync 0xffffffff"
    assert (print_stmt(N.Shuffle(i, ShflMode.BFLY, i, C(16, T.u32)))
            == "%i:u32 = shfl.sync.bfly %i, 16:u32 mask=0xffffffff width=32")
    assert print_stmt(N.Vote(p, VoteMode.ALL, p)) == "%ok:pred = vote.sync.all %ok mask=0xffffffff"
    assert print_stmt(N.If(p, (N.Break(),), (N.Return(),))) == (
        "if %ok:pred {\n  break\n} else {\n  ret\n}")
    assert print_stmt(N.For(i, C(0, T.u32), C(4, T.u32), C(1, T.u32), ())) == (
        "for %i:u32 in [0:u32, 4:u32) step=1:u32 {\n}")
    assert print_stmt(N.Comment("note")) == "// note"


def test_expression_forms():
    i = N.Var("i", T.u32)
    assert print_expr(C(-3, T.s32)) == "-3:s32"
    assert print_expr(C(0.5, T.f32)) == "0.5:f32"
    assert print_expr(N.Cmp(CmpOp.LT, i, i)) == "lt(%i:u32, %i)"
    assert print_expr(N.Cast(T.u64, N.SRegRead(SReg.CTAID_X))) == "cvt.u64(@ctaid.x)"
    assert print_expr(N.Pack(T.vec(T.u16, 2), (C(1, T.u16), C(2, T.u16)))) == (
        "pack.v2.u16(1:u16, 2:u16)")
    assert print_expr(N.Extract(N.Var("v", T.vec(T.f32, 4)), 2)) == "extract(%v:v4.f32, 2)"
    assert print_expr(N.SharedAddr("tile")) == "&tile"
    assert print_expr(N.Param("n", T.u32)) == "$n"
    assert print_expr(N.CvtE4M3x2(N.Param("a", T.f32), C(1.5, T.f32))) == (
        "cvt.rn.satfinite.e4m3x2.f32($a, 1.5:f32)")


def test_spin_wait_line_shows_every_field():
    w = N.SpinWait(N.Var("seen", T.u32), N.Param("flag", T.ptr_global), T.u32, CmpOp.GE,
                   C(1, T.u32), N.DiagSite(3, "flags", C(5, T.u64)), N.Param("t", T.u64),
                   N.Param("e", T.ptr_global), C(0, T.u32), Sem.ACQUIRE, Scope.SYS, 4, None, 50)
    assert print_stmt(w) == (
        "%seen:u32 = spin_wait.acquire.sys.global.u32 [$flag] ge 1:u32 site=3 buffer=flags "
        "index=5:u64 timeout_ns=$t err_buf=$e rank=0:u32 shift=4 mask=none backoff_ns=50")


def test_var_type_is_shown_once_per_kernel():
    v = N.Var("v", T.u32)
    body = [N.Assign(v, C(1, T.u32)), N.Assign(v, N.BinOp(BinOpKind.ADD, v, C(1, T.u32)))]
    lines = _lines(_kernel_with(body))
    assert lines[4:6] == ["%v:u32 = 1:u32", "%v = add(%v, 1:u32)"]


def test_print_node_is_one_short_line():
    loop = N.While(N.Var("ok", T.pred), (N.Break(),) * 100)
    assert print_node(loop) == "while %ok:pred { ... }"
    assert print_node(N.NamedBarrier("b", 3, 64)) == "barrier b id=3 count=64"
    long = N.Comment("x" * 500)
    assert len(print_node(long)) == 200 and print_node(long).endswith("...")


# -- parse errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, line, message", [
    ("kernel k {\n}\n", 1, "missing block_threads"),
    ("kernel k block_threads=32 {\n  role r blocks=[0:u32, end) threads=all {\n"
     "    %x = 1:u32\n  }\n}\n", 3, "has no type yet"),
    ("kernel k block_threads=32 {\n  role r blocks=[0:u32, end) threads=all {\n"
     "    st.global [$p], 1:u32\n  }\n}\n", 3, "parameter $p is not declared"),
    ("kernel k block_threads=32 {\n  role r blocks=[0:u32, end) threads=all {\n"
     "    frobnicate\n  }\n}\n", 3, "unknown statement"),
    ("kernel k block_threads=32 {\n  role r blocks=[0:u32, end) threads=all {\n", 2,
     "role r is not closed"),
    ("kernel k block_threads=32 {\n  param $p:ptr.shared\n  role r blocks=[0:u32, end) "
     "threads=all {\n    st.global [$p], 1:u32\n  }\n}\n", 4, "names .global but"),
    ("kernel k block_threads=32 {\n}\nkernel j block_threads=32 {\n}\n", 3,
     "unexpected text after the end"),
    ("kernel k block_threads=32 {\n  role r blocks=[0:u32, end) threads=all {\n"
     "    %x:u32 = add(1:u32)\n  }\n}\n", 3, "expected 2 operands"),
    ("kernel k block_threads=32 {\n  role r blocks=[0:u32, end) threads=all {\n"
     "    %x:q7 = 1:u32\n  }\n}\n", 3, "unknown type 'q7'"),
])
def test_parse_errors_name_the_line(text, line, message):
    with pytest.raises(ParseError, match=re.escape(message)) as info:
        parse_kernel(text)
    assert info.value.lineno == line
    assert str(info.value).startswith(f"line {line}: ")


def test_parser_ignores_blank_lines_and_header_comments():
    k = _kernel_with([N.Comment("kept")])
    text = "// golden header\n\n" + print_kernel(k).replace("{\n", "{\n\n")
    assert parse_kernel(text) == k


def test_golden_ir_files_round_trip():
    """Every golden IR file parses back and prints to the same text; the warp send path's
    token-group barriers (``group=true``) are among them."""
    from pathlib import Path
    files = sorted((Path(__file__).resolve().parents[2] / "golden").rglob("*.ir"))
    assert files
    texts = {f.name: f.read_text() for f in files}
    for name, text in texts.items():
        assert print_module(parse_module(text)) == text, name
    assert any(" group=true" in t for t in texts.values())
