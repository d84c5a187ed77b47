"""The final rows by warp on the GPU: every quantising format's ``ep_final_layout`` rows and
output scales (BlockwiseFP8's transposed) written by the warp send path, against the
reference, with and without ``ep_prod_reserve``, on streams and as graph replays."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen.kernels import send_policy
from format_cases import QUANT
from world_checks import checked_calls, make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (4, 32, 2048, 4, 32, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("prod", [False, True], ids=["final", "final_prod"])
@pytest.mark.parametrize("fmt", QUANT)
def test_final_rows_by_warp(fmt, prod, graph, seed):
    R, E, H, K, T, threads, sms = SHAPE
    cfg = make_cfg(*SHAPE, fmt=fmt, ep_final_layout=True, ep_prod_reserve=prod)
    assert send_policy.uses_warp_send(cfg)
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(0, T + 1)) for _ in range(R)]
    for _ in checked_calls(epgen.EmulatedWorld(cfg), rng, seed, counts, 3, graph):
        pass
