"""``NVFP4Codec``: NVFP4 on the host, exactly as the kernel quantises (the arithmetic is in
``nvfp4``'s docstring): e4m3 group scale codes and e2m1 nibbles through ``ml_dtypes``
(``e2m1_codes``: NaN -> +0, saturated to +-6), packed two per byte, the even element low."""

from __future__ import annotations

import numpy as np

from .blockscaled_codec import BlockScaledCodec
from .codec import ml_dtypes
from .elements import FP4_MAX


def e2m1_codes(q: np.ndarray) -> np.ndarray:
    """The kernel's e2m1 encoding of float32 ``q`` through ml_dtypes: NaN -> +0 (ml_dtypes
    would give -0), saturate to +-6, round to nearest even. uint8 codes 0..15."""
    q = np.where(np.isnan(q), np.float32(0), q)
    q = np.clip(q, np.float32(-FP4_MAX), np.float32(FP4_MAX))
    return q.astype(ml_dtypes().float4_e2m1fn).view(np.uint8) & 0xF


class NVFP4Codec(BlockScaledCodec):
    """Numpy side of ``NVFP4Format``."""

    def group_scales(self, amax: np.ndarray, input_scale) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3 scale codes uint8, multipliers float32) of groups with maxima ``amax``."""
        g = self.check_input_scale(input_scale)
        with np.errstate(over="ignore"):
            sf = (g * amax) / np.float32(FP4_MAX)
        codes = np.minimum(sf, np.float32(448)).astype(ml_dtypes().float8_e4m3fn).view(np.uint8)
        sdec = codes.view(ml_dtypes().float8_e4m3fn).astype(np.float32)
        with np.errstate(divide="ignore"):
            mult = np.where(amax == 0, np.float32(0), g / sdec).astype(np.float32)
        return codes, mult

    def quantize(self, x, input_scale=1.0):
        f = self.fmt
        g, amax = self.scale_groups(x)
        t = g.shape[0]
        codes, mult = self.group_scales(amax, input_scale)
        with np.errstate(invalid="ignore", over="ignore"):
            nib = e2m1_codes(g * mult[..., None]).reshape(t, f.hid_dim)
        payload = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        return payload, codes

    def element_values(self, rows):
        nib = np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(rows.shape[0], -1)
        return nib.astype(np.uint8).view(ml_dtypes().float4_e2m1fn).astype(np.float64)

    def dequantize_groups(self, q, scales, input_scale=1.0):
        g = float(self.check_input_scale(input_scale))
        return q * (scales.view(ml_dtypes().float8_e4m3fn).astype(np.float64) / g)[..., None]

    def error_bound(self, x, input_scale=1.0):
        """``max(|x|/4, d/4, |x| - 6 d)`` with ``d = float(s) / input_scale`` the group's decode
        step (``x = q d``): half an e2m1 step is at most ``max(|q|/4, 1/4)`` for ``|q| <= 6``,
        and past 6 the value saturates. While the group scale neither saturates nor
        underflows (``input_scale * amax / 6`` in e4m3's normal range ``[2^-6, 448]``, where
        rounding it costs at most 2^-4), ``|q| <= 6.4`` and the bound is ``|x|/4 + d/4``."""
        f = self.fmt
        x = np.asarray(x, dtype=np.float32).reshape(-1, f.hid_dim)
        _, codes = self.quantize(x, input_scale)
        d = codes.view(ml_dtypes().float8_e4m3fn).astype(np.float64) \
            / float(self.check_input_scale(input_scale))
        d = np.repeat(d, f.group_size, axis=1)
        a = np.abs(x.astype(np.float64))
        return np.maximum(np.maximum(a / 4, d / 4), a - 6 * d)
