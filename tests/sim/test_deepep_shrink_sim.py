"""DeepEP's shrink mode (``enable_shrink``, ``low_latency_update_mask_buffer``,
``low_latency_query_mask_buffer``, ``low_latency_clean_mask_buffer``) on an
``EmulatedGroup(backend="sim")``, checked as DeepEP's own low-latency test checks it
(``tests/legacy/test_low_latency.py``, ``--shrink-test``): ranks fail when they first call
dispatch, combine and the buffer clean-up (they stop calling); after each call every
survivor's mask is exactly the ranks failed so far; its dispatch receives only from unmasked
ranks and its combine weighs nothing on a masked rank's experts. Then the mask calls by
hand: update, query, clean."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402

from deepep_checks import (FAILS, LLCase, check_dispatch_masked, query,  # noqa: E402
                           rank_inputs, shrink_rounds)


def test_ranks_failing_at_dispatch_combine_and_clean_are_masked(seed):
    case = LLCase(n_ranks=5, num_experts=10, tokens=4, hidden=256, top_k=3)
    inputs = rank_inputs(torch, case, seed)
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
    L = case.num_experts // case.n_ranks

    def rank_main(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True,
                             num_qps_per_rank=L, enable_shrink=True)
        return shrink_rounds(torch, buf, rank, case, inputs, FAILS, lambda api: None)

    survivors = group.run(rank_main)
    assert [r for r, got in enumerate(survivors) if got is not None] == [0, 2]
    assert all(got == set(FAILS.values()) for got in survivors if got is not None)


def test_the_mask_calls_by_hand(seed):
    """Every rank masks rank 2 by hand: nobody waits for it (the simulator has no deadline
    to spare: the calls would hang otherwise) and its experts receive nothing; unmasked by
    every rank, it is back; clean_mask unmasks everything."""
    case = LLCase(n_ranks=3, num_experts=6, tokens=4, hidden=256, top_k=2, masked=0)
    inputs = rank_inputs(torch, case, seed)
    all_idx = [i for _, i, _ in inputs]
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
    T, E = case.tokens, case.num_experts

    def rank_main(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True, enable_shrink=True)
        x, idx, w = inputs[rank]
        buf.low_latency_update_mask_buffer(2, True)
        assert query(torch, buf, 3) == {2}
        if rank == 2:
            return None                 # masked by everyone: it makes no call
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        check_dispatch_masked(case, rank, all_idx, recv_x, count, handle, {2})
        buf.low_latency_update_mask_buffer(2, False)
        buf.low_latency_update_mask_buffer(0, True)
        buf.low_latency_clean_mask_buffer()
        return query(torch, buf, 3)

    assert group.run(rank_main) == [set(), set(), None]


def test_shrink_is_refused_where_it_is_not_available():
    group = deep_ep.EmulatedGroup(2, backend="sim")
    buf = deep_ep.Buffer(group.rank(0), low_latency_mode=True)
    with pytest.raises(EPInputError, match="needs a buffer built with enable_shrink"):
        buf.low_latency_update_mask_buffer(1, True)
    shrinking = deep_ep.Buffer(group.rank(1), low_latency_mode=True, enable_shrink=True)
    with pytest.raises(EPInputError, match="rank_to_mask"):
        shrinking.low_latency_update_mask_buffer(2, True)
    with pytest.raises(EPInputError, match="mask_status"):
        shrinking.low_latency_query_mask_buffer(torch.zeros(3, dtype=torch.int32))
    gpu_group = deep_ep.EmulatedGroup(2, backend="cuda")
    with pytest.raises(EPInputError, match="enable_shrink: rank masks"):
        deep_ep.Buffer(gpu_group.rank(0), low_latency_mode=True, enable_shrink=True)
