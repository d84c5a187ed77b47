"""An independent model of the combine's arithmetic, and the crafted inputs that check it.

The model follows the stated steps (docs/combine.md, "Order of the sum") with exact
rational arithmetic (``fractions.Fraction``), rounding by hand:

1. ``acc = +0``;
2. for ``k = 0 .. K-1`` in order: ``acc = RN32(w[k] * y[k] + acc)``, the exact value rounded
   once to float32 (nearest even, subnormals kept, overflow to infinity);
3. with a residual: ``acc = RN32(acc + r)``;
4. the result rounds to BF16 to nearest even; a NaN result is BF16 ``0x7fff`` (f32 arithmetic
   on the GPU returns the canonical NaN ``0x7fffffff``, whose rounding keeps it a NaN).

Infinities, NaN and signed zeros follow IEEE 754 (an exact zero sum is ``+0`` unless both
addends are ``-0``). Nothing here uses the code under test (``epgen.reference_combine``,
``backends.sim.numerics``) or float32 arithmetic: numpy only encodes the final value.

``CASES`` are tokens whose top-k slots are crafted so that the summation order, fma against
multiply-then-add (and fma against a sum rounded twice), the final rounding and the NaN
handling each change the result (``VARIANTS`` are the model with one step done wrong; the
reference's tests check that each case tells its variant from the model). ``K = 4`` slots;
an unused slot has weight 0 and a zero row; ``RESIDUAL_NONE`` (``-0``) is the residual of a
case that has none (``acc + -0 == acc`` for every ``acc``, ``-0`` included).
"""

from __future__ import annotations

import math
from fractions import Fraction

import attrs
import numpy as np

K = 4
RESIDUAL_NONE = 0x8000


def f32(bits: int) -> float:
    """The float32 with bit pattern ``bits``, as a Python float (exact)."""
    return float(np.array(bits, np.uint32).view(np.float32))


def bf16(bits: int) -> float:
    """The BF16 with bit pattern ``bits``, as a Python float (exact)."""
    return f32(int(bits) << 16)


def round_binary(x: Fraction, precision: int) -> float:
    """``x`` rounded to nearest even on a binary format of ``precision`` significant bits and
    float32's exponent range (normals from ``2**-126``, subnormals below, overflow to
    infinity at ``2**128``); the result as a Python float (exact). A nonzero ``x`` that
    rounds to zero keeps its sign."""
    sign = -1.0 if x < 0 else 1.0
    a = abs(x)
    if a == 0:
        return 0.0
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1                                   # now 2**e <= a < 2**(e + 1)
    quantum = Fraction(2) ** (max(e, -126) - (precision - 1))
    n = a / quantum
    whole = math.floor(n)
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    v = whole * quantum
    if v >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(v)


def fma_exact(w: float, y: float, acc: float, rounding=lambda x: round_binary(x, 24)) -> float:
    """``w * y + acc`` computed exactly and rounded once by ``rounding`` (IEEE specials)."""
    if math.isnan(w) or math.isnan(y) or math.isnan(acc):
        return math.nan
    if (math.isinf(w) and y == 0) or (math.isinf(y) and w == 0):
        return math.nan                          # 0 * inf
    if math.isinf(w) or math.isinf(y):
        prod = math.copysign(math.inf, w) * math.copysign(1.0, y)
        if math.isinf(acc) and acc != prod:
            return math.nan                      # inf - inf
        return prod
    if math.isinf(acc):
        return acc
    exact = Fraction(w) * Fraction(y) + Fraction(acc)
    if exact == 0:
        prod_neg = (math.copysign(1.0, w) * math.copysign(1.0, y)) < 0
        both_neg_zero = w * y == 0 and prod_neg and math.copysign(1.0, acc) < 0
        return -0.0 if both_neg_zero else 0.0
    return rounding(exact)


def bf16_bits_of(v: float) -> int:
    """``v`` rounded to BF16 (nearest even) as bits; a NaN is ``0x7fff``."""
    if math.isnan(v):
        return 0x7FFF
    if math.isinf(v):
        return 0x7F80 if v > 0 else 0xFF80
    r = round_binary(Fraction(v), 8) if v != 0 else v
    return int(np.array(r, np.float32).view(np.uint32)) >> 16


def combine_one(ws, ys_bits, r_bits=RESIDUAL_NONE, *, order=None, fma=fma_exact,
                to_bf16=bf16_bits_of) -> int:
    """One element of one token: the stated steps over slots ``order`` (default ascending),
    ``fma`` per slot, the residual added with the same rounding, ``to_bf16`` at the end."""
    acc = 0.0
    for k in (range(len(ws)) if order is None else order):
        acc = fma(ws[k], bf16(ys_bits[k]), acc)
    acc = fma(1.0, bf16(r_bits), acc)
    return to_bf16(acc)


# ---- the variants: one step done wrong -------------------------------------------------------
def _mul_then_add(w, y, acc):
    return fma_exact(1.0, fma_exact(w, y, -0.0), acc)


def _twice_rounded(w, y, acc):
    """The sum rounded to float64 first, then to float32."""
    return fma_exact(w, y, acc, rounding=lambda x: round_binary(Fraction(float(x)), 24))


def _bf16_no_nan_branch(v):
    if not math.isnan(v):
        return bf16_bits_of(v)
    u = 0x7FFFFFFF                               # the canonical NaN through the integer rounding
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _bf16_half_up(v):
    if math.isnan(v) or math.isinf(v):
        return bf16_bits_of(v)
    u = int(np.array(v, np.float32).view(np.uint32))
    return ((u + 0x8000) >> 16) & 0xFFFF


def _bf16_truncated(v):
    if math.isnan(v):
        return 0x7FFF
    return int(np.array(v, np.float32).view(np.uint32)) >> 16


def _flushed(v: float) -> float:
    return math.copysign(0.0, v) if v != 0 and abs(v) < 2.0 ** -126 else v


def _ftz(w, y, acc):
    """Subnormal operands and results flushed to zero (``fma.rn.ftz.f32``)."""
    return _flushed(fma_exact(_flushed(w), _flushed(y), _flushed(acc)))


def _from_first_product(ws, ys_bits, r_bits):
    """The sum started from the first product (``acc = w[0] * y[0]``) instead of ``+0``."""
    acc = None
    for k in range(len(ws)):
        acc = fma_exact(ws[k], bf16(ys_bits[k]), -0.0 if acc is None else acc)
    return bf16_bits_of(fma_exact(1.0, bf16(r_bits), acc))


def _residual_first(ws, ys_bits, r_bits):
    acc = fma_exact(1.0, bf16(r_bits), 0.0)
    for k in range(len(ws)):
        acc = fma_exact(ws[k], bf16(ys_bits[k]), acc)
    return bf16_bits_of(acc)


VARIANTS = {
    "order": lambda ws, ys, r: combine_one(ws, ys, r, order=range(len(ws) - 1, -1, -1)),
    "fma": lambda ws, ys, r: combine_one(ws, ys, r, fma=_mul_then_add),
    "single_rounding": lambda ws, ys, r: combine_one(ws, ys, r, fma=_twice_rounded),
    "rounding": lambda ws, ys, r: combine_one(ws, ys, r, to_bf16=_bf16_half_up),
    "truncation": lambda ws, ys, r: combine_one(ws, ys, r, to_bf16=_bf16_truncated),
    "nan": lambda ws, ys, r: combine_one(ws, ys, r, to_bf16=_bf16_no_nan_branch),
    "residual_last": _residual_first,
    "ftz": lambda ws, ys, r: combine_one(ws, ys, r, fma=_ftz),
    "starts_at_zero": _from_first_product,
}


@attrs.frozen
class Case:
    """One crafted token: its ``K`` weights (float32 values), ``K`` expert-output rows (BF16
    bits, every element the same), its residual (BF16 bits), the model's result and the
    variants whose result differs from it (``tells``)."""

    name: str
    w: tuple
    y: tuple
    want: int
    tells: tuple = ()
    r: int = RESIDUAL_NONE


ONE, TWO24, MINUS_TWO24 = 0x3F80, 0x4B80, 0xCB80
PINF, NINF = 0x7F80, 0xFF80


def _w(*vals):
    return tuple(float(np.float32(v)) for v in vals) + (0.0,) * (K - len(vals))


def _y(*bits):
    return tuple(bits) + (0,) * (K - len(bits))


CASES = [
    # summation order: k ascending absorbs the 1 into 2^24; any other order keeps it
    Case("order_absorbs_one", _w(1, 1, 1, 1), _y(TWO24, ONE, MINUS_TWO24, 0), 0x0000,
         ("order",)),
    # the residual after the slots (slots cancel to 0, then + 1); before them it is absorbed
    Case("residual_after_slots", _w(1, 1), _y(TWO24, MINUS_TWO24), ONE, ("residual_last",),
         r=ONE),
    # fma: w1 * y1 = 1 + 2^-7 + 2^-23 + 2^-30 is not a float32; only a single rounding keeps
    # the 2^-30 once slot 0 cancels the rest
    Case("fma_keeps_the_product_exact", _w(-(1 + 2 ** -7 + 2 ** -23), 1 + 2 ** -23),
         _y(ONE, 0x3F81), 0x3080, ("order", "fma")),
    # fma rounded once: w1 * y1 = 2^-24 + 2^-54 (5237765 * 205 = 2^30 + 1), so 1 + w1 * y1
    # is above the float32 midpoint 1 + 2^-24, but the float64 sum rounds onto it (and then
    # to even, 1); slot 2 subtracts the 1
    Case("fma_rounds_once", _w(1, 5237765 * 2.0 ** -47, -1), _y(ONE, 0x3FCD, ONE), 0x3400,
         ("order", "fma", "single_rounding")),
    # the final rounding: ties to even (down and up), above a tie, negative, overflow
    Case("bf16_tie_to_even_down", _w(1 + 2 ** -8), _y(ONE), 0x3F80, ("rounding",)),
    Case("bf16_tie_to_even_up", _w(1 + 3 * 2 ** -8), _y(ONE), 0x3F82, ("truncation",)),
    Case("bf16_above_a_tie", _w(1 + 2 ** -8 + 2 ** -23), _y(ONE), 0x3F81, ("truncation",)),
    Case("bf16_negative_tie", _w(-(1 + 2 ** -8)), _y(ONE), 0xBF80, ("rounding",)),
    Case("bf16_overflows_to_inf", _w(f32(0x7F7FFFFF)), _y(ONE), PINF, ("truncation",)),
    # NaN: a NaN weight with a payload, a signalling negative NaN row, inf - inf, 0 * inf
    Case("nan_weight", _w(f32(0x7FC0FFFF)), _y(ONE), 0x7FFF, ("nan",)),
    Case("nan_row", _w(1), _y(0xFF81), 0x7FFF, ("nan",)),
    Case("inf_minus_inf", _w(1, 1), _y(PINF, NINF), 0x7FFF, ("nan",)),
    Case("zero_times_inf", _w(math.inf), _y(0x0000), 0x7FFF, ("nan",)),
    Case("nan_residual", _w(1), _y(ONE), 0x7FFF, ("nan",), r=0xFFC1),
    # infinities and overflow
    Case("inf_row_scaled", _w(2, -0.5), _y(PINF, 0x3F80), PINF),
    Case("negative_inf", _w(-0.5), _y(PINF), NINF),
    Case("sum_overflows", _w(1, 1), _y(0x7F7F, 0x7F7F), PINF),
    Case("inf_residual", _w(1), _y(0x4000), NINF, r=NINF),
    # signed zeros: the sum starts at +0, so -0 rows give +0; a product that underflows
    # keeps its sign; a -0 residual changes nothing
    Case("negative_zero_rows", _w(1, 1, 1, 1), _y(0x8000, 0x8000, 0x8000, 0x8000), 0x0000,
         ("starts_at_zero",)),
    Case("underflow_to_negative_zero", _w(0, 0, 0, -2 ** -100), _y(0, 0, 0, 0x0D80), 0x8000,
         ("order", "fma")),
    Case("positive_zero_residual", _w(1), _y(0x8000), 0x0000, r=0x0000),
    # subnormals: BF16 subnormal rows and residuals, the sum rounded to a BF16 subnormal
    Case("subnormal_rows", _w(1, 0.5, 1), _y(0x0001, 0x0001, 0x0003), 0x0004,
         ("rounding", "ftz")),
    Case("subnormal_residual", _w(-0.5), _y(0x0001), 0x0000, ("rounding",), r=0x0001),
    Case("subnormal_weight", _w(f32(0x00000001)), _y(0x4B80), 0x0100, ("ftz",)),
]
