"""Back-to-back dispatch + combine calls (``enqueue_round_trip`` then ``Combiner.load`` /
``enqueue``, no host synchronisation between unchecked calls) on the simulator: ten calls with
varying token counts, 0 among them, each checked against ``epgen.reference`` bit for bit, and
no error record left. ``back_to_back`` is shared with the GPU stress test."""

from __future__ import annotations

import numpy as np

from ir import diag

from epgen import reference, routing

from combine_checks import weights
from sim_world import sim_world
from test_final_layout_sim import SHAPES, make_cfg


def input_sets(rng, cfg, token_counts):
    """One input set per entry of ``token_counts`` (tokens per rank, an int or one per rank):
    dispatch inputs, one random BF16 expert-output row per row the reference dispatch gives
    each destination, and random weights."""
    H = cfg.token_fmt.hid_dim
    sets = []
    for counts in token_counts:
        toks, ids = routing.routing(rng, cfg, counts)
        ys = [rng.integers(0, 1 << 16, size=(len(r.src_info), H), dtype=np.uint16)
              & np.uint16(0xBFFF) for r in reference.dispatch(cfg, toks, ids)]
        sets.append((toks, ids, ys, weights(rng, cfg, ids)))
    return sets


def back_to_back(world, sets, calls: int, checked, seed) -> int:
    """``calls`` dispatch + combine calls, call ``i`` on ``sets[i % len(sets)]``, enqueued
    back to back; the calls in ``checked`` (and the last) synchronise and are compared with
    the reference (dispatch, then the combine of the world's dispatch results). At the end
    no error record (expired wait, refused row) may be in the error buffer. Returns the
    number of calls checked."""
    cfg, comb = world.cfg, world.combiner()
    checked = set(checked) | {calls - 1}
    for i in range(calls):
        toks, ids, ys, w = sets[i % len(sets)]
        world.load_inputs(toks, ids)
        world.enqueue_round_trip()
        comb.load(ys, w)
        comb.enqueue()
        if i not in checked:
            continue
        got = comb.finish()
        results = world.results()
        what = f"seed {seed}, call {i} (set {i % len(sets)}, tokens {[len(x) for x in ids]})"
        try:
            reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), results)
        except AssertionError as exc:
            raise AssertionError(f"{what}: dispatch: {exc}") from None
        for s, (g, r) in enumerate(zip(got, reference.combine(cfg, results, ys, w))):
            assert g.shape == r.shape and np.array_equal(g, r), \
                f"{what}, rank {s}: {np.count_nonzero(g != r)} elements differ"
    world.check("back-to-back calls")
    words = world.err.array.to_host()
    assert not diag.decode_bounds(words) and not np.any(words), \
        f"seed {seed}: error records left after {calls} calls"
    return len(checked)


def test_ten_back_to_back_calls_with_varying_token_counts(seed):
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    counts = [T, 0, [1, T], [0, 2], T - 1, [T, 0], 0, 2, [3, 1], T]
    sets = input_sets(rng, cfg, counts)
    with sim_world(cfg, seed) as world:
        assert back_to_back(world, sets, len(sets), checked=range(len(sets)), seed=seed) == 10


def test_unchecked_calls_in_between_leave_the_last_exact(seed):
    """Only the last of six calls is read back: the ones before it ran without a host
    synchronisation between them."""
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    sets = input_sets(rng, cfg, [[T, 1], 0, T, [2, T]])
    with sim_world(cfg, seed) as world:
        assert back_to_back(world, sets, 6, checked=(), seed=seed) == 1
