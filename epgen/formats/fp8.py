"""``BlockwiseFP8Format``: e4m3 payload, one float32 scale per 128 elements.

Per group of 128 bf16 values ``x`` (in f32)::

    amax  = max(0, |x_i|)                      (max.f32: NaN elements ignored)
    scale = max(amax, 1e-4) / 448              (div.rn.f32)
    q_i   = min(max(x_i / scale, -448), 448)   (div.rn.f32; a NaN element becomes -448)
    byte_i = e4m3(q_i)                         (cvt.rn.satfinite.e4m3x2.f32: nearest even)

Message: ``[0, align_up(H, A))`` the e4m3 bytes, ``[scales_offset, +align_up(4 H/128, A))``
the f32 scales (``scales_offset = fp8_quant_size``), then the header. Output: e4m3 rows
``[M, H]`` and the scales **transposed**, ``output_scales[g, row]`` of a float32
``[H/128, output_scales_rows]`` tensor. ``row_offsets`` are padded per expert to
``expert_m_padding = 16 // sizeof(f32) = 4`` rows (``pad_expert_offsets``, in the
dispatch_wait aux block); padding rows are never written. Declared as element ``E4M3``,
scale rule ``FP32_PER_GROUP``, groups of 128 (``scaling``); device emitter
``fp8_emit.BlockwiseFP8Emitter`` (the padding).
"""

from __future__ import annotations

import attrs

from .blockscaled import BlockScaledFormat
from .fp8_emit import BlockwiseFP8Emitter
from .registry import register_format
from .scaling import E4M3, FP32_PER_GROUP


@register_format
@attrs.frozen
class BlockwiseFP8Format(BlockScaledFormat):
    """``BlockwiseFP8Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 128 == 0``."""

    name = "BlockwiseFP8"
    element = E4M3
    scale_rule = FP32_PER_GROUP
    group_size = 128
    scales_transposed = True
    ir_prefix = "fp8"
    #: the payload words' IR name (the IR goldens pin it)
    ir_words = "fp8"
    golden_suffix = "fp8"
    #: ``16 // sizeof(scales_dtype)``: rows per expert are rounded up to this
    expert_m_padding = 16 // 4
    #: the block-staged broadcast wins at prefill (``TokenFormat``'s measurement)
    prefers_block_staged_broadcast = True
    emitter_class = BlockwiseFP8Emitter

    @property
    def fp8_quant_size(self) -> int:
        """The reference's name of ``quant_size``: ``align_up(H, A)``."""
        return self.quant_size
