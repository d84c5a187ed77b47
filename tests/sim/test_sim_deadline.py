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


# ---- the deadline every world passes to its kernels -----------------------------------------
# Each world on a machine that logs the timeout_ns argument of every launch (rank-batched
# tables unpacked; a graph's launches as captured): by default every kernel must receive the
# documented 2 s, and an explicit timeout_ns or the configuration's must arrive unchanged.

class _DeadlineLog:
    """Mixin of a ``backends.sim.Machine``: ``deadlines``, the set of ``timeout_ns`` values
    each kernel (by name) was launched with."""

    def launched(self, kernel, params, stream, deps):
        super().launched(kernel, params, stream, deps)
        rows = (sim_backend.unpack_rank_table(kernel.ir, params["rank_args"])
                if kernel.ir.rank_batch is not None else [params])
        log = self.__dict__.setdefault("deadlines", {})
        for row in rows:
            if "timeout_ns" in row:
                log.setdefault(kernel.name, set()).add(int(row["timeout_ns"]))


class _LoggedMachine(_DeadlineLog, sim_backend.Machine):
    pass


STAGED = {"ep_dispatch_async", "ep_dispatch_wait", "ep_combine_async", "ep_combine_wait"}
FUSED = {"ep_dispatch", "ep_combine"}


def _cfg(**changes):
    from world_checks import make_cfg
    cfg = make_cfg(2, 4, 16, 2, 4, 64, 4)
    return cfg.replace(**changes) if changes else cfg


def _round_trip(world, seed, graph: bool = False):
    """One dispatch (a captured graph's replay with ``graph``) and one weighted combine."""
    from combine_checks import expert_outputs, weights
    from epgen import routing
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, world.cfg, world.cfg.max_tokens_per_rank)
    results = (world.dispatch_replayed(toks, ids)[1] if graph
               else world.dispatch(toks, ids))
    world.combine(expert_outputs(rng, world.cfg, results), weights(rng, world.cfg, ids))


def _assert_received(deadlines: dict, kernels: set, want: int) -> None:
    missing = kernels - set(deadlines)
    assert not missing, f"kernels never launched with a timeout_ns: {missing}; got {deadlines}"
    wrong = {k: v for k, v in deadlines.items() if v != {want}}
    assert not wrong, f"timeout_ns received (want {want} everywhere): {wrong}"


EMULATED = {
    "staged": ({}, {}, STAGED, False),
    "fused": ({"fused": True}, {}, FUSED, False),
    "batched": ({"batched": True}, {}, STAGED - {"ep_combine_async", "ep_combine_wait"}, False),
    "graph": ({}, {}, STAGED - {"ep_combine_async", "ep_combine_wait"}, True),
    "final_layout": ({}, {"ep_final_layout": True, "ep_prod_reserve": True}, STAGED, False),
}


@pytest.mark.parametrize("case", EMULATED, ids=list(EMULATED))
def test_emulated_world_kernels_receive_the_default_deadline(case, seed):
    import epgen
    world_kw, flags, kernels, graph = EMULATED[case]
    machine = _LoggedMachine(seed)
    world = epgen.EmulatedWorld(_cfg(**flags), backend=machine, **world_kw)
    _round_trip(world, seed, graph)
    _assert_received(machine.deadlines, kernels, DEFAULT_TIMEOUT_NS)


@pytest.mark.parametrize("how", ["world", "config"])
def test_an_explicit_deadline_reaches_every_kernel_unchanged(how, seed):
    import epgen
    timeout = 123_456_789_012
    machine = _LoggedMachine(seed)
    if how == "world":
        world = epgen.EmulatedWorld(_cfg(), backend=machine, timeout_ns=timeout)
    else:
        world = epgen.EmulatedWorld(_cfg(timeout_ns=timeout), backend=machine)
    _round_trip(world, seed)
    _assert_received(machine.deadlines, STAGED, timeout)


@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_p2p_world_kernels_receive_the_default_deadline(fused, seed):
    import epgen
    from sim_p2p import PlacementMachine

    class Logged(_DeadlineLog, PlacementMachine):
        pass
    cfg = _cfg()
    machine = Logged(seed, n_gpus=cfg.n_ranks)
    world = epgen.P2PWorld(cfg, backend=machine, fused=fused)
    _round_trip(world, seed)
    _assert_received(machine.deadlines, FUSED if fused else STAGED, DEFAULT_TIMEOUT_NS)


def test_shmem_world_kernels_receive_the_default_deadline(seed):
    """Two PEs' ``ShmemWorld`` in one process (the fakes of tests/sim/test_shmem_world.py)."""
    from combine_checks import expert_outputs, weights
    from epgen import routing
    from test_shmem_world import SymmetricMachine, combine_all, make_worlds, round_trip, small

    class Logged(_DeadlineLog, SymmetricMachine):
        pass
    cfg = small(num_threads=64, n_sms=4, n_experts=4, max_tokens_per_rank=4)
    machine = Logged(seed)
    worlds = make_worlds(cfg, machine, [])
    try:
        rng = np.random.default_rng(seed)
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        results = round_trip(worlds, machine, toks, ids)
        combine_all(machine, worlds, expert_outputs(rng, cfg, results), weights(rng, cfg, ids))
    finally:
        for w in worlds:
            w.close()
    _assert_received(machine.deadlines, STAGED, DEFAULT_TIMEOUT_NS)
