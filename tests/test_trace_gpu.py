"""Trace points on the GPU: kernels built with ``tuning.trace`` still match the reference
bit-exactly (BF16) or as the format's reference says (NVFP4), on streams and as a graph
replay, and ``%globaltimer`` stamps respect the protocol's hand-offs; ``epgen run --trace``
prints the timeline."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import cli
from epgen.kernels import trace
from epgen.runtime import trace as runtime_trace
from test_trace_sim import check_roles_stamped, traced
from world_checks import checked_calls, make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (4, 32, 2048, 4, 32, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)
POINT = {p: i for i, p in enumerate(trace.POINTS)}


def at(s, point, edge=0):
    return s[..., POINT[point], edge].astype(np.int64)


def hit(s, point):
    return s[..., POINT[point], 0] != runtime_trace.UNSTAMPED


def check_timeline(world, tl, msg):
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


def test_epgen_run_trace_prints_the_timeline(capsys):
    assert cli.main(["run", "--preset", "decode", "--set", "format=NVFP4", "--tokens", "8",
                     "--calls", "3", "--graph", "--trace", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("matches the reference") == 3
    table = out[out.index("trace points, median of 3 calls"):].splitlines()[2:]
    points = {line.split()[1] for line in table}
    assert {"comm.begin", "aux.counts_seen", "aux.flag_raised", "copy.flag_seen",
            "copy.end"} <= points
