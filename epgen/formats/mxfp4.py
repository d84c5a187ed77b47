"""``MXFP4Format``: OCP MX FP4, e2m1 elements two per byte (the even element low) and one e8m0
scale per 32 elements by the OCP shared-exponent rule (docs/formats.md, "MXFP4")::

    X      = floor(log2(amax)) - 2        (2: e2m1's emax; code X + 127, at least 0)
    nib_i  = e2m1(x_i * 2^-X)             (nearest even, saturated to +-6, NaN -> +0)

``amax == 0`` gives code 0 (``2^-127``) and +-0 elements; an infinite ``amax`` gives code
0xFF and zero payload bytes (a "dead" block, as MXFP8). Output: packed rows ``[M, H/2]`` and
row-major scales ``[M, H/32]`` (uint8 e8m0 bits).
"""

from __future__ import annotations

import attrs

from .blockscaled import BlockScaledFormat
from .registry import register_format
from .scaling import E2M1, E8M0_OCP


@register_format
@attrs.frozen
class MXFP4Format(BlockScaledFormat):
    """``MXFP4Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 32 == 0``."""

    name = "MXFP4"
    element = E2M1
    scale_rule = E8M0_OCP
    group_size = 32
    ir_prefix = "mx4"
