"""``RankBuffers``: the device buffers and the stream of one rank of a world (layout members
in ``epgen/layout.py``; where the peer-written ones come from is the world's
``RankWorld.memory_of``)."""

from __future__ import annotations

import numpy as np

from ..kernels.rank_mask import mask_words


class RankBuffers:
    """The device buffers and stream of one rank (``rank``, its ``my_rank``) on ``device``.
    The buffers other ranks write (receive buffers and count words; with ep_final_layout the
    grouped output and its scales, the header array and the prod buffer) come from
    ``peer_memory`` when one is given (a pool the peers' GPUs can access, ``P2PWorld``; the
    symmetric heap, ``ShmemWorld``), the send buffer (read by SHMEM puts) from
    ``send_memory``; None: the device's default memory (``RankWorld.memory_of``).

    Besides the buffers: ``n_tokens`` (this call's token count), ``wait_done`` (the event
    after the rank's last launch of a call: the next call waits for every rank's),
    ``calling`` (whether the rank takes part in the world's current call: always, unless
    ``ep_rank_mask`` lets it sit one out, docs/design.md "Rank masks") and ``trace_bufs``
    (kernel name -> trace buffer, for kernels built with trace points). With
    ``ep_rank_mask``, ``rank_mask``: the rank's mask words (``kernels.rank_mask``), from
    ``peer_memory`` (its peers set them when they mask it). With ``ep_rank_dedup``,
    ``topk_weights`` (``[T, K]`` float32, the weights dispatch_async puts in its messages)
    and ``row_map`` (``layout.dedup_row_map_words`` u32, filled by dispatch_wait); else
    None. With ``Tuning.wait_times``, ``wait_time``: dispatch_wait's wait for each count word
    (``n_experts`` u64, ns; ``kernels.wait_time``); else None."""

    def __init__(self, cuda, cfg, rank, device, peer_memory=None, send_memory=None):
        lay, fmt = cfg.layout, cfg.token_fmt
        H, K, T = fmt.hid_dim, fmt.top_k, cfg.max_tokens_per_rank
        self.rank = rank
        self.device = device
        self.stream = cuda.create_stream(device)

        def z(shape, dt, memory=None):
            kw = {} if memory is None else {"memory_resource": memory}
            return cuda.zeros(shape, dt, device=device, stream=self.stream, **kw)
        peer = {} if peer_memory is None else {"memory_resource": peer_memory}
        self.tokens = z((T, H), np.uint16)
        self.topk_ids = z((T, K), np.int32)
        self.send_buf = z(lay.send_buf_bytes, np.uint8, send_memory)
        self.recv_buf = z(lay.recv_buf_bytes, np.uint8, peer_memory)
        self.recv_count = cuda.to_device(lay.recv_count_initial(), device=device,
                                         stream=self.stream, **peer)
        self.counters = z(lay.counter_words, np.int32)
        self.out_tokens = z((lay.max_out_rows, *fmt.out_row_shape), fmt.host_dtype, peer_memory)
        self.out_scales = (z(fmt.out_scales_shape(lay.max_out_rows), fmt.scales_host_dtype,
                             peer_memory) if fmt.out_scales is not None else None)
        self.row_offsets = z(lay.n_groups + 1, np.uint32)
        self.expert_ids = z(lay.n_groups, np.int32)
        self.src_info = z((lay.max_out_rows, 2), np.int32)
        self.hdr_buf = z(lay.hdr_buf_bytes, np.uint8, peer_memory)       # ep_final_layout
        self.prod_buf = z(lay.prod_buf_words, np.uint64, peer_memory)    # ep_prod_reserve
        # ep_rank_mask: this rank's mask words, which its peers' kernels write too (the push)
        self.rank_mask = z(mask_words(cfg), np.uint32, peer_memory) if cfg.ep_rank_mask \
            else None
        # ep_rank_dedup (ours): the router weights the messages carry, and the row map
        # dispatch_wait fills (docs/flags.md); read by the partial-reduce combine
        self.topk_weights = z((T, K), np.float32) if cfg.ep_rank_dedup else None
        self.row_map = z(max(lay.dedup_row_map_words, 1), np.uint32) if cfg.ep_rank_dedup \
            else None
        # Tuning.wait_times (ours): dispatch_wait's time waited for each count word, ns
        self.wait_time = z(cfg.n_experts, np.uint64) if cfg.tuning.wait_times else None
        self.n_tokens = 0
        self.wait_done = None
        self.calling = True
        self.trace_bufs = {}

    def counter_ptr(self, region) -> int:
        """The address of counter ``region`` (a ``layout`` region) in this rank's counters."""
        return self.counters.ptr + 4 * region.offset


__all__ = ["RankBuffers"]
