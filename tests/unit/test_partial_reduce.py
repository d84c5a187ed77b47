"""The partial-reduce combine's host side (docs/combine.md, "Partial reduce"): the refusals
by name (the call's flag, the kernel builder, the reference), the layout members it reads
(weights after the message, the row map), and the stated error against the plain BF16
combine on the MoE example's SwiGLU expert outputs (``examples/moe_layer.py``'s own
functions, as the FP8 combine's error is measured)."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference
from epgen.errors import EPInputError
from epgen.formats import make_format
from epgen.kernels import build_combine_partial_module
from epgen.kernels.combine_partial import COUNT_SHIFT
from epgen.reference_combine import bf16_to_f32
from epgen.runtime import call_args

from example_runs import moe_reference_round_trip

#: the stated tolerance of the partial-reduce combine against the plain BF16 combine on
#: realistic activations (docs/combine.md): per output row, relative L2 error and max abs
#: error over the row's amax (measured: about 0.0026 and 2^-7 at H=1024, K=4, 2 ranks)
REL_L2 = 0.005
MAX_ABS_OVER_AMAX = 2.0 ** -6


def _cfg(H=256, K=2, R=2, T=4, E=4, threads=64, sms=5, dedup=True, **flags):
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format("BF16", H, K), ep_rank_dedup=dedup, **flags)


# ---- refusals --------------------------------------------------------------------------------
def test_the_flag_is_refused_by_name():
    cfg, plain = _cfg(), _cfg(dedup=False)
    assert call_args.combine_partial_flag(plain, False) is False
    with pytest.raises(EPInputError, match="partial_reduce: must be True or False"):
        call_args.combine_partial_flag(cfg, "yes")
    with pytest.raises(ValueError, match="partial_reduce: needs ep_rank_dedup=True"):
        call_args.combine_partial_flag(plain, True, dispatched=True)
    with pytest.raises(ValueError, match="partial_reduce: not with fp8=True"):
        call_args.combine_partial_flag(cfg, True, fp8=True, dispatched=True)
    with pytest.raises(EPInputError, match="topk_weights: must be None with partial_reduce"):
        call_args.combine_partial_flag(cfg, True, [np.ones((1, 2), np.float32)] * 2,
                                       dispatched=True)
    with pytest.raises(EPInputError, match="the last dispatch was given no topk_weights"):
        call_args.combine_partial_flag(cfg, True)
    assert call_args.combine_partial_flag(cfg, True, dispatched=True) is True


def test_the_builder_refuses_what_it_cannot_count():
    with pytest.raises(ValueError, match="partial_reduce: needs ep_rank_dedup=True"):
        build_combine_partial_module(_cfg(dedup=False))
    warps = 1 << COUNT_SHIFT
    with pytest.raises(ValueError, match=rf"n_sms \* num_threads / 32 = {warps} warps"):
        build_combine_partial_module(_cfg(threads=1024, sms=warps // 32))
    names = [k.name for k in build_combine_partial_module(_cfg()).kernels]
    assert names == ["ep_combine_async_partial", "ep_combine_wait_partial",
                     "ep_combine_partial"]


def test_the_reference_refuses_without_weights_or_with_fp8():
    cfg = _cfg()
    with pytest.raises(ValueError, match="partial_reduce=True needs the dispatched"):
        reference.combine(cfg, [], [], None, partial_reduce=True, n_tokens=[0, 0])
    with pytest.raises(ValueError, match="partial_reduce=True needs the dispatched"):
        reference.combine(cfg, [], [], [], partial_reduce=True, fp8=True)


# ---- layout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("H,K,E", [(256, 2, 4), (7168, 8, 8), (64, 3, 6)])
def test_weights_and_row_map_members(H, K, E):
    """The weights start at the message rounded to 16 and the row is 16-aligned; the
    message area and the send buffer take that stride; one row-map word per (message,
    slot)."""
    cfg = _cfg(H=H, K=K, E=E, sms=8)
    lay = cfg.layout
    assert lay.dedup_weights_offset == -(-lay.msg_bytes // 16) * 16
    assert lay.dedup_row_bytes == -(-(lay.dedup_weights_offset + 4 * K) // 16) * 16
    assert lay.dedup_index_offset == lay.dedup_msg_rows * lay.dedup_row_bytes
    assert lay.send_buf_bytes == cfg.max_tokens_per_rank * lay.dedup_row_bytes
    assert lay.dedup_row_map_words == cfg.n_ranks * cfg.max_tokens_per_rank * K
    plain = _cfg(H=H, K=K, E=E, sms=8, dedup=False).layout
    assert plain.send_buf_bytes == cfg.max_tokens_per_rank * plain.msg_bytes
    assert plain.dedup_row_map_words == 0


# ---- the error against the plain BF16 combine ------------------------------------------------
def _moe_round_trip(seed):
    """The example's layer on the reference with ``ep_rank_dedup`` (2 ranks of 8 experts,
    top-4: most tokens have several experts on one rank): ``(plain, partial, unreduced rows,
    weights)`` of every source."""
    cfg = _cfg(H=1024, K=4, R=2, T=64, E=16, threads=128, sms=12)
    results, ys, ws = moe_reference_round_trip(cfg, seed)
    plain = reference.combine(cfg, results, ys, ws)
    partial = reference.combine(cfg, results, ys, ws, partial_reduce=True)
    rows = reference.combine(cfg, results, ys, None, n_tokens=[cfg.max_tokens_per_rank] * 2)
    return plain, partial, rows, ws


def test_error_against_the_plain_combine_on_swiglu_outputs(seed):
    """Per output row: relative L2 error <= 0.005 and max abs error <= 2^-6 of the row's
    amax."""
    plain, partial, *_ = _moe_round_trip(seed % 1000)
    a = bf16_to_f32(np.concatenate(plain)).astype(np.float64)
    b = bf16_to_f32(np.concatenate(partial)).astype(np.float64)
    assert not np.array_equal(a, b), "the partial sums are rounded to BF16"
    rel = np.linalg.norm(b - a, axis=1) / np.linalg.norm(a, axis=1)
    worst = np.abs(b - a).max(axis=1) / np.abs(a).max(axis=1)
    assert rel.max() <= REL_L2, f"relative L2 error {rel.max():.4f}"
    assert worst.max() <= MAX_ABS_OVER_AMAX, f"max abs error / amax {worst.max():.4f}"


def test_error_within_the_double_rounding_bound_per_element(seed):
    """Every element: ``|partial - plain| <= 2^-8 sum_k |w_k y_k| + 2^-8 (|partial| +
    |plain|)`` (each partial sum's BF16 rounding, at most half an ulp, ``2^-8`` of its
    magnitude, which is at most the sum over the slots it sums; both results' final
    roundings), with 1% slack for the f32 sums."""
    plain, partial, rows, ws = _moe_round_trip(seed % 1000)
    for s in range(len(plain)):
        a = bf16_to_f32(plain[s]).astype(np.float64)
        b = bf16_to_f32(partial[s]).astype(np.float64)
        y = bf16_to_f32(rows[s]).astype(np.float64)
        mass = np.abs(ws[s].astype(np.float64)[:, :, None] * y).sum(axis=1)
        bound = (2.0 ** -8 * (mass + np.abs(a) + np.abs(b))) * 1.01
        assert (np.abs(b - a) <= bound).all()
