"""Host runner of the SM-remapping test kernel ``ep_dispatch_sm_remap``
(``epgen.kernels.sm_remap``) on an ``EmulatedWorld`` built with ``fused=True``: every rank
launches the test kernel in place of ``ep_dispatch``, with the same arguments
(``world.fused_rows()``), buffers and inter-call ordering, and the world reads the results
back as usual."""

from __future__ import annotations

import ir

from ..kernels.sm_remap import KERNEL_NAME, build_dispatch_sm_remap


class SMRemapRunner:
    """Runs ``ep_dispatch_sm_remap`` on ``world`` (an unbatched ``EmulatedWorld`` built with
    ``fused=True``, on either backend); ``sms`` as ``build_dispatch_sm_remap``'s."""

    def __init__(self, world, sms=None):
        if not world.fused or getattr(world, "batched", False):
            raise ValueError("SMRemapRunner replaces the fused ep_dispatch: use an unbatched "
                             "world built with fused=True")
        cfg = world.cfg
        self.world, self.cfg = world, cfg
        self.programs = world.load(ir.Module(KERNEL_NAME, (build_dispatch_sm_remap(cfg, sms),)))
        self.program = self.programs.first
        world.check_resident(self.programs, (KERNEL_NAME,), KERNEL_NAME)

    def dispatch(self, tokens, topk_ids) -> list:
        """One call: returns a ``reference.RankResult`` per rank."""
        w = self.world
        w.load_inputs(tokens, topk_ids)
        w.after_previous_call()
        for rk, args in zip(w.ranks, w.fused_rows()):
            self.programs.of(rk).launch(KERNEL_NAME, self.cfg.n_sms, args, rk.stream)
            rk.wait_done = rk.stream.record()
        self.check()
        return w.results()

    def check(self):
        """Synchronise; raise ``EPTimeoutError`` (records named by either program's kernels)
        if a wait expired, after re-arming the world."""
        self.world.check_with(self.programs, KERNEL_NAME)


__all__ = ["SMRemapRunner"]
