"""``epgen bench --world shmem`` on simulated PEs: one PE's measurement
(``bench.shmem.measure_shape``) of every op on two PEs (``ShmemWorld`` on the simulator with
the fake NVSHMEM of tests/sim/test_shmem_world.py, each PE in its own thread as if it were
its own process), by SHMEM puts and by direct stores, only the CUDA events replaced; the
checks can fail and then stop every PE before the timing; and a whole ``run`` on one
simulated PE (its session, world, lines, report and JSON)."""

from __future__ import annotations

import io
import itertools
import json
import threading
import types

import numpy as np
import pytest

from backends import sim as sim_backend
from epgen import reference, routing
from epgen.bench import combine as bench_combine
from epgen.bench import shmem as bench_shmem
from epgen.bench.plan import ShmemPlan
from epgen.runtime.shmem_session import ShmemSession

from test_shmem_world import (FakeBootstrap, FakeHost, SymmetricMachine, collectively,
                              make_worlds, small)

OPS = ("dispatch", "combine", "moe")


def tick_events(monkeypatch, module):
    """``module``'s CUDA events (its ``cuda``): each event a tick of one clock, 10 us apart."""
    clock = itertools.count()
    lock = threading.Lock()

    def record(stream):
        with lock:
            return next(clock)
    monkeypatch.setattr(module, "cuda", types.SimpleNamespace(
        record=record, elapsed_ms=lambda a, b: 0.01 * (b - a)))


@pytest.fixture
def fake_events(monkeypatch):
    """``bench.shmem``'s CUDA events: ticks of one clock (``tick_events``)."""
    tick_events(monkeypatch, bench_shmem)


def shared_exchange(worlds):
    """An ``exchange`` per PE that really gathers: each PE leaves its value, then the
    collective synchronize of ``collectively`` (every PE reaches one) lets all read all."""
    box = {}

    def of(rank):
        def exchange(value):
            box[rank] = value
            worlds[rank].synchronize()
            return [box[r] for r in range(len(worlds))]
        return exchange
    return [of(r) for r in range(len(worlds))]


def two_pes(p2p: int, seed: int, **changes):
    cfg = small(num_threads=64, n_sms=4, n_experts=4, max_tokens_per_rank=8, use_shmem=True,
                p2p_world_size=p2p, **changes)
    machine = SymmetricMachine(seed)
    return cfg, machine, make_worlds(cfg, machine, [])


@pytest.mark.parametrize("p2p", [1, 2], ids=["puts", "stores"])
@pytest.mark.parametrize("op", OPS)
def test_measure_shape_on_two_simulated_pes(op, p2p, seed, fake_events):
    """Every PE's checks before and after the timing pass, it timed ``iters`` calls, and its
    bytes are its own; the calls of each PE ran the kernels of ``op`` (the combine's launches
    counted)."""
    cfg, machine, worlds = two_pes(p2p, seed)
    T = cfg.max_tokens_per_rank
    plan = ShmemPlan(base=cfg, tokens=(T,), op=op, iters=3, warmup=1, seed=seed)
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    w = bench_combine.weights(cfg, T, seed) if op != "dispatch" else None
    exchange = shared_exchange(worlds)
    got, errors = collectively(machine, worlds, [
        (lambda r=r: bench_shmem.measure_shape(worlds[r], plan, T, toks, ids, w,
                                               exchange=exchange[r])) for r in range(2)])
    assert errors == [None, None], errors
    for r, res in enumerate(got):
        assert res["rank"] == r and res["check"] == "ok", (seed, res)
        assert res["post_check"] == "ok", (seed, res)
        assert len(res["times_ms"]) == 3 and all(t > 0 for t in res["times_ms"])
        assert res["sent_bytes"] == bench_shmem.op_sent_bytes(cfg, ids, r, op)
    calls = 1 + 1 + 3                       # the checked call, warm-up, timed
    for wd in worlds:
        launched = [k for k, _ in wd.program.loaded.launched]
        assert launched.count("ep_dispatch_async") == calls, launched
        if op != "dispatch":
            comb = wd.combiner()
            assert [k for k, _ in comb.program.loaded.launched].count(
                "ep_combine_async") == calls
            # the world's own expert-output buffer is back
            assert comb.bufs[0].expert_out is not wd.ranks[0].out_tokens
        wd.close()


def measure_two(cfg, machine, worlds, op, seed):
    T = cfg.max_tokens_per_rank
    plan = ShmemPlan(base=cfg, tokens=(T,), op=op, iters=2, warmup=0, seed=seed)
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    w = bench_combine.weights(cfg, T, seed)
    exchange = shared_exchange(worlds)
    got, errors = collectively(machine, worlds, [
        (lambda r=r: bench_shmem.measure_shape(worlds[r], plan, T, toks, ids, w,
                                               exchange=exchange[r])) for r in range(2)])
    assert errors == [None, None], errors
    for wd in worlds:
        wd.close()
    return got


@pytest.mark.parametrize("fmt", ["NVFP4", "BlockwiseFP8"])
def test_a_quantising_format_sends_fixed_rows(fmt, seed, fake_events):
    """Its rows are not BF16: the check's rows (naming their slots) pass the check before the
    timing and go back each timed call; the combine is not checked after it."""
    from epgen.formats import make_format

    cfg, machine, worlds = two_pes(1, seed, token_fmt=make_format(fmt, 128, 2))
    for res in measure_two(cfg, machine, worlds, "moe", seed):
        assert res["check"] == "ok" and len(res["times_ms"]) == 2, (seed, res)
        assert res["post_check"] == ("dispatch ok; combine not checked (fixed rows of a "
                                     "quantising format)"), res


def test_large_shapes_check_sampled_tokens_before_and_after(seed, fake_events, monkeypatch):
    """Above ``PREFILL_CHECK_TOKENS`` (4 here) each PE's combine checks compute 4 of its
    tokens (``combine.check_tokens``), before the timing and after it; a wrong row among
    them fails the check."""
    monkeypatch.setattr(bench_combine, "PREFILL_CHECK_TOKENS", 4)
    asked = []
    real = bench_shmem.reference.combine

    def recording(*a, tokens=None, **kw):
        asked.append(tokens)
        return real(*a, tokens=tokens, **kw)
    monkeypatch.setattr(bench_shmem.reference, "combine", recording)
    cfg, machine, worlds = two_pes(1, seed)
    T = cfg.max_tokens_per_rank
    assert T > 4
    for res in measure_two(cfg, machine, worlds, "combine", seed):
        assert res["check"] == "ok" and res["post_check"] == "ok", res
    want = bench_combine.check_tokens(T).tolist()
    assert len(asked) == 4 and all(len(t) == 1 and list(t.values())[0].tolist() == want
                                   for t in asked), asked
    cfg, machine, worlds = two_pes(1, seed)
    real_combine = worlds[0].combine
    worlds[0].combine = lambda y, *a: _flip_token(real_combine(y, *a), int(want[1]))
    for res in measure_two(cfg, machine, worlds, "combine", seed):
        assert res["check"].startswith("FAILED: rank 0"), res


def _flip_token(out, t: int):
    """A copy of a PE's combine output with one bit of token ``t`` flipped."""
    out = out.copy()
    out[t, 0] ^= 1
    return out


def test_a_failed_check_stops_every_pe_before_the_timing(seed, fake_events):
    """PE 0's combine is corrupted: both PEs hear it (the exchange) and neither times."""
    cfg, machine, worlds = two_pes(1, seed)
    T = cfg.max_tokens_per_rank
    plan = ShmemPlan(base=cfg, tokens=(T,), op="combine", iters=2, warmup=0, seed=seed)
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    w = bench_combine.weights(cfg, T, seed)
    real = worlds[0].combine
    worlds[0].combine = lambda y, *a: real(y ^ np.uint16(1), *a)
    exchange = shared_exchange(worlds)
    got, errors = collectively(machine, worlds, [
        (lambda r=r: bench_shmem.measure_shape(worlds[r], plan, T, toks, ids, w,
                                               exchange=exchange[r])) for r in range(2)])
    assert errors == [None, None], errors
    for res in got:
        assert res["check"].startswith("FAILED: rank 0: rank 0: combine differs"), res
        assert "times_ms" not in res
    entry = bench_shmem.combine_pes(got, 1, 2, T)
    assert entry["error"].startswith("FAILED: rank 0") and "summary" not in entry
    for wd in worlds:
        wd.close()


def test_expert_rows_name_their_slot_in_a_world_result(seed):
    """The rows the check sends, built from a simulated PE's own result (rows in the world's
    order), are what ``reference.combine`` expects: the rotated tokens of each slot."""
    cfg, machine, worlds = two_pes(1, seed)
    T = cfg.max_tokens_per_rank
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    for wd in worlds:
        wd.load_inputs(toks[wd.rank], ids[wd.rank])
    for wd in worlds:
        wd.enqueue_round_trip()
    machine.drain()
    got = [wd.results()[0] for wd in worlds]
    K = cfg.token_fmt.top_k
    want = reference.combine(cfg, got, [bench_shmem.expert_rows(g, toks) for g in got], None,
                             n_tokens=[T, T])
    for s in range(2):
        for t in range(T):
            for k in range(K):
                assert np.array_equal(want[s][t, k], np.roll(toks[s][t], k)), (seed, s, t, k)
    for wd in worlds:
        wd.close()


# ---- a whole run on one simulated PE ---------------------------------------------------------------
class GatherBootstrap(FakeBootstrap):
    """One PE alone: its gather is its own value."""

    def all_gather_bytes(self, data, name="gather", timeout_s=None):
        self.log.append(("gather", self.rank, name))
        return [bytes(data)]


@pytest.mark.parametrize("op", OPS)
def test_run_on_one_simulated_pe(op, seed, fake_events, tmp_path):
    cfg = small(n_ranks=1, p2p_world_size=1, n_experts=8, max_tokens_per_rank=8)
    log = []
    host = FakeHost(log)
    session = ShmemSession(0, 1, bootstrap=GatherBootstrap(0, 1, log), host=host.view(0),
                           backend=SymmetricMachine(seed))
    plan = ShmemPlan(base=cfg, tokens=(4, 16), op=op, iters=3, warmup=1, seed=seed)
    out = io.StringIO()
    js = tmp_path / "shmem.json"
    res = bench_shmem.run(plan, session=session, json_path=str(js), out=out)
    assert res["failures"] == [], res["failures"]
    lines = out.getvalue().splitlines()
    label = bench_shmem.OP_LABELS[op]
    mine = [x for x in lines if x.startswith("rank 0: ")]
    assert len(mine) == 2 and "4 tokens/rank" in mine[0] and "16 tokens/rank" in mine[1]
    assert all(f"{label} median 10.0 us" in x or f"{label} median 20.0 us" in x
               for x in mine), mine
    assert any(x.startswith("epgen bench --world shmem --op " + op) for x in lines)
    data = json.loads(js.read_text())
    assert data["op"] == op and [r["tokens_per_rank"] for r in data["runs"]] == [4, 16]
    for r in data["runs"]:
        assert r["per_pe"][0]["check"] == "ok" and r["per_pe"][0]["post_check"] == "ok"
        assert r["summary"]["n"] == 3 and r["path"] == "direct stores"
    assert data["comparisons"] == []
    # one world for both shapes, closed at the end; the session stays up (it was given);
    # every timed or warm-up call ends at the world's barrier
    assert sum(1 for e in log if e[0] == "barrier" and e[2] == "close") == 1
    assert sum(1 for e in log if e == ("barrier", 0, "bench")) == 2 * (1 + 3)
    assert ("gather", 0, "bench") in log
    assert not session.closed
    session.close()
