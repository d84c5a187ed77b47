"""``epgen bench --world shmem --op combine --combine-fp8 | --combine-partial`` on simulated
PEs (the harness of tests/sim/test_bench_shmem_sim.py): each extra combine is checked
against the reference with its flags and timed after the plain one on the same world, its
calls ran its own kernels, its bytes are the model's; a wrong extra combine stops every PE;
a whole run on one simulated PE prints and records the extra figure."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from epgen import routing
from epgen.bench import combine as bench_combine
from epgen.bench import shmem as bench_shmem
from epgen.bench.link_bytes import combine_row_bytes
from epgen.bench.plan import ShmemPlan
from epgen.formats import make_format
from epgen.runtime.shmem_session import ShmemSession

from test_bench_shmem_sim import (GatherBootstrap, fake_events, shared_exchange,  # noqa: F401
                                  two_pes)
from test_shmem_world import FakeHost, SymmetricMachine, collectively, small

ARMS = {"fp8": dict(combine_fp8=True), "partial": dict(combine_partial=True)}


def _cfg_changes(arm: str) -> dict:
    out = {"token_fmt": make_format("BF16", 128, 2)}
    if arm == "partial":
        out["ep_rank_dedup"] = True
    return out


def _measure(arm, p2p, seed, corrupt=False):
    cfg, machine, worlds = two_pes(p2p, seed, **_cfg_changes(arm))
    T = cfg.max_tokens_per_rank
    plan = ShmemPlan(base=cfg, tokens=(T,), op="combine", iters=3, warmup=1, seed=seed,
                     **ARMS[arm])
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    w = bench_combine.weights(cfg, T, seed)
    if corrupt:                       # PE 0's extra combine returns one wrong bit
        real = worlds[0].combine
        worlds[0].combine = lambda y, wt=None, **kw: (
            real(y, wt, **kw) ^ np.uint16(any(kw.values())))
    exchange = shared_exchange(worlds)
    got, errors = collectively(machine, worlds, [
        (lambda r=r: bench_shmem.measure_shape(worlds[r], plan, T, toks, ids, w,
                                               exchange=exchange[r])) for r in range(2)])
    assert errors == [None, None], errors
    return cfg, plan, worlds, ids, got


@pytest.mark.parametrize("p2p", [1, 2], ids=["puts", "stores"])
@pytest.mark.parametrize("arm", sorted(ARMS))
def test_the_extra_combine_is_checked_and_timed(arm, p2p, seed, fake_events):  # noqa: F811
    cfg, plan, worlds, ids, got = _measure(arm, p2p, seed)
    (a,) = plan.arms
    for r, res in enumerate(got):
        assert res["check"] == res["post_check"] == "ok", (seed, res)
        x = res[a.key]
        assert x["check"] == x["post_check"] == "ok", (seed, x)
        assert len(x["times_ms"]) == 3 and all(t > 0 for t in x["times_ms"])
        # by hand: the rows this PE sends back to the other one
        L, other = cfg.layout.n_local_experts, np.asarray(ids[1 - r])
        mine = other // L == r
        rows = int(mine.any(axis=1).sum()) if arm == "partial" else int(mine.sum())
        assert x["sent_bytes"] == rows * combine_row_bytes(128, arm == "fp8", cfg.needs_shmem)
    calls = 1 + 1 + 3                        # the arm's checked call, warm-up, timed
    for wd in worlds:
        comb = wd.combiner()
        side = comb.fp8_side if arm == "fp8" else comb.partial_side
        name = comb.kernel_name("ep_combine_async", fp8=arm == "fp8",
                                partial=arm == "partial")
        assert [k for k, _ in side.program.loaded.launched].count(name) == calls
        assert comb.bufs[0].expert_out is not wd.ranks[0].out_tokens
        wd.close()
    entry = bench_shmem.combine_pes(got, p2p, 2, cfg.max_tokens_per_rank, plan.arms)
    assert "error" not in entry and entry[a.key]["summary"]["n"] == 3
    assert entry[a.speedup_key] == pytest.approx(
        entry["summary"]["median_ms"] / entry[a.key]["summary"]["median_ms"])


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_a_wrong_extra_combine_stops_every_pe(arm, seed, fake_events):  # noqa: F811
    cfg, plan, worlds, _ids, got = _measure(arm, 1, seed, corrupt=True)
    (a,) = plan.arms
    for res in got:
        assert res["check"] == "ok" and "times_ms" in res
        assert res[a.key]["check"].startswith(f"FAILED: rank 0: rank 0 {a.name}: combine "
                                              f"differs"), res
        assert "times_ms" not in res[a.key]
    entry = bench_shmem.combine_pes(got, 1, 2, cfg.max_tokens_per_rank, plan.arms)
    assert entry["error"].startswith("FAILED: rank 0") and a.speedup_key not in entry
    for wd in worlds:
        wd.close()


def test_run_on_one_simulated_pe_reports_the_partial_combine(seed, fake_events,  # noqa: F811
                                                             tmp_path):
    cfg = small(n_ranks=1, p2p_world_size=1, n_experts=8, max_tokens_per_rank=8,
                ep_rank_dedup=True)
    log = []
    session = ShmemSession(0, 1, bootstrap=GatherBootstrap(0, 1, log),
                           host=FakeHost(log).view(0), backend=SymmetricMachine(seed))
    plan = ShmemPlan(base=cfg, tokens=(4,), op="combine", iters=3, warmup=1, seed=seed,
                     combine_partial=True)
    out = io.StringIO()
    js = tmp_path / "shmem.json"
    res = bench_shmem.run(plan, session=session, json_path=str(js), out=out)
    session.close()
    assert res["failures"] == [], res["failures"]
    text = out.getvalue()
    assert "rank 0: 4 tokens/rank, 1 PEs (p2p_world_size=1): combine_partial median " \
           "10.0 us" in text and "x the plain combine, slowest PE)" in text, text
    assert "  combine_partial" in bench_shmem.format_table(res), text
    run = json.loads(js.read_text())["runs"][0]
    assert run["combine_partial"]["per_pe"][0]["check"] == "ok"
    assert run["partial_speedup_vs_plain"] == pytest.approx(1.0)
