"""The arithmetic of ``backends.sim`` that Python floats do not give directly: ``fma.rn``
rounded once, the canonical NaN of f32 arithmetic, and the e4m3 conversions
(``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rn.f16x2.e4m3x2``), modelled with numpy and
ml_dtypes. ``fma_f32`` and ``add_f32`` work elementwise on numpy arrays too (the format tests
evaluate quantiser IR with them; ``epgen.reference.combine`` sums with them)."""

from __future__ import annotations

import math

import numpy as np

from ir import types as T


#: The one NaN that f32 arithmetic (``add``/``sub``/``mul``/``div``/``fma``) returns on the GPU:
#: single precision keeps no NaN payload and no sign, whatever NaN or invalid operation made it.
CANONICAL_NAN_F32 = 0x7FFFFFFF
_CANONICAL_NAN = np.array(CANONICAL_NAN_F32, np.uint32).view(np.float32)


def canonical_nan_f32(x) -> np.ndarray:
    """``x`` (float32, elementwise) with every NaN replaced by the canonical NaN
    (``CANONICAL_NAN_F32``), as an f32 arithmetic result on the GPU."""
    x = np.asarray(x, np.float32)
    return np.where(np.isnan(x), _CANONICAL_NAN, x)


def canonical_f32(v: float) -> float:
    """One f32 arithmetic result held as a Python float: the canonical NaN if it is a NaN
    (its double form, which ``struct`` stores as ``0x7fffffff``), else ``v``."""
    return float(_CANONICAL_NAN) if v != v else v


def add_f32(a, b) -> np.ndarray:
    """``add.rn.f32`` (elementwise): the float32 sum, a NaN canonical."""
    with np.errstate(invalid="ignore", over="ignore"):      # inf - inf, overflow: IEEE
        return canonical_nan_f32(np.asarray(a, np.float32) + np.asarray(b, np.float32))


def fma_f32(a, b, c) -> np.ndarray:
    """``fma.rn.f32``: ``RN32(a * b + c)`` with one rounding, a NaN canonical. ``a * b`` is
    exact in f64 (24 + 24 bits); ``s = RN64(p + c)`` may not be, and rounding ``s`` to f32
    is wrong only where ``s`` lands exactly on an f32 midpoint that the exact sum does not:
    the TwoSum error ``err`` says which side of it the exact sum lies."""
    with np.errstate(invalid="ignore", over="ignore"):      # infinities, NaN: IEEE results
        p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32)
        c = np.asarray(c, np.float32).astype(np.float64)
        s = p + c
        t = s - p
        err = (p - (s - t)) + (c - t)
        r = s.astype(np.float32)
        down = np.nextafter(r, np.float32(-np.inf))
        up = np.nextafter(r, np.float32(np.inf))
        rd = r.astype(np.float64)
        at_upper_mid = (s == (rd + up.astype(np.float64)) / 2) & (err > 0)
        at_lower_mid = (s == (rd + down.astype(np.float64)) / 2) & (err < 0)
    return canonical_nan_f32(np.where(at_upper_mid, up, np.where(at_lower_mid, down, r)))


def fma(a: float, b: float, c: float, dtype: T.DType) -> float:
    """``fma.rn``: ``a * b + c`` rounded once to ``dtype`` (f32: ``fma_f32``; f64: the exact
    sum by fractions, rounded by ``float``)."""
    if dtype.bits == 32:
        return float(fma_f32(a, b, c))
    from fractions import Fraction
    exact = (Fraction(a) * Fraction(b) + Fraction(c)
             if all(math.isfinite(v) for v in (a, b, c)) else None)
    return a * b + c if exact is None or exact == 0 else float(exact)


def e4m3_code(v: float) -> int:
    """``cvt.rn.satfinite`` of one f32 to an e4m3 byte: nearest even, saturated to +-448,
    NaN to 0x7F."""
    import ml_dtypes
    if math.isnan(v):
        return 0x7F
    v = min(max(v, -448.0), 448.0)
    return int(np.array(v, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def e4m3_value(code: int) -> float:
    """``cvt.rn.f16x2.e4m3x2`` then ``cvt.f32.f16``: the value of the e4m3 byte ``code``."""
    import ml_dtypes
    return float(np.array(code, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
