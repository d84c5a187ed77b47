"""``NVFP4Format`` (reference ``NVBlockScaledTokenFormat[uint8, float8_e4m3fn, ...]``, protocol
section 3.4): e2m1 payload packed two per byte (the even element in the low nibble), one e4m3
scale per 16 elements, and a global input scale ``input_scale`` the caller supplies (the
reference's ``input_scales_wrapper``; here the f32 launch argument ``input_scale`` of
dispatch_async, an ``EmulatedWorld`` option).

Per group of 16 bf16 values ``x`` (in f32), with ``g = input_scale``::

    amax  = max(0, |x_i|)                          (max.f32: NaN elements ignored)
    s     = e4m3((g * amax) / 6)                   (mul.rn, div.rn, cvt.rn.satfinite: <= 448)
    mult  = 0 if amax == 0 else g / float(s)       (div.rn.f32; s == 0 gives +inf)
    nib_i = e2m1(x_i * mult)                       (nearest even, saturated to +-6, NaN -> +0)

sm_90 has no e2m1 conversion (``cvt...e2m1x2.f32`` is sm_100a+), so ``e2m1`` is one rounding
``add.rn.f32`` and integer arithmetic in IR (``quant_ir.e2m1_nibble``) and ``float(s)`` an
integer decode (``quant_ir.e4m3_to_f32``). Message: ``[0, align_up(H/2, A))`` the packed nibbles,
``[scales_offset, +align_up(H/16, A))`` the e4m3 scale bytes, then the header. Output: packed
rows ``[M, H/2]`` and the plain row-major scales ``[M, H/16]`` (uint8 e4m3 bits). The
reference's 5-D tcgen05/TMA scale layout and ``output_scales_offset`` are not implemented; no
``row_offsets`` padding.
"""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

import ir
from ir import types as T

from .blockscaled import BlockScaledFormat
from .quant_ir import (e2m1_nibble, e4m3_byte, e4m3_to_f32_by_cvt, f32, kernel_param,
                       quotient_by_fma)
from .registry import register_format

FP4_MAX = 6.0
#: ``g * amax`` is clamped here before the division by 6: every quotient from 448 up saturates
#: to e4m3's 448 (4096 / 6 = 682.7 does too), and the clamp turns an overflowed ``+inf`` into
#: a finite value for ``quotient_by_fma``
SCALE_INPUT_CLAMP = 4096.0
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def e2m1_codes(q: np.ndarray) -> np.ndarray:
    """The kernel's e2m1 encoding of float32 ``q`` through ml_dtypes: NaN -> +0 (ml_dtypes
    would give -0), saturate to +-6, round to nearest even. uint8 codes 0..15."""
    q = np.where(np.isnan(q), np.float32(0), q)
    q = np.clip(q, np.float32(-FP4_MAX), np.float32(FP4_MAX))
    return q.astype(E2M1).view(np.uint8) & 0xF


@register_format
@attrs.frozen
class NVFP4Format(BlockScaledFormat):
    """``NVFP4Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 32 == 0`` (groups of 16,
    16-byte vectors of 32 packed elements)."""

    name = "NVFP4"
    group_size = 16
    element_bits = 4
    scale_bytes = 1
    scales_host_dtype = np.uint8
    scales_dtype_name = "e4m3 (u8 bits)"
    scales_transposed = False
    uses_input_scale = True

    # ---- numpy reference --------------------------------------------------------------------
    def group_scales(self, amax: np.ndarray, input_scale) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3 scale codes uint8, multipliers float32) of groups with maxima ``amax``."""
        g = self.check_input_scale(input_scale)
        with np.errstate(over="ignore"):
            sf = (g * amax) / np.float32(FP4_MAX)
        codes = np.minimum(sf, np.float32(448)).astype(E4M3).view(np.uint8)
        sdec = codes.view(E4M3).astype(np.float32)
        with np.errstate(divide="ignore"):
            mult = np.where(amax == 0, np.float32(0), g / sdec).astype(np.float32)
        return codes, mult

    def quantize(self, x, input_scale=1.0):
        x = np.asarray(x, dtype=np.float32).reshape(-1, self.hid_dim)
        t = x.shape[0]
        g = x.reshape(t, self.n_scale_groups, self.group_size)
        amax = np.fmax.reduce(np.abs(g), axis=2, initial=np.float32(0))
        codes, mult = self.group_scales(amax, input_scale)
        with np.errstate(invalid="ignore", over="ignore"):
            nib = e2m1_codes(g * mult[..., None]).reshape(t, self.hid_dim)
        payload = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        return payload, codes

    def element_values(self, rows):
        nib = np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(rows.shape[0], -1)
        return nib.astype(np.uint8).view(E2M1).astype(np.float64)

    def dequantize_groups(self, q, scales, input_scale=1.0):
        g = float(self.check_input_scale(input_scale))
        return q * (scales.view(E4M3).astype(np.float64) / g)[..., None]

    def error_bound(self, x, input_scale=1.0):
        """``max(|x|/4, d/4, |x| - 6 d)`` with ``d = float(s) / input_scale`` the group's decode
        step (``x = q d``): half an e2m1 step is at most ``max(|q|/4, 1/4)`` for ``|q| <= 6``,
        and past 6 the value saturates. While the group scale neither saturates nor
        underflows (``input_scale * amax / 6`` in e4m3's normal range ``[2^-6, 448]``, where
        rounding it costs at most 2^-4), ``|q| <= 6.4`` and the bound is ``|x|/4 + d/4``."""
        x = np.asarray(x, dtype=np.float32).reshape(-1, self.hid_dim)
        _, codes = self.quantize(x, input_scale)
        d = codes.view(E4M3).astype(np.float64) / float(self.check_input_scale(input_scale))
        d = np.repeat(d, self.group_size, axis=1)
        a = np.abs(x.astype(np.float64))
        return np.maximum(np.maximum(a / 4, d / 4), a - 6 * d)

    # ---- device steps -----------------------------------------------------------------------
    def emit_item_quant(self, r, xs, amax):
        """``mul.rn.f32``, ``min.f32``, ``mul.rn.f32`` and two ``fma.rn.f32`` (the division by
        6), ``cvt.rn.satfinite.e4m3x2.f32`` (the scale byte), ``cvt.rn.f16x2.e4m3x2`` and
        ``cvt.f32.f16`` (its value), ``div.rn.f32`` (the multiplier), then per element
        ``mul.rn.f32`` and the e2m1 encoding (``quant_ir.e2m1_nibble``); 8 nibbles make one
        u32. The quotient by 6 (``quant_ir.quotient_by_fma``, on ``min(g * amax,
        SCALE_INPUT_CLAMP)``) and the ``cvt`` decode give the same scale bytes and
        multipliers as a ``div.rn.f32`` and the integer decode (``quant_ir.e4m3_to_f32``)
        for every input (tests/test_formats_quant.py), with one ``div.rn.f32`` fewer per
        8-element item."""
        g = kernel_param(r, "input_scale", T.f32)
        scaled = r.let("nv_gamax", (g * amax).min(f32(SCALE_INPUT_CLAMP)))
        code = e4m3_byte(r, quotient_by_fma(r, scaled, FP4_MAX, "nv_sf"), "nv_scale")
        sdec = e4m3_to_f32_by_cvt(r, code, "nv_sdec")
        mult = r.let("nv_mult", ir.Select(amax.eq(f32(0)), f32(0), g / sdec))
        word = None
        for i, x in enumerate(xs):
            nib = e2m1_nibble(r, x * mult, f"nv_e{i}")
            part = nib << (4 * i) if i else nib
            word = part if word is None else word | part
        return [r.let("nv_word", word)], code
