"""``epgen bench --world shmem --copy-rate`` on simulated PEs (``bench.copy_rate``): every
mode's kernel copies each PE's messages into the right slots of the right peers on two
simulated PEs (the fake NVSHMEM of tests/sim/test_shmem_world.py), the put-with-signal
mode's signal words count every delivered message, and a wrong slot fails the check."""

from __future__ import annotations

import numpy as np
import pytest

from epgen.bench import copy_rate
from epgen.kernels import peer_copy

from test_bench_shmem_sim import shared_exchange, tick_events, two_pes
from test_shmem_world import collectively


@pytest.fixture
def copy_events(monkeypatch):
    """``bench.copy_rate``'s CUDA events: ticks of one clock."""
    tick_events(monkeypatch, copy_rate)


def run_two(seed, n_msgs, iters=2, warmup=1):
    cfg, machine, worlds = two_pes(1, seed)
    exchange = shared_exchange(worlds)
    got, errors = collectively(machine, worlds, [
        (lambda r=r: copy_rate.measure(worlds[r], n_msgs, iters, warmup, exchange[r]))
        for r in range(2)])
    for w in worlds:
        w.close()
    assert errors == [None, None], (seed, errors)
    return cfg, got


@pytest.mark.parametrize("n_msgs", [1, 11])
def test_every_mode_lands_every_message_in_its_slot(n_msgs, seed, copy_events):
    """Both PEs agree on one figure per mode, each checked; more messages than the grid
    has warps (11 against 8) take the strided loop."""
    cfg, got = run_two(seed, n_msgs)
    assert got[0] == got[1]
    entry = got[0]
    assert entry["n_msgs"] == n_msgs and entry["msg_bytes"] == cfg.layout.msg_bytes
    assert list(entry["modes"]) == list(peer_copy.MODES)
    for mode, fig in entry["modes"].items():
        assert fig["check"] == "ok", (seed, mode, fig)
        assert fig["median_us"] > 0 and len(fig["pe_median_us"]) == 2
    assert entry["modes"]["stores"]["of_stores"] == pytest.approx(1.0)
    assert copy_rate.failures(entry) == []
    assert "puts" in copy_rate.report_line(128, entry)


def test_a_message_in_the_wrong_slot_fails_the_check(seed, copy_events, monkeypatch):
    """The checker expects each slot from the PE itself: every mode's first check fails, on
    both PEs, and the modes after it are not run."""
    monkeypatch.setattr(peer_copy, "message_source", lambda pe, i, n: pe)
    _, got = run_two(seed, 3)
    entry = got[0]
    assert list(entry["modes"]) == ["stores"]
    check = entry["modes"]["stores"]["check"]
    assert check.startswith("FAILED: PE 0:") and "PE 1:" in check, check
    assert copy_rate.failures(entry) == [f"copy rate stores: {check}"]


@pytest.mark.parametrize("n_pes", range(2, 9))
def test_each_slot_has_one_source_and_every_pe_reaches_every_other(n_pes):
    """By enumeration: slot ``i`` of PE ``p`` is written by exactly the PE
    ``message_source`` names, never by ``p`` itself; over ``n_pes - 1`` consecutive
    messages a PE sends one to each other PE."""
    for i in range(3 * n_pes):
        for p in range(n_pes):
            writers = [q for q in range(n_pes) if peer_copy.message_peer(q, i, n_pes) == p]
            assert writers == [peer_copy.message_source(p, i, n_pes)], (n_pes, i, p)
            assert writers != [p]
    for q in range(n_pes):
        assert sorted(peer_copy.message_peer(q, i, n_pes) for i in range(n_pes - 1)) == \
            [p for p in range(n_pes) if p != q]


def test_check_slots_spread_over_the_messages():
    assert copy_rate.check_slots(5) == [0, 1, 2, 3, 4]
    slots = copy_rate.check_slots(10_000)
    assert len(slots) == copy_rate.CHECK_SLOTS and slots[0] == 0 and slots[-1] == 9_999
    assert np.all(np.diff(slots) > 100)


def test_source_words_depend_on_the_pe_and_the_word():
    a, b = copy_rate.source_words(0, 0, 1000), copy_rate.source_words(1, 0, 1000)
    assert len(np.unique(a)) == 1000 and not np.any(a == b)
    assert np.array_equal(copy_rate.source_words(3, 500, 10), copy_rate.source_words(3, 0, 510)[500:])
