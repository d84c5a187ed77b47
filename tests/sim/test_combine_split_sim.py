"""The combine's split knobs: ``Tuning.reduce_warps_per_token_max``
(``combine_wait.token_shares``: several warps share a token's row in the reduce when the
grid's warps outnumber a call's tokens) and ``Tuning.combine_send_warps_per_row``
and ``Tuning.combine_fp8_partial_send_warps_per_row`` (``combine_async.row_shares``: several
warps share each returned row in the send, over P2P, on a block with fewer rows than its
warps), each alone and both. On the simulator, every form against ``epgen.reference.combine`` bit
for bit: BF16 weighted with a residual, weighted, unreduced; the FP8 combine; the
partial-reduce combine; the fused kernel with the shared expert; calls of 0, 1, a few and
every token (so the reduce's split is 8, 4, 2 and 1 warps a token over the grid's 10 warps),
rows whose chunks the shares cover and rows with fewer chunks than a split's lanes (shares
with nothing to do). The knobs' defaults build the same kernels as before (the goldens pin
them); a split build differs; the send split stays off under the SHMEM transport."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from epgen.kernels import (build_combine_fp8_module, build_combine_module,
                           build_combine_partial_module)
from epgen.kernels.combine_async import row_shares
from epgen.runtime.world import EmulatedWorld
from ir.printer import print_module

from combine_checks import (check_round_trips, corrupted_row_check, expert_outputs, residuals,
                            weights)


#: (reduce_warps_per_token_max, the send knobs of every wire) of each split build
SPLITS = {"reduce": (8, 1), "send": (1, 4), "both": (8, 4)}


def _cfg(H=1024, split="reduce", **flags):
    """64 threads x 5 blocks: 10 warps in the reduce grid; 8 tokens per rank at most."""
    most, send = SPLITS[split] if isinstance(split, str) else split
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=4, n_ranks=2,
                          max_tokens_per_rank=8, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format("BF16", H, 2),
                          tuning=epgen.Tuning(reduce_warps_per_token_max=most,
                                              combine_send_warps_per_row=send,
                                              combine_fp8_partial_send_warps_per_row=send),
                          **flags)


def _calls(rng, cfg, counts):
    return [routing.routing(rng, cfg, [n] * cfg.n_ranks) for n in counts]


def _same(got, want, what: str) -> None:
    """Each source's combine bit for bit against the reference."""
    assert len(got) == len(want)
    for s, (g, x) in enumerate(zip(got, want)):
        assert g.shape == x.shape and np.array_equal(g, x), f"{what} source {s}"


#: tokens per rank of each call: 10 warps give 8, 4, 2 and 1 warps a token
COUNTS = (1, 2, 4, 8, 0)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("H", [1024, 512], ids=["shares_full", "shares_idle"])
def test_bf16_forms(H, split, seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(H=H, split=split)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_round_trips(world, rng, seed, _calls(rng, cfg, COUNTS), "split")


@pytest.mark.parametrize("split", SPLITS)
def test_fp8_combine(split, seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(split=split)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    for call, (toks, ids) in enumerate(_calls(rng, cfg, COUNTS)):
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        for w in (weights(rng, cfg, ids), None):
            _same(world.combine(ys, w, fp8=True),
                  reference.combine(cfg, results, ys, w, fp8=True,
                                    n_tokens=[len(i) for i in ids]),
                  f"seed {seed} call {call} unreduced={w is None}")


@pytest.mark.parametrize("split", SPLITS)
def test_partial_reduce_combine(split, seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(split=split, ep_rank_dedup=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    for call, (toks, ids) in enumerate(_calls(rng, cfg, COUNTS)):
        w = weights(rng, cfg, ids)
        results = world.dispatch(toks, ids, topk_weights=w)
        ys = expert_outputs(rng, cfg, results)
        res = residuals(rng, cfg, ids)
        _same(world.combine(ys, residual=res, partial_reduce=True),
              reference.combine(cfg, results, ys, w, residual=res, partial_reduce=True),
              f"seed {seed} call {call}")


@pytest.mark.parametrize("split", SPLITS)
def test_fused_kernel_with_the_shared_expert(split, seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(split=split, fused_shared_expert=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=True)
    check_round_trips(world, rng, seed, _calls(rng, cfg, (1, 4, 8)), "split fused SE")


def test_the_defaults_are_one_warp_per_token_and_per_row():
    """Knobs at 1 build the reduce of one warp per token and the send of one warp per row
    (no share arithmetic); each split build adds its own; under the SHMEM transport the
    send takes no share."""
    text = {k: print_module(build_combine_module(_cfg(split=v)))
            for k, v in {"none": (1, 1), **SPLITS}.items()}
    assert "red_share" not in text["none"] and "row_share" not in text["none"]
    assert "red_share" in text["reduce"] and "row_share" not in text["reduce"]
    assert "row_share" in text["send"] and "red_share" not in text["send"]
    assert "red_share" in text["both"] and "row_share" in text["both"]
    shmem = _cfg(split="send").replace(n_ranks=2, p2p_world_size=1, use_shmem=True)
    assert row_shares(shmem) == 1 and row_shares(shmem, wire=object()) == 1
    assert "row_share" not in print_module(build_combine_module(shmem))
    # the defaults measured best at decode: a shared reduce, one warp per sent BF16 row,
    # four per FP8 or partial-reduce row
    t = epgen.Tuning()
    assert (t.reduce_warps_per_token_max, t.combine_send_warps_per_row,
            t.combine_fp8_partial_send_warps_per_row) == (8, 1, 4)


def test_a_bad_row_is_reported_once_with_a_split_send(seed):
    """A corrupted ``src_info`` row with four warps sharing each row: named once in the
    error (one bounds record, by the row's share 0), nothing written, the next call exact
    (``combine_checks.corrupted_row_check``)."""
    rng = np.random.default_rng(seed)
    cfg = _cfg(split="send")
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    text, rows = corrupted_row_check(world, rng)
    assert all(text.count(f"src_info[{row}] =") == 1 for row in rows), text


def _crowded_and_sparse_calls(rng, cfg):
    """Two calls per rank: 8 tokens all routed to experts 0 and 2 (local expert 0 of each
    rank), so each of those blocks holds 8 rows, more than the 5 warps of its expert (one
    warp a row); and 1 token (one row a block, shared)."""
    crowded = [np.tile(np.array([[0, 2]], np.int32), (8, 1)) for _ in range(cfg.n_ranks)]
    sparse = [np.array([[1, 3]], np.int32) for _ in range(cfg.n_ranks)]
    H = cfg.token_fmt.hid_dim
    return [([routing.random_tokens(rng, len(i), H) for i in ids], ids)
            for ids in (crowded, sparse)]


@pytest.mark.parametrize("form", ["fp8", "partial"])
def test_a_block_with_more_rows_than_warps_keeps_one_warp_a_row(form, seed):
    """The default build (four warps a row for these wires): a block of 8 rows on the 5
    warps of its expert takes the one-warp path, a block of 1 row the shared one; both
    bit for bit against the reference, as are the row counts the partial combine sends."""
    rng = np.random.default_rng(seed)
    cfg = _cfg(split=(8, 1), ep_rank_dedup=form == "partial")
    cfg = cfg.replace(tuning=epgen.Tuning())
    build = build_combine_fp8_module if form == "fp8" else build_combine_partial_module
    assert "row_share" in print_module(build(cfg))
    assert "row_share" not in print_module(build_combine_module(cfg))      # BF16: one warp
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    for call, (toks, ids) in enumerate(_crowded_and_sparse_calls(rng, cfg)):
        w = weights(rng, cfg, ids)
        kw = {"topk_weights": w} if form == "partial" else {}
        results = world.dispatch(toks, ids, **kw)
        ys = expert_outputs(rng, cfg, results)
        if form == "fp8":
            got = world.combine(ys, w, fp8=True)
            want = reference.combine(cfg, results, ys, w, fp8=True,
                                     n_tokens=[len(i) for i in ids])
        else:
            got = world.combine(ys, partial_reduce=True)
            want = reference.combine(cfg, results, ys, w, partial_reduce=True)
        _same(got, want, f"seed {seed} {form} call {call}")
