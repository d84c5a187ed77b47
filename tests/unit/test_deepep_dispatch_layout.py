"""``Buffer.get_dispatch_layout`` against the layout DeepEP's ``test_intranode.py`` computes by
hand (written here as plain loops over tokens and slots): per-rank and per-expert counts and
``is_token_in_rank``, with ``-1`` slots, several slots on one rank, int32 ids; bad ids and
arguments refused by name."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402


def loop_layout(ids: np.ndarray, E: int, R: int):
    """The layout by loops: DeepEP's test's definitions."""
    T, K = ids.shape
    L = E // R
    per_expert = np.zeros(E, np.int64)
    in_rank = np.zeros((T, R), bool)
    for t in range(T):
        for k in range(K):
            g = int(ids[t, k])
            if g == -1:
                continue
            per_expert[g] += 1
            in_rank[t, g // L] = True
    return in_rank.sum(axis=0), per_expert, in_rank


def routing(rng, T, E, K, mask_frac=0.2):
    ids = np.array([rng.permutation(E)[:K] for _ in range(T)], np.int64).reshape(T, K)
    ids[rng.random(ids.shape) < mask_frac] = -1
    return ids


@pytest.mark.parametrize("R,E,K,T", [(2, 8, 4, 17), (4, 16, 8, 33), (8, 64, 6, 5), (4, 8, 8, 0)])
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_layout_matches_the_loops(rng, R, E, K, T, dtype):
    ids = routing(rng, T, E, K)
    buf = deep_ep.Buffer(deep_ep.EmulatedGroup(R, backend="sim").rank(0))
    got = buf.get_dispatch_layout(torch.from_numpy(ids).to(getattr(torch, dtype)), E)
    per_rank, rdma, per_expert, in_rank, event = got
    want_rank, want_expert, want_in = loop_layout(ids, E, R)
    assert rdma is None and isinstance(event, deep_ep.EventOverlap)
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32
    assert in_rank.dtype == torch.bool and tuple(in_rank.shape) == (T, R)
    np.testing.assert_array_equal(per_rank.numpy(), want_rank)
    np.testing.assert_array_equal(per_expert.numpy(), want_expert)
    np.testing.assert_array_equal(in_rank.numpy(), want_in)


def test_a_token_with_every_slot_on_one_rank_counts_once():
    buf = deep_ep.Buffer(deep_ep.EmulatedGroup(2, backend="sim").rank(1))
    ids = torch.tensor([[0, 1, 2, 3], [-1, -1, -1, -1], [4, -1, 0, 5]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 8)
    assert per_rank.tolist() == [2, 1]
    assert per_expert.tolist() == [2, 1, 1, 1, 1, 1, 0, 0]
    assert in_rank.tolist() == [[True, False], [False, False], [True, True]]


def test_bad_ids_and_arguments_are_refused_by_name():
    buf = deep_ep.Buffer(deep_ep.EmulatedGroup(2, backend="sim").rank(0))
    for bad in (8, -2):
        with pytest.raises(EPInputError, match=r"^topk_idx: 1 id\(s\) outside \[-1, num_experts\)"):
            buf.get_dispatch_layout(torch.tensor([[0, bad]]), 8)
    with pytest.raises(EPInputError, match=r"^num_experts: 7 must be a positive multiple"):
        buf.get_dispatch_layout(torch.tensor([[0, 1]]), 7)
    with pytest.raises(EPInputError, match=r"^topk_idx: dtype torch.float32"):
        buf.get_dispatch_layout(torch.zeros((2, 2)), 8)
    with pytest.raises(EPInputError, match=r"^topk_idx: 1 dimensions, must be 2"):
        buf.get_dispatch_layout(torch.tensor([0, 1]), 8)
    buf.check()      # nothing was captured: nothing left to report
