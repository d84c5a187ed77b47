"""Per-rank memory of the combine (docs/combine.md): the combine receive buffer and the
arrival words, which peers write, and the counter words of the rank's counter array that
the combine kernels use (``EPLayout`` regions)."""

from __future__ import annotations

import attrs


@attrs.frozen
class CombineLayout:
    """Sizes of one rank's combine buffers for ``cfg``."""

    cfg: object

    @property
    def recv_bytes(self) -> int:
        """The combine receive buffer: ``max_tokens_per_rank * K * H`` BF16 rows, slot
        ``(t, k)`` at ``(t * K + k) * H * 2``; peer-visible."""
        fmt = self.cfg.token_fmt
        return self.cfg.max_tokens_per_rank * fmt.top_k * fmt.hid_dim * 2

    @property
    def arrival_words(self) -> int:
        """``n_sources`` arrival words (``R``; 1 under ``skip_a2a``, where the device is its
        own only destination), word ``d`` written by destination ``d``; peer-visible."""
        return self.cfg.layout.n_sources

    @property
    def arrival_word_bytes(self) -> int:
        """4 (u32 words), or 8 under the SHMEM transport (``cfg.needs_shmem``): a source
        outside the sender's P2P group gets its word through ``nvshmemx_signal_op``, which
        sets a u64 signal word, so every word of the array is a u64 there."""
        return 8 if self.cfg.needs_shmem else 4

    @property
    def done_counter_offset(self) -> int:
        """combine_async's per-source done counters: the combine rank-completion region."""
        return self.cfg.layout.combine_rank_completion_region.offset

    @property
    def wait_counter_offset(self) -> int:
        """combine_wait's block counter: word 0 of the combine-wait region."""
        return self.cfg.layout.combine_wait_region.offset

    def describe(self) -> dict:
        return {"combine_recv_bytes": self.recv_bytes,
                "combine_arrival_words": self.arrival_words,
                "combine_arrival_word_bytes": self.arrival_word_bytes,
                "combine_done_counter_offset": self.done_counter_offset,
                "combine_wait_counter_offset": self.wait_counter_offset}
