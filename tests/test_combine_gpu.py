"""The combine kernels on the GPU (``EmulatedWorld``, cuda): 8 ranks, a small and a
decode-like shape, weights random and None, with and without a residual, against ``epgen.reference.combine`` bit for bit;
a 200-call dispatch + combine loop; the corrupted-``src_info`` check
(``combine_checks.corrupted_row_check``)."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing

from combine_checks import corrupted_row_check, expert_outputs, weights
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

SHAPES = {
    # R, E, H, K, T, threads, sms
    "small": (8, 64, 256, 4, 32, 256, 9),
    "decode": (8, 256, 7168, 8, 128, 512, 33),
}

_worlds = {}


def _world(name):
    if name not in _worlds:
        _worlds[name] = epgen.EmulatedWorld(make_cfg(*SHAPES[name]))
    return _worlds[name]


def _check(world, rng, seed, call, n_tok):
    cfg = world.cfg
    toks, ids = routing.routing(rng, cfg, n_tok)
    results = world.dispatch(toks, ids)
    ys = expert_outputs(rng, cfg, results)
    w = weights(rng, cfg, ids) if call % 2 == 0 else None
    res = None
    if call % 4 == 0:
        res = [rng.integers(0, 1 << 16, size=(len(i), cfg.token_fmt.hid_dim), dtype=np.uint16)
               & np.uint16(0xBFFF) for i in ids]
    got = world.combine(ys, w, residual=res)
    want = reference.combine(cfg, results, ys, w, residual=res, n_tokens=[len(i) for i in ids])
    for s, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"seed {seed} call {call} rank {s}: {np.count_nonzero(g != r)} elements differ"


@pytest.mark.parametrize("name", list(SHAPES))
def test_combine_matches_the_reference(name, seed):
    rng = np.random.default_rng(seed)
    world = _world(name)
    for call in range(6):
        n_tok = world.cfg.max_tokens_per_rank if call < 4 else int(
            rng.integers(0, world.cfg.max_tokens_per_rank + 1))
        _check(world, rng, seed, call, n_tok)


def test_200_back_to_back_calls(seed):
    rng = np.random.default_rng(seed)
    world = _world("small")
    for call in range(200):
        _check(world, rng, seed, call, int(rng.integers(1, world.cfg.max_tokens_per_rank + 1)))


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_corrupted_src_info_row_is_reported(name, seed):
    corrupted_row_check(_world(name), np.random.default_rng(seed), d=3)
