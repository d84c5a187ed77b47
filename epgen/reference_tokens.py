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
"""

from __future__ import annotations

import attrs
import numpy as np


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


__all__ = ["TokenMajorResult", "normal_dispatch"]
