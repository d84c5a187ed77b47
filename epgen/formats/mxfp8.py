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
does it with integer operations (``quant_host.e8m0_ceil_codes`` on the host). Values at or
below ``2^-127`` get the smallest scale ``2^-127`` (code 0; also for ``amax == 0``); an
infinite ``amax`` gives code 0xFF (e8m0's NaN) and zero payload bytes (a "dead" block, as the
reference's MX path writes).

Message: ``[0, align_up(H, A))`` the e4m3 bytes, ``[scales_offset, +align_up(H/32, A))`` the
e8m0 scale bytes, then the header. Output: e4m3 rows ``[M, H]`` and the plain row-major scales
``[M, H/32]`` (uint8 e8m0 bits); no ``row_offsets`` padding. Declared as element ``E4M3``,
scale rule ``E8M0_CEIL``, groups of 32 (``scaling``).
"""

from __future__ import annotations

import attrs

from .blockscaled import BlockScaledFormat
from .registry import register_format
from .scaling import E4M3, E8M0_CEIL


@register_format
@attrs.frozen
class MXFP8Format(BlockScaledFormat):
    """``MXFP8Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 32 == 0``."""

    name = "MXFP8"
    element = E4M3
    scale_rule = E8M0_CEIL
    group_size = 32
    ir_prefix = "mx"
    #: the block-staged broadcast wins at prefill (``TokenFormat``'s measurement)
    prefers_block_staged_broadcast = True
