"""``BlockwiseFP8Pow2Format``: e4m3 payload, one float32 power-of-two scale per 128 elements,
the scales of DeepEP's low-latency dispatch with ``round_scale=True`` (its
``calculate_fp8_scales``).

Per group of 128 bf16 values ``x`` (in f32)::

    amax   = max(1e-4, |x_i|)                     (max.f32: NaN elements ignored)
    e      = ceil(log2(amax * RN(1/448)))         (mul.rn.f32 by 0f3B124925; exponent field
                                                   - 127, +1 when the mantissa is not zero)
    scale  = 2^e                                  (stored float32, never zero)
    q_i    = min(max(x_i * 2^-e, -448), 448)      (mul.rn.f32, exact; a NaN element -> -448)
    byte_i = e4m3(q_i)                            (cvt.rn.satfinite.e4m3x2.f32: nearest even)

An infinite ``amax`` gives the scale +inf and zero payload bytes (a dead group). The message
and output layouts are BlockwiseFP8's: e4m3 rows ``[M, H]``, the scales **transposed**
``[H/128, output_scales_rows]`` float32, ``row_offsets`` padded per expert to
``expert_m_padding = 16 // sizeof(f32) = 4`` rows (``fp8_emit.BlockwiseFP8Emitter``).
Declared as element ``E4M3``, scale rule ``FP32_POW2_PER_GROUP``, groups of 128
(``scaling``). DeepEP's UE8M0 scale byte is the stored scale's exponent byte, ``bits >> 23``.
"""

from __future__ import annotations

import attrs

from .blockscaled import BlockScaledFormat
from .fp8_emit import BlockwiseFP8Emitter
from .registry import register_format
from .scaling import E4M3, FP32_POW2_PER_GROUP


@register_format
@attrs.frozen
class BlockwiseFP8Pow2Format(BlockScaledFormat):
    """``BlockwiseFP8Pow2Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 128 == 0``."""

    name = "BlockwiseFP8Pow2"
    element = E4M3
    scale_rule = FP32_POW2_PER_GROUP
    group_size = 128
    scales_transposed = True
    ir_prefix = "pow2"
    golden_suffix = "fp8pow2"
    #: ``16 // sizeof(scales_dtype)``: rows per expert are rounded up to this
    expert_m_padding = 16 // 4
    emitter_class = BlockwiseFP8Emitter
