"""``NVFP4Emitter``: NVFP4's item arithmetic: the group scale (the quotient by 6 by ``fma``,
its e4m3 byte and ``cvt`` decode), the multiplier, and per element the e2m1 encoding by one
rounding addition; 8 nibbles make one u32."""

from __future__ import annotations

import ir
from ir import types as T

from .blockscaled_emit import BlockScaledEmitter
from .elements import FP4_MAX
from .quant_ir import (e2m1_nibble, e4m3_byte, e4m3_to_f32_by_cvt, f32, kernel_param,
                       quotient_by_fma)

#: ``g * amax`` is clamped here before the division by 6: every quotient from 448 up saturates
#: to e4m3's 448 (4096 / 6 = 682.7 does too), and the clamp turns an overflowed ``+inf`` into
#: a finite value for ``quotient_by_fma``
SCALE_INPUT_CLAMP = 4096.0


class NVFP4Emitter(BlockScaledEmitter):
    """Device steps of ``NVFP4Format``."""

    def emit_item_quant(self, r, xs, amax):
        """``mul.rn.f32``, ``min.f32``, ``mul.rn.f32`` and two ``fma.rn.f32`` (the division by
        6), ``cvt.rn.satfinite.e4m3x2.f32`` (the scale byte), ``cvt.rn.f16x2.e4m3x2`` and
        ``cvt.f32.f16`` (its value), ``div.rn.f32`` (the multiplier), then per element
        ``mul.rn.f32`` and the e2m1 encoding (``quant_ir.e2m1_nibble``); 8 nibbles make one
        u32. The quotient by 6 (``quant_ir.quotient_by_fma``, on ``min(g * amax,
        SCALE_INPUT_CLAMP)``) and the ``cvt`` decode give the same scale bytes and
        multipliers as a ``div.rn.f32`` and the integer decode (``quant_ir.e4m3_to_f32``)
        for every input (tests/unit/test_formats_quant.py), with one ``div.rn.f32`` fewer per
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
