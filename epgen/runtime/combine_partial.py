"""The partial-reduce combine's side of a world's ``Combiner`` (``ep_rank_dedup`` only;
docs/combine.md, "Partial reduce"): made on the first ``partial_reduce=True`` call, it loads
the partial-reduce module (``build_combine_partial_module``: ``ep_combine_async_partial``,
``ep_combine_wait_partial``, ``ep_combine_partial``) the way the Combiner loads the BF16 one
(co-resident, grids checked, trace buffers) and, under the SHMEM transport, allocates each
rank's send staging (one BF16 row per grouped-output row, where a put's source must live).
The receive buffers, arrival words, counters, expert outputs, residual and output are the
Combiner's; the destination also reads its dispatch receive buffer (the messages' top-k ids
and weights) and the row map dispatch_wait filled (``RankBuffers``).
"""

from __future__ import annotations

import numpy as np

from ..kernels import build_combine_partial_module
from ..kernels.combine_partial import PartialWire
from . import trace as runtime_trace


class PartialCombine:
    """The partial-reduce module's programs and buffers of ``combiner`` (module
    docstring)."""

    def __init__(self, combiner):
        world = combiner.world
        cfg = world.cfg
        self.world = world
        self.programs = world.load(world.co_resident(build_combine_partial_module(cfg)))
        self.program = self.programs.first
        world.check_resident(self.programs,
                             tuple(self.wire_name(n) for n in combiner.bf16_kernels()),
                             f"{world.world_name}.combine(partial_reduce=True)")
        runtime_trace.allocate(world, self.program.module)
        self.stage = []
        row_bytes = 2 * cfg.token_fmt.hid_dim
        for rk in world.ranks:
            mem = world.memory_of(rk.device).get("send_memory")
            kw = {} if mem is None else {"memory_resource": mem}
            self.stage.append(world.cuda.zeros(cfg.layout.max_out_rows * row_bytes, np.uint8,
                                               device=rk.device, stream=rk.stream, **kw)
                              if cfg.needs_shmem else None)
        world.synchronize()

    @staticmethod
    def wire_name(bf16_name: str) -> str:
        """The partial-reduce twin of a BF16 combine kernel's name."""
        return PartialWire.name(bf16_name)

    def async_args(self, i: int) -> dict:
        """What ``ep_combine_async_partial`` takes besides the BF16 kernel's arguments: this
        rank's dispatch receive buffer and row map and, under the SHMEM transport, the send
        staging."""
        rk = self.world.ranks[i]
        args = {"dedup_recv_buf": rk.recv_buf, "row_map": rk.row_map}
        if self.stage[i] is not None:
            args["pr_stage"] = self.stage[i]
        return args

    def wait_args(self, i: int) -> dict:
        """What ``ep_combine_wait_partial`` takes besides the BF16 kernel's: nothing."""
        return {}


__all__ = ["PartialCombine"]
