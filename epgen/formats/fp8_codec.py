"""``BlockwiseFP8Codec``: BlockwiseFP8 on the host, exactly as the kernel quantises (the
arithmetic is in ``fp8``'s docstring): e4m3 bytes through ``ml_dtypes.float8_e4m3fn`` (round
to nearest even), float32 group scales."""

from __future__ import annotations

import numpy as np

from .blockscaled_codec import BlockScaledCodec
from .codec import ml_dtypes
from .elements import FP8_MAX, MIN_AMAX


class BlockwiseFP8Codec(BlockScaledCodec):
    """Numpy side of ``BlockwiseFP8Format``."""

    def quantize(self, x, input_scale=1.0):
        f = self.fmt
        g, amax = self.scale_groups(x)
        scale = np.fmax(amax, np.float32(MIN_AMAX)) / np.float32(FP8_MAX)
        with np.errstate(invalid="ignore", divide="ignore"):
            q = g / scale[..., None]
        q = np.fmin(np.fmax(q, np.float32(-FP8_MAX)), np.float32(FP8_MAX))
        payload = q.astype(ml_dtypes().float8_e4m3fn).view(np.uint8)
        payload = payload.reshape(g.shape[0], f.hid_dim)
        return payload, scale.astype(np.float32)

    def element_values(self, rows):
        return rows.view(ml_dtypes().float8_e4m3fn).astype(np.float64)

    def dequantize_groups(self, q, scales, input_scale=1.0):
        return q * scales.astype(np.float64)[..., None]

    def error_bound(self, x, input_scale=1.0):
        """``2^-4 |x| + 2^-10 scale``: half an e4m3 step (3 mantissa bits; subnormal step
        ``2^-9``) in units of the group scale."""
        f = self.fmt
        x = np.asarray(x, dtype=np.float32).reshape(-1, f.hid_dim)
        _, scale = self.quantize(x)
        s = np.repeat(scale.astype(np.float64), f.group_size, axis=1)
        return 2.0 ** -4 * np.abs(x.astype(np.float64)) + 2.0 ** -10 * s
