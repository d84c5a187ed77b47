"""``epgen.deepep.Buffer.dispatch`` (DeepEP's normal mode on the deduplicated transport) on
the CPU simulator, with the properties of DeepEP's tests/legacy/test_intranode.py dispatch
checks (``normal_checks``): 2 and 4 ranks, ``-1`` slots, a token with all its experts on one
rank and one with none, ``num_worst_tokens``, ``expert_alignment``, cached dispatch,
consecutive calls on both result slots, ``recv_topk_weights``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402

from normal_checks import NormalCase, draw_inputs, draw_weights, rank_checks  # noqa: E402


@pytest.mark.parametrize("case,alignment,with_weights", [
    (NormalCase(n_ranks=2, num_experts=4, tokens=4, hidden=32, top_k=2), 1, True),
    (NormalCase(n_ranks=4, num_experts=8, tokens=3, hidden=16, top_k=3), 4, False),
], ids=["R2-weights", "R4-aligned"])
def test_normal_dispatch_has_deepeps_properties(case, alignment, with_weights, seed):
    inputs = draw_inputs(torch, case, seed)
    weights = draw_weights(torch, case, inputs, seed) if with_weights else None
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
    assert all(group.run(lambda rank: rank_checks(
        torch, deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=case.tokens),
        rank, case, inputs, alignment=alignment, weights=weights)))


def test_a_bad_layout_argument_fails_every_rank(seed):
    """``is_token_in_rank`` that does not match ``topk_idx`` is refused before anything is
    sent (the other ranks' calls end with the failure, not a hang)."""
    case = NormalCase(n_ranks=2, num_experts=4, tokens=4, hidden=16, top_k=2)
    inputs = draw_inputs(torch, case, seed)
    group = deep_ep.EmulatedGroup(2, backend="sim", rendezvous_timeout_s=30)

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=4)
        x, idx = inputs[rank]
        ntpr, _, ntpe, itir, _ = buf.get_dispatch_layout(idx, 4)
        if rank == 1:
            itir = ~itir
        buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                     num_tokens_per_expert=ntpe, topk_idx=idx)
    with pytest.raises(EPInputError, match="topk_idx: .*mismatch"):
        group.run(body)
