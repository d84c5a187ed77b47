"""IR building blocks of the quantising formats' device emitters.

The element encoders (``e4m3_pairs``, ``e2m1_nibble``, ``e4m3_to_f32``, ``e8m0_ceil``,
``e8m0_to_f32``) and ``bf16x8_to_f32`` emit straight-line ``Assign`` statements only (no
memory access, no control flow), so ``tests/support/ir_numpy.py`` can evaluate the very IR a kernel
contains on numpy arrays and compare it with ``ml_dtypes``. PTX they produce:

- bf16 -> f32: ``shl.b32`` / ``and.b32`` (a bf16 is the upper half of an f32);
- amax: ``abs.f32`` (``and.b32 .., 0x7fffffff``), ``max.f32``, ``shfl.sync.bfly.b32``;
- e4m3: ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+), after a ``max.f32``/``min.f32`` clamp;
- e2m1: ``min.f32``/``max.f32``, ``and.b32``, one ``add.rn.f32`` against a power of two that
  leaves e2m1's step as the sum's ulp, integer ``sub``/``shr``/``add`` (sm_90 has no e2m1
  conversion; ``cvt...e2m1x2.f32`` is sm_100a+);
- e8m0 (rounded up) and e4m3/e8m0 -> f32: integer ``shr``/``and``/``shl``/``selp``, ``mov.b32``;
  e4m3 -> f32 also as ``cvt.rn.f16x2.e4m3x2`` + ``cvt.f32.f16`` (``e4m3_to_f32_by_cvt``);
- a quotient by a constant as ``mul.rn.f32`` and two ``fma.rn.f32`` (``quotient_by_fma``);
- e8m0 by the OCP shared-exponent rule (``e8m0_floor``) and its power-of-two multiplier:
  integer ``shr``/``max``/``sub``/``shl``/``selp``;
- the power of two at or above a normal f32 (``pow2_ceil_exponent``, DeepEP's
  ``fast_log2_ceil``): integer ``shr``/``and``/``selp``/``add``.

The group scales (``fp32_group_scale``, ``fp32_pow2_group_scale``, ``e8m0_ceil_group_scale``,
``e8m0_floor_group_scale``, ``e4m3_global_group_scale``) and the element words (``e4m3_words``,
``e2m1_words``) compose those; each has its numpy twin of the same name in ``quant_host``, and
``epgen.formats.scaling`` pairs the twins into the declarations a format is made of.
"""

from __future__ import annotations

import numpy as np

import ir
from ir import ShflMode, UnOpKind
from ir import types as T

from .elements import E8M0_BIAS, E8M0_NAN, FP8_MAX, SCALE_INPUT_CLAMP

F32 = T.f32


def f32(value: float) -> ir.Const:
    """An f32 immediate holding ``value`` rounded to float32 (the value numpy's float32 has)."""
    return ir.Const(float(np.float32(value)), F32)


def u32(value: int) -> ir.Const:
    return ir.Const(int(value), T.u32)


def kernel_param(r: ir.RoleBuilder, name: str, dtype: T.Type) -> ir.Param:
    """The parameter ``name`` of the kernel being built, declared on first use. Formats use
    it for the launch arguments only they need (``input_scale`` of NVFP4, ``output_scales``),
    so the kernel builders stay format-agnostic; the world passes an argument for every
    parameter the kernel declares."""
    for p in r.kb.params:
        if p.name == name:
            if p.dtype != dtype:
                raise ValueError(f"kernel {r.kb.name}: parameter {name!r} is {p.dtype}, a "
                                 f"format asked for {dtype}")
            return p
    return r.kb.param(name, dtype)


# ---- inputs and group maxima ---------------------------------------------------------------
def bf16x8_to_f32(r: ir.RoleBuilder, words, name: str = "x") -> list[ir.Var]:
    """The 8 bf16 of a ``v4.u32`` as 8 f32 (exact): element ``2j`` is the low half of word
    ``j``, element ``2j+1`` the high half (little-endian memory order)."""
    xs = []
    for j in range(4):
        w = r.let(f"{name}w{j}", ir.Extract(words, j))
        xs.append(r.let(f"{name}{2 * j}", ir.Bitcast(F32, w << 16)))
        xs.append(r.let(f"{name}{2 * j + 1}", ir.Bitcast(F32, w & 0xFFFF0000)))
    return xs


def abs_max(r: ir.RoleBuilder, xs, name: str = "amax") -> ir.Var:
    """A new f32 variable: ``max(0, |x_0|, |x_1|, ...)`` (``max.f32`` returns the non-NaN
    operand, so NaN elements are ignored and the result is never NaN)."""
    acc = f32(0.0)
    for x in xs:
        acc = acc.max(ir.UnOp(UnOpKind.ABS, x))
    return r.var(name, F32, acc)


def group_max(r: ir.RoleBuilder, amax: ir.Var, lanes: int) -> None:
    """``amax`` becomes the maximum over the ``lanes`` adjacent lanes of its aligned lane
    group (``lanes`` a power of two <= 32; every lane of the warp must execute it):
    ``log2(lanes)`` butterfly shuffles."""
    d = 1
    while d < lanes:
        other = r.shfl(ShflMode.BFLY, amax, d, name=f"{amax.name}_x{d}")
        r.assign(amax, amax.max(other))
        d *= 2


def clamp(q, bound: float):
    """``min(max(q, -bound), bound)`` (``max.f32``/``min.f32``: a NaN ``q`` becomes
    ``-bound``)."""
    return q.max(f32(-bound)).min(f32(bound))


# ---- e4m3 ----------------------------------------------------------------------------------
def e4m3_pairs(r: ir.RoleBuilder, qs, name: str = "fp8") -> list[ir.Var]:
    """e4m3 bytes of the f32 values ``qs`` (rounded to nearest even, saturated to +-448),
    packed little-endian into ``len(qs) // 4`` u32 words: byte ``i`` of the result is
    ``e4m3(qs[i])``. One ``cvt.rn.satfinite.e4m3x2.f32`` per pair (the odd element is the
    upper byte)."""
    halves = [ir.CvtE4M3x2(qs[2 * i + 1], qs[2 * i]) for i in range(len(qs) // 2)]
    return [r.let(f"{name}{j}", halves[2 * j].cast(T.u32) | (halves[2 * j + 1].cast(T.u32) << 16))
            for j in range(len(halves) // 2)]


def e4m3_byte(r: ir.RoleBuilder, value, name: str) -> ir.Var:
    """The e4m3 byte (in a u32) of one f32 (rounded to nearest even, saturated)."""
    return r.let(name, ir.CvtE4M3x2(f32(0.0), value).cast(T.u32) & 0xFF)


def e4m3_to_f32(r: ir.RoleBuilder, code, name: str) -> ir.Var:
    """The value of a non-negative e4m3 code ``code`` (u32 in ``[0, 0x7e]``; the NaN code
    0x7f is not handled) as f32, exactly: normal codes rebias the exponent (``e + 120``) and
    move the 3 mantissa bits to the top of the f32 mantissa; subnormal codes are
    ``m * 2^-9``. The kernels decode with ``e4m3_to_f32_by_cvt``; this integer decode is what
    the tests check it against, on the CPU and on the GPU."""
    code = ir.as_expr(code)
    e = r.let(f"{name}_e", code >> 3)
    m = r.let(f"{name}_m", code & 7)
    normal = ir.Bitcast(F32, ((e + 120) << 23) | (m << 20))
    sub = m.cast(F32) * f32(2.0 ** -9)
    return r.let(name, ir.Select(e.eq(0), sub, normal))


def e4m3_to_f32_by_cvt(r: ir.RoleBuilder, code, name: str) -> ir.Var:
    """The value of the e4m3 code in the low byte of ``code`` (a u32 or u16 expression) as
    f32, exactly, by the hardware: ``cvt.rn.f16x2.e4m3x2`` and ``cvt.f32.f16`` (sm_89+; two
    instructions against ``e4m3_to_f32``'s integer decode, whose ``cvt.rn.f32.u32`` of the
    subnormal branch is a quarter-rate I2F)."""
    code = ir.as_expr(code)
    return r.let(name, ir.CvtE4M3ToF32(code if code.dtype == T.u16 else code.cast(T.u16)))


def quotient_by_fma(r: ir.RoleBuilder, x, d: float, name: str) -> ir.Var:
    """``x / d`` for an f32 constant ``d`` without ``div.rn.f32`` (Markstein): ``y = RN(1/d)``,
    ``q0 = x * y``, ``rem = fma(-q0, d, x)`` (exact), ``q = fma(rem, y, q0)``. That is
    ``div.rn.f32``'s result wherever the quotient is normal (for ``d = 6``: every f32 ``x`` in
    ``[0, 4096]``, tests/unit/test_formats_quant.py, all of them with ``EPGEN_EXHAUSTIVE=1``); a
    subnormal quotient may be an ulp off, and infinities give NaN, so callers clamp ``x``."""
    y = f32(np.float32(1) / np.float32(d))
    q0 = r.let(f"{name}_q0", ir.as_expr(x) * y)
    rem = r.let(f"{name}_rem", ir.Fma(ir.UnOp(UnOpKind.NEG, q0), f32(d), ir.as_expr(x)))
    return r.let(name, ir.Fma(rem, y, q0))


# ---- e2m1 ----------------------------------------------------------------------------------
FP4_SATURATION = 6.0


def e2m1_nibble(r: ir.RoleBuilder, v, name: str) -> ir.Var:
    """The e2m1 code (u32 in ``[0, 15]``: sign bit 3, magnitude code bits 0-2) of the f32
    ``v``, rounded to nearest even and saturated to +-6. A NaN gives +0 (its sign is
    dropped); -0 and negatives that round to zero give -0 (code 8)."""
    v = r.let(f"{name}_q", v)
    a = r.let(f"{name}_abs", ir.UnOp(UnOpKind.ABS, v))
    magnitude = e2m1_by_rounding_add(r, a, name)
    sign = (ir.Bitcast(T.u32, v) >> 31) << 3
    return r.let(name, ir.Select(v.eq(v), magnitude | sign, u32(0)))


def e2m1_by_rounding_add(r: ir.RoleBuilder, a, name: str) -> ir.Expr:
    """The magnitude code of ``a = |v|`` by one rounding addition (``min.f32``, ``max.f32``,
    ``and.b32``, ``add.rn.f32``, integer ``sub``/``shr``/``add``).

    With ``s = min(a, 6)`` in the binade ``[2^e, 2^(e+1))`` (``e`` in 0..2; ``e = 0`` also for
    ``s < 1``), e2m1's step there is ``2^(e-1)``, the ulp of f32 at ``c = 2^(e+22)``. So
    ``c + s`` rounds ``s`` to e2m1 once, to nearest even, and ``bits(c + s) - bits(c)`` is
    ``n = round(s / 2^(e-1))`` (2..4 for ``s >= 1``, 0..2 below). The code is ``n + 2e``:
    1.0, 1.5, 2.0 are codes 2, 3, 4 at ``e = 0``; 2, 3, 4 are 4, 5, 6 at ``e = 1``; 4, 6 are
    6, 7 at ``e = 2``; below 1, ``n`` itself (0, 0.5, 1.0 are 0, 1, 2). ``min.f32`` turns
    +inf into 6 and a NaN into 6 (the caller drops NaN). 16-17 PTX instructions an element
    with its multiply, where counting the 7 rounding thresholds (``setp``/``selp`` each)
    took 27-29 for the same codes; tests/unit/test_formats_quant.py checks every code against
    ml_dtypes."""
    s = r.let(f"{name}_sat", ir.as_expr(a).min(f32(FP4_SATURATION)))
    e_bits = r.let(f"{name}_ebits", ir.Bitcast(T.u32, s.max(f32(1.0))) & 0x7F800000)
    c = r.let(f"{name}_c", e_bits + (22 << 23))
    rounded = ir.Bitcast(T.u32, s + ir.Bitcast(F32, c))
    return rounded - c + (e_bits >> 22) - 254


# ---- e8m0 ----------------------------------------------------------------------------------


def e8m0_ceil(r: ir.RoleBuilder, v, name: str) -> ir.Var:
    """The e8m0 code (u32) of the smallest power of two ``>= v`` for an f32 ``v >= 0``
    (rounding up, as the reference's e8m0 cast): ``exponent + (mantissa != 0)`` for normal
    ``v``; subnormal ``v`` (and 0) give the smallest scale ``2^-127`` (code 0) when
    ``v <= 2^-127``, else ``2^-126`` (code 1); ``+inf`` (and anything rounding past
    ``2^127``) gives 0xFF, e8m0's NaN."""
    bits = r.let(f"{name}_bits", ir.Bitcast(T.u32, v))
    e = r.let(f"{name}_e", bits >> 23)
    m = r.let(f"{name}_m", bits & 0x7FFFFF)
    normal = (e + m.ne(0).cast(T.u32)).min(E8M0_NAN)
    sub = (m > 0x400000).cast(T.u32)
    return r.let(name, ir.Select(e.eq(0), sub, normal))


def pow2_ceil_exponent(r: ir.RoleBuilder, v, name: str) -> ir.Var:
    """The biased exponent (u32) of the smallest power of two ``>= v`` for a normal f32
    ``v > 0`` (or +inf, which gives 255): the exponent field plus one where the mantissa is
    not zero, DeepEP's ``fast_log2_ceil`` plus 127 (``shr``, ``and``, ``setp``/``selp``,
    ``add``). Unlike ``e8m0_ceil`` it has no subnormal or overflow case: its callers' ``v``
    has neither."""
    bits = r.let(f"{name}_bits", ir.Bitcast(T.u32, v))
    mantissa = (bits & 0x7FFFFF).ne(0).cast(T.u32)
    return r.let(name, (bits >> 23) + mantissa)


def e8m0_to_f32(r: ir.RoleBuilder, code, name: str) -> ir.Var:
    """The value ``2^(code - 127)`` of an e8m0 code as f32 (code 0 is the f32 subnormal
    ``2^-127``; 0xFF gives +inf, not NaN)."""
    code = ir.as_expr(code)
    return r.let(name, ir.Bitcast(F32, ir.Select(code.eq(0), u32(0x400000), code << 23)))


def e8m0_floor(r: ir.RoleBuilder, amax, emax: int, name: str) -> ir.Var:
    """The OCP MX shared exponent of an f32 ``amax >= 0`` as an e8m0 code (u32):
    ``floor(log2(amax)) - emax + 127``, which for a normal ``amax`` is its biased exponent
    field less ``emax``; clamped below at code 0 (``2^-127``: also ``amax == 0`` and subnormal
    maxima, whose exponent field is 0); ``+inf`` gives 0xFF, e8m0's NaN."""
    e = r.let(f"{name}_e", ir.Bitcast(T.u32, amax) >> 23)
    return r.let(name, ir.Select(e.eq(0xFF), u32(E8M0_NAN), e.max(emax) - emax))


# ---- group scales --------------------------------------------------------------------------
def fp32_group_scale(r: ir.RoleBuilder, amax, bound: float, min_amax: float,
                     prefix: str) -> ir.Var:
    """The f32 scale ``max(amax, min_amax) / bound`` (``max.f32``, ``div.rn.f32``), named
    ``<prefix>_scale``; the elements are divided by it."""
    return r.let(f"{prefix}_scale", amax.max(f32(min_amax)) / f32(bound))


def fp32_pow2_group_scale(r: ir.RoleBuilder, amax, bound: float, min_amax: float,
                          prefix: str):
    """(the f32 scale ``2^e``, the exact multiplier ``2^-e``, the group's liveness ``e + 127
    != 255``) with ``e = ceil(log2(max(amax, min_amax) * RN(1 / bound)))``: ``max.f32``,
    ``mul.rn.f32`` by the rounded inverse (no division), ``pow2_ceil_exponent`` of the
    product, and both powers of two built from their exponent fields. The product is a normal
    f32 for every finite ``amax`` (``min_amax / bound`` and up), or +inf: an infinite
    ``amax`` gives the scale +inf (``255 << 23``) and a dead group, whose multiplier is
    meaningless (its elements are masked by the liveness). Named ``<prefix>_v``, ``_exp``,
    ``_scale``, ``_mult``, ``_live``."""
    v = r.let(f"{prefix}_v", amax.max(f32(min_amax)) * f32(np.float32(1) / np.float32(bound)))
    biased = pow2_ceil_exponent(r, v, f"{prefix}_exp")
    scale = r.let(f"{prefix}_scale", ir.Bitcast(F32, biased << 23))
    mult = r.let(f"{prefix}_mult", ir.Bitcast(F32, (u32(2 * E8M0_BIAS) - biased) << 23))
    return scale, mult, r.let(f"{prefix}_live", biased.ne(E8M0_NAN))


def e8m0_ceil_group_scale(r: ir.RoleBuilder, amax, bound: float, prefix: str):
    """(e8m0 code of ``amax / bound`` rounded up, the multiplier ``0 if amax == 0 else 1 /
    scale``, the group's liveness ``code != 0xFF``): ``div.rn.f32``, ``e8m0_ceil``,
    ``e8m0_to_f32``, ``div.rn.f32``. Named ``<prefix>_scale``, ``_s``, ``_mult``, ``_live``."""
    code = e8m0_ceil(r, amax / f32(bound), f"{prefix}_scale")
    s = e8m0_to_f32(r, code, f"{prefix}_s")
    mult = r.let(f"{prefix}_mult", ir.Select(amax.eq(f32(0)), f32(0), f32(1.0) / s))
    return code, mult, r.let(f"{prefix}_live", code.ne(E8M0_NAN))


def e8m0_floor_group_scale(r: ir.RoleBuilder, amax, emax: int, prefix: str):
    """(the OCP e8m0 code ``floor(log2(amax)) - emax + 127`` (``e8m0_floor``), the exact
    multiplier ``2^(127 - code)`` built from its bits, the group's liveness ``code != 0xFF``):
    integer operations only, no division. A dead group's (code 0xFF) multiplier is
    meaningless; its elements are masked by the liveness. Named ``<prefix>_scale``,
    ``_mult``, ``_live``."""
    code = e8m0_floor(r, amax, emax, f"{prefix}_scale")
    mult = r.let(f"{prefix}_mult", ir.Bitcast(F32, (u32(2 * E8M0_BIAS) - code) << 23))
    return code, mult, r.let(f"{prefix}_live", code.ne(E8M0_NAN))


def e4m3_global_group_scale(r: ir.RoleBuilder, amax, bound: float, prefix: str):
    """(e4m3 code of ``(g * amax) / bound`` with ``g`` the kernel parameter ``input_scale``,
    the multiplier ``0 if amax == 0 else g / float(scale)``): ``mul.rn.f32``, ``min.f32``
    (``SCALE_INPUT_CLAMP``), the quotient by ``fma`` (``quotient_by_fma``),
    ``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rn.f16x2.e4m3x2`` and ``cvt.f32.f16`` (its value),
    ``div.rn.f32``. The quotient by ``fma`` and the ``cvt`` decode give the same scale bytes
    and multipliers as a ``div.rn.f32`` and the integer decode (``e4m3_to_f32``) for every
    input (tests/unit/test_formats_quant.py), with one ``div.rn.f32`` fewer per 8-element item.
    Named ``<prefix>_gamax``, ``_sf``, ``_scale``, ``_sdec``, ``_mult``."""
    g = kernel_param(r, "input_scale", T.f32)
    scaled = r.let(f"{prefix}_gamax", (g * amax).min(f32(SCALE_INPUT_CLAMP)))
    code = e4m3_byte(r, quotient_by_fma(r, scaled, bound, f"{prefix}_sf"), f"{prefix}_scale")
    sdec = e4m3_to_f32_by_cvt(r, code, f"{prefix}_sdec")
    return code, r.let(f"{prefix}_mult", ir.Select(amax.eq(f32(0)), f32(0), g / sdec))


# ---- element words -------------------------------------------------------------------------
def e4m3_words(r: ir.RoleBuilder, vs, live, prefix: str, words: str) -> list[ir.Var]:
    """The e4m3 bytes of the scaled f32 elements ``vs`` packed in u32 words (``e4m3_pairs``,
    named ``words``): each element clamped to +-448 first (``max.f32``/``min.f32``: a NaN
    becomes -448), and 0 where the group is not ``live`` (a ``selp``; None: always live).
    The elements are named ``<prefix>_q<i>``."""
    qs = []
    for i, v in enumerate(vs):
        q = clamp(v, FP8_MAX)
        qs.append(r.let(f"{prefix}_q{i}", q if live is None else ir.Select(live, q, f32(0))))
    return e4m3_pairs(r, qs, words)


def e2m1_words(r: ir.RoleBuilder, vs, live, prefix: str, words: str) -> list[ir.Var]:
    """The e2m1 codes of the scaled f32 elements ``vs`` (``e2m1_nibble``, named
    ``<prefix>_e<i>``; +0 where the group is not ``live``, None: always live), eight to a u32
    word (element ``i`` in bits ``4i..4i+3``) named ``words``."""
    word = None
    for i, v in enumerate(vs):
        nib = e2m1_nibble(r, v if live is None else ir.Select(live, v, f32(0)), f"{prefix}_e{i}")
        part = nib << (4 * i) if i else nib
        word = part if word is None else word | part
    return [r.let(words, word)]
