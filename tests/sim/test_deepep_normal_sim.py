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


def _dispatch(buf, x, idx, E, **kw):
    ntpr, _, ntpe, itir, _ = buf.get_dispatch_layout(idx, E)
    return buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                        num_tokens_per_expert=ntpe, topk_idx=idx, **kw)


def test_combine_with_one_and_two_biases_matches_the_reference(seed):
    """``bias`` as one tensor and as a pair (summed in BF16 first: ``combined_bias``), bit
    for bit against ``normal_combine``, over consecutive dispatch/combine rounds."""
    import numpy as np
    from epgen.reference_tokens import normal_combine, normal_dispatch
    case = NormalCase(n_ranks=2, num_experts=4, tokens=4, hidden=16, top_k=2)
    inputs = draw_inputs(torch, case, seed)
    g = torch.Generator().manual_seed(seed % 1000)
    biases = [[torch.randn((len(i), case.hidden), generator=g).to(torch.bfloat16)
               for _ in range(2)] for _, i in inputs]
    group = deep_ep.EmulatedGroup(2, backend="sim", sim_seed=seed % 1000)

    def bits(t):
        return t.view(torch.int16).numpy().view(np.uint16)
    ids = [i.numpy() for _, i in inputs]
    refs = [normal_dispatch(4, [bits(x) for x, _ in inputs], ids, d) for d in range(2)]

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=4)
        x, idx = inputs[rank]
        for n_bias in (1, 2, 0):
            recv_x, _, _, _, handle, _ = _dispatch(buf, x, idx, 4)
            bias = (None, biases[rank][0], tuple(biases[rank]))[n_bias]
            out, w, _ = buf.combine(recv_x, handle, bias=bias)
            assert w is None
            exp = normal_combine(4, ids, [r.src for r in refs], [r.x for r in refs],
                                 bias=[tuple(bits(b) for b in bs[:n_bias]) for bs in biases])
            np.testing.assert_array_equal(bits(out), exp[rank][0])
        return True
    assert all(group.run(body))


def test_combine_handle_rules_and_refusals(seed):
    """A handle whose slot a later dispatch reused, one of another buffer, one combined
    twice, FP8 rows, rows of the wrong shape and a bias of the wrong shape: refused by name,
    nothing sent (every rank refuses alike, so no rank waits)."""
    case = NormalCase(n_ranks=2, num_experts=4, tokens=4, hidden=16, top_k=2)
    inputs = draw_inputs(torch, case, seed)
    group = deep_ep.EmulatedGroup(2, backend="sim", sim_seed=seed % 1000)

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=4)
        other = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=4)
        x, idx = inputs[rank]
        rx_a, _, _, _, h_a, _ = _dispatch(buf, x, idx, 4)
        rx_b, _, _, _, h_b, _ = _dispatch(buf, x, idx, 4)
        with pytest.raises(EPInputError, match=r"^handle: from another buffer"):
            other.combine(rx_b, h_b)
        with pytest.raises(EPInputError, match=r"^x: FP8 input"):
            buf.combine((rx_b, torch.ones(1)), h_b)
        with pytest.raises(EPInputError, match=r"^x: shape"):
            buf.combine(rx_b[:, :8].contiguous(), h_b)
        with pytest.raises(EPInputError, match=r"^bias\[0\]: shape"):
            buf.combine(rx_b, h_b, bias=torch.zeros((1, 16), dtype=torch.bfloat16))
        with pytest.raises(EPInputError, match=r"^topk_weights: shape"):
            buf.combine(rx_b, h_b, topk_weights=torch.zeros((len(rx_b), 3)))
        _dispatch(buf, x, idx, 4)                     # slot of h_a reused
        with pytest.raises(EPInputError, match=r"^handle: its result slot was reused"):
            buf.combine(rx_a, h_a)
        buf.combine(rx_b, h_b)
        with pytest.raises(EPInputError, match=r"^handle: already combined"):
            buf.combine(rx_b, h_b)
        cx, *_ = buf.dispatch(x, handle=h_b)          # a cached dispatch makes it current
        out, _, _ = buf.combine(cx, h_b)
        with pytest.raises(EPInputError, match=r"^topk_weights: a cached dispatch"):
            buf.dispatch(x, handle=h_b, topk_weights=torch.zeros((len(x), 2)))
        return out.shape == x.shape
    assert all(group.run(body))
