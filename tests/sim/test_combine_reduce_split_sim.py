"""``Tuning.reduce_warps_per_token_max`` (``combine_wait.token_shares``): several warps share
a token's row in the combine reduce when the grid's warps outnumber a call's tokens. On the
simulator, every form against ``epgen.reference.combine`` bit for bit: BF16 weighted with a
residual, weighted, unreduced; the FP8 combine; the partial-reduce combine; the fused
kernel with the shared expert; calls of 0, 1, a few and every token (so the split is 8, 4,
2 and 1 warps a token over the grid's 10 warps), rows whose chunks the shares cover and
rows with fewer chunks than a split's lanes (shares with nothing to do). The knob's default
builds the same kernels as before (the goldens pin it); a split build differs."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from epgen.kernels import build_combine_module
from epgen.runtime.world import EmulatedWorld

from combine_checks import check_round_trips, expert_outputs, residuals, weights


def _cfg(H=1024, most=8, **flags):
    """64 threads x 5 blocks: 10 warps in the reduce grid; 8 tokens per rank at most."""
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=4, n_ranks=2,
                          max_tokens_per_rank=8, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format("BF16", H, 2),
                          tuning=epgen.Tuning(reduce_warps_per_token_max=most), **flags)


def _calls(rng, cfg, counts):
    return [routing.routing(rng, cfg, [n] * cfg.n_ranks) for n in counts]


#: tokens per rank of each call: 10 warps give 8, 4, 2 and 1 warps a token
COUNTS = (1, 2, 4, 8, 0)


@pytest.mark.parametrize("H", [1024, 512], ids=["shares_full", "shares_idle"])
def test_bf16_forms(H, seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(H=H)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_round_trips(world, rng, seed, _calls(rng, cfg, COUNTS), "split")


def test_fp8_combine(seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg()
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    for call, (toks, ids) in enumerate(_calls(rng, cfg, COUNTS)):
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        for w in (weights(rng, cfg, ids), None):
            got = world.combine(ys, w, fp8=True)
            want = reference.combine(cfg, results, ys, w, fp8=True,
                                     n_tokens=[len(i) for i in ids])
            for s, (g, x) in enumerate(zip(got, want)):
                assert np.array_equal(g, x), f"seed {seed} call {call} source {s} {w is None}"


def test_partial_reduce_combine(seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(ep_rank_dedup=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    for call, (toks, ids) in enumerate(_calls(rng, cfg, COUNTS)):
        w = weights(rng, cfg, ids)
        results = world.dispatch(toks, ids, topk_weights=w)
        ys = expert_outputs(rng, cfg, results)
        res = residuals(rng, cfg, ids)
        got = world.combine(ys, residual=res, partial_reduce=True)
        want = reference.combine(cfg, results, ys, w, residual=res, partial_reduce=True)
        for s, (g, x) in enumerate(zip(got, want)):
            assert np.array_equal(g, x), f"seed {seed} call {call} source {s}"


def test_fused_kernel_with_the_shared_expert(seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(fused_shared_expert=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=True)
    check_round_trips(world, rng, seed, _calls(rng, cfg, (1, 4, 8)), "split fused SE")


def test_the_default_is_one_warp_per_token():
    """Knob 1 builds the reduce of one warp per token (no share arithmetic); a split build
    adds it."""
    one = build_combine_module(_cfg(most=1))
    split = build_combine_module(_cfg(most=8))
    from ir.printer import print_module
    assert "red_share" not in print_module(one) and "red_share" in print_module(split)
    assert epgen.Tuning().reduce_warps_per_token_max == 1
