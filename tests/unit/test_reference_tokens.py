"""``epgen.reference_tokens.normal_dispatch`` against DeepEP's normal-mode dispatch written as
loops over sources, tokens and slots (the definitions of its tests/legacy/test_intranode.py:
a rank receives a token once if one of its experts lives there, grouped by source rank in
rank order, ``recv_topk_idx`` local ids or ``-1``, the per-expert counts the global
``(token, slot)`` counts of the rank's experts)."""

from __future__ import annotations

import numpy as np
import pytest

from epgen.reference_tokens import normal_dispatch


def loop_definition(E, toks, ids, ws, d):
    R = len(toks)
    L = E // R
    x, idx, wts, src, prefix, counts, total = [], [], [], [], [], [0] * L, 0
    for s in range(R):
        for t in range(len(ids[s])):
            row, wrow, here = [], [], False
            for k in range(ids[s].shape[1]):
                g = int(ids[s][t, k])
                if g != -1 and g // L == d:
                    row.append(g - d * L)
                    wrow.append(ws[s][t, k])
                    counts[g - d * L] += 1
                    here = True
                else:
                    row.append(-1)
                    wrow.append(0.0)
            if here:
                x.append(toks[s][t])
                idx.append(row)
                wts.append(wrow)
                src.append((s, t))
                total += 1
        prefix.append(total)
    return x, idx, wts, src, prefix, counts


@pytest.mark.parametrize("R,L,K", [(2, 3, 2), (4, 2, 4), (3, 1, 1)])
def test_against_loops(rng, R, L, K):
    E = R * L
    K = min(K, E)
    toks, ids, ws = [], [], []
    for _ in range(R):
        n = int(rng.integers(0, 9))
        toks.append(rng.integers(0, 1000, (n, 5)))
        a = np.array([rng.permutation(E)[:K] for _ in range(n)], np.int64).reshape(n, K)
        a[rng.random(a.shape) < 0.3] = -1
        ids.append(a)
        ws.append(rng.standard_normal(a.shape).astype(np.float32))
    for d in range(R):
        got = normal_dispatch(E, toks, ids, d, ws)
        x, idx, wts, src, prefix, counts = loop_definition(E, toks, ids, ws, d)
        assert got.n_rows == len(x)
        np.testing.assert_array_equal(got.x.reshape(-1, 5), np.array(x).reshape(-1, 5))
        np.testing.assert_array_equal(got.topk_idx, np.array(idx, np.int64).reshape(-1, K))
        np.testing.assert_array_equal(got.topk_weights,
                                      np.array(wts, np.float32).reshape(-1, K))
        np.testing.assert_array_equal(got.src, np.array(src, np.int32).reshape(-1, 2))
        np.testing.assert_array_equal(got.rank_prefix, prefix)
        np.testing.assert_array_equal(got.expert_counts, counts)
