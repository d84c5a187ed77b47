"""Host runner of the ``ep_fused_roles`` test kernel (``epgen.kernels.fused_roles``) on an
``EmulatedWorld``: every rank runs the world's dispatch_async, then the test kernel in place of
dispatch_wait (same buffers, same inter-call ordering), with its L1 arrival counters zeroed and
its output rows and checksums poisoned first."""

from __future__ import annotations

import attrs
import numpy as np

import ir

from ..kernels.fused_roles import (KERNEL_NAME, FusedRolesSpec, build_fused_roles,
                                   dynamic_smem_bytes)
from . import trace as runtime_trace

POISON = 0xA5


@attrs.define
class FusedRolesResult:
    """One call: the world's per-rank results, each rank's final L1 arrival counter words
    (u32 ``[L * pad]``) and ffn checksums (u32 per output row, poison where no row landed)."""

    results: list
    l1_counters: list
    ffn_out: list


class FusedRolesRunner:
    """Runs ``ep_fused_roles`` on ``world`` (built with ``fused=False``)."""

    def __init__(self, world, spec: FusedRolesSpec = FusedRolesSpec()):
        if world.fused:
            raise ValueError("FusedRolesRunner replaces dispatch_wait: use a world built with "
                             "fused=False")
        cfg = world.cfg
        self.world, self.spec, self.cfg = world, spec, cfg
        self.smem = dynamic_smem_bytes(cfg)
        self.programs = world.load(ir.Module(KERNEL_NAME, (build_fused_roles(cfg, spec),)))
        runtime_trace.allocate(world, self.programs.module)   # built with trace rings only
        world.check_resident(self.programs, (KERNEL_NAME,), KERNEL_NAME, self.smem)
        cuda, L, lay = world.cuda, cfg.layout.n_local_experts, cfg.layout
        self.l1 = [cuda.zeros(L * spec.l1_release_atomic_pad, np.uint32, device=world.device,
                              stream=rk.stream) for rk in world.ranks]
        self.ffn_out = [cuda.zeros(lay.max_out_rows, np.uint32, device=world.device,
                                   stream=rk.stream) for rk in world.ranks]

    def dispatch(self, tokens, topk_ids) -> FusedRolesResult:
        w, lay = self.world, self.cfg.layout
        w.load_inputs(tokens, topk_ids)
        w.dispatch_async()
        for rk, l1, ffn in zip(w.ranks, self.l1, self.ffn_out):
            l1.zero(stream=rk.stream)
            ffn.fill_bytes(POISON, stream=rk.stream)
            rk.out_tokens.fill_bytes(POISON, stream=rk.stream)
            self.programs.of(rk).launch(KERNEL_NAME, self.cfg.n_sms, {
                "recv_buf_p": rk.recv_buf, "recv_count_p": rk.recv_count,
                "atomic_counter": rk.counter_ptr(lay.dispatch_wait_region),
                "output_tokens": rk.out_tokens, "row_offsets": rk.row_offsets,
                "expert_ids": rk.expert_ids, "src_info": rk.src_info, "my_rank": rk.rank,
                "err_buf": w.err_of(rk).ptr, "timeout_ns": w.timeout_ns, "l1_arrival_ptr": l1,
                "ffn_out": ffn, **w.trace_args(KERNEL_NAME, rk)}, rk.stream, shmem=self.smem)
            rk.wait_done = rk.stream.record()
        self.check()
        return FusedRolesResult(w.results(), [a.to_host() for a in self.l1],
                                [a.to_host() for a in self.ffn_out])


    def check(self):
        """Synchronise; raise ``EPTimeoutError`` (records named by either program's kernels)
        if a wait expired, after re-arming the world."""
        self.world.check_with(self.programs, KERNEL_NAME)


__all__ = ["FusedRolesRunner", "FusedRolesResult", "POISON"]
