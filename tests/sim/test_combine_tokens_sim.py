"""The normal-mode combine (``ep_combine_async_tokens`` then ``ep_combine_wait_partial``;
``world.combine_tokens``) on the CPU simulator, bit-exact against
``epgen.reference_tokens.normal_combine``: 2 and 4 ranks, ``-1`` slots, a token with all its
experts on one rank and one with none, weights, 0 / 1 / 2 biases, consecutive
dispatch/combine rounds on one world, an idle rank, padding rows not read, the weak memory
model, ``P2PWorld``."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from backends import sim as sim_backend
from epgen.reference_tokens import normal_combine

from test_dispatch_tokens_sim import draw_inputs, make_cfg


def rows_of(rng, got, H, extra=0):
    """Random BF16 rows (finite: exponent bits kept small) for every received row, plus
    ``extra`` padding rows the combine must not read."""
    return [(rng.integers(0, 1 << 14, (g.n_rows + extra, H)) ^ 0x3000).astype(np.uint16)
            for g in got]


@pytest.mark.parametrize("R,L,K", [(2, 2, 2), (4, 2, 3)], ids=["R2", "R4"])
def test_matches_reference_over_rounds(seed, rng, R, L, K):
    cfg = make_cfg(R=R, L=L, K=K)
    H, T = cfg.token_fmt.hid_dim, cfg.max_tokens_per_rank
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed % 1000))
    for call, n_bias in enumerate((0, 1, 2)):
        counts = [0] + [T] * (R - 1) if call == 1 else None
        toks, ids = draw_inputs(rng, cfg, counts)
        got = world.dispatch_tokens(toks, ids)
        xs = rows_of(rng, got, H, extra=2)
        ws = None if call == 2 else [rng.standard_normal((g.n_rows + 2, K)).astype(np.float32)
                                     for g in got]
        bias = [tuple(rng.integers(0, 1 << 14, (len(i), H)).astype(np.uint16)
                      for _ in range(n_bias)) for i in ids]
        out = world.combine_tokens(xs, ws, bias)
        exp = normal_combine(cfg.n_experts, ids, [g.src for g in got], xs, ws, bias)
        for s in range(R):
            np.testing.assert_array_equal(out[s][0], exp[s][0], err_msg=f"call {call} rank {s}")
            if ws is None:
                assert out[s][1] is None
            else:
                np.testing.assert_array_equal(out[s][1], exp[s][1],
                                              err_msg=f"call {call} rank {s} weights")


def test_weak_memory_model(seed, rng):
    """The arrival words order the rows and weight slots under the simulator's weak memory
    model (two rounds: the counters and arrival words re-armed in between)."""
    cfg = make_cfg(R=2, L=2, K=2)
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed % 1000, memory="weak"))
    for _ in range(2):
        toks, ids = draw_inputs(rng, cfg)
        got = world.dispatch_tokens(toks, ids)
        xs = rows_of(rng, got, cfg.token_fmt.hid_dim)
        ws = [rng.standard_normal((g.n_rows, 2)).astype(np.float32) for g in got]
        out = world.combine_tokens(xs, ws)
        exp = normal_combine(cfg.n_experts, ids, [g.src for g in got], xs, ws)
        for s in range(2):
            np.testing.assert_array_equal(out[s][0], exp[s][0])
            np.testing.assert_array_equal(out[s][1], exp[s][1])


def test_p2p_world_one_gpu_per_rank(seed, rng):
    """``P2PWorld`` (one simulated GPU per rank, the peers' buffers through its tables)."""
    cfg = make_cfg(R=2, L=2, K=2)
    world = epgen.P2PWorld(cfg, backend="sim", sim_seed=seed % 1000)
    toks, ids = draw_inputs(rng, cfg)
    got = world.dispatch_tokens(toks, ids)
    xs = rows_of(rng, got, cfg.token_fmt.hid_dim)
    ws = [rng.standard_normal((g.n_rows, 2)).astype(np.float32) for g in got]
    bias = [(rng.integers(0, 1 << 14, (len(i), cfg.token_fmt.hid_dim)).astype(np.uint16),)
            for i in ids]
    out = world.combine_tokens(xs, ws, bias)
    exp = normal_combine(cfg.n_experts, ids, [g.src for g in got], xs, ws, bias)
    for s in range(2):
        np.testing.assert_array_equal(out[s][0], exp[s][0])
        np.testing.assert_array_equal(out[s][1], exp[s][1])
