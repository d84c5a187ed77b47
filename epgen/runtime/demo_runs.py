"""Host drivers of the demo kernels (``epgen.demos``): the GPU tests and the copy benchmark
use them. Each returns what the kernel produced and what numpy says it should be."""

from __future__ import annotations

import numpy as np

import ir
from .. import demos
from .diagnostics import DiagBuffer
from .program import Program

DEFAULT_TIMEOUT_NS = 2_000_000_000


class DemoRunner:
    """Compiles the three demo kernels once for the current GPU."""

    def __init__(self, device=None):
        from backends import cuda
        self.cuda = cuda
        self.copy = Program(demos.copy16_module(), device=device)
        self.pc = Program(demos.producer_consumer_module(), device=device)
        self.hs = Program(demos.handshake_module(), device=device)
        self.device = self.copy.device

    # -- copy16 ----------------------------------------------------------------------------
    def copy16(self, dst, src, n_bytes: int, stream=None, blocks: int | None = None):
        """Enqueue ``dst[:n_bytes] = src[:n_bytes]`` (``n_bytes`` a multiple of 16)."""
        if n_bytes % 16:
            raise ValueError(f"n_bytes must be a multiple of 16, got {n_bytes}")
        blocks = blocks or 2 * self.cuda.sm_count(self.device)
        self.copy.launch("copy16", blocks, {"dst": dst, "src": src, "n_vec": n_bytes // 16},
                         stream)

    # -- producer/consumer -------------------------------------------------------------------
    def producer_consumer(self, n_producers: int, n_consumers: int, chunk_words: int, seed: int,
                          epoch: int = 1, timeout_ns: int = DEFAULT_TIMEOUT_NS):
        """Run one grid of producers and consumers; returns ``(out, expected)``."""
        cuda = self.cuda
        data = cuda.zeros(n_producers * chunk_words, np.uint32, device=self.device)
        flags = cuda.zeros(n_producers, np.uint32, device=self.device)
        out = cuda.zeros(n_consumers * chunk_words, np.uint32, device=self.device)
        err = DiagBuffer(self.device)
        self.pc.launch("producer_consumer", n_producers + n_consumers, {
            "data": data, "flags": flags, "out": out, "n_producers": n_producers,
            "chunk_words": chunk_words, "seed": seed, "epoch": epoch, "err_buf": err.ptr,
            "timeout_ns": timeout_ns})
        result = out.to_host()
        err.check(self.pc.module.kernels, "producer_consumer")
        idx = np.arange(n_producers * chunk_words, dtype=np.uint64)
        produced = (np.uint64(seed) ^ idx).astype(np.uint32)
        c = np.arange(n_consumers, dtype=np.uint64)[:, None]
        src = produced.reshape(n_producers, chunk_words)[(c[:, 0] % n_producers)]
        expected = (src.astype(np.uint64) * 3 + c).astype(np.uint32).reshape(-1)
        return result, expected

    # -- handshake ---------------------------------------------------------------------------
    def handshake(self, payloads, n_blocks: int, epochs: int = 1, launch_ranks=(0, 1),
                  timeout_ns: int = DEFAULT_TIMEOUT_NS):
        """Two emulated ranks exchange ``payloads[r]`` (uint32 arrays of equal size, a multiple
        of ``4 * n_blocks``) over ``epochs`` back-to-back calls, each rank on its own stream.
        Only the ranks in ``launch_ranks`` are launched (one alone exercises the timeout).
        Returns the per-rank ``out`` arrays of the last call."""
        cuda = self.cuda
        n_words = payloads[0].size
        if n_words % (4 * n_blocks):
            raise ValueError("payload size must be a multiple of 4 * n_blocks words")
        chunk_vecs = n_words // 4 // n_blocks
        streams = [cuda.create_stream(self.device) for _ in range(2)]
        payload = [cuda.to_device(np.ascontiguousarray(p, np.uint32), device=self.device)
                   for p in payloads]
        inbox = [cuda.zeros(n_words, np.uint32, device=self.device) for _ in range(2)]
        arrivals = [cuda.zeros(1, np.uint32, device=self.device) for _ in range(2)]
        out = [cuda.zeros(n_words, np.uint32, device=self.device) for _ in range(2)]
        err = DiagBuffer(self.device)
        for epoch in range(1, epochs + 1):
            for r in launch_ranks:
                peer = 1 - r
                self.hs.launch("handshake", n_blocks, {
                    "payload": payload[r], "peer_inbox": inbox[peer],
                    "peer_arrivals": arrivals[peer], "inbox": inbox[r], "arrivals": arrivals[r],
                    "out": out[r], "chunk_vecs": chunk_vecs, "epoch": epoch, "my_rank": r,
                    "err_buf": err.ptr, "timeout_ns": timeout_ns}, streams[r])
            for s in streams:
                s.sync()
        result = [o.to_host() for o in out]
        err.check(self.hs.module.kernels, "handshake")
        return result


def kernels_of(*programs: Program) -> list[ir.Kernel]:
    return [k for p in programs for k in p.module.kernels]
