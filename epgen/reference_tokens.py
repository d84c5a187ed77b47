"""The reference of the token-major receive (DeepEP's normal-mode dispatch on one rank,
docs/deepep.md "Normal mode"), in numpy from every rank's inputs, independent of the
kernels: the oracle of ``world.dispatch_tokens`` and of ``epgen.deepep.Buffer.dispatch``.

Rank ``d`` receives each token ``t`` of each source rank ``s`` that has at least one expert
on ``d`` (expert ``g`` lives on rank ``g // L``; ``-1`` selects none) once, as one row; rows
are source-major (source 0's first) and in source token order inside a source. A row holds
the token, its top-k ids as ``d``'s local ids (``g - d * L`` where ``g`` lives on ``d``, else
``-1``), its top-k weights (``0.0`` where the local id is ``-1``; zeros without weights) and
``(s, t)``. ``rank_prefix[s]`` is the rows from sources ``0 .. s`` (DeepEP's
``rank_prefix_matrix[s][d]``), ``expert_counts[e]`` the ``(token, slot)`` pairs of every
source routed to ``d``'s local expert ``e``.

``normal_combine`` is the normal-mode combine (DeepEP's ``Buffer.combine``): each source
token is the sum of the rows the ranks that received it return, with epgen's summation
order (its docstring), and the sum of their top-k weight rows.
"""

from __future__ import annotations

import attrs
import numpy as np

from backends.sim.numerics import add_f32

from .reference_combine import bf16_to_f32, f32_to_bf16


@attrs.frozen
class TokenMajorResult:
    """One rank's token-major receive (numpy): ``n_rows`` received tokens; ``x`` ``[n_rows,
    H]`` (the tokens' values as given, BF16 bits for the worlds), ``topk_idx`` ``[n_rows,
    K]`` int64 local expert ids (``-1``: not this rank's), ``topk_weights`` ``[n_rows, K]``
    float32 (``0.0`` where the id is ``-1``), ``src`` ``[n_rows, 2]`` int32
    (source rank, source token), ``rank_prefix`` ``[R]`` int32 (inclusive rows per source),
    ``expert_counts`` ``[L]`` int32 (received ``(token, slot)`` pairs per local expert),
    ``pad_topk``, ``pad_weights`` and ``pad_src`` the top-k ids, weights and sources of the
    padding rows past ``n_rows`` (empty without padding)."""

    rank: int
    n_rows: int
    x: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    src: np.ndarray
    rank_prefix: np.ndarray
    expert_counts: np.ndarray
    pad_topk: np.ndarray
    pad_weights: np.ndarray
    pad_src: np.ndarray


def normal_dispatch(n_experts: int, tokens, topk_ids, rank: int,
                    topk_weights=None) -> TokenMajorResult:
    """Rank ``rank``'s token-major receive (module docstring) of every rank's ``tokens[s]``
    ``[T_s, H]``, ``topk_ids[s]`` ``[T_s, K]`` and ``topk_weights[s]`` ``[T_s, K]`` (None:
    zeros) (``len(tokens)`` ranks of ``n_experts // len(tokens)`` experts each)."""
    R = len(tokens)
    L = n_experts // R
    xs, idx, wts, srcs, prefix = [], [], [], [], []
    counts = np.zeros(L, np.int64)
    for s in range(R):
        ids = np.asarray(topk_ids[s]).astype(np.int64)
        here = (ids >= 0) & (ids // L == rank)
        rows = np.flatnonzero(here.any(axis=1))
        xs.append(np.asarray(tokens[s])[rows])
        idx.append(np.where(here, ids - rank * L, -1)[rows])
        w = np.zeros(ids.shape, np.float32) if topk_weights is None \
            else np.asarray(topk_weights[s], np.float32)
        wts.append(np.where(here, w, np.float32(0.0))[rows])
        srcs.append(np.stack([np.full(len(rows), s), rows], axis=1))
        counts += np.bincount(ids[here] - rank * L, minlength=L)
        prefix.append(len(rows))
    K = np.asarray(topk_ids[0]).shape[1]
    x = np.concatenate(xs) if xs else np.zeros((0, 0))
    return TokenMajorResult(
        rank=rank, n_rows=int(sum(prefix)), x=x,
        topk_idx=np.concatenate(idx).reshape(-1, K).astype(np.int64),
        topk_weights=np.concatenate(wts).reshape(-1, K).astype(np.float32),
        src=np.concatenate(srcs).reshape(-1, 2).astype(np.int32),
        rank_prefix=np.cumsum(prefix).astype(np.int32),
        expert_counts=counts.astype(np.int32), pad_topk=np.zeros((0, K), np.int64),
        pad_weights=np.zeros((0, K), np.float32), pad_src=np.zeros((0, 2), np.int32))


def lead_slots(topk_ids, n_experts: int, n_ranks: int) -> np.ndarray:
    """``[T, K]`` bool: slot ``k`` of token ``t`` is the lowest valid slot (an expert in
    ``[0, n_experts)``) of the token whose expert lives on its rank: the slot a rank that
    received the token returns its row to."""
    ids = np.asarray(topk_ids).astype(np.int64)
    L = n_experts // n_ranks
    valid = (ids >= 0) & (ids < n_experts)
    rank = np.where(valid, ids // L, -1)
    lead = valid.copy()
    for k in range(ids.shape[1]):
        for j in range(k):
            lead[:, k] &= ~(valid[:, j] & (rank[:, j] == rank[:, k]))
    return lead


def combined_bias(bias) -> np.ndarray | None:
    """The one BF16 residual ``[T, H]`` (uint16 bits) that ``bias`` (0, 1 or 2 BF16 arrays)
    adds: None, the one, or the two summed in float32 and rounded to BF16 (what ``a + b`` of
    two torch BF16 tensors gives)."""
    bias = [b for b in bias if b is not None]
    if not bias:
        return None
    if len(bias) == 1:
        return np.asarray(bias[0], np.uint16)
    return f32_to_bf16(add_f32(bf16_to_f32(bias[0]), bf16_to_f32(bias[1])))


def normal_combine(n_experts: int, topk_ids, recv_src, xs, weights=None, bias=None) -> list:
    """DeepEP's normal-mode combine of every rank's token-major rows, per source rank ``s``
    ``(x, w)``: ``topk_ids[s]`` ``[T_s, K]`` the routing of its dispatch; ``recv_src[d]``
    ``[N_d, 2]`` and ``xs[d]`` ``[N_d, H]`` (BF16 bits) rank ``d``'s received rows (their
    source rank and token) and the rows it returns; ``weights[d]`` ``[N_d, K]`` float32 or
    None; ``bias[s]``: 0, 1 or 2 ``[T_s, H]`` BF16 arrays (None: none).

    Token ``t`` of ``s``: ``acc = 0``; for ``k`` ascending over the token's lead slots
    (``lead_slots``; one per rank holding one of its experts), ``acc = add.rn.f32(acc,
    x_d[row])`` where ``d`` is slot ``k``'s rank and ``row`` the row of ``(s, t)`` at ``d``;
    then ``acc = add.rn.f32(acc, combined_bias(bias[s]))``; rounded to BF16 (nearest even).
    ``w`` (None without ``weights``): the same sum, in float32, of ``weights_d[row]``
    (``K`` values each), without bias."""
    R = len(xs)
    L = n_experts // R
    rows_of = []            # rows_of[d][s]: row of (s, t) at rank d, -1 where not received
    for d in range(R):
        src = np.asarray(recv_src[d]).reshape(-1, 2)
        per = []
        for s in range(R):
            m = np.full(len(topk_ids[s]), -1, np.int64)
            here = np.flatnonzero(src[:, 0] == s)
            m[src[here, 1]] = here
            per.append(m)
        rows_of.append(per)
    out = []
    for s in range(R):
        ids = np.asarray(topk_ids[s]).astype(np.int64)
        T, K = ids.shape
        H = np.asarray(xs[0]).shape[1] if R and np.asarray(xs[0]).ndim == 2 else 0
        acc = np.zeros((T, H), np.float32)
        wacc = None if weights is None else np.zeros((T, K), np.float32)
        lead = lead_slots(ids, n_experts, R)
        for k in range(K):
            for d in range(R):
                sel = np.flatnonzero(lead[:, k] & (ids[:, k] // L == d))
                if not len(sel):
                    continue
                rows = rows_of[d][s][sel]
                assert (rows >= 0).all(), "a lead slot's rank did not receive the token"
                acc[sel] = add_f32(acc[sel], bf16_to_f32(np.asarray(xs[d])[rows]))
                if wacc is not None:
                    wacc[sel] = add_f32(wacc[sel], np.asarray(weights[d], np.float32)[rows])
        res = combined_bias(() if bias is None or bias[s] is None else bias[s])
        if res is not None:
            acc = add_f32(acc, bf16_to_f32(res))
        out.append((f32_to_bf16(acc), wacc))
    return out


__all__ = ["TokenMajorResult", "normal_dispatch", "normal_combine", "lead_slots",
           "combined_bias"]
