"""Per-rank memory of the combine (docs/combine.md): the combine receive buffer and the
arrival words, which peers write (and the FP8 combine's receive buffer and send staging,
epgen's own), and the counter words of the rank's counter array that
the combine kernels use (``EPLayout`` regions)."""

from __future__ import annotations

import attrs

from . import combine_fp8


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

    # ---- the FP8 combine (epgen's own: ``fp8=True``, docs/combine.md "FP8 combine") -------
    @property
    def fp8_slot_bytes(self) -> int:
        """One slot of the FP8 receive buffer: the E4M3 codes of a row, then its float32
        scales (one per 128 elements), padded to 16 bytes (``combine_fp8.slot_bytes``);
        ``ValueError`` unless ``hid_dim`` is a multiple of 128."""
        return combine_fp8.slot_bytes(self.cfg)

    @property
    def fp8_recv_bytes(self) -> int:
        """The FP8 combine receive buffer: ``max_tokens_per_rank * K`` slots, slot ``(t, k)``
        at ``(t * K + k) * fp8_slot_bytes``; peer-visible (a symmetric object under the SHMEM
        transport)."""
        return self.cfg.max_tokens_per_rank * self.cfg.token_fmt.top_k * self.fp8_slot_bytes

    @property
    def fp8_stage_bytes(self) -> int:
        """Under the SHMEM transport only (else 0): the FP8 send staging, one slot per row of
        the grouped output (``max_out_rows``), where a destination quantises a row before
        copying or putting it (a put's source must be registered memory)."""
        if not self.cfg.needs_shmem:
            return 0
        return self.cfg.layout.max_out_rows * self.fp8_slot_bytes

    @property
    def fp8_supported(self) -> bool:
        """Whether ``fp8=True`` is possible: ``hid_dim`` a multiple of 128."""
        return self.cfg.token_fmt.hid_dim % combine_fp8.GROUP == 0

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
        """The sizes and counter words by name; the FP8 buffers' where ``hid_dim`` allows
        them (``fp8_supported``)."""
        d = {"combine_recv_bytes": self.recv_bytes,
             "combine_arrival_words": self.arrival_words,
             "combine_arrival_word_bytes": self.arrival_word_bytes,
             "combine_done_counter_offset": self.done_counter_offset,
             "combine_wait_counter_offset": self.wait_counter_offset}
        if self.fp8_supported:
            d.update(combine_fp8_slot_bytes=self.fp8_slot_bytes,
                     combine_fp8_recv_bytes=self.fp8_recv_bytes,
                     combine_fp8_stage_bytes=self.fp8_stage_bytes)
        return d
