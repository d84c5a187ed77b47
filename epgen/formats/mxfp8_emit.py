"""``MXFP8Emitter``: MXFP8's item arithmetic (the integer e8m0 round-up of the scale, its
multiplier, ``mul.rn.f32``, clamp, the dead-block ``selp``, ``cvt.rn.satfinite.e4m3x2.f32``)."""

from __future__ import annotations

import ir

from .blockscaled_emit import BlockScaledEmitter
from .elements import E8M0_NAN, FP8_MAX
from .quant_ir import clamp, e4m3_pairs, e8m0_ceil, e8m0_to_f32, f32


class MXFP8Emitter(BlockScaledEmitter):
    """Device steps of ``MXFP8Format``."""

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
