"""DeepEP's normal-mode dispatch checks (its tests/legacy/test_intranode.py, the dispatch
half) for ``epgen.deepep.Buffer.dispatch``, shared by the simulator and GPU tests: every
rank's inputs drawn up front (``NormalCase``, ``draw_inputs``), then per rank
``rank_checks``: a dispatch of tokens equal to the source rank (``check_data`` per source
block) and of random tokens (against ``epgen.reference_tokens.normal_dispatch``), the
received count against the global per-rank count, the counts list against the global
per-expert counts (aligned), ``recv_topk_idx``'s range and per-expert counts, with weights
``recv_topk_weights`` (DeepEP's check: rank-constant weights come back equal to the source
rank where the id is local; random ones equal to the reference's, ``0.0`` elsewhere), the
``num_worst_tokens`` dispatch equal on the received rows with ``-1`` ids and ``0.0``
weights in the padding, and the cached dispatch; then DeepEP's combine checks: the cached
dispatch's rows combined with the handle (``combined_x / is_token_in_rank.sum(1)`` against
``x``, ``calc_diff < 5e-6``, on the tokens some rank received; the combined weights against
the dispatched ones, ``< 1e-9``), bit-exact against ``reference_tokens.normal_combine`` for
random tokens, and the ``num_worst_tokens`` dispatch's rows (padding included) combined to
the same result."""

from __future__ import annotations

import attrs
import numpy as np

from epgen.reference_tokens import normal_combine, normal_dispatch

from deepep_checks import calc_diff


@attrs.frozen
class NormalCase:
    n_ranks: int
    num_experts: int
    tokens: int
    hidden: int
    top_k: int
    masked: float = 0.25


def draw_inputs(torch, case: NormalCase, seed: int, device="cpu") -> list:
    """Per rank ``(x_rand, topk_idx)``: random BF16 tokens and unique top-k ids with ``-1``
    slots; the first token has all its experts on one rank, the second only ``-1``s, and the
    last rank has one token fewer than the others."""
    rng = np.random.default_rng(seed)
    R, E, K = case.n_ranks, case.num_experts, case.top_k
    L = E // R
    out = []
    for r in range(R):
        T = case.tokens - (1 if r == R - 1 else 0)
        a = np.array([rng.permutation(E)[:K] for _ in range(T)], np.int64).reshape(T, K)
        a[rng.random(a.shape) < case.masked] = -1
        if K <= L:
            d = int(rng.integers(R))
            a[0] = d * L + rng.permutation(L)[:K]
        a[1] = -1
        x = torch.from_numpy(rng.standard_normal((T, case.hidden)).astype(np.float32))
        out.append((x.to(torch.bfloat16).to(device), torch.from_numpy(a).to(device)))
    return out


def draw_weights(torch, case: NormalCase, inputs, seed: int) -> list:
    """Per rank random float32 top-k weights ``[T, K]`` (DeepEP's ``topk_weights_pure_rand``)
    on the inputs' device."""
    rng = np.random.default_rng(seed + 7919)
    return [torch.from_numpy(rng.standard_normal(tuple(idx.shape)).astype(np.float32))
            .to(idx.device) for _, idx in inputs]


def global_counts(case: NormalCase, inputs):
    """The all-reduced ``num_tokens_per_rank`` ``[R]`` and ``num_tokens_per_expert`` ``[E]``
    of every rank's ids."""
    R, E = case.n_ranks, case.num_experts
    L = E // R
    per_rank, per_expert = np.zeros(R, np.int64), np.zeros(E, np.int64)
    for _, idx in inputs:
        a = idx.cpu().numpy()
        for r in range(R):
            per_rank[r] += ((a >= 0) & (a // L == r)).any(axis=1).sum()
        per_expert += np.bincount(a[a >= 0], minlength=E)
    return per_rank, per_expert


def _bits(torch, x):
    return x.cpu().view(torch.int16).numpy().view(np.uint16)


def check_data(torch, check_x, rank_prefix_matrix, rank: int, R: int):
    """DeepEP's ``check_data``: every row constant, rows of source ``i`` equal to ``i``."""
    check_x = check_x.float().cpu()
    assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
    start = 0
    for i in range(R):
        end = int(rank_prefix_matrix[i][rank])
        assert (check_x[start:end, :].int() - i).sum().item() == 0, (rank, i)
        start = end


def rank_checks(torch, buf, rank: int, case: NormalCase, inputs, *, alignment=1,
                weights=None):
    """Rank ``rank``'s dispatches on ``buf`` (module docstring); ``weights``: every rank's
    random top-k weights (``draw_weights``), None: the dispatches carry none."""
    R, E, K = case.n_ranks, case.num_experts, case.top_k
    L = E // R
    x_rand, idx = inputs[rank]
    T = x_rand.shape[0]
    x_rank = torch.ones_like(x_rand) * rank
    per_rank, per_expert = global_counts(case, inputs)
    ntpr, _, ntpe, itir, _ = buf.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                topk_idx=idx, expert_alignment=alignment)
    w_rank = torch.ones(tuple(idx.shape), dtype=torch.float32, device=idx.device) * rank
    for x in (x_rank, x_rand):
        w = None if weights is None else (w_rank if x is x_rank else weights[rank])
        recv_x, recv_idx, recv_w, counts_list, handle, event = buf.dispatch(
            x, **args, topk_weights=w)
        assert (recv_w is None) == (w is None)
        saved_w = None if recv_w is None else recv_w.clone()
        rank_prefix_matrix = handle[0]
        assert int(per_rank[rank]) == recv_x.size(0)
        want = [-(-int(c) // alignment) * alignment for c in per_expert.reshape(R, L)[rank]]
        assert want == counts_list
        if x is x_rank:
            check_data(torch, recv_x, rank_prefix_matrix, rank, R)
            if w is not None:       # DeepEP's: the -1 slots filled with the row's max
                filled = recv_w.clone()
                filled[recv_idx.eq(-1)] = filled.amax(dim=1, keepdim=True) \
                    .expand_as(filled)[recv_idx.eq(-1)]
                check_data(torch, filled, rank_prefix_matrix, rank, R)
                assert torch.all(recv_w[recv_idx.eq(-1)] == 0).item()
        else:
            ref = normal_dispatch(E, [_bits(torch, xs) for xs, _ in inputs],
                                  [i.cpu().numpy() for _, i in inputs], rank,
                                  None if w is None else [q.cpu().numpy() for q in weights])
            if w is not None:
                np.testing.assert_array_equal(recv_w.cpu().numpy(), ref.topk_weights)
            np.testing.assert_array_equal(_bits(torch, recv_x), ref.x)
            np.testing.assert_array_equal(recv_idx.cpu().numpy(), ref.topk_idx)
            np.testing.assert_array_equal(handle.recv_src.cpu().numpy(), ref.src)
            np.testing.assert_array_equal(handle[3].cpu().numpy(), ref.src[:, 1])
            np.testing.assert_array_equal(rank_prefix_matrix[:, rank].cpu().numpy(),
                                          ref.rank_prefix)
        assert ((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < L))).sum().item() \
            == recv_idx.numel()
        if alignment == 1:
            for i, count in enumerate(counts_list):
                assert recv_idx.eq(i).sum().item() == count
        worst = R * case.tokens
        wx, widx, ww, empty, hw, event = buf.dispatch(x, **args, num_worst_tokens=worst,
                                                      topk_weights=w)
        buf.check()
        assert len(empty) == 0 and (ww is None) == (w is None)
        assert wx.size(0) == worst and widx.size(0) == worst
        n = recv_x.size(0)
        assert torch.equal(recv_x, wx[:n])
        assert torch.equal(recv_idx, widx[:n])
        assert torch.all(widx[n:] == -1).item()
        if w is not None:
            assert ww.size(0) == worst and torch.equal(recv_w, ww[:n])
            assert torch.all(ww[n:] == 0).item()
        cx, c1, c2, c3, c4, event = buf.dispatch(x, handle=handle)
        assert (c1, c2, c3, c4) == (None, None, None, None)
        assert cx.size(0) == n
        if x is x_rank:
            check_data(torch, cx, rank_prefix_matrix, rank, R)
        else:
            np.testing.assert_array_equal(_bits(torch, cx), ref.x)
        # DeepEP's test combines recv_topk_weights after the cached dispatch; under epgen's
        # rule (results valid until the second dispatch after) that needs a copy
        cw = filled if w is not None and x is x_rank else saved_w
        combine_checks(torch, buf, rank, case, inputs, weights, x is x_rank, x, w, cx, cw,
                       handle, itir)
        padded = wx.clone()
        padded[n:] = 7          # the padding rows' values must not reach the result
        wcx, wcw, _ = buf.combine(padded, hw, topk_weights=ww)
        ref_x, ref_w = reference_combine(torch, case, inputs, weights if w is not None else None,
                                         rank, x_rank if x is x_rank else None)
        np.testing.assert_array_equal(_bits(torch, wcx), ref_x)
        if w is None:
            assert wcw is None
        else:
            if x is x_rank:     # the unfilled weights: the source rank on the valid slots
                ref_w = np.where(idx.cpu().numpy() >= 0, np.float32(rank), np.float32(0))
            np.testing.assert_array_equal(wcw.cpu().numpy(), ref_w)
    return True


def reference_combine(torch, case: NormalCase, inputs, weights, rank: int, x_rank):
    """Rank ``rank``'s ``(x bits, weights)`` of ``reference_tokens.normal_combine`` when
    every rank returns the rows (and weights) it received: of random tokens, or with
    ``x_rank`` given of every rank's rank-constant tokens."""
    R, E = case.n_ranks, case.num_experts
    if x_rank is None:
        toks = [_bits(torch, xs) for xs, _ in inputs]
    else:
        toks = [np.full((len(i), case.hidden), _bits(torch, torch.ones(1, dtype=torch.bfloat16)
                                                      * q)[0], np.uint16)
                for q, (_, i) in enumerate(inputs)]
    ids = [i.cpu().numpy() for _, i in inputs]
    ws = None if weights is None else [q.cpu().numpy() for q in weights]
    refs = [normal_dispatch(E, toks, ids, d, ws) for d in range(R)]
    out = normal_combine(E, ids, [r.src for r in refs], [r.x for r in refs],
                         None if ws is None else [r.topk_weights for r in refs])
    return out[rank]


def combine_checks(torch, buf, rank, case, inputs, weights, constant, x, w, recv_x, recv_w,
                   handle, is_token_in_rank):
    """DeepEP's combine checks of ``recv_x`` (and ``recv_w``) combined with ``handle``
    (module docstring); ``constant``: ``x`` is the rank-constant tokens (and ``recv_w`` the
    weights DeepEP's test filled in place), else random, also checked bit-exact against the
    reference."""
    combined_x, combined_w, event = buf.combine(recv_x, handle, topk_weights=recv_w)
    count = is_token_in_rank.sum(dim=1)
    some = count > 0
    per_rank = count.clamp(min=1).unsqueeze(1)
    if bool(some.any()):        # calc_diff of no rows is 0 / 0 (a rank whose slots are all -1)
        assert calc_diff(torch, combined_x.float()[some] / per_rank[some],
                         x.float()[some]) < 5e-6
    assert torch.all(combined_x[~some] == 0).item()
    if w is None:
        assert combined_w is None
    elif constant:      # every slot of a received token held the source rank on each rank
        assert calc_diff(torch, combined_w[some] / per_rank[some], w[some]) < 1e-9
    else:
        ref_w = torch.where(handle.topk_idx >= 0, w, torch.zeros_like(w))
        assert calc_diff(torch, combined_w[some], ref_w[some]) < 1e-9
    if not constant:
        ref_x, ref_w = reference_combine(torch, case, inputs, weights, rank, None)
        np.testing.assert_array_equal(_bits(torch, combined_x), ref_x)
        if w is not None:
            np.testing.assert_array_equal(combined_w.cpu().numpy(), ref_w)
