"""The token-major receive (``ep_dispatch_wait_tokens`` after ``ep_dispatch_async`` of an
``ep_rank_dedup`` configuration; ``world.dispatch_tokens``) on the CPU simulator, against
``epgen.reference_tokens.normal_dispatch``: 2 and 4 ranks, ``-1`` slots, a token with all
its experts on one rank, a token of ``-1`` only, an idle rank, consecutive calls on one world
(every word re-armed by the kernels), padding rows, the top-k weights, the weak memory
model, ``P2PWorld``."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from backends import sim as sim_backend
from epgen.formats import make_format
from epgen.kernels.dispatch_tokens import TokensLayout
from epgen.reference_tokens import normal_dispatch


def make_cfg(R=2, L=2, K=2, T=4, H=32, **flags):
    """``R`` ranks of ``L`` experts, top-``K``, ``T`` tokens per rank, BF16 ``H``, 64 threads
    on 3 blocks (an aux block and two copy blocks), ``ep_rank_dedup``."""
    return epgen.EPConfig(num_threads=64, n_sms=max(3, -(-L * R // 2) + 1), n_experts=L * R,
                          n_ranks=R, max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format("BF16", H, K), ep_rank_dedup=True, **flags)


def draw_inputs(rng, cfg, counts=None):
    """Every rank's tokens (random BF16 bits) and unique top-k ids with some ``-1`` slots; the
    first token of a rank with at least two tokens has all its experts on one rank, the
    second only ``-1``s."""
    R, K, E = cfg.n_ranks, cfg.token_fmt.top_k, cfg.n_experts
    L, H, T = E // R, cfg.token_fmt.hid_dim, cfg.max_tokens_per_rank
    toks, ids = [], []
    for r in range(R):
        n = int(rng.integers(1, T + 1)) if counts is None else counts[r]
        toks.append(rng.integers(0, 1 << 16, (n, H)).astype(np.uint16))
        a = np.array([rng.permutation(E)[:K] for _ in range(n)], np.int32).reshape(n, K)
        a[rng.random(a.shape) < 0.25] = -1
        if n >= 2:
            d = int(rng.integers(R))
            a[0] = d * L + rng.permutation(L)[:K] if K <= L else -1
            a[1] = -1
        ids.append(a)
    return toks, ids


def check_rank(cfg, got, toks, ids, d, pad_rows=0, weights=None):
    exp = normal_dispatch(cfg.n_experts, toks, ids, d, weights)
    np.testing.assert_array_equal(got.topk_weights, exp.topk_weights,
                                  err_msg=f"rank {d} topk_weights")
    assert (got.pad_weights == 0).all() and len(got.pad_weights) == len(got.pad_topk)
    assert got.n_rows == exp.n_rows, (d, got.n_rows, exp.n_rows)
    np.testing.assert_array_equal(got.src, exp.src, err_msg=f"rank {d} src")
    np.testing.assert_array_equal(got.x, exp.x, err_msg=f"rank {d} x")
    np.testing.assert_array_equal(got.topk_idx, exp.topk_idx, err_msg=f"rank {d} topk_idx")
    np.testing.assert_array_equal(got.rank_prefix, exp.rank_prefix,
                                  err_msg=f"rank {d} rank_prefix")
    np.testing.assert_array_equal(got.expert_counts, exp.expert_counts,
                                  err_msg=f"rank {d} expert_counts")
    assert got.pad_topk.shape == (max(0, pad_rows - got.n_rows), cfg.token_fmt.top_k)
    assert (got.pad_topk == -1).all()
    assert (got.pad_src == -1).all() and len(got.pad_src) == len(got.pad_topk)


@pytest.mark.parametrize("R,L,K", [(2, 2, 2), (4, 2, 3)], ids=["R2", "R4"])
def test_matches_reference_over_consecutive_calls(seed, rng, R, L, K):
    cfg = make_cfg(R=R, L=L, K=K)
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed % 1000))
    rows = TokensLayout(cfg).rows
    for call in range(3):
        toks, ids = draw_inputs(rng, cfg)
        pad = rows if call == 1 else 0
        # weights on the first and last calls: the middle one's travel as zeros
        ws = None if call == 1 else [rng.standard_normal(i.shape).astype(np.float32)
                                     for i in ids]
        got = world.dispatch_tokens(toks, ids, pad_rows=pad, topk_weights=ws)
        for d in range(R):
            check_rank(cfg, got[d], toks, ids, d, pad, ws)
    tl = TokensLayout(cfg)
    for b in world.token_receiver().bufs:   # the flag, countdown and bitmap left re-armed
        words = b.scratch.to_host()
        assert not words[:tl.prefix_offset].any() and not words[tl.bitmap_offset:].any()
    lay = cfg.layout
    for rk in world.ranks:
        words = rk.recv_count.to_host()
        assert (words[:lay.rank_flag_base] == np.uint64(2**64 - 1)).all()


def test_weak_memory_and_an_idle_rank(seed, rng):
    cfg = make_cfg(R=2, L=2, K=2)
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed % 1000, memory="weak"))
    for counts in ([0, 3], [4, 4]):
        toks, ids = draw_inputs(rng, cfg, counts)
        got = world.dispatch_tokens(toks, ids, pad_rows=5)
        for d in range(2):
            check_rank(cfg, got[d], toks, ids, d, 5)


def test_then_the_grouped_dispatch_on_the_same_world(seed, rng):
    """The token-major receive and ``ep_dispatch_wait`` take turns on one world: each leaves
    the words the other needs re-armed."""
    from epgen import reference
    cfg = make_cfg()
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed % 1000))
    for call in range(2):
        toks, ids = draw_inputs(rng, cfg)
        got = world.dispatch_tokens(toks, ids)
        for d in range(2):
            check_rank(cfg, got[d], toks, ids, d)
        toks, ids = draw_inputs(rng, cfg)
        exp = reference.dispatch(cfg, toks, ids)
        for e, g in zip(exp, world.dispatch(toks, ids)):
            reference.assert_match(cfg, e, g)


def test_refused_configurations():
    for flags, name in (({"ep_rank_dedup": False}, "ep_rank_dedup"),
                        ({"ep_ord_r": True, "has_rank_flag": True}, "ep_ord_r"),
                        ({"ep_rank_mask": True}, "ep_rank_mask")):
        cfg = make_cfg(**flags) if name != "ep_rank_dedup" else make_cfg().replace(**flags)
        world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(0))
        with pytest.raises(ValueError, match=name):
            world.token_receiver()


def test_p2p_world_one_gpu_per_rank(seed, rng):
    """``P2PWorld`` (one simulated GPU per rank) runs the same receive."""
    cfg = make_cfg(R=2, L=2, K=2)
    world = epgen.P2PWorld(cfg, backend="sim", sim_seed=seed % 1000)
    for _ in range(2):
        toks, ids = draw_inputs(rng, cfg)
        got = world.dispatch_tokens(toks, ids, pad_rows=3)
        for d in range(2):
            check_rank(cfg, got[d], toks, ids, d, 3)
