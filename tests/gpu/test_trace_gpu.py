"""Trace rings on the GPU: kernels built with ``tuning.trace`` still match the reference
bit-exactly (BF16) or as the format's reference says (NVFP4), on streams and as a graph
replay, and ``%globaltimer`` events respect the protocol's hand-offs (every L1 release before
the fused consumer sees its expert complete); ``epgen run --trace FILE.json`` prints the
timeline and writes a Chrome trace-event file that passes its schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

import epgen
from epgen import cli
from epgen.kernels import trace
from epgen.runtime import trace as runtime_trace
from epgen.runtime import trace_export
from test_trace_sim import check_chrome_trace, check_events, check_roles_stamped, traced
from world_checks import checked_calls, make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (4, 32, 2048, 4, 32, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)
POINT = {p: i for i, p in enumerate(trace.EVENTS)}


def at(s, point, edge=0):
    return s[..., POINT[point], edge].astype(np.int64)


def hit(s, point):
    return s[..., POINT[point], 0] != runtime_trace.UNSTAMPED


def check_timeline(world, tl, msg):
    check_events(world, tl, msg)
    check_roles_stamped(world, tl, msg)
    wait = tl.stamps["ep_dispatch" if world.fused else "ep_dispatch_wait"]
    aux = world.cfg.n_sms - 1
    assert hit(wait, "aux.flag_raised")[:, aux].all(), msg
    assert (at(wait, "aux.counts_seen")[:, aux] <= at(wait, "aux.flag_raised")[:, aux]).all()
    assert hit(wait, "copy.flag_seen")[:, :aux].all(), msg
    assert (at(wait, "copy.flag_seen")[:, :aux] >= at(wait, "aux.flag_raised")[:, aux:]).all()
    rows = tl.rows()
    # a round trip of this size takes microseconds, not seconds
    assert rows[0][2] == 0.0 and 0 < max(r[3] for r in rows) < 1e5, (msg, rows)


@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_traced_round_trip_matches_and_orders(fused, fmt, graph, seed):
    T = SHAPE[4]
    world = epgen.EmulatedWorld(traced(make_cfg(*SHAPE, fmt=fmt)), fused=fused)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, T + 1))       # one count: a graph replays the captured one
    runtime_trace.arm(world)
    for call in checked_calls(world, rng, seed,
                              lambda call: n if graph else int(rng.integers(1, T + 1)), 3,
                              graph):
        check_timeline(world, runtime_trace.read(world), f"seed {seed}, call {call}")
        runtime_trace.arm(world)


def test_epgen_run_trace_prints_the_timeline(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert cli.main(["run", "--preset", "decode", "--set", "format=NVFP4", "--tokens", "8",
                     "--calls", "3", "--graph", "--trace", str(path), "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("matches the reference") == 3
    doc = json.loads(path.read_text())
    assert trace_export.validate(doc) == [] and doc["otherData"]["calls"] == 3
    table = out[out.index("trace events, median of 3 calls"):].splitlines()[2:-1]
    points = {line.split()[1] for line in table}
    assert {"comm.begin", "aux.counts_seen", "aux.flag_raised", "copy.flag_seen",
            "copy.end"} <= points


def test_traced_round_trip_exports_one_track_per_rank_role_and_block(seed):
    """Dispatch + combine on streams: the export of two calls passes the schema with a
    track per (rank, kernel, role, block) that recorded events."""
    from combine_checks import combine_matches
    from epgen import routing
    world = epgen.EmulatedWorld(traced(make_cfg(*SHAPE)), fused=False)
    rng = np.random.default_rng(seed)
    timelines = []
    for call in range(2):
        toks, ids = routing.routing(rng, world.cfg, SHAPE[4])
        runtime_trace.arm(world)
        results = world.dispatch(toks, ids)
        combine_matches(world, rng, seed, call, results, ids)
        timelines.append(runtime_trace.read(world))
        check_events(world, timelines[-1], f"seed {seed}, call {call}")
    assert {"ep_combine_async", "ep_combine_wait"} <= set(timelines[0].events)
    check_chrome_trace(trace_export.chrome_trace(timelines), timelines)


def test_fused_roles_l1_releases_precede_the_consumer(seed):
    """``ep_fused_roles`` traced: each expert's L1 release events name its token blocks once
    and all come before the ffn role's ``ffn.l1_seen`` of that expert."""
    from epgen import reference, routing
    from epgen.kernels.fused_roles import FusedRolesSpec
    from epgen.runtime.fused_roles_run import FusedRolesRunner
    cfg = traced(make_cfg(*SHAPE), trace_rings_per_cta=2)
    spec = FusedRolesSpec()
    runner = FusedRolesRunner(epgen.EmulatedWorld(cfg, fused=False), spec)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, SHAPE[4])
    runtime_trace.arm(runner.world)
    out = runner.dispatch(toks, ids)
    tl = runtime_trace.read(runner.world)
    want = reference.dispatch(cfg, toks, ids)
    reference.assert_match(cfg, want, out.results)
    ev = tl.events["ep_fused_roles"]
    rel, seen = (ev[ev["event"] == POINT[p]] for p in ("copy.l1_release", "ffn.l1_seen"))
    tb = spec.l1_release_token_block
    for r in range(cfg.n_ranks):
        counts = want[r].counts.sum(axis=1)
        mine = rel[rel["rank"] == r]
        got = sorted((int(p) >> 32, int(p) & 0xFFFFFFFF) for p in mine["payload"])
        assert got == sorted((e, b) for e in range(len(counts))
                             for b in range(-(-int(counts[e]) // tb))), f"seed {seed}"
        for e in range(len(counts)):
            t_seen = seen[(seen["rank"] == r) & (seen["payload"] == e)]["t"]
            t_rel = mine[(mine["payload"] >> np.uint64(32)) == e]["t"]
            assert t_seen.size == 1, (seed, r, e)
            assert t_rel.size == 0 or int(t_seen[0]) >= int(t_rel.max()), (seed, r, e)
