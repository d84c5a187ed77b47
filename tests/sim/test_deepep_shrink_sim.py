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

from deepep_checks import (RANK_OFFSET, LLCase, check_combine, gemm_input,  # noqa: E402
                           rank_inputs)

#: API -> the rank that fails when it first calls it (DeepEP's test: 1, 3, 5 of 8+ ranks)
FAILS = {"dispatch": 1, "combine": 3, "clean": 4}


def failed(rank: int, api: str, expected: set) -> bool:
    """DeepEP's ``simulate_failure_and_skip``: the rank already failed, or it is the one
    that fails at ``api`` (every rank then expects it masked)."""
    if rank in expected:
        return True
    expected.add(FAILS[api])
    return FAILS[api] == rank


def query(buf, n: int) -> set:
    status = torch.zeros(n, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return set(status.nonzero().view(-1).tolist())


def check_dispatch_masked(case, rank, all_idx, recv_x, count, handle, masked):
    """DeepEP's dispatch checks with its shrink rule: counts from the unmasked sources only;
    each unmasked source's block holds its rows."""
    L = case.num_experts // case.n_ranks
    layout = handle[1].cpu()
    for i in range(L):
        e = rank * L + i
        routed = [0 if j in masked else int((ids == e).sum()) for j, ids in enumerate(all_idx)]
        n = int(count[i])
        assert n == sum(routed), f"rank {rank} expert {e}: {n} rows, {sum(routed)} routed"
        rows = recv_x[i][:n].float()
        for j in range(case.n_ranks):
            begin, cnt = int(layout[i, j] >> 32), int(layout[i, j] & 0xFFFFFFFF)
            if j in masked:
                assert cnt == 0, f"rank {rank} expert {e}: {cnt} rows of masked rank {j}"
                continue
            assert cnt == routed[j]
            assert bool((rows[begin:begin + cnt, :-128] == j - RANK_OFFSET).all())


def test_ranks_failing_at_dispatch_combine_and_clean_are_masked(seed):
    case = LLCase(n_ranks=5, num_experts=10, tokens=4, hidden=256, top_k=3)
    inputs = rank_inputs(torch, case, seed)
    all_idx = [i for _, i, _ in inputs]
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
    T, E, H = case.tokens, case.num_experts, case.hidden
    L = E // case.n_ranks

    def rank_main(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True,
                             num_qps_per_rank=L, enable_shrink=True)
        x, idx, w = inputs[rank]
        expected: set = set()
        for _ in range(3):
            if failed(rank, "dispatch", expected):
                return None
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E,
                                                                   use_fp8=False)
            masked = query(buf, case.n_ranks)
            assert masked == expected, f"rank {rank} after dispatch: {masked}"
            check_dispatch_masked(case, rank, all_idx, recv_x, count, handle, masked)
            if failed(rank, "combine", expected):
                return None
            combined, _, _ = buf.low_latency_combine(gemm_input(torch, recv_x, False, H),
                                                     idx, w, handle)
            masked = query(buf, case.n_ranks)
            assert masked == expected, f"rank {rank} after combine: {masked}"
            owner = idx.clamp(min=0) // L
            dead = torch.tensor([q in masked for q in range(case.n_ranks)])[owner]
            check_combine(torch, rank, x, idx.masked_fill(dead & (idx >= 0), -1), w,
                          combined, use_fp8=False, round_scale=False)
            if failed(rank, "clean", expected):
                return None
            buf.clean_low_latency_buffer(T, H, E)
            assert query(buf, case.n_ranks) == expected
        return query(buf, case.n_ranks)

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
    T, E, H = case.tokens, case.num_experts, case.hidden

    def rank_main(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True, enable_shrink=True)
        x, idx, w = inputs[rank]
        buf.low_latency_update_mask_buffer(2, True)
        assert query(buf, 3) == {2}
        if rank == 2:
            return None                 # masked by everyone: it makes no call
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        check_dispatch_masked(case, rank, all_idx, recv_x, count, handle, {2})
        buf.low_latency_update_mask_buffer(2, False)
        buf.low_latency_update_mask_buffer(0, True)
        buf.low_latency_clean_mask_buffer()
        return query(buf, 3)

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
