"""The FP8 combine's side of a world's ``Combiner`` (docs/combine.md, "FP8 combine"): made on
the first ``fp8=True`` call, it loads the FP8 combine module (``build_combine_fp8_module``:
``ep_combine_async_fp8``, ``ep_combine_wait_fp8``, ``ep_combine_fp8``) the way the Combiner
loads the BF16 one (co-resident, grids checked, trace buffers), allocates each rank's FP8
receive buffer (``CombineLayout.fp8_recv_bytes`` plus the guard bytes, peer-visible:
registered symmetric under the SHMEM transport) and, under the SHMEM transport, its send
staging (``fp8_stage_bytes``, where the Combiner's expert outputs come from: a put's source),
and builds the receive-buffer tables as the Combiner builds the BF16 ones. Afterwards a world
switches between the two combines per call without building anything. The arrival words,
counters, expert outputs, weights, residual and output are the Combiner's, shared by both.
"""

from __future__ import annotations

import numpy as np

from ..combine_fp8 import check_hid_dim
from ..combine_layout import CombineLayout
from ..kernels import build_combine_fp8_module
from ..kernels.combine_fp8 import Fp8Wire
from . import trace as runtime_trace


class Fp8Combine:
    """The FP8 module's programs and buffers of ``combiner`` (module docstring)."""

    def __init__(self, combiner, guard_bytes: int):
        world = combiner.world
        cfg = world.cfg
        check_hid_dim(cfg.token_fmt.hid_dim, f"{world.world_name}.combine")
        self.programs = world.load(world.co_resident(build_combine_fp8_module(cfg)))
        self.program = self.programs.first
        world.check_resident(self.programs,
                             tuple(self.wire_name(n) for n in combiner.bf16_kernels()),
                             f"{world.world_name}.combine(fp8=True)")
        runtime_trace.allocate(world, self.program.module)
        clay = CombineLayout(cfg)
        self.recv, self.stage = [], []
        for rk in world.ranks:
            mem = world.memory_of(rk.device)

            def z(nbytes, memory):
                kw = {} if memory is None else {"memory_resource": memory}
                return world.cuda.zeros(nbytes, np.uint8, device=rk.device, stream=rk.stream,
                                        **kw)
            self.recv.append(z(clay.fp8_recv_bytes + guard_bytes, mem.get("peer_memory")))
            self.stage.append(z(clay.fp8_stage_bytes, mem.get("send_memory"))
                              if clay.fp8_stage_bytes else None)
        world.synchronize()
        world.register_symmetric("combine_fp8_recv", self.recv)
        self.recv_ptrs = [world.pointer_table(i, combiner.table_ranks(rk), self.recv)
                          for i, rk in enumerate(world.ranks)]
        world.synchronize()           # the tables landed before any stream's kernel reads them

    @staticmethod
    def wire_name(bf16_name: str) -> str:
        """The FP8 twin of a BF16 combine kernel's name (``ep_combine`` -> ``ep_combine_fp8``)."""
        return Fp8Wire.name(bf16_name)

    def async_args(self, i: int) -> dict:
        """What ``ep_combine_async_fp8`` takes in place of the BF16 kernel's arguments: the
        FP8 receive-buffer table and, under the SHMEM transport, the send staging."""
        args = {"combine_buf_ptrs": self.recv_ptrs[i]}
        if self.stage[i] is not None:
            args["fp8_stage"] = self.stage[i]
        return args

    def wait_args(self, i: int) -> dict:
        """What ``ep_combine_wait_fp8`` takes in place of the BF16 kernel's: the FP8 receive
        buffer."""
        return {"combine_buf": self.recv[i]}


__all__ = ["Fp8Combine"]
