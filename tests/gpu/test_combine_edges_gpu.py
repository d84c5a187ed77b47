"""The GPU twins of tests/sim/test_combine_edges_sim.py (``EmulatedWorld``, cuda, 8 ranks): the
send's bounds check at ``t = -1``, ``t = max_tokens_per_rank``, ``k = -1`` and ``k = top_k``
in one call (recorded, nothing written, guard bytes intact), split and fused; and the
reduce's arithmetic edges (the crafted tokens of ``combine_arith_model`` and random NaN,
+-inf, -0 and subnormal expert outputs, weights and residuals) against
``reference.combine`` bit for bit and the independent model, split and fused."""

from __future__ import annotations

import numpy as np
import pytest

import epgen

from combine_checks import corrupted_row_check
from combine_special_checks import special_values_check
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

# R, E, H, K, T, threads, sms: the "small" shape of tests/gpu/test_combine_gpu.py
SMALL = (8, 64, 256, 4, 32, 256, 9)
_worlds = {}


def _world(fused: bool):
    if fused not in _worlds:
        _worlds[fused] = epgen.EmulatedWorld(make_cfg(*SMALL), fused=fused)
    return _worlds[fused]


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_bounds_edges_are_recorded_and_write_nothing(fused, seed):
    corrupted_row_check(_world(fused), np.random.default_rng(seed), d=3, edges=True)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_special_values_and_crafted_sums_match_the_reference_and_the_model(fused, seed):
    special_values_check(_world(fused), np.random.default_rng(seed), seed)
