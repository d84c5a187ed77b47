"""``NVFP4Format``: e2m1 payload packed two per byte (the even element in the low nibble), one
e4m3 scale per 16 elements, and a global input scale ``input_scale`` the caller supplies (the
reference's ``input_scales_wrapper``; here the f32 launch argument ``input_scale`` of
dispatch_async, an ``EmulatedWorld`` option).

Per group of 16 bf16 values ``x`` (in f32), with ``g = input_scale``::

    amax  = max(0, |x_i|)                          (max.f32: NaN elements ignored)
    s     = e4m3((g * amax) / 6)                   (mul.rn, quotient, cvt.rn.satfinite: <= 448)
    mult  = 0 if amax == 0 else g / float(s)       (div.rn.f32; s == 0 gives +inf)
    nib_i = e2m1(x_i * mult)                       (nearest even, saturated to +-6, NaN -> +0)

The quotient by 6 is ``div.rn.f32``'s, computed by a multiply and two ``fma.rn.f32``
(``quant_ir.quotient_by_fma``, on ``min(g * amax, 4096)``), and ``float(s)`` is decoded by
``cvt.rn.f16x2.e4m3x2``. sm_90 has no e2m1 conversion (``cvt...e2m1x2.f32`` is sm_100a+), so
``e2m1`` is one rounding ``add.rn.f32`` and integer arithmetic in IR
(``quant_ir.e2m1_nibble``). Message: ``[0, align_up(H/2, A))`` the packed nibbles,
``[scales_offset, +align_up(H/16, A))`` the e4m3 scale bytes, then the header. Output: packed
rows ``[M, H/2]`` and the plain row-major scales ``[M, H/16]`` (uint8 e4m3 bits). The
reference's 5-D tcgen05/TMA scale layout and ``output_scales_offset`` are not implemented; no
``row_offsets`` padding. Declared as element ``E2M1``, scale rule ``E4M3_GLOBAL``, groups of
16 (``scaling``).
"""

from __future__ import annotations

import attrs

from .blockscaled import BlockScaledFormat
from .registry import register_format
from .scaling import E2M1, E4M3_GLOBAL


@register_format
@attrs.frozen
class NVFP4Format(BlockScaledFormat):
    """``NVFP4Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 32 == 0`` (groups of 16,
    16-byte vectors of 32 packed elements)."""

    name = "NVFP4"
    element = E2M1
    scale_rule = E4M3_GLOBAL
    group_size = 16
    ir_prefix = "nv"
    #: the warp send path wins at prefill (``TokenFormat``'s measurement)
    prefers_block_staged_broadcast = False
