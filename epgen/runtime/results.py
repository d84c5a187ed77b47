"""One rank's dispatch outputs, as the kernels left them in its buffers, read as the
reference's ``RankResult``: the one assembly that every world's ``results()`` and
``epgen.torch``'s ``DispatchOutput.to_reference`` use."""

from __future__ import annotations

import numpy as np

from .. import reference
from ..layout import EP_DATA_READY_FLAG


def region_a_blocks(region_a, L: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """``(counts[L, R], block_starts[L, R])`` from dispatch_wait's Region A (pair ``w = e*R +
    src``: ``[2w] = 1024 + end row``, ``[2w+1] = count``): where each (expert, source) block
    landed, which in the capacity-strided layout is the reservation order."""
    a = np.asarray(region_a[:2 * L * R]).astype(np.int64)
    counts = a[1::2].reshape(L, R)
    return counts.astype(np.int32), a[0::2].reshape(L, R) - EP_DATA_READY_FLAG - counts


def rank_result(cfg, rank: int, *, n_tokens: int, out_tokens, row_offsets, expert_ids,
                src_info, region_a, out_scales=None,
                allreduce_world_size: int | None = None) -> reference.RankResult:
    """Rank ``rank``'s ``reference.RankResult`` from host copies of its buffers:
    ``out_tokens`` and ``src_info`` (at least the ``row_offsets[-1]`` rows written),
    ``row_offsets``, ``expert_ids``, ``region_a`` (dispatch_wait's Region A words),
    ``out_scales`` (the format's device layout; None for a format without scales).
    ``n_tokens``: the rank's token count this call; ``allreduce_world_size``: the devices
    sharing the shared expert's tokens under ``skip_a2a`` (None: every rank packs all its
    tokens; ``reference.se_slice``)."""
    lay = cfg.layout
    row_offsets = np.asarray(row_offsets).view(np.uint32)
    n = int(row_offsets[-1])
    counts, starts = region_a_blocks(region_a, lay.n_local_experts, cfg.n_ranks)
    se_start, se_tokens = 0, 0
    if cfg.fused_shared_expert:
        se_start, se_tokens = reference.se_slice(n_tokens, rank, allreduce_world_size)
    scales = None if out_scales is None else cfg.token_fmt.scales_from_device(out_scales, n)
    return reference.RankResult.from_outputs(
        cfg, rank, out_tokens[:n], row_offsets, expert_ids, src_info[:n], counts,
        se_tokens=se_tokens, se_token_start=se_start, out_scales=scales,
        block_starts=starts if cfg.ep_final_layout else None)


__all__ = ["region_a_blocks", "rank_result"]
