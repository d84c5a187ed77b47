"""The arithmetic of ``backends.sim`` that Python floats do not give directly: ``fma.rn``
rounded once, and the e4m3 conversions (``cvt.rn.satfinite.e4m3x2.f32``,
``cvt.rn.f16x2.e4m3x2``), modelled with numpy and ml_dtypes. ``fma_f32`` works elementwise on
numpy arrays too (the format tests evaluate quantiser IR with it)."""

from __future__ import annotations

import math

import numpy as np

from ir import types as T


def fma_f32(a, b, c) -> np.ndarray:
    """``fma.rn.f32``: ``RN32(a * b + c)`` with one rounding. ``a * b`` is exact in f64 (24 + 24
    bits); ``s = RN64(p + c)`` may not be, and rounding ``s`` to f32 is wrong only where ``s``
    lands exactly on an f32 midpoint that the exact sum does not: the TwoSum error ``err``
    says which side of it the exact sum lies."""
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
    return np.where(at_upper_mid, up, np.where(at_lower_mid, down, r)).astype(np.float32)


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
