"""``MXFP8Format`` (reference ``NVBlockScaledTokenFormat[float8_e4m3fn, float8_e8m0fnu, ...]``,
protocol section 3.4): e4m3 payload, one e8m0 (power-of-two) scale per 32 elements.

Per group of 32 bf16 values ``x`` (in f32)::

    amax  = max(0, |x_i|)                      (max.f32: NaN elements ignored)
    s     = e8m0(amax / 448)                   (div.rn.f32, then rounded UP to a power of two)
    mult  = 0 if amax == 0 else 1 / float(s)   (div.rn.f32, exact)
    q_i   = min(max(x_i * mult, -448), 448)    (mul.rn.f32 exact; the clamp only catches NaN)
    byte_i = e4m3(q_i), or 0 when s is 0xFF    (cvt.rn.satfinite.e4m3x2.f32)

Rounding of the scale: the reference casts ``amax / 448`` to ``float8_e8m0fnu``, and its own
probe records that this cast rounds toward +inf (1.0 -> 127, 1.0 + ulp -> 128, 1.5 -> 128;
protocol section 10); ``ml_dtypes.float8_e8m0fnu`` rounds to nearest instead (1.0 + ulp ->
127), which would let ``|x| * mult`` exceed 448. We round up, as the reference does: then
``|x_i| * mult <= 448`` (up to the rounding of ``amax / 448``). sm_90 has no e8m0 conversion
(``cvt...ue8m0x2`` is sm_100a+): ``quant_ir.e8m0_ceil`` does it with integer operations. Values
at or below ``2^-127`` get the smallest scale ``2^-127`` (code 0; also for ``amax == 0``); an
infinite ``amax`` gives code 0xFF (e8m0's NaN) and zero payload bytes (a "dead" block, as the
reference's MX path writes).

Message: ``[0, align_up(H, A))`` the e4m3 bytes, ``[scales_offset, +align_up(H/32, A))`` the
e8m0 scale bytes, then the header. Output: e4m3 rows ``[M, H]`` and the plain row-major scales
``[M, H/32]`` (uint8 e8m0 bits); no ``row_offsets`` padding.
"""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

import ir

from .blockscaled import BlockScaledFormat
from .quant_ir import E8M0_NAN, clamp, e4m3_pairs, e8m0_ceil, e8m0_to_f32, f32
from .registry import register_format

FP8_MAX = 448.0
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


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
        return p.astype(E8M0).view(np.uint8)


@register_format
@attrs.frozen
class MXFP8Format(BlockScaledFormat):
    """``MXFP8Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 32 == 0``."""

    name = "MXFP8"
    group_size = 32
    element_bits = 8
    scale_bytes = 1
    scales_host_dtype = np.uint8
    scales_dtype_name = "e8m0 (u8 bits)"
    scales_transposed = False

    # ---- numpy reference --------------------------------------------------------------------
    def quantize(self, x, input_scale=1.0):
        x = np.asarray(x, dtype=np.float32).reshape(-1, self.hid_dim)
        t = x.shape[0]
        g = x.reshape(t, self.n_scale_groups, self.group_size)
        amax = np.fmax.reduce(np.abs(g), axis=2, initial=np.float32(0))
        codes = e8m0_ceil_codes(amax / np.float32(FP8_MAX))
        s = codes.view(E8M0).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            mult = np.where(amax == 0, np.float32(0), np.float32(1) / s).astype(np.float32)
            q = g * mult[..., None]
        q = np.fmin(np.fmax(q, np.float32(-FP8_MAX)), np.float32(FP8_MAX))
        q = np.where((codes == E8M0_NAN)[..., None], np.float32(0), q)
        return q.astype(E4M3).view(np.uint8).reshape(t, self.hid_dim), codes

    def element_values(self, rows):
        return rows.view(E4M3).astype(np.float64)

    def dequantize_groups(self, q, scales, input_scale=1.0):
        return q * scales.view(E8M0).astype(np.float64)[..., None]

    def error_bound(self, x, input_scale=1.0):
        """``2^-4 |x| + 2^-10 s``: half an e4m3 step in units of the group's power-of-two
        scale ``s``."""
        x = np.asarray(x, dtype=np.float32).reshape(-1, self.hid_dim)
        _, codes = self.quantize(x)
        s = np.repeat(codes.view(E8M0).astype(np.float64), self.group_size, axis=1)
        return 2.0 ** -4 * np.abs(x.astype(np.float64)) + 2.0 ** -10 * s

    # ---- device steps -----------------------------------------------------------------------
    def emit_item_quant(self, r, xs, amax):
        """``div.rn.f32`` and the integer e8m0 round-up (the scale byte), ``div.rn.f32`` (the
        multiplier), then per element ``mul.rn.f32``, the clamp, a dead-block ``selp`` and one
        ``cvt.rn.satfinite.e4m3x2.f32`` per pair."""
        code = e8m0_ceil(r, amax / f32(FP8_MAX), "mx_scale")
        s = e8m0_to_f32(r, code, "mx_s")
        mult = r.let("mx_mult", ir.Select(amax.eq(f32(0)), f32(0), f32(1.0) / s))
        live = r.let("mx_live", code.ne(E8M0_NAN))
        qs = [r.let(f"mx_q{i}", ir.Select(live, clamp(x * mult, FP8_MAX), f32(0)))
              for i, x in enumerate(xs)]
        return e4m3_pairs(r, qs, "mx_fp8"), code
