"""Trace points on the GPU: kernels built with ``trace.ENABLED`` still match the reference
bit-exactly (BF16) or as the format's reference says (NVFP4), on streams and as a graph
replay, and ``%globaltimer`` stamps respect the protocol's hand-offs; ``epgen run --trace``
prints the timeline."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import cli, reference, routing
from epgen.formats import make_format
from epgen.kernels import trace
from epgen.runtime import trace as runtime_trace
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (4, 32, 2048, 4, 32, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)
POINT = {p: i for i, p in enumerate(trace.POINTS)}


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(trace, "ENABLED", True)


def at(s, point, edge=0):
    return s[..., POINT[point], edge].astype(np.int64)


def hit(s, point):
    return s[..., POINT[point], 0] != runtime_trace.UNSTAMPED


def check_timeline(world, tl, msg):
    kernels = {k.name: k for k in world.program.module.kernels}
    for name, s in tl.stamps.items():
        for role in kernels[name].roles:
            began = hit(s, f"{role.name}.begin")
            assert began.sum(axis=1).min() > 0, (msg, name, role.name)
            assert (began == hit(s, f"{role.name}.end")).all(), (msg, role.name)
            assert (at(s, f"{role.name}.begin")[began]
                    <= at(s, f"{role.name}.end", 1)[began]).all(), (msg, role.name)
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
def test_traced_round_trip_matches_and_orders(traced, fused, fmt, graph, seed):
    R, E, H, K, T, threads, sms = SHAPE
    cfg = make_cfg(*SHAPE) if fmt == "BF16" else epgen.EPConfig(
        num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R, max_tokens_per_rank=T,
        p2p_world_size=R, use_shmem=False, token_fmt=make_format(fmt, H, K))
    world = epgen.EmulatedWorld(cfg, fused=fused)
    rng = np.random.default_rng(seed)
    replay = None
    n = int(rng.integers(1, T + 1))       # one count: a graph replays the captured one
    for call in range(3):
        toks, ids = routing.routing(rng, cfg, n if graph else int(rng.integers(1, T + 1)))
        runtime_trace.arm(world)
        if graph:
            replay, got = world.dispatch_replayed(toks, ids, replay)
        else:
            got = world.dispatch(toks, ids)
        msg = f"seed {seed}, call {call}"
        try:
            reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
        except AssertionError as exc:
            raise AssertionError(f"{msg}: {exc}") from None
        check_timeline(world, runtime_trace.read(world), msg)


def test_epgen_run_trace_prints_the_timeline(capsys):
    assert cli.main(["run", "--preset", "decode", "--set", "format=NVFP4", "--tokens", "8",
                     "--calls", "3", "--graph", "--trace", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("matches the reference") == 3
    table = out[out.index("trace points, median of 3 calls"):].splitlines()[2:]
    points = {line.split()[1] for line in table}
    assert {"comm.begin", "aux.counts_seen", "aux.flag_raised", "copy.flag_seen",
            "copy.end"} <= points
    assert not trace.ENABLED           # the command restores the build knob
