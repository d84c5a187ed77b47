"""``BlockwiseFP8Emitter``: BlockwiseFP8's ``pad_expert_offsets`` (rows per expert rounded up
to ``expert_m_padding``, by a block-wide scan); its item arithmetic is its declaration's
(``BlockScaledEmitter.emit_item_quant``)."""

from __future__ import annotations

from ir import types as T

from ..primitives import block_inclusive_scan, word
from .blockscaled_emit import BlockScaledEmitter


class BlockwiseFP8Emitter(BlockScaledEmitter):
    """Device steps of ``BlockwiseFP8Format``."""

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups):
        """``pad_expert_offsets``, by the whole aux block after the prefix sum: thread ``j <
        n_groups`` rounds group ``j``'s row count up to ``expert_m_padding``, a block-wide
        inclusive scan (the role's scratch ``pad_totals``) gives the padded ends, and thread ``j``
        rewrites ``row_offsets[j + 1]`` (``row_offsets[0]`` stays 0). The caller's next
        barrier publishes them to the block."""
        f = self.fmt
        p = f.expert_m_padding
        totals = r.scratch("pad_totals", 4 * 32)
        rows = r.var("pad_rows", T.u32, 0)
        with r.if_(r.tid < n_groups):
            lo = r.load(word(row_offsets, r.tid), T.u32, name="pad_lo")
            hi = r.load(word(row_offsets, r.tid + 1), T.u32, name="pad_hi")
            r.assign(rows, (hi - lo + (p - 1)) // p * p)
        end = block_inclusive_scan(r, rows, totals, r.n_threads // 32, "pad")
        with r.if_(r.tid < n_groups):
            r.store(word(row_offsets, r.tid + 1), end)
