"""NVSHMEM calls per token of ``ep_rank_dedup``'s SHMEM send (``epgen.shmem_calls.per_token``
on the PTX of ``ep/shmem_mixed_rank_dedup``): the message put and the fence run once per
(token, remote rank) holding one of the token's experts, the slot words' puts and the index
words' put-with-signal once per remote top-k slot; the expected pairs counted here by visiting every expert set of
a token, not by the formula."""

from __future__ import annotations

import itertools

import pytest

import epgen
from backends.nvptx import emit_ptx
from epgen import ep_goldens as eg
from epgen import shmem_calls


def remote_pairs_by_enumeration(cfg) -> float:
    """Mean number of ranks outside rank 0's P2P group that hold one of a token's experts,
    over every set of ``K`` distinct experts (uniform top-k routing)."""
    E, K, L, P = cfg.n_experts, cfg.layout.top_k, cfg.layout.n_local_experts, \
        cfg.p2p_world_size
    sets = list(itertools.combinations(range(E), K))
    return sum(len({e // L for e in s if e // L >= P}) for s in sets) / len(sets)


@pytest.mark.parametrize("kernel", ["ep_dispatch_async", "ep_dispatch"])
def test_dedup_puts_a_message_and_a_fence_per_remote_rank_and_two_words_per_slot(kernel):
    cfg = eg.flag_variant_config("shmem_mixed_rank_dedup")
    assert cfg.ep_rank_dedup and cfg.p2p_world_size < cfg.n_ranks
    sites = shmem_calls.call_sites(emit_ptx(epgen.build_module(cfg)))
    T = 128
    got = shmem_calls.per_token(cfg, sites, kernel, tokens=T)
    E, R, P, K = cfg.n_experts, cfg.n_ranks, cfg.p2p_world_size, cfg.layout.top_k
    pairs = remote_pairs_by_enumeration(cfg)
    slots = K * (R - P) / R
    assert pairs < slots
    assert got["nvshmemx_putmem_nbi_warp"] == pytest.approx(pairs + slots)
    assert got["nvshmem_fence"] == pytest.approx(pairs)
    assert got["nvshmemx_putmem_signal_nbi_warp"] == pytest.approx(slots)
    assert got["nvshmemx_signal_op"] == pytest.approx(E * (R - P) / R / T)
    waits = got.get("nvshmem_signal_wait_until", 0.0)      # the fused kernel's receive side
    assert got["operations"] == pytest.approx(pairs + 2 * slots + E * (R - P) / R / T + waits)
    assert shmem_calls.remote_rank_pairs(cfg) == pytest.approx(pairs)


def test_without_dedup_every_send_loop_call_is_per_slot():
    cfg = eg.flag_variant_config("shmem_mixed")
    assert not cfg.ep_rank_dedup
    got = shmem_calls.per_token(cfg, shmem_calls.call_sites(emit_ptx(epgen.build_module(cfg))),
                                tokens=128)
    K, R, P = cfg.layout.top_k, cfg.n_ranks, cfg.p2p_world_size
    assert got["nvshmemx_putmem_signal_nbi_warp"] == pytest.approx(K * (R - P) / R)
    assert "nvshmemx_putmem_nbi_warp" not in got and "nvshmem_fence" not in got
