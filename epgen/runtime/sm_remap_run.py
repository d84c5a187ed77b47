"""Host runner of the SM-remapping test kernel ``ep_dispatch_sm_remap``
(``epgen.kernels.sm_remap``) on an ``EmulatedWorld`` built with ``fused=True``: every rank
launches the test kernel in place of ``ep_dispatch``, with the same arguments
(``world.fused_rows()``), buffers and inter-call ordering, and the world reads the results
back as usual."""

from __future__ import annotations

import ir

from ..kernels.sm_remap import KERNEL_NAME, build_dispatch_sm_remap
from .program import Program
from .world import CapacityError


class SMRemapRunner:
    """Runs ``ep_dispatch_sm_remap`` on ``world`` (an unbatched ``EmulatedWorld`` built with
    ``fused=True``, on either backend); ``sms`` as ``build_dispatch_sm_remap``'s."""

    def __init__(self, world, sms=None):
        if not world.fused or getattr(world, "batched", False):
            raise ValueError("SMRemapRunner replaces the fused ep_dispatch: use an unbatched "
                             "world built with fused=True")
        cfg = world.cfg
        self.world, self.cfg = world, cfg
        self.program = Program(ir.Module(KERNEL_NAME, (build_dispatch_sm_remap(cfg, sms),)),
                               arch=world.program.arch, device=world.device,
                               backend=world.cuda)
        per_sm = self.program.blocks_per_sm(KERNEL_NAME)
        sms = world.cuda.sm_count(world.device)
        if len(world.ranks) * cfg.n_sms > per_sm * sms:
            raise CapacityError(f"{KERNEL_NAME}: {len(world.ranks)} ranks x n_sms={cfg.n_sms} "
                                f"blocks do not fit ({per_sm} per SM x {sms} SMs)")

    def dispatch(self, tokens, topk_ids) -> list:
        """One call: returns a ``reference.RankResult`` per rank."""
        w = self.world
        w.load_inputs(tokens, topk_ids)
        w._after_previous_call()
        for rk, args in zip(w.ranks, w.fused_rows()):
            self.program.launch(KERNEL_NAME, self.cfg.n_sms, args, rk.stream)
            rk.wait_done = rk.stream.record()
        self.check()
        return w.results()

    def check(self):
        """Synchronise; raise ``EPTimeoutError`` (records named by either program's kernels)
        if a wait expired, after re-arming the world."""
        self.world.check_with(self.program, KERNEL_NAME)


__all__ = ["SMRemapRunner"]
