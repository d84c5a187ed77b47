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
dispatch_wait aux block); padding rows are never written. Host codec:
``fp8_codec.BlockwiseFP8Codec``; device emitter: ``fp8_emit.BlockwiseFP8Emitter``.
"""

from __future__ import annotations

import attrs
import numpy as np

from .blockscaled import BlockScaledFormat
from .elements import FP8_MAX, MIN_AMAX  # noqa: F401
from .fp8_codec import BlockwiseFP8Codec
from .fp8_emit import BlockwiseFP8Emitter
from .registry import register_format


@register_format
@attrs.frozen
class BlockwiseFP8Format(BlockScaledFormat):
    """``BlockwiseFP8Format(hid_dim, top_k, alignment=16)``; ``hid_dim % 128 == 0``."""

    name = "BlockwiseFP8"
    group_size = 128
    element_bits = 8
    scale_bytes = 4
    scales_host_dtype = np.float32
    scales_dtype_name = "f32"
    scales_transposed = True
    #: ``16 // sizeof(scales_dtype)``: rows per expert are rounded up to this
    expert_m_padding = 16 // 4
    #: the block-staged broadcast wins at prefill (``TokenFormat``'s measurement)
    prefers_block_staged_broadcast = True
    codec_class = BlockwiseFP8Codec
    emitter_class = BlockwiseFP8Emitter

    @property
    def fp8_quant_size(self) -> int:
        """The reference's name of ``quant_size``: ``align_up(H, A)``."""
        return self.quant_size
