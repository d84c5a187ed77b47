"""``BlockwiseFP8Format`` (reference ``BlockwiseFP8TokenFormat[float8_e4m3fn, float32, ...]``,
protocol section 3.3): e4m3 payload, one float32 scale per 128 elements.

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
dispatch_wait aux block); padding rows are never written.
"""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

from ir import types as T

from ..primitives import block_inclusive_scan, word
from .blockscaled import BlockScaledFormat
from .quant_ir import clamp, e4m3_pairs, f32
from .registry import register_format

FP8_MAX = 448.0
MIN_AMAX = 1e-4
E4M3 = ml_dtypes.float8_e4m3fn


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

    @property
    def fp8_quant_size(self) -> int:
        """The reference's name of ``quant_size``: ``align_up(H, A)``."""
        return self.quant_size

    # ---- numpy reference --------------------------------------------------------------------
    def quantize(self, x, input_scale=1.0):
        x = np.asarray(x, dtype=np.float32).reshape(-1, self.hid_dim)
        g = x.reshape(x.shape[0], self.n_scale_groups, self.group_size)
        amax = np.fmax.reduce(np.abs(g), axis=2, initial=np.float32(0))
        scale = np.fmax(amax, np.float32(MIN_AMAX)) / np.float32(FP8_MAX)
        with np.errstate(invalid="ignore", divide="ignore"):
            q = g / scale[..., None]
        q = np.fmin(np.fmax(q, np.float32(-FP8_MAX)), np.float32(FP8_MAX))
        payload = q.astype(E4M3).view(np.uint8).reshape(x.shape[0], self.hid_dim)
        return payload, scale.astype(np.float32)

    def element_values(self, rows):
        return rows.view(E4M3).astype(np.float64)

    def dequantize_groups(self, q, scales, input_scale=1.0):
        return q * scales.astype(np.float64)[..., None]

    def error_bound(self, x, input_scale=1.0):
        """``2^-4 |x| + 2^-10 scale``: half an e4m3 step (3 mantissa bits; subnormal step
        ``2^-9``) in units of the group scale."""
        x = np.asarray(x, dtype=np.float32).reshape(-1, self.hid_dim)
        _, scale = self.quantize(x)
        s = np.repeat(scale.astype(np.float64), self.group_size, axis=1)
        return 2.0 ** -4 * np.abs(x.astype(np.float64)) + 2.0 ** -10 * s

    # ---- device steps -----------------------------------------------------------------------
    def emit_item_quant(self, r, xs, amax):
        """``max.f32``, ``div.rn.f32`` (scale), then per element ``div.rn.f32``, the
        ``max.f32``/``min.f32`` clamp and one ``cvt.rn.satfinite.e4m3x2.f32`` per pair."""
        scale = r.let("fp8_scale", amax.max(f32(MIN_AMAX)) / f32(FP8_MAX))
        qs = [r.let(f"fp8_q{i}", clamp(x / scale, FP8_MAX)) for i, x in enumerate(xs)]
        return e4m3_pairs(r, qs), scale

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups, comm_barrier_id=-1):
        """``pad_expert_offsets``, by the whole aux block after the prefix sum: thread ``j <
        n_groups`` rounds group ``j``'s row count up to ``expert_m_padding``, a block-wide
        inclusive scan (shared memory ``pad_totals``) gives the padded ends, and thread ``j``
        rewrites ``row_offsets[j + 1]`` (``row_offsets[0]`` stays 0). The caller's next
        barrier publishes them to the block."""
        p = self.expert_m_padding
        totals = r.kb.shared_buffer("pad_totals", 4 * 32)
        rows = r.var("pad_rows", T.u32, 0)
        with r.if_(r.tid < n_groups):
            lo = r.load(word(row_offsets, r.tid), T.u32, name="pad_lo")
            hi = r.load(word(row_offsets, r.tid + 1), T.u32, name="pad_hi")
            r.assign(rows, (hi - lo + (p - 1)) // p * p)
        end = block_inclusive_scan(r, rows, totals, r.n_threads // 32, "pad", comm_barrier_id)
        with r.if_(r.tid < n_groups):
            r.store(word(row_offsets, r.tid + 1), end)
