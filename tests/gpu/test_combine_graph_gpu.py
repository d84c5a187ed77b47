"""Dispatch + combine as one CUDA graph (``world.capture_moe``) on the GPU: replays of fresh
random inputs (dispatch inputs by ``load_inputs``, combine inputs by ``graph.combiner.load``)
against ``epgen.reference.dispatch`` / ``epgen.reference.combine`` bit for bit, weighted,
with a residual and unreduced, two calls per replay, stream calls between replays."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing

from combine_checks import weights
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (8, 64, 2048, 8, 64, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)

_worlds = {}


def _world():
    if "w" not in _worlds:
        _worlds["w"] = epgen.EmulatedWorld(make_cfg(*SHAPE))
    return _worlds["w"]


def _inputs(rng, cfg, counts, residual):
    toks, ids = routing.routing(rng, cfg, counts)
    H = cfg.token_fmt.hid_dim
    ys = [rng.integers(0, 1 << 16, size=(len(r.src_info), H), dtype=np.uint16)
          & np.uint16(0xBFFF) for r in reference.dispatch(cfg, toks, ids)]
    res = [rng.integers(0, 1 << 16, size=(len(i), H), dtype=np.uint16) & np.uint16(0xBFFF)
           for i in ids] if residual else None
    return toks, ids, ys, weights(rng, cfg, ids), res


def _check(world, toks, ids, ys, w, res, got, seed, what):
    cfg = world.cfg
    results = world.results()
    try:
        reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), results)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}, {what}: dispatch: {exc}") from None
    want = reference.combine(cfg, results, ys, w, residual=res, n_tokens=[len(i) for i in ids])
    for s, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"seed {seed}, {what}, rank {s}: {np.count_nonzero(g != r)} elements differ"


@pytest.mark.parametrize("mode", ["weighted", "residual", "unreduced"])
def test_replays_and_stream_calls_match_the_reference(mode, seed):
    world = _world()
    cfg = world.cfg
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    residual = mode == "residual"
    toks, ids, *_ = _inputs(rng, cfg, counts, residual)
    world.load_inputs(toks, ids)
    with world.capture_moe(weighted=mode != "unreduced", residual=residual) as graph:
        for call in range(5):
            toks, ids, ys, w, res = _inputs(rng, cfg, counts, residual)
            if mode == "unreduced":
                w = None
            if call == 2:
                world.dispatch(toks, ids)
                got = world.combine(ys, w, res)
            else:
                world.load_inputs(toks, ids)
                graph.combiner.load(ys, w, res)
                graph.launch()
                got = graph.combiner.finish()
            _check(world, toks, ids, ys, w, res, got, seed, f"{mode} call {call}")


def test_two_calls_per_replay(seed):
    world = _world()
    cfg = world.cfg
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    toks, ids, *_ = _inputs(rng, cfg, T, False)
    world.load_inputs(toks, ids)
    with world.capture_moe(calls=2) as graph:
        for replay in range(3):
            toks, ids, ys, w, _ = _inputs(rng, cfg, T, False)
            world.load_inputs(toks, ids)
            graph.combiner.load(ys, w)
            graph.launch()
            got = graph.combiner.finish()
            _check(world, toks, ids, ys, w, None, got, seed, f"replay {replay}")
