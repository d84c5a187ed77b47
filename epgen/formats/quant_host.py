"""The host encoders of the quantising formats: numpy twins of ``quant_ir``'s device encoders,
computing the same bits (float32 arithmetic rounding as the kernels' ``.rn`` instructions,
element codes through ``ml_dtypes``).

Each device encoder of ``quant_ir`` has its twin here, under the same name where the step is
the same:

============================  ====================================  ==========================
step                          host (this module)                    device (``quant_ir``)
============================  ====================================  ==========================
e4m3 elements                 ``e4m3_codes``                        ``e4m3_words``
e2m1 elements                 ``e2m1_codes``, ``pack_nibbles``      ``e2m1_words``
f32 group scale               ``fp32_group_scale``                  ``fp32_group_scale``
power of two at or above      ``pow2_ceil_exponents``               ``pow2_ceil_exponent``
f32 power-of-two group scale  ``fp32_pow2_group_scale``             ``fp32_pow2_group_scale``
e8m0 scale, rounded up        ``e8m0_ceil_group_scale``             ``e8m0_ceil_group_scale``
e8m0 scale, OCP rule          ``e8m0_floor_group_scale``            ``e8m0_floor_group_scale``
e4m3 scale, global scale      ``e4m3_global_group_scale``           ``e4m3_global_group_scale``
============================  ====================================  ==========================

A group scale function returns the scale as stored and the multiplier (or divisor) its
elements are scaled by; ``epgen.formats.scaling`` pairs the twins into the declarations a
format is made of. ``ml_dtypes`` is imported on first use (``codec.ml_dtypes``).
"""

from __future__ import annotations

import numpy as np

from .codec import ml_dtypes
from .elements import E8M0_BIAS, E8M0_NAN, FP4_MAX, FP8_MAX


# ---- elements ------------------------------------------------------------------------------
def e4m3_codes(v: np.ndarray, live=None) -> np.ndarray:
    """The kernel's e4m3 bytes (uint8, shape of ``v``) of float32 ``v``: clamped to +-448 with
    ``fmax``/``fmin`` (a NaN becomes -448, as ``max.f32(NaN, -448)``), zero where ``live``
    (a boolean per group, ``v``'s shape less its last axis) is False, then rounded to nearest
    even."""
    q = np.fmin(np.fmax(v, np.float32(-FP8_MAX)), np.float32(FP8_MAX))
    if live is not None:
        q = np.where(live[..., None], q, np.float32(0))
    return q.astype(ml_dtypes().float8_e4m3fn).view(np.uint8)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """float64 values of e4m3 codes (uint8)."""
    return np.asarray(codes, np.uint8).view(ml_dtypes().float8_e4m3fn).astype(np.float64)


def e2m1_codes(q: np.ndarray, live=None) -> np.ndarray:
    """The kernel's e2m1 encoding of float32 ``q`` through ml_dtypes: NaN -> +0 (ml_dtypes
    would give -0), saturate to +-6, round to nearest even; +0 where ``live`` (a boolean per
    group, ``q``'s shape less its last axis) is False. uint8 codes 0..15."""
    if live is not None:
        q = np.where(live[..., None], q, np.float32(0))
    q = np.where(np.isnan(q), np.float32(0), q)
    q = np.clip(q, np.float32(-FP4_MAX), np.float32(FP4_MAX))
    return q.astype(ml_dtypes().float4_e2m1fn).view(np.uint8) & 0xF


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """float64 values of e2m1 codes (uint8 0..15)."""
    return np.asarray(codes, np.uint8).view(ml_dtypes().float4_e2m1fn).astype(np.float64)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``[n, 2m]`` packed two per byte ``[n, m]``, the even element in the low
    nibble (``quant_ir.e2m1_words``' order)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(rows: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_nibbles``: bytes ``[n, m]`` -> 4-bit codes ``[n, 2m]``."""
    rows = np.asarray(rows, np.uint8)
    return np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(rows.shape[0], -1)


# ---- e8m0 ----------------------------------------------------------------------------------
def e8m0_ceil_codes(v: np.ndarray) -> np.ndarray:
    """e8m0 codes (uint8) of the smallest powers of two ``>= v`` (float32 ``v >= 0`` or
    +inf), clamped below at ``2^-127``: the power of two is found with ``np.frexp``, the code
    is ml_dtypes' encoding of it (exact)."""
    v = np.asarray(v, dtype=np.float32).astype(np.float64)
    m, e = np.frexp(v)                                  # v = m * 2^e, 0.5 <= m < 1
    p = np.where(m == 0.5, v, np.ldexp(1.0, e))
    p = np.where(v == 0, 0.0, p)
    p = np.maximum(p, 2.0 ** -127)
    p = np.where(np.isinf(v), np.inf, p)
    with np.errstate(over="ignore"):                    # 2^128 and up: e8m0's NaN
        return p.astype(ml_dtypes().float8_e8m0fnu).view(np.uint8)


def e8m0_floor_codes(amax: np.ndarray, emax: int) -> np.ndarray:
    """The OCP MX shared exponent as e8m0 codes (uint8): ``floor(log2(amax)) - emax + 127``
    for float32 ``amax >= 0``, clamped below at code 0 (``2^-127``: also ``amax == 0`` and
    subnormal maxima); +inf gives 0xFF (e8m0's NaN). ``floor(log2)`` is ``np.frexp``'s
    exponent less one (exact)."""
    a = np.asarray(amax, dtype=np.float32).astype(np.float64)
    _, e = np.frexp(a)                                  # a = m * 2^e, 0.5 <= m < 1
    codes = np.maximum(e.astype(np.int64) - 1 - emax + E8M0_BIAS, 0)
    codes = np.where(a == 0, 0, codes)
    return np.where(np.isinf(a), E8M0_NAN, codes).astype(np.uint8)


def pow2_ceil_exponents(v: np.ndarray) -> np.ndarray:
    """The biased exponents (uint32) of the smallest powers of two ``>= v`` for normal float32
    ``v > 0`` (and +inf, which gives 255): the exponent field plus one where the mantissa is
    not zero (DeepEP's ``fast_log2_ceil`` plus 127). Not for zero, subnormals or NaN."""
    bits = np.asarray(v, dtype=np.float32).view(np.uint32)
    return (bits >> np.uint32(23)) + ((bits & np.uint32(0x7FFFFF)) != 0).astype(np.uint32)


def e8m0_values(codes: np.ndarray) -> np.ndarray:
    """float32 values ``2^(code - 127)`` of e8m0 codes (NaN for 0xFF)."""
    return np.asarray(codes, np.uint8).view(ml_dtypes().float8_e8m0fnu).astype(np.float32)


# ---- group scales --------------------------------------------------------------------------
def fp32_group_scale(amax: np.ndarray, bound: float, min_amax: float) -> np.ndarray:
    """float32 scales ``max(amax, min_amax) / bound``; the elements are divided by them."""
    return np.fmax(amax, np.float32(min_amax)) / np.float32(bound)


def fp32_pow2_group_scale(amax: np.ndarray, bound: float,
                          min_amax: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float32 scales ``2^e``, float32 multipliers ``2^-e`` (exact; 0 where not live), the
    groups' liveness) with ``e = ceil(log2(max(amax, min_amax) * RN(1 / bound)))``: one
    float32 multiply by the rounded inverse, then ``pow2_ceil_exponents`` of the product, the
    scale's biased exponent ``e + 127`` (its bits are that ``<< 23``). An infinite ``amax``
    gives 255: scale +inf, not live."""
    v = np.fmax(amax, np.float32(min_amax)) * (np.float32(1) / np.float32(bound))
    biased = pow2_ceil_exponents(v)
    live = biased != E8M0_NAN
    scale = (biased << np.uint32(23)).view(np.float32)
    exponent = E8M0_BIAS - biased.astype(np.int64)
    mult = np.where(live, np.ldexp(1.0, exponent), 0.0).astype(np.float32)
    return scale, mult, live


def e8m0_ceil_group_scale(amax: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """(e8m0 codes of ``amax / bound`` rounded up to a power of two, float32 multipliers
    ``0 if amax == 0 else 1 / scale``)."""
    codes = e8m0_ceil_codes(amax / np.float32(bound))
    s = e8m0_values(codes)
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = np.where(amax == 0, np.float32(0), np.float32(1) / s).astype(np.float32)
    return codes, mult


def e8m0_floor_group_scale(amax: np.ndarray, emax: int) -> tuple[np.ndarray, np.ndarray]:
    """(OCP e8m0 codes ``floor(log2(amax)) - emax + 127`` (``e8m0_floor_codes``), float32
    multipliers ``2^(127 - code)``, exact; 0 for the code 0xFF)."""
    codes = e8m0_floor_codes(amax, emax)
    live = codes != E8M0_NAN
    exponent = E8M0_BIAS - codes.astype(np.int64)
    return codes, np.where(live, np.ldexp(1.0, exponent), 0.0).astype(np.float32)


def e4m3_global_group_scale(amax: np.ndarray, g: np.float32,
                            bound: float) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes of ``(g * amax) / bound``, rounded to nearest even and saturated to 448,
    float32 multipliers ``0 if amax == 0 else g / float(scale)``)."""
    with np.errstate(over="ignore"):
        sf = (g * amax) / np.float32(bound)
    codes = np.minimum(sf, np.float32(FP8_MAX)).astype(ml_dtypes().float8_e4m3fn) \
        .view(np.uint8)
    sdec = codes.view(ml_dtypes().float8_e4m3fn).astype(np.float32)
    with np.errstate(divide="ignore"):
        mult = np.where(amax == 0, np.float32(0), g / sdec).astype(np.float32)
    return codes, mult

