"""The host halves of the normal-mode combine's weights (``runtime.token_major_combine``):
``lead_mask`` in numpy and in torch (the GPU path's) against
``reference_tokens.lead_slots``, and ``reduce_weights`` in torch equal bit for bit to numpy's
ascending-``k`` float32 adds."""

from __future__ import annotations

import numpy as np
import pytest

from epgen.reference_tokens import lead_slots
from epgen.runtime.token_major_combine import lead_mask, reduce_weights

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("R,L,K", [(2, 2, 2), (4, 3, 5), (8, 1, 8)])
def test_lead_mask_and_reduce_in_numpy_and_torch(rng, R, L, K):
    E, T = R * L, 40
    ids = rng.integers(-1, E + 2, (T, K))       # -1, valid ids and out-of-range ones
    want = lead_slots(ids, E, R)
    lead_np = lead_mask(ids, E, L, np.where, np.stack)
    lead_t = lead_mask(torch.from_numpy(ids), E, L, torch.where, torch.stack)
    np.testing.assert_array_equal(lead_np, want)
    np.testing.assert_array_equal(lead_t.numpy(), want)
    slots = rng.standard_normal((T, K, K)).astype(np.float32)
    acc = np.zeros((T, K), np.float32)
    for k in range(K):
        acc = np.where(want[:, k:k + 1], acc + slots[:, k, :], acc)
    got_np = reduce_weights(slots, lead_np, np.where, np.zeros((T, K), np.float32))
    got_t = reduce_weights(torch.from_numpy(slots), lead_t, torch.where,
                           torch.zeros((T, K), dtype=torch.float32))
    np.testing.assert_array_equal(got_np, acc)
    np.testing.assert_array_equal(got_t.numpy(), acc)
