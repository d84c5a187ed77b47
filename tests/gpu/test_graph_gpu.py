"""``RoundTripGraph`` (CUDA-graph capture of the round trip) on the GPU: replays against the
numpy reference, bit-exact, for the staged default, the fused single launch, a quantising
format and ``ep_final_layout`` + ``ep_prod_reserve`` (a new generation every replay); replays
mixed with stream calls; several calls per graph; the generation wrap before a capture;
frozen arguments refused; an expired wait inside a replay reported like a stream call's."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from world_checks import kinds, make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (4, 32, 2048, 4, 32, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)

VARIANTS = {
    "default": ({}, False),
    "fused": ({}, True),
    "final_prod": ({"ep_final_layout": True, "ep_prod_reserve": True}, False),
    "ord_r": ({"ep_ord_r": True, "has_rank_flag": True}, False),
}


def variant_world(name):
    flags, fused = VARIANTS[name]
    return epgen.EmulatedWorld(make_cfg(*SHAPE, **flags), fused=fused)


def nvfp4_world():
    R, E, H, K, T, threads, sms = SHAPE
    cfg = epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                         max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                         token_fmt=make_format("NVFP4", H, K))
    return epgen.EmulatedWorld(cfg, input_scale=0.75)


def expect_match(world, toks, ids, seed, what):
    want = reference.dispatch(world.cfg, toks, ids, input_scale=world.input_scale)
    try:
        reference.assert_match(world.cfg, want, world.results())
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}, {what}: {exc}") from None


def replay(world, graph, toks, ids):
    world.load_inputs(toks, ids)
    graph.launch()
    world.check("graph replay")


@pytest.mark.parametrize("name", [*VARIANTS, "NVFP4"])
def test_replays_and_stream_calls_match_the_reference(name, seed):
    """Capture once; replay with new inputs in the same buffers, a stream call between two
    replays, then replays again: every call matches the reference."""
    world = nvfp4_world() if name == "NVFP4" else variant_world(name)
    rng = np.random.default_rng(seed)
    T = world.cfg.max_tokens_per_rank
    toks, ids = routing.routing(rng, world.cfg, T)
    world.load_inputs(toks, ids)
    graph = world.capture_round_trip()
    try:
        for call in range(6):
            toks, ids = routing.routing(rng, world.cfg, T)
            if call == 2:
                world.dispatch(toks, ids)            # a stream call between replays
            else:
                replay(world, graph, toks, ids)
            expect_match(world, toks, ids, seed, f"{name} call {call}")
    finally:
        graph.close()


def test_several_calls_per_graph(seed):
    """A graph of 3 round trips: each replay runs them in order (the last one's output is
    what the world holds), then a stream call still matches."""
    world = variant_world("final_prod")
    rng = np.random.default_rng(seed)
    T = world.cfg.max_tokens_per_rank
    toks, ids = routing.routing(rng, world.cfg, T)
    world.load_inputs(toks, ids)
    before = world.prod_generations()
    graph = world.capture_round_trip(calls=3)
    try:
        assert world.prod_generations() == before          # a capture runs nothing
        for call in range(3):
            toks, ids = routing.routing(rng, world.cfg, T)
            replay(world, graph, toks, ids)
            expect_match(world, toks, ids, seed, f"replay {call}")
        assert world.prod_generations() == [g + 9 for g in before]
        toks, ids = routing.routing(rng, world.cfg, T)
        world.dispatch(toks, ids)
        expect_match(world, toks, ids, seed, "stream call")
    finally:
        graph.close()


def test_generation_wraps_inside_a_replay(seed):
    """Three calls per graph with two generations left before the 32-bit wrap: the kernels
    wrap inside the replay (skipping 0) and the replays stay correct."""
    world = variant_world("final_prod")
    rng = np.random.default_rng(seed)
    T = world.cfg.max_tokens_per_rank
    toks, ids = routing.routing(rng, world.cfg, T)
    world.dispatch(toks, ids)
    world.set_prod_generations(2**32 - 3)
    world.load_inputs(toks, ids)
    graph = world.capture_round_trip(calls=3)
    try:
        for call in range(2):
            replay(world, graph, toks, ids)
            expect_match(world, toks, ids, seed, f"replay {call} across the wrap")
        assert world.prod_generations() == [4] * world.cfg.n_ranks
    finally:
        graph.close()


def test_changed_launch_arguments_are_refused(seed):
    """A different token count or input scale than at capture: ValueError naming it, and
    nothing runs (the world still matches afterwards)."""
    world = nvfp4_world()
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, world.cfg, 8)
    world.load_inputs(toks, ids)
    graph = world.capture_round_trip()
    try:
        toks2, ids2 = routing.routing(rng, world.cfg, 5)
        world.load_inputs(toks2, ids2)
        with pytest.raises(ValueError, match="rank 0 n_tokens changed since the capture"):
            graph.launch()
        world.load_inputs(toks, ids)
        world.input_scale = 2.0
        with pytest.raises(ValueError, match="input_scale changed"):
            graph.launch()
        world.input_scale = 0.75
        replay(world, graph, toks, ids)
        expect_match(world, toks, ids, seed, "after the refusals")
    finally:
        graph.close()


def test_calls_must_be_positive():
    world = variant_world("default")
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="calls must be a positive integer"):
            world.capture_round_trip(calls=bad)


def test_missing_rank_times_out_inside_a_replay(seed):
    """Rank 0 alone captured and replayed: its dispatch_wait gives up, the timeout is
    reported by check() as for a stream call, and the world works again afterwards."""
    cfg = make_cfg(*SHAPE)
    world = epgen.EmulatedWorld(cfg, timeout_ns=100_000_000)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 8)
    world.load_inputs(toks, ids)
    everyone = world.ranks
    world.ranks = [rk for rk in everyone if rk.rank == 0]
    try:
        graph = world.capture_round_trip()
        graph.launch()
        with pytest.raises(epgen.EPTimeoutError) as info:
            world.check()
    finally:
        world.ranks = everyone
        world.reset()                   # the other ranks' count words rank 0 wrote
    graph.close()
    assert ("ep_dispatch_wait", "aux", "recv_count") in kinds(info.value.records)
    assert all(r.rank == 0 for r in info.value.records)
    toks, ids = routing.routing(rng, cfg, 8)
    got = world.dispatch(toks, ids)
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)


def test_cli_run_graph(capsys, seed):
    from epgen import cli
    assert cli.main(["run", "--preset", "small", "--calls", "3", "--graph",
                     "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    assert "each call a CUDA-graph replay" in out
    assert out.count("matches the reference") == 3
