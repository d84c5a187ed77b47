"""The token-major receive of a world (``world.dispatch_tokens``; docs/deepep.md, "Normal
mode"): every rank's ``ep_dispatch_async`` of an ``ep_rank_dedup`` configuration, unchanged,
then every rank's ``ep_dispatch_wait_tokens`` (``kernels.dispatch_tokens``) in place of
``ep_dispatch_wait``. Placed through the world's placement interface alone, as the combine
side is (``runtime.combine.Combiner``): the module is made co-resident, loaded on the world's
GPUs, its grids checked; each rank's buffers (``TokensLayout``) are allocated on its GPU.
"""

from __future__ import annotations

import numpy as np

from ..reference_tokens import TokenMajorResult
from ..kernels.dispatch_tokens import (KERNEL_NAME, TokensLayout, build_dispatch_tokens_module,
                                       check_supported)


class TokenMajorBuffers:
    """One rank's buffers of the token-major receive (``TokensLayout``): ``scratch``
    (zeroed; each call leaves it zeroed), ``out_x`` ``[rows, H]`` uint16, ``out_topk``
    ``[rows, K]`` int64, ``out_weights`` ``[rows, K]`` float32, ``out_src`` ``[rows, 2]``
    int32, ``meta`` int32."""

    def __init__(self, cuda, cfg, rk):
        tl, fmt = TokensLayout(cfg), cfg.token_fmt

        def z(shape, dt):
            return cuda.zeros(shape, dt, device=rk.device, stream=rk.stream)
        self.scratch = z(tl.scratch_words, np.uint32)
        self.out_x = z((tl.rows, fmt.hid_dim), np.uint16)
        self.out_topk = z((tl.rows, fmt.top_k), np.int64)
        self.out_weights = z((tl.rows, fmt.top_k), np.float32)
        self.out_src = z((tl.rows, 2), np.int32)
        self.meta = z(tl.meta_words, np.int32)


class TokenMajorReceiver:
    """The token-major receive of ``world`` (module docstring; ``world.token_receiver()``).
    ``ValueError`` for a configuration the kernel does not take
    (``dispatch_tokens.check_supported``) or a batched world."""

    def __init__(self, world):
        cfg = world.cfg
        check_supported(cfg)
        if world.batched:
            raise ValueError(f"{world.world_name}.dispatch_tokens: a batched world (one "
                             f"launch of every rank's grid) is not supported")
        self.world = world
        self.layout = TokensLayout(cfg)
        self.programs = world.load(world.co_resident(build_dispatch_tokens_module(cfg)))
        self.program = self.programs.first
        world.check_resident(self.programs, (KERNEL_NAME,),
                             f"{world.world_name}.dispatch_tokens")
        self.bufs = [TokenMajorBuffers(world.cuda, cfg, rk) for rk in world.ranks]
        self.pad_rows = [0] * len(world.ranks)
        world.synchronize()

    def kernels(self) -> tuple:
        """The loaded kernels (``ir.Kernel``), naming the error buffers' records."""
        return tuple(self.program.module.kernels)

    def args(self, i: int, pad_rows: int = 0) -> dict:
        """``ep_dispatch_wait_tokens``'s launch arguments for rank index ``i``: its receive
        buffer and count words, its token-major buffers, ``pad_rows`` (rows up to which the
        ids of rows past the received ones are written ``-1``)."""
        w = self.world
        rk, b = w.ranks[i], self.bufs[i]
        return {"recv_buf_p": rk.recv_buf, "recv_count_p": rk.recv_count,
                "scratch": b.scratch, "out_x": b.out_x, "out_topk": b.out_topk,
                "out_weights": b.out_weights, "out_src": b.out_src, "meta": b.meta, "pad_rows": pad_rows,
                "my_rank": rk.rank, "err_buf": w.err_of(rk).ptr, "timeout_ns": w.timeout_ns}

    def enqueue(self, pad_rows=0) -> None:
        """Enqueue every calling rank's ``ep_dispatch_wait_tokens`` on its stream, after its
        ``ep_dispatch_async`` (stream order); each rank's ``wait_done`` becomes the end of
        it. ``pad_rows``: one int for every rank, or one per rank."""
        w = self.world
        pads = list(pad_rows) if isinstance(pad_rows, (list, tuple)) \
            else [pad_rows] * len(w.ranks)
        for i, rk in enumerate(w.ranks):
            pad = pads[i]
            if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) \
                    or not 0 <= pad <= self.layout.rows:
                raise ValueError(f"pad_rows: must be an int in [0, {self.layout.rows}] (the "
                                 f"rows n_ranks * max_tokens_per_rank), got {pad!r}")
        for i, rk in enumerate(w.ranks):
            if not rk.calling:
                continue
            self.pad_rows[i] = int(pads[i])
            self.programs.of(rk).launch(KERNEL_NAME, w.cfg.n_sms, self.args(i, int(pads[i])),
                                        rk.stream)
            rk.wait_done = w.cuda.record_event(rk.stream)

    def run(self, tokens, topk_ids, pad_rows=0, topk_weights=None) -> list:
        """One dispatch of every rank's ``tokens`` / ``topk_ids`` (as ``world.dispatch``
        takes them) and ``topk_weights`` (None: zeros travel), received token-major:
        ``finish``'s results."""
        w = self.world
        weights = w.check_weights(topk_weights, topk_ids)
        w.load_inputs(tokens, topk_ids)
        w.load_weights(weights)
        w.dispatch_async()
        self.enqueue(pad_rows)
        return self.finish()

    def finish(self) -> list:
        """Synchronise, raise ``EPTimeoutError`` if a wait expired (re-arming the world and
        these buffers), and return each rank's ``TokenMajorResult``."""
        w = self.world
        w.synchronize()
        try:
            w.raise_timeouts(tuple(w.program.module.kernels) + self.kernels(),
                             "dispatch_tokens")
        except Exception:
            self.rearm()
            w.reset()
            raise
        return [self.result(i) for i in range(len(w.ranks))]

    def rearm(self) -> None:
        """Zero every rank's scratch (after a failed call)."""
        for b in self.bufs:
            b.scratch.zero()

    def result(self, i: int) -> TokenMajorResult:
        """Rank index ``i``'s ``TokenMajorResult`` of the last call (synchronised)."""
        w, tl = self.world, self.layout
        rk, b = w.ranks[i], self.bufs[i]
        R = w.cfg.n_ranks
        meta = b.meta.to_host()
        n = int(meta[tl.N_ROWS])
        topk, src = b.out_topk.to_host(), b.out_src.to_host()
        weights = b.out_weights.to_host()
        pad = max(n, self.pad_rows[i])
        return TokenMajorResult(
            rank=rk.rank, n_rows=n, x=b.out_x.to_host()[:n], topk_idx=topk[:n],
            topk_weights=weights[:n], src=src[:n],
            rank_prefix=meta[tl.rank_prefix_offset:tl.rank_prefix_offset + R].copy(),
            expert_counts=meta[tl.expert_count_offset:tl.meta_words].copy(),
            pad_topk=topk[n:pad], pad_weights=weights[n:pad], pad_src=src[n:pad])


__all__ = ["TokenMajorReceiver", "TokenMajorBuffers"]
