"""The combine kernels on the GPU (``EmulatedWorld``, cuda): 8 ranks, a small and a
decode-like shape, weights random and None, with and without a residual, against ``epgen.reference.combine`` bit for bit;
a 200-call dispatch + combine loop; the corrupted-``src_info`` check
(``combine_checks.corrupted_row_check``); and every dispatch format, ``ep_final_layout``
(with and without ``ep_prod_reserve``), ``skip_a2a`` devices, the fused ``ep_combine`` and
``fused_shared_expert`` (``combine_checks.check_round_trips``: weighted with and without a
residual, and unreduced)."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import routing

from combine_checks import (check_round_trips, combine_matches, corrupted_row_check,
                            round_trip_inputs)
from format_cases import FORMATS, QUANT
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
    combine_matches(world, rng, seed, call, results, ids)


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


# name -> (make_cfg arguments, flags, world keyword arguments, skip_a2a devices)
VARIANTS = {
    **{FORMATS[name].golden_suffix: ((8, 64, 2048, 4, 32, 256, 9, name), {}, {}, None)
       for name in QUANT},     # every quantising format: "fp8" (BlockwiseFP8), "nvfp4", ...
    "final_layout": ((8, 64, 256, 4, 32, 256, 9), {"ep_final_layout": True}, {}, None),
    "prod_reserve": ((8, 64, 256, 4, 32, 256, 9),
                     {"ep_final_layout": True, "ep_prod_reserve": True}, {}, None),
    "prod_reserve_nvfp4": ((8, 64, 2048, 4, 32, 256, 9, "NVFP4"),
                           {"ep_final_layout": True, "ep_prod_reserve": True}, {}, None),
    "skip_a2a": ((1, 8, 256, 4, 32, 256, 9), {"skip_a2a": True}, {}, 4),
    "skip_a2a_fused": ((1, 8, 256, 4, 32, 256, 9), {"skip_a2a": True}, {"fused": True}, 4),
    "fused": ((8, 64, 256, 4, 32, 256, 9), {}, {"fused": True}, None),
    "fused_decode": ((8, 256, 7168, 8, 128, 512, 33), {}, {"fused": True}, None),
    "fused_se": ((8, 64, 256, 4, 32, 256, 9), {"fused_shared_expert": True}, {}, None),
    "fused_se_skip_a2a": ((1, 8, 256, 4, 32, 256, 9),
                          {"skip_a2a": True, "fused_shared_expert": True}, {}, 4),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_combine_variants_match_the_reference(name, seed):
    args, flags, kw, devices = VARIANTS[name]
    rng = np.random.default_rng(seed)
    cfg = make_cfg(*args, **flags)
    world = epgen.EmulatedWorld(cfg, devices=devices, **kw)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 6, devices=devices), name)
