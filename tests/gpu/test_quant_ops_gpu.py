"""The quantisers' arithmetic on the GPU itself, so the hardware (not the numpy models of
tests/support/ir_numpy.py) settles it:

- ``quant_ir.quotient_by_fma(x, 6)`` against the hardware's ``div.rn.f32`` for every f32 of
  NVFP4's clamped scale domain ``[0, 4096]`` (1.17e9 patterns, one launch): the same bits
  wherever the quotient is normal, the same e4m3 scale code everywhere;
- ``quant_ir.e4m3_to_f32_by_cvt`` (``cvt.rn.f16x2.e4m3x2``) against the integer decode for
  every non-NaN e4m3 code;
- ``fma.rn.f32`` against ``ir_numpy.fma_f32`` on random operands and constructed ties.
"""

from __future__ import annotations

import numpy as np
import pytest

import ir
import ir_numpy
from epgen.formats import quant_ir as Q
from ir import AtomOp
from ir import types as T

pytestmark = pytest.mark.gpu

SCALE_DOMAIN_END = 0x45800000          # 4096.0: NVFP4's SCALE_INPUT_CLAMP
SMALLEST_NORMAL_QUOTIENT = 6 * 2.0 ** -126


def build_probe() -> ir.Kernel:
    """``out`` u32[4]: [0] patterns whose quotient bits differ (normal quotients), [1] patterns
    whose e4m3 code differs, [2] the smallest such pattern (0xFFFFFFFF: none), [3] e4m3 codes
    whose two decodes differ."""
    kb = ir.KernelBuilder("quant_ops_probe", 256)
    out = kb.param("out", T.ptr_global)
    n = kb.param("n", T.u32)
    with kb.role("probe") as r:
        with r.for_range("i", r.global_thread_id(), n, r.grid_threads()) as i:
            x = r.let("x", ir.Bitcast(T.f32, i))
            q = Q.quotient_by_fma(r, x, 6.0, "q")
            ref = r.let("ref", x / Q.f32(6.0))
            bits_differ = r.let("bits_differ", (x >= Q.f32(SMALLEST_NORMAL_QUOTIENT))
                                & ir.Bitcast(T.u32, q).ne(ir.Bitcast(T.u32, ref)))
            codes_differ = r.let("codes_differ",
                                 Q.e4m3_byte(r, q, "cq").ne(Q.e4m3_byte(r, ref, "cr")))
            with r.if_(bits_differ):
                r.red(AtomOp.ADD, out, ir.Const(1, T.u32))
            with r.if_(codes_differ):
                r.red(AtomOp.ADD, out + 4, ir.Const(1, T.u32))
            with r.if_(bits_differ | codes_differ):
                r.red(AtomOp.MIN, out + 8, i)
        code = r.let("code", r.global_thread_id())
        with r.if_(code < 0x7F):
            by_cvt = Q.e4m3_to_f32_by_cvt(r, code, "by_cvt")
            by_int = Q.e4m3_to_f32(r, code, "by_int")
            with r.if_(ir.Bitcast(T.u32, by_cvt).ne(ir.Bitcast(T.u32, by_int))):
                r.red(AtomOp.ADD, out + 12, ir.Const(1, T.u32))
    return kb.build()


def build_fma() -> ir.Kernel:
    """``d[i] = fma(a[i], b[i], c[i])`` (f32) for ``i < n``."""
    kb = ir.KernelBuilder("fma_probe", 256)
    d, a, b, c = (kb.param(name, T.ptr_global) for name in "dabc")
    n = kb.param("n", T.u32)
    with kb.role("fma") as r:
        i = r.let("i", r.global_thread_id())
        with r.if_(i < n):
            off = i.cast(T.u64) * 4
            r.store(d + off, ir.Fma(r.load(a + off, T.f32, name="a"),
                                    r.load(b + off, T.f32, name="b"),
                                    r.load(c + off, T.f32, name="c")))
    return kb.build()


@pytest.fixture(scope="module")
def program():
    from epgen.runtime.program import Program
    return Program(ir.Module("quant_ops", (build_probe(), build_fma())))


def test_quotient_by_fma_and_e4m3_decode_on_every_input(program):
    from backends import cuda
    out = cuda.to_device(np.array([0, 0, 0xFFFFFFFF, 0], np.uint32))
    program.launch("quant_ops_probe", 8 * cuda.sm_count(program.device),
                   {"out": out, "n": SCALE_DOMAIN_END + 1})
    bits, codes, first, decodes = (int(v) for v in out.to_host())
    first_x = np.uint32(first).view(np.float32)
    assert bits == 0 and codes == 0, \
        f"{bits} quotients and {codes} e4m3 codes differ from div.rn.f32; first at x = {first_x!r}"
    assert decodes == 0, f"{decodes} e4m3 codes decode differently by cvt and by integers"


def test_fma_matches_the_model(program, seed):
    from backends import cuda
    rng = np.random.default_rng(seed)
    n = 1 << 16
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -22)) \
        .astype(np.float32)
    # sums on an f32 tie: 1 + 2^-24 (c) plus a product of +-2^-60
    a[:3], b[:3] = np.float32([2.0 ** -30] * 3), np.float32([2.0 ** -30, -(2.0 ** -30), 0])
    c[:3] = np.float32(1.0) + np.float32(2.0 ** -23)
    d = cuda.zeros(n, np.float32)
    args = {"d": d, "a": cuda.to_device(a), "b": cuda.to_device(b), "c": cuda.to_device(c),
            "n": n}
    program.launch("fma_probe", n // 256, args)
    got = d.to_host()
    want = ir_numpy.fma_f32(a, b, c)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"seed {seed}: " + ", ".join(
        f"fma({a[i]!r}, {b[i]!r}, {c[i]!r}) = {got[i]!r}, model {want[i]!r}" for i in bad[:3])
