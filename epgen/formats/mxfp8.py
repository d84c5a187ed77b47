"""``MXFP8Format``: e4m3 payload, one e8m0 (power-of-two) scale per 32 elements.

Per group of 32 bf16 values ``x`` (in f32)::

    amax  = max(0, |x_i|)                      (max.f32: NaN elements ignored)
    s     = e8m0(amax / 448)                   (div.rn.f32, then rounded UP to a power of two)
    mult  = 0 if amax == 0 else 1 / float(s)   (div.rn.f32, exact)
    q_i   = min(max(x_i * mult, -448), 448)    (mul.rn.f32 exact; the clamp only catches NaN)
    byte_i = e4m3(q_i), or 0 when s is 0xFF    (cvt.rn.satfinite.e4m3x2.f32)

Rounding of the scale: the reference casts ``amax / 448`` to ``float8_e8m0fnu``, and that cast
rounds toward +inf (1.0 -> 127, 1.0 + ulp -> 128, 1.5 -> 128); ``ml_dtypes.float8_e8m0fnu``
rounds to nearest instead (1.0 + ulp -> 127), which would let ``|x| * mult`` exceed 448. We
round up, as the reference does: then ``|x_i| * mult <= 448`` (up to the rounding of ``amax /
448``). sm_90 has no e8m0 conversion (``cvt...ue8m0x2`` is sm_100a+): ``quant_ir.e8m0_ceil``
does it with integer operations. Values at or below ``2^-127`` get the smallest scale
``2^-127`` (code 0; also for ``amax == 0``); an infinite ``amax`` gives code 0xFF (e8m0's NaN)
and zero payload bytes (a "dead" block, as the reference's MX path writes).

Message: ``[0, align_up(H, A))`` the e4m3 bytes, ``[scales_offset, +align_up(H/32, A))`` the
e8m0 scale bytes, then the header. Output: e4m3 rows ``[M, H]`` and the plain row-major scales
``[M, H/32]`` (uint8 e8m0 bits); no ``row_offsets`` padding. Host codec:
``mxfp8_codec.MXFP8Codec``; device emitter: ``mxfp8_emit.MXFP8Emitter``.
"""

from __future__ import annotations

import attrs
import numpy as np

from .blockscaled import BlockScaledFormat
from .elements import FP8_MAX  # noqa: F401
from .mxfp8_codec import MXFP8Codec, e8m0_ceil_codes  # noqa: F401
from .mxfp8_emit import MXFP8Emitter
from .registry import register_format


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
    #: the block-staged broadcast wins at prefill (``TokenFormat``'s measurement)
    prefers_block_staged_broadcast = True
    codec_class = MXFP8Codec
    emitter_class = MXFP8Emitter
