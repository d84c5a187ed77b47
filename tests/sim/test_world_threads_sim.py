"""A world's parts built on first use (the combiner, its FP8 and partial-reduce sides, the
token-major receiver and combine) asked for by several rank threads at once, as the DeepEP
API's ``EmulatedGroup`` and an engine's rank threads do: every thread gets the one part,
built once. Each part's constructor is slowed (a sleep while it holds no lock of its own)
so that, without the world's ``build_lock``, the threads would each build their own."""

from __future__ import annotations

import threading
import time

import pytest

import epgen
from backends import sim as sim_backend
from epgen.formats import make_format
from epgen.runtime import combine as combine_mod
from epgen.runtime import rank_world

N_THREADS = 4


def make_world(seed):
    cfg = epgen.EPConfig(num_threads=64, n_sms=3, n_experts=4, n_ranks=2, max_tokens_per_rank=4,
                         p2p_world_size=2, use_shmem=False, ep_rank_dedup=True,
                         token_fmt=make_format("BF16", 128, 2))
    return epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed % 1000))


def slowed(monkeypatch, module, name):
    """Replace ``module.name`` (a class) by a subclass whose constructor sleeps first;
    returns the list of the objects it made."""
    made = []
    base = getattr(module, name)

    class Slow(base):
        def __init__(self, *args, **kwargs):
            time.sleep(0.05)
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(module, name, Slow)
    return made


def from_threads(fn):
    """``fn()`` on ``N_THREADS`` threads released together; their results."""
    start = threading.Barrier(N_THREADS)
    out, errors = [None] * N_THREADS, []

    def body(i):
        try:
            start.wait()
            out[i] = fn()
        except BaseException as e:       # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=body, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


@pytest.mark.parametrize("part,module,cls", [
    ("combiner", rank_world, "Combiner"),
    ("token_receiver", rank_world, "TokenMajorReceiver"),
    ("token_combiner", rank_world, "TokenMajorCombine"),
], ids=["combiner", "token_receiver", "token_combiner"])
def test_a_part_asked_for_by_rank_threads_at_once_is_built_once(seed, monkeypatch, part,
                                                                 module, cls):
    world = make_world(seed)
    made = slowed(monkeypatch, module, cls)
    got = from_threads(getattr(world, part))
    assert len(made) == 1, f"{part}: built {len(made)} times by {N_THREADS} threads"
    assert all(g is got[0] for g in got)


@pytest.mark.parametrize("side,cls", [("prepare_fp8", "Fp8Combine"),
                                      ("prepare_partial", "PartialCombine")],
                         ids=["fp8", "partial"])
def test_a_combine_side_asked_for_by_rank_threads_at_once_is_built_once(seed, monkeypatch,
                                                                        side, cls):
    comb = make_world(seed).combiner()
    made = slowed(monkeypatch, combine_mod, cls)
    fresh = from_threads(getattr(comb, side))
    assert len(made) == 1, f"{side}: built {len(made)} times by {N_THREADS} threads"
    assert sorted(fresh) == [False] * (N_THREADS - 1) + [True]


def test_prepare_combine_reports_each_side_built_once_also_from_threads(seed, monkeypatch):
    """``prepare_combine`` builds the combiner and the asked-for sides once and hands the
    names built now to ``sides_built`` (where ``ShmemWorld`` meets the other PEs before any
    peer writes): the first call's names, nothing again for the same sides, from any
    thread."""
    world = make_world(seed)
    reported = []
    monkeypatch.setattr(world, "sides_built", lambda names: reported.append(list(names)))
    slowed(monkeypatch, rank_world, "Combiner")
    got = from_threads(world.prepare_combine)
    assert all(g is got[0] for g in got)
    assert sorted(reported) == [[]] * (N_THREADS - 1) + [["combine"]]
    reported.clear()
    world.prepare_combine(fp8=True, partial=True)
    world.prepare_combine(fp8=True, partial=True)
    assert reported == [["fp8", "partial"], []]
