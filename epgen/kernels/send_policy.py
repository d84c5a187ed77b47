"""The send path's policy: which send path a build takes (``uses_warp_send``,
``uses_block_broadcast``, ``prefers_block_broadcast``), whether the monitor blocks send too
(``sends_from_every_block``) and how many warps share a token (``send_warps_per_token``).
Pure functions of the configuration (its format's properties, flags, geometry and
``cfg.tuning``); they emit nothing.

A destination outside the sender's P2P group (``cfg.needs_shmem``, the one SHMEM decision)
is reached by an NVSHMEM put whose source is the message in the send buffer, so such a build
takes the send-buffer path (``send_buffer_tokens``) with its cross-group fan-out, never the
warp path or the block-staged broadcast (whose messages live in registers or shared memory).
"""

from __future__ import annotations


def prefers_block_broadcast(cfg) -> bool:
    """Whether a staged variant that could take the warp send path takes the block-staged
    broadcast (every block sending) instead: its format prefers it
    (``fmt.prefers_block_staged_broadcast``: measured faster at prefill for BF16, MXFP8 and
    BlockwiseFP8, not NVFP4), a prefill-sized ``max_tokens_per_rank``
    (``cfg.tuning.block_broadcast_min_tokens_per_block`` per block: a full call gives every
    block at least that many tokens), not the final layout (the block-staged broadcast
    writes receive buffers only)."""
    return (cfg.token_fmt.prefers_block_staged_broadcast and not cfg.ep_final_layout
            and not cfg.needs_shmem and cfg.max_tokens_per_rank
            >= cfg.tuning.block_broadcast_min_tokens_per_block * cfg.n_sms)


def uses_warp_send(cfg) -> bool:
    """Whether ``copy_and_send_tokens`` takes the warp send path (``warp_broadcast_tokens``):
    no role split, no shared expert (both read the staged send buffer), no
    ``ep_send_join_named`` (it names the staged paths' block-wide join), no NVSHMEM
    destination (``cfg.needs_shmem``: the put reads the send buffer), under
    ``ep_final_layout`` only formats whose payload is the output row, and not where the
    block-staged broadcast is faster (``prefers_block_broadcast``)."""
    return (not cfg.layout.role_split.enabled and not cfg.fused_shared_expert
            and not cfg.ep_send_join_named and not cfg.needs_shmem
            and (not cfg.ep_final_layout or writes_final_rows_by_warp(cfg.token_fmt))
            and not prefers_block_broadcast(cfg))


def writes_final_rows_by_warp(fmt) -> bool:
    """Whether the warp send path can write ``fmt``'s ``ep_final_layout`` rows: its payload
    is the output row (BF16), or its broadcast also writes the rows' scales
    (``broadcasts_final_rows``: NVFP4, MXFP8, BlockwiseFP8's transposed scales): each warp
    quantizes its token once and writes the payload to the K output rows and the scales to
    those rows' places. Measured on the H200, final+prod at prefill, against the staged path
    (docs/PERF.md's tuning table): NVFP4 0.212 -> 0.643 of copy, MXFP8 0.299 -> 0.686,
    BlockwiseFP8 0.225 -> 0.328. Other formats (scale rows not whole 16-byte vectors) take
    the staged path."""
    return fmt.payload_is_output_row or fmt.broadcasts_final_rows


def uses_block_broadcast(cfg) -> bool:
    """Whether ``copy_and_send_tokens`` takes the block-staged broadcast
    (``broadcast_tokens``): a staged path (``uses_warp_send`` false) without the role split,
    the final layout, the shared expert or an NVSHMEM destination, which read the staged send
    buffer."""
    return (not uses_warp_send(cfg) and not cfg.layout.role_split.enabled
            and not cfg.ep_final_layout and not cfg.fused_shared_expert
            and not cfg.needs_shmem)


def sends_from_every_block(cfg) -> bool:
    """Whether the monitor blocks send too (``add_send_phase`` splits their work around the
    sends): the warp send path and the block-staged broadcast (``ep_send_join_named``). The
    monitor blocks count their experts and reserve first (``count_and_reserve``), send their
    share of the tokens, then signal (``signal_after_sends``), instead of leaving the sends to
    the ``grid - n_signal_sms`` comm blocks. For the block-staged broadcast, measured on the
    H200 at prefill (docs/PERF.md's tuning table): round trip BF16 0.817 -> 0.896 of copy,
    NVFP4 0.536 -> 0.770."""
    return uses_warp_send(cfg) or uses_block_broadcast(cfg)


#: The first hardware barrier id of the token groups' barriers (one id per group of a block:
#: ids ``[TOKEN_GROUP_BARRIER_BASE, 16)``; ids below it are the kernels' other barriers).
TOKEN_GROUP_BARRIER_BASE = 4


def send_warps_per_token(cfg) -> int:
    """Warps per token on the warp send path: the largest power of two up to
    ``cfg.tuning.send_warps_per_token_max`` that divides a block's warps, leaves at most
    ``cfg.tuning.max_token_groups`` groups per block, and still gives every token of a full
    call (``max_tokens_per_rank``) a group of its own over the grid's ``n_sms`` blocks; 1
    under ``ep_final_layout`` (its rows come from the monitors' hand-off, per warp). When the
    sending warps outnumber a call's tokens (decode), a token's quantising loop or copy runs
    on that many warps of one block at once. Measured on the H200 at decode, 1 -> 4 warps,
    fused graph round trip (docs/PERF.md's tuning table): NVFP4 0.464 -> 0.543 of copy, MXFP8
    0.596 -> 0.655, BlockwiseFP8 0.560 -> 0.635. Each group's barrier is a branch of its own
    (``token_group_sync``), so more groups mean more code and a slower generation."""
    warps = cfg.num_threads // 32
    if cfg.ep_final_layout:
        return 1
    tuning = cfg.tuning
    fits = [n for n in (2 ** i for i in range(1, 6)) if n <= tuning.send_warps_per_token_max
            and warps % n == 0
            and warps // n <= min(tuning.max_token_groups, 16 - TOKEN_GROUP_BARRIER_BASE)
            and cfg.n_sms * warps // n >= cfg.max_tokens_per_rank]
    return max(fits, default=1)


__all__ = ["TOKEN_GROUP_BARRIER_BASE", "prefers_block_broadcast",
           "uses_warp_send", "writes_final_rows_by_warp", "uses_block_broadcast",
           "sends_from_every_block", "send_warps_per_token"]
