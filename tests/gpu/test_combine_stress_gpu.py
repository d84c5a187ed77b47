"""1000 back-to-back dispatch + combine calls on an ``EmulatedWorld`` on the GPU
(``test_combine_stress_sim.back_to_back``): rotating input sets with varying token counts (0
among them), a seeded sample of calls (and the last) checked against ``epgen.reference`` bit
for bit, and no error record in the error buffer at the end."""

from __future__ import annotations

import numpy as np
import pytest

import epgen

from test_combine_stress_sim import back_to_back, input_sets
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (8, 64, 2048, 8, 64, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)
CALLS = 1000
SAMPLE = 25


def test_1000_back_to_back_calls(seed):
    cfg = make_cfg(*SHAPE)
    rng = np.random.default_rng(seed)
    T, R = cfg.max_tokens_per_rank, cfg.n_ranks
    counts = [T, 0, 1, T // 2,
              [int(x) for x in rng.integers(0, T + 1, size=R)],
              [0] * (R - 1) + [T],
              [int(x) for x in rng.integers(0, T + 1, size=R)]]
    sets = input_sets(rng, cfg, counts)
    checked = rng.choice(CALLS, size=SAMPLE, replace=False)
    world = epgen.EmulatedWorld(cfg)
    assert back_to_back(world, sets, CALLS, checked, seed) >= SAMPLE
