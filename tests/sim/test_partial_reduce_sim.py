"""The partial-reduce combine under ``ep_rank_dedup`` (docs/combine.md, "Partial reduce") on
the CPU simulator, and what the dispatch gives it (docs/flags.md, ``ep_rank_dedup``): the
router weights travel in each message-area row after the message, and dispatch_wait's row
map names the grouped-output row of every (message, local slot)."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference
from epgen.reference_combine import source_of_rows

from combine_checks import weights
from sim_world import sim_world
from test_rank_dedup_sim import PATHS, _edge_calls, make_cfg


def _dispatch(world, cfg, call, rng):
    """``call``'s dispatch with random weights (NaN in ``-1`` slots); checked against the
    reference; returns ``(weights, results)``."""
    toks, ids = call
    ws = weights(rng, cfg, ids)
    got = world.dispatch(toks, ids, topk_weights=ws)
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
    return ws, got


@pytest.mark.parametrize("path", PATHS)
def test_weights_travel_in_the_message_row(path, seed):
    """Every (source, token) with an expert on a rank finds the token's ``K`` weights, bit
    for bit, at ``dedup_weights_offset`` of its message-area row there, on every send
    path, two calls in a row (each call's own weights)."""
    cfg = make_cfg("BF16", 64, R=4, K=4, L=4, T=8, path=path)
    lay, L, K = cfg.layout, cfg.layout.n_local_experts, cfg.token_fmt.top_k
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        for call in _edge_calls(cfg, seed, n_calls=2):
            ws, _ = _dispatch(world, cfg, call, rng)
            ids = call[1]
            for d, rk in enumerate(world.ranks):
                buf = rk.recv_buf.to_host()
                for s, (i, w) in enumerate(zip(ids, ws)):
                    for t, row in enumerate(np.asarray(i)):
                        if not any(g >= 0 and g // L == d for g in row):
                            continue
                        at = lay.dedup_msg_row(s, t) * lay.dedup_row_bytes \
                            + lay.dedup_weights_offset
                        got = buf[at:at + 4 * K].view(np.uint32)
                        assert np.array_equal(got, w[t].view(np.uint32)), (d, s, t)


@pytest.mark.parametrize("path", PATHS)
def test_row_map_names_each_slots_output_row(path, seed):
    """``row_map[dedup_msg_row(s, t) * K + k]`` is the grouped-output row whose ``src_info``
    is ``(t, k)`` from source ``s``, for every routed row of every rank."""
    cfg = make_cfg("BF16", 64, R=2, K=4, L=4, T=8, path=path)
    lay, K = cfg.layout, cfg.token_fmt.top_k
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        for call in _edge_calls(cfg, seed, n_calls=2):
            _, results = _dispatch(world, cfg, call, rng)
            for rk, res in zip(world.ranks, results):
                row_map = rk.row_map.to_host()
                src = source_of_rows(res)
                rows = np.nonzero(src >= 0)[0]
                assert len(rows)
                for row in rows:
                    t, k = (int(v) for v in res.src_info[row])
                    assert row_map[lay.dedup_msg_row(int(src[row]), t) * K + k] == row


def test_dispatch_without_weights_carries_zero(seed):
    """A dispatch given no weights carries zeros (the world's zero buffer), even after a
    call that carried weights."""
    cfg = make_cfg("BF16", 64, R=2, K=2, L=2, T=4, path="warp_split")
    lay, L = cfg.layout, cfg.layout.n_local_experts
    rng = np.random.default_rng(seed)
    (call1, call2) = _edge_calls(cfg, seed, n_calls=2)
    with sim_world(cfg, seed) as world:
        _dispatch(world, cfg, call1, rng)
        world.dispatch(*call2)
        assert world.last_weights is None
        for d, rk in enumerate(world.ranks):
            buf = rk.recv_buf.to_host()
            for s, i in enumerate(call2[1]):
                for t, row in enumerate(np.asarray(i)):
                    if any(g >= 0 and g // L == d for g in row):
                        at = lay.dedup_msg_row(s, t) * lay.dedup_row_bytes \
                            + lay.dedup_weights_offset
                        assert not buf[at:at + 4 * lay.top_k].any()
