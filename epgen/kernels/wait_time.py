"""Wait times (``Tuning.wait_times``, epgen's own): how long a kernel waited for each word
another rank writes, in ``%globaltimer`` nanoseconds, so that a slow rank can be found (what
DeepEP's ``dispatch_wait_recv_cost_stats`` and ``combine_wait_recv_cost_stats`` report).

The kernel takes one more parameter, ``wait_time`` (u64 words, one per waited word): the
thread that waits for word ``w`` reads the timer before its first poll and after the wait
ends, and stores the difference into ``wait_time[w]``, every call (a plain store: nothing to
re-arm; the host reads the words after the kernel, or adds them to its own totals on the
stream). A word no thread waits for (not published in this layout) gets 0; a word of a
source masked before the wait (``ep_rank_mask``) is not polled, so its time is the few
nanoseconds of the mask check.

- dispatch_wait: the aux block's thread ``w < E`` for count word ``w = e * R + src``
  (``E`` words; source ``src`` is ``w % R``);
- combine_wait: block 0's thread ``d < R`` for arrival word ``d`` (every block waits for every
  word; one block's times are the record).

PTX Mapping::

    mov.u64 %t0, %globaltimer;      // before the wait
    ...                             // the bounded wait (SpinWait)
    mov.u64 %t1, %globaltimer;
    sub.s64 %d, %t1, %t0;
    st.global.b64 [wait_time + 8 * w], %d;

Off (the default), nothing is declared or emitted: the PTX is that of a build without it.
"""

from __future__ import annotations

import ir
from ir import types as T

from .common import word

PARAM = "wait_time"


def declare(kb: ir.KernelBuilder, cfg):
    """The ``wait_time`` parameter on ``kb`` with ``cfg.tuning.wait_times``, else None."""
    if cfg is None or not cfg.tuning.wait_times:
        return None
    return kb.param(PARAM, T.ptr_global)


class WaitClock:
    """One thread's timing of its wait (``start`` before it, ``stop`` after it, ``store``
    where the time is recorded); every method does nothing when ``param`` is None."""

    def __init__(self, r: ir.RoleBuilder, param, name: str = "wait"):
        self.r, self.param = r, param
        self.spent = None if param is None else r.var(f"{name}_ns", T.u64, 0)
        self._t0 = None
        self.name = name

    def start(self) -> None:
        """``mov.u64 %t0, %globaltimer``."""
        if self.param is not None:
            self._t0 = self.r.let(f"{self.name}_t0", self.r.sreg(ir.SReg.GLOBALTIMER))

    def stop(self) -> None:
        """``mov.u64 %t1, %globaltimer``; the time since ``start`` kept for ``store``."""
        if self.param is not None:
            now = self.r.let(f"{self.name}_t1", self.r.sreg(ir.SReg.GLOBALTIMER))
            self.r.assign(self.spent, now - self._t0)

    def store(self, index) -> None:
        """``st.global.b64 [wait_time + 8 * index]`` of the time kept (0 without a wait)."""
        if self.param is not None:
            self.r.store(word(self.param, index, 8), self.spent)


__all__ = ["PARAM", "declare", "WaitClock"]
