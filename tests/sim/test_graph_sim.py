"""``RoundTripGraph`` with the real kernels on the simulator (``sim_world``, ``backends.sim``):
replays against the reference for the staged default, ORD-R and final+prod (whose
generation the kernels advance, so the graph replays unchanged), mixed with stream calls;
several calls per graph;
and that a replay launches the recorded kernels, not the world's stream path."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing

from sim_world import sim_world
from test_final_layout_sim import FLAGS, SHAPES, make_cfg


def check(world, cfg, toks, ids, seed, what):
    try:
        reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), world.results())
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}, {what}: {exc}") from None


@pytest.mark.parametrize("flags", ["staged", "ord_r", "prod_reserve"])
def test_replays_and_stream_calls_match_the_reference(flags, seed):
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, counts)
        world.load_inputs(toks, ids)
        with world.capture_round_trip() as graph:
            for call in range(4):
                toks, ids = routing.routing(rng, cfg, counts)
                if call == 1:
                    world.dispatch(toks, ids)
                else:
                    world.load_inputs(toks, ids)
                    stream_launches = len(world.program.loaded.launched)
                    replays = graph.exec.replays
                    graph.launch()
                    world.check()
                    # the replay ran the recorded kernels and recorded nothing again
                    assert graph.exec.replays == replays + 1
                    assert len(graph.exec.nodes) == 2 * cfg.n_ranks
                    assert len(world.program.loaded.launched) == stream_launches
                check(world, cfg, toks, ids, seed, f"{flags} call {call}")


def test_three_calls_per_graph_with_prod_reserve(seed):
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS["prod_reserve"])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        world.load_inputs(toks, ids)
        with world.capture_round_trip(calls=3) as graph:
            for replay in range(2):
                toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
                world.load_inputs(toks, ids)
                graph.launch()
                world.check()
                check(world, cfg, toks, ids, seed, f"replay {replay}")
            assert world.prod_generations() == [6] * cfg.n_ranks   # 3 calls per replay
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        world.dispatch(toks, ids)
        check(world, cfg, toks, ids, seed, "stream call after the replays")
    assert graph.exec is None                     # closed by the with block
    assert world.cuda.capture is None              # no capture left open


FORMAT_CASES = [("NVFP4", 64, "staged"), ("BlockwiseFP8", 384, "fused_se"),
                ("MXFP8", 64, "skip_a2a")]


@pytest.mark.parametrize("fmt,H,flags", FORMAT_CASES,
                         ids=[f"{f}-{g}" for f, _, g in FORMAT_CASES])
def test_formats_fused_and_skip_a2a_replays(fmt, H, flags, seed):
    """The quantising formats (NVFP4 with an input scale frozen into the graph), the fused
    single launch (the shared expert) and a ``skip_a2a`` device, replayed."""
    import test_formats_sim as F
    cfg = F.make_cfg(fmt, H, **F.FLAGS[flags])
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    scale = 0.5 if getattr(cfg.token_fmt, "uses_input_scale", False) else 1.0
    with sim_world(cfg, seed) as world:
        world.input_scale = scale
        toks, ids = routing.routing(rng, cfg, counts)
        world.load_inputs(toks, ids)
        with world.capture_round_trip() as graph:
            for call in range(2):
                toks, ids = routing.routing(rng, cfg, counts)
                world.load_inputs(toks, ids)
                graph.launch()
                world.check()
                want = reference.dispatch(cfg, toks, ids, input_scale=scale)
                try:
                    reference.assert_match(cfg, want, world.results())
                except AssertionError as exc:
                    raise AssertionError(f"seed {seed}, {fmt} {flags} call {call}: "
                                         f"{exc}") from None
            assert graph.exec.replays == 2
