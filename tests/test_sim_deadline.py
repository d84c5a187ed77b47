"""A bounded wait's deadline on the CPU simulator means its value (docs/sim.md, "Deadlines").

The simulator charges each poll 10 ms of simulated time: with ``timeouts=True`` a wait of
``timeout_ns`` T expires on poll ``T // 10 ms + 1``; one that would expire only after more
than ``max_spins`` polls, or never (T = 0), is a ``SimHang`` at poll ``max_spins + 1``. The
poll on which a wait expires is pinned here without trusting the expiry code's own count: the
hang detector counts polls on its own, so a wait that expires on poll E expires with
``max_spins = E`` and hangs with ``max_spins = E - 1``.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import sim as sim_backend
from ir import diag
from ir import nodes as N
from ir import types as T
from ir.builder import KernelBuilder
from ir.enums import CmpOp

#: the documented simulated poll period (docs/sim.md)
POLL_NS = 10_000_000
#: the documented default deadline (``EPConfig.timeout_ns``, docs/design.md)
DEFAULT_TIMEOUT_NS = 2_000_000_000


def _never_set_wait_kernel() -> N.Module:
    """One thread waiting for ``flag[0] >= 1``, which nothing writes."""
    kb = KernelBuilder("waits_forever", block_threads=1)
    flag = kb.param("flag", T.ptr_global)
    kb.diagnostics(rank=0)
    with kb.role("waiter") as r:
        r.spin_wait(flag, T.u32, CmpOp.GE, 1, buffer="flag", index=0)
    return N.Module("deadline", (kb.build(),))


def _run_wait(timeout_ns: int, max_spins: int, timeouts: bool = True) -> list:
    """Run the never-satisfied wait under ``timeout_ns``; its decoded timeout records."""
    machine = sim_backend.Machine(0, max_spins=max_spins, timeouts=timeouts)
    module = _never_set_wait_kernel()
    kernel = machine.load_module(module).kernel("waits_forever")
    flag = machine.zeros((1,), np.uint32)
    err = machine.zeros((diag.BUFFER_WORDS,), np.uint32)
    kernel.launch(1, 1, (flag, err, timeout_ns))
    machine.drain()
    return diag.decode(err.to_host(), module.kernels)


def test_the_documented_rule():
    assert sim_backend.SIM_POLL_NS == POLL_NS
    assert sim_backend.polls_to_expiry(DEFAULT_TIMEOUT_NS) == 201
    assert sim_backend.polls_to_expiry(1000 * DEFAULT_TIMEOUT_NS) == 200_001
    assert sim_backend.polls_to_expiry(3 * POLL_NS) == 4        # elapsed must exceed T
    assert sim_backend.polls_to_expiry(3 * POLL_NS - 1) == 3
    assert sim_backend.polls_to_expiry(1) == 1
    assert sim_backend.polls_to_expiry(0) is None                  # unbounded


@pytest.mark.parametrize("timeout_ns,expiry_poll", [
    (DEFAULT_TIMEOUT_NS, 201),          # the default: 2 s
    (20_000_000, 3),                    # 20 ms
    (1, 1),                             # any non-zero deadline takes at least one poll
])
def test_a_wait_expires_on_the_poll_its_deadline_gives(timeout_ns, expiry_poll):
    records = _run_wait(timeout_ns, max_spins=expiry_poll)
    assert len(records) == 1, records
    rec = records[0]
    assert (rec.kernel, rec.role, rec.buffer, rec.last_seen) == (
        "waits_forever", "waiter", "flag", 0)
    assert rec.elapsed_ns == expiry_poll * POLL_NS > timeout_ns
    # one poll fewer allowed: the hang detector fires first, so the wait expired on exactly
    # poll expiry_poll
    with pytest.raises(sim_backend.SimHang, match=f"expires only on poll {expiry_poll}"):
        _run_wait(timeout_ns, max_spins=expiry_poll - 1)


def test_a_thousand_times_the_default_deadline_does_not_expire_within_the_default_max_spins():
    """2 s expires on poll 201; 2000 s (about 33 minutes) would expire only on poll 200,001,
    past the default ``max_spins`` of 20000: a SimHang that names the deadline."""
    assert len(_run_wait(DEFAULT_TIMEOUT_NS, max_spins=20000)) == 1
    with pytest.raises(sim_backend.SimHang, match="expires only on poll 200001"):
        _run_wait(1000 * DEFAULT_TIMEOUT_NS, max_spins=20000)


def test_a_zero_deadline_is_unbounded_and_a_hang_in_the_simulator():
    with pytest.raises(sim_backend.SimHang, match="timeout_ns 0: an unbounded wait"):
        _run_wait(0, max_spins=300)


def test_without_timeouts_no_deadline_expires():
    with pytest.raises(sim_backend.SimHang, match="timeouts off"):
        _run_wait(1, max_spins=300, timeouts=False)
