"""Masked top-k slots (an id of ``-1``: the slot selects no expert) in the numpy reference and
the host checks: a hand-worked dispatch and combine, the input rules (``-1`` accepted and
repeatable, other negatives refused by name), and the masked routings of ``epgen.routing``."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from epgen.reference import EPInputError, validate_inputs
from epgen.reference_combine import bf16_to_f32, f32_to_bf16

NAN, INF = float("nan"), float("inf")

# E = 4 experts on R = 2 ranks (L = 2), K = 2
IDS = [np.array([[1, -1], [-1, -1], [2, 0]], np.int32),
       np.array([[-1, 3], [0, -1]], np.int32)]


def cfg_of(E=4, R=2, K=2, H=8, T=4, **flags):
    return epgen.EPConfig(num_threads=128, n_sms=8, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format("BF16", H, K), **flags)


def tokens_of(cfg, ids):
    """Token ``t`` of rank ``s``: every element ``1 + 8 s + t`` (exact in BF16)."""
    H = cfg.token_fmt.hid_dim
    return [f32_to_bf16(np.full((len(a), H), 1 + 8 * s, np.float32)
                        + np.arange(len(a), dtype=np.float32)[:, None])
            for s, a in enumerate(ids)]


def test_hand_worked_dispatch():
    cfg = cfg_of()
    res = reference.dispatch(cfg, tokens_of(cfg, IDS), IDS)
    # rank 0 holds experts 0, 1: expert 0 gets (src 0, t 2, k 1) and (src 1, t 1, k 0);
    # expert 1 gets (src 0, t 0, k 0). Rank 1 holds experts 2, 3: expert 2 gets
    # (src 0, t 2, k 0); expert 3 gets (src 1, t 0, k 1). No -1 slot is anywhere.
    np.testing.assert_array_equal(res[0].counts, [[1, 1], [1, 0]])
    np.testing.assert_array_equal(res[1].counts, [[1, 0], [0, 1]])
    np.testing.assert_array_equal(res[0].row_offsets, [0, 2, 3])
    np.testing.assert_array_equal(res[1].row_offsets, [0, 1, 2])
    np.testing.assert_array_equal(res[0].src_info, [[2, 1], [1, 0], [0, 0]])
    np.testing.assert_array_equal(res[1].src_info, [[2, 0], [0, 1]])
    value = bf16_to_f32(res[0].out_tokens[:, 0])
    np.testing.assert_array_equal(value, [3, 10, 1])      # 1 + 8 s + t


@pytest.mark.parametrize("flags", [{}, {"ep_final_layout": True},
                                   {"ep_final_layout": True, "ep_prod_reserve": True}],
                         ids=["staged", "final", "final+prod"])
def test_hand_worked_combine(flags):
    cfg = cfg_of(**flags)
    H = cfg.token_fmt.hid_dim
    res = reference.dispatch(cfg, tokens_of(cfg, IDS), IDS)
    # each expert output row is the row as received: y(s, t, k) = 1 + 8 s + t for every slot
    # that received a row
    ys = [r.out_tokens for r in res]
    # masked slots carry NaN or infinite weights: they must be skipped, not multiplied by 0
    ws = [np.array([[0.5, NAN], [NAN, INF], [0.25, 2.0]], np.float32),
          np.array([[NAN, 1.0], [3.0, -INF]], np.float32)]
    residual = [f32_to_bf16(np.full((3, H), 100, np.float32)),
                f32_to_bf16(np.full((2, H), 200, np.float32))]
    out = reference.combine(cfg, res, ys, ws)
    want0 = [0.5 * 1, 0.0, 0.25 * 3 + 2.0 * 3]
    want1 = [1.0 * 9, 3.0 * 10]
    np.testing.assert_array_equal(bf16_to_f32(out[0]), np.repeat(want0, H).reshape(3, H))
    np.testing.assert_array_equal(bf16_to_f32(out[1]), np.repeat(want1, H).reshape(2, H))
    out = reference.combine(cfg, res, ys, ws, residual=residual)
    # the all-masked token combines to its residual alone
    np.testing.assert_array_equal(bf16_to_f32(out[0][1]), np.full(H, 100, np.float32))
    np.testing.assert_array_equal(bf16_to_f32(out[1][0]), np.full(H, 209, np.float32))
    rows = reference.combine(cfg, res, ys, None, n_tokens=[3, 2])
    assert not rows[0][1].any() and not rows[0][0, 1].any() and not rows[1][1, 1].any()


def test_the_device_check_and_the_reference_agree_on_the_masked_id():
    from epgen.kernels import check_ids
    assert check_ids.MASKED == reference.MASKED == -1
    assert check_ids.SKIP_A2A_BOUND == reference.SKIP_A2A_ID_BOUND


def test_masked_ids_accepted_and_other_negatives_refused():
    cfg = cfg_of()
    toks = tokens_of(cfg, IDS)
    assert validate_inputs(cfg, toks, IDS) == (3, 2)
    assert validate_inputs(cfg, toks, [a.astype(np.int64) for a in IDS]) == (3, 2)
    bad = [IDS[0].copy(), IDS[1]]
    bad[0][2, 1] = -2
    with pytest.raises(EPInputError, match=r"topk_ids\[0\]\[2, 1\] = -2 .*\[0, 4\)"):
        validate_inputs(cfg, toks, bad)
    bad[0][2, 1] = 4
    with pytest.raises(EPInputError, match=r"topk_ids\[0\]\[2, 1\] = 4"):
        validate_inputs(cfg, toks, bad)
    dup = [np.array([[1, 1], [-1, -1], [2, 0]], np.int32), IDS[1]]
    with pytest.raises(EPInputError, match="more than once"):
        validate_inputs(cfg, toks, dup)


def test_masked_slots_do_not_count_against_block_capacity():
    # recv_block_capacity 2 < max_tokens_per_rank 4: the -1 slots of 4 tokens are no expert's
    cfg = cfg_of(recv_block_capacity=2)
    ids = [np.array([[-1, 0], [-1, 1], [-1, -1], [-1, -1]], np.int32),
           np.array([[2, -1]], np.int32)]
    validate_inputs(cfg, tokens_of(cfg, ids), ids)
    ids[0][2, 1] = 0
    ids[0][3, 1] = 0
    with pytest.raises(EPInputError, match="recv_block_capacity=2"):
        validate_inputs(cfg, tokens_of(cfg, ids), ids)


def test_skip_a2a_masked_slots():
    cfg = epgen.EPConfig(num_threads=128, n_sms=8, n_experts=4, n_ranks=1,
                         max_tokens_per_rank=4, p2p_world_size=1, use_shmem=False,
                         skip_a2a=True, token_fmt=make_format("BF16", 8, 2))
    ids = [np.array([[5, -1], [-1, -1], [0, 3]], np.int32)]
    (res,) = reference.dispatch(cfg, tokens_of(cfg, ids), ids)
    np.testing.assert_array_equal(res.counts[:, 0], [1, 0, 0, 1])
    np.testing.assert_array_equal(res.src_info[:int(res.row_offsets[-1])], [[2, 0], [2, 1]])


@pytest.mark.parametrize("case", ["masked_slots", "masked_rank"])
def test_masked_edge_cases(case, seed):
    rng = np.random.default_rng(seed)
    cfg = cfg_of(E=8, R=4, K=2, T=6)
    toks, ids = routing.edge_case(rng, cfg, case)
    validate_inputs(cfg, toks, ids)
    masked = [(a == -1) for a in ids]
    if case == "masked_slots":
        assert all(m.all(axis=1).any() for m in masked), f"seed {seed}: no all-masked token"
    else:
        assert any(m.all() for m in masked), f"seed {seed}: no all-masked rank"
    res = reference.dispatch(cfg, toks, ids)
    sent = sum(int((a >= 0).sum()) for a in ids)
    assert sum(int(r.counts.sum()) for r in res) == sent, f"seed {seed}"
