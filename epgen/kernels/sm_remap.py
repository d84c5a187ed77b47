"""``ep_dispatch_sm_remap``: a test kernel for the SM arguments of the reference methods.

It is the fused ``ep_dispatch`` (same parameters, launched the same way) built with
``sm_map.ReversedSubsetSMs``: the monitor, send, copy and pack roles see their SM ids in
reversed (or, for the packers, unreversed) block order, the sends skip the last block and the
copy role the first one, so every SM argument (``sm_id``, ``n_active_send_sms``,
``n_active_offset_sms``, ``scatter_sm_id``, ``pack_sm_id``, ``n_active_comm_sms``,
``n_send_sms``) takes a value other than its default, as in a persistent fused kernel that
places the dispatch roles on SMs of its own choosing. Its outputs must equal the reference's
(``epgen.runtime.sm_remap_run``).
"""

from __future__ import annotations

import ir

from .dispatch_fused import build_dispatch_fused
from .sm_map import ReversedSubsetSMs

KERNEL_NAME = "ep_dispatch_sm_remap"


def build_dispatch_sm_remap(cfg, sms: ReversedSubsetSMs | None = None) -> ir.Kernel:
    """The test kernel (module docstring); ``ValueError`` when the grid is too small for the
    remap (``ReversedSubsetSMs.check``). ``sms``: another map of that shape (a test's
    deliberately wrong one)."""
    sms = ReversedSubsetSMs() if sms is None else sms
    sms.check(cfg)
    return build_dispatch_fused(cfg, sms, name=KERNEL_NAME)


__all__ = ["build_dispatch_sm_remap", "KERNEL_NAME"]
