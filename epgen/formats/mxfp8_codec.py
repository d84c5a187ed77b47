"""``MXFP8Codec``: MXFP8 on the host, exactly as the kernel quantises (the arithmetic is in
``mxfp8``'s docstring): e4m3 bytes through ``ml_dtypes.float8_e4m3fn``, e8m0 scale codes
rounded up (``e8m0_ceil_codes``)."""

from __future__ import annotations

import numpy as np

from .blockscaled_codec import BlockScaledCodec
from .codec import ml_dtypes
from .elements import E8M0_NAN, FP8_MAX


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


class MXFP8Codec(BlockScaledCodec):
    """Numpy side of ``MXFP8Format``."""

    def quantize(self, x, input_scale=1.0):
        f = self.fmt
        g, amax = self.scale_groups(x)
        t = g.shape[0]
        codes = e8m0_ceil_codes(amax / np.float32(FP8_MAX))
        s = codes.view(ml_dtypes().float8_e8m0fnu).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            mult = np.where(amax == 0, np.float32(0), np.float32(1) / s).astype(np.float32)
            q = g * mult[..., None]
        q = np.fmin(np.fmax(q, np.float32(-FP8_MAX)), np.float32(FP8_MAX))
        q = np.where((codes == E8M0_NAN)[..., None], np.float32(0), q)
        return q.astype(ml_dtypes().float8_e4m3fn).view(np.uint8).reshape(t, f.hid_dim), codes

    def element_values(self, rows):
        return rows.view(ml_dtypes().float8_e4m3fn).astype(np.float64)

    def dequantize_groups(self, q, scales, input_scale=1.0):
        return q * scales.view(ml_dtypes().float8_e8m0fnu).astype(np.float64)[..., None]

    def error_bound(self, x, input_scale=1.0):
        """``2^-4 |x| + 2^-10 s``: half an e4m3 step in units of the group's power-of-two
        scale ``s``."""
        f = self.fmt
        x = np.asarray(x, dtype=np.float32).reshape(-1, f.hid_dim)
        _, codes = self.quantize(x)
        s = codes.view(ml_dtypes().float8_e8m0fnu).astype(np.float64)
        s = np.repeat(s, f.group_size, axis=1)
        return 2.0 ** -4 * np.abs(x.astype(np.float64)) + 2.0 ** -10 * s
