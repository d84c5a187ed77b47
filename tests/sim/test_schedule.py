"""The SM schedule (``epgen.kernels.schedule``): the numpy model of the table against an
independent exact-arithmetic model and its stated properties; the IR dispatch_wait runs
(``fill_sm_schedule``, ``first_expert``, ``load_expert_tiles``, ``claim_next_tile``) on the
CPU simulator under random interleavings: the table it writes is the exact-shares model's,
and the copy blocks claim every tile (a last partial one included) exactly once and all
finish."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from epgen import routing
from epgen.kernels.schedule import sm_schedule


def schedule_by_shares(counts, n_blocks, n_entries):
    """Independent model: each expert with tokens gets one block plus its share of the spare
    blocks, the shares cut at exact rational boundaries ``floor(spare * prefix / total)``."""
    counts = [int(c) for c in counts]
    n = min(n_blocks, n_entries)
    table = [0] * n_entries
    total = sum(counts)
    if total == 0:
        return np.array(table, dtype=np.int32)
    nonzero = [e for e, c in enumerate(counts) if c]
    spare = max(n - len(nonzero), 0)
    cut = lambda prefix: int(Fraction(spare * prefix, total))  # noqa: E731 (floor, >= 0)
    b = 0
    prefix = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        k = 1 + cut(prefix + c) - cut(prefix)
        for _ in range(k):
            if b < n:
                table[b] = e
            b += 1
        prefix += c
    return np.array(table, dtype=np.int32)


def _cases(rng, n_cases=300):
    for _ in range(n_cases):
        L = int(rng.integers(1, 40))
        n_blocks = int(rng.integers(1, 140))
        kind = rng.integers(4)
        if kind == 0:
            counts = rng.integers(0, 300, L)
        elif kind == 1:                                   # Zipf-skewed
            w = routing.zipf_weights(L, 1.3, rng)
            counts = rng.multinomial(int(rng.integers(0, 5000)), w)
        elif kind == 2:                                   # mostly empty
            counts = rng.integers(0, 300, L) * (rng.random(L) < 0.2)
        else:                                             # huge counts: u64 products
            counts = rng.integers(0, 2**31 // max(L, 1), L)
        yield counts, n_blocks, n_blocks + int(rng.integers(0, 3))


def test_model_matches_exact_shares(seed):
    rng = np.random.default_rng(seed)
    for counts, n_blocks, n_entries in _cases(rng):
        got = sm_schedule(counts, n_blocks, n_entries)
        want = schedule_by_shares(counts, n_blocks, n_entries)
        assert np.array_equal(got, want), f"seed {seed}: counts {list(counts)}, n={n_blocks}"


def test_table_properties(seed):
    rng = np.random.default_rng(seed)
    for counts, n_blocks, n_entries in _cases(rng):
        t = sm_schedule(counts, n_blocks, n_entries)
        n = min(n_blocks, n_entries)
        ctx = f"seed {seed}: counts {list(counts)}, n={n}"
        assert t.shape == (n_entries,) and t.dtype == np.int32
        assert (t[n:] == 0).all(), ctx
        head = t[:n]
        assert (np.diff(head) >= 0).all(), f"{ctx}: not non-decreasing"
        nz = np.flatnonzero(np.asarray(counts) > 0)
        if nz.size == 0:
            assert (t == 0).all(), ctx
            continue
        assert head[0] == nz[0], f"{ctx}: block 0 must start on the first expert with tokens"
        blocks = np.bincount(head, minlength=len(counts))
        assert (blocks[np.asarray(counts) == 0] == 0).all(), f"{ctx}: zero-token expert scheduled"
        if nz.size <= n:
            assert (blocks[nz] >= 1).all(), f"{ctx}: an expert with tokens got no block"
            # the spare blocks follow the token counts: within one block of the exact share
            spare = n - nz.size
            share = spare * np.asarray(counts, dtype=np.float64) / np.sum(counts)
            assert (np.abs(blocks[nz] - 1 - share[nz]) < 1 + 1e-9).all(), ctx


def test_skewed_routing_gets_more_blocks_where_the_tokens_are():
    counts = np.array([1000, 10, 0, 10, 0, 0, 500, 1])
    t = sm_schedule(counts, 64)
    blocks = np.bincount(t, minlength=8)
    assert blocks[0] > blocks[6] > blocks[1] >= 1
    assert blocks[2] == blocks[4] == blocks[5] == 0
    assert blocks.sum() == 64


# ---- the schedule's IR (what dispatch_wait runs) on the simulator ---------------------------
# Two kernels built from the product's functions: ``fill`` (one block) is fill_sm_schedule,
# ``claim`` is each copy block's warp 0 as dispatch_wait's copy role drives it (first_expert,
# load_expert_tiles, then claim_next_tile until it answers "no work left"), logging each
# claimed (expert, tile). The counter words are laid out as dispatch_wait's aux block leaves
# them (region B prefixes, zeroed tile counters); the expected tiles are counted here.

TILE_TOKENS = 128          # every format's dispatch_wait tile (dispatch_wait_tile_shape)
FILL_THREADS = 64


def _cfg(L: int, n_sms: int, R: int = 2):
    """A configuration of ``L`` local experts, ``R`` ranks and an ``n_sms``-entry table (at
    least ``L + 1`` entries, as EPConfig requires)."""
    from world_checks import make_cfg
    cfg = make_cfg(R, L * R, 16, 1, 8, 1024, max(n_sms, L + 1))
    assert cfg.token_fmt.dispatch_wait_tile_shape == (TILE_TOKENS, 1)
    return cfg


def _tiles_of(count: int) -> int:
    """Tiles of an expert with ``count`` tokens: a last partial tile counts."""
    return -(-int(count) // TILE_TOKENS)


def _schedule_module(cfg, max_tiles: int, max_steps: int):
    """The ``fill`` and ``claim`` kernels of ``cfg`` (module comment above)."""
    from epgen.kernels.schedule import (claim_next_tile, fill_sm_schedule, first_expert,
                                        load_expert_tiles)
    from epgen.primitives import word
    from ir import nodes as N
    from ir import types as T
    from ir.builder import KernelBuilder
    from ir.enums import AtomOp

    L = cfg.layout.n_local_experts
    kb = KernelBuilder("fill", block_threads=FILL_THREADS)
    ctr, S, n_copy = kb.param("ctr", T.ptr_global), kb.param("S", T.ptr_global), \
        kb.param("n_copy", T.u32)
    warp_totals = kb.shared_buffer("warp_totals", 4 * 32)
    with kb.role("aux") as r:
        fill_sm_schedule(r, cfg, ctr, S, warp_totals, n_copy_blocks=n_copy)
    fill = kb.build()

    kb = KernelBuilder("claim", block_threads=32)
    ctr, log, unfinished = (kb.param(n, T.ptr_global) for n in ("ctr", "log", "unfinished"))
    with kb.role("copy") as r:
        cur_e = r.var("cur_e", T.u32, L)
        cur_tiles = r.var("cur_tiles", T.u32, 0)
        claim = r.var("claim", T.u32, 0)
        r.assign(cur_e, first_expert(r, cfg, ctr).min(L))
        with r.if_(cur_e < L):
            r.assign(cur_tiles, load_expert_tiles(r, cfg, ctr, cur_e))
        steps = r.var("steps", T.u32, 0)
        with r.while_(steps < max_steps):
            claim_next_tile(r, cfg, ctr, cur_e, cur_tiles, claim)
            with r.if_(cur_e >= L):
                r.break_()
            with r.if_(r.lane.eq(0)):
                slot = N.Select(claim < max_tiles, cur_e * max_tiles + claim,
                                N.Const(L * max_tiles, T.u32))      # the overflow slot
                r.red(AtomOp.ADD, word(log, slot), 1)
            r.assign(steps, steps + 1)
        with r.if_(r.lane.eq(0) & (cur_e < L)):
            r.store(word(unfinished, r.block), 1)
    return N.Module("schedule", (fill, kb.build()))


def run_schedule_ir(cfg, counts, n_copy: int, seed: int, table=None):
    """Run the schedule's IR for ``counts`` ``[L, R]`` (tokens of local expert e from rank
    src) on ``n_copy`` copy blocks: ``table`` (the SM schedule, as ``fill`` writes it, or
    given: then ``fill`` is not run), ``copied`` ``[L, max_tiles]`` (how often each tile was
    claimed), ``overflow`` (claims past ``max_tiles``) and the blocks that did not finish."""
    from backends import sim as sim_backend

    lay = cfg.layout
    L, R = lay.n_local_experts, cfg.n_ranks
    counts = np.asarray(counts, dtype=np.int64).reshape(L, R)
    max_tiles = max(_tiles_of(c) for c in counts.sum(axis=1)) + 2
    max_steps = int(sum(_tiles_of(c) for c in counts.sum(axis=1))) + L + 2
    module = _schedule_module(cfg, max_tiles, max_steps)
    machine = sim_backend.Machine(seed)
    words = np.zeros(lay.counter_words, np.uint32)
    words[lay.rank_prefix_offset:lay.rank_prefix_offset + L * R] = \
        np.cumsum(counts, axis=1).ravel()                       # region B, within expert
    if table is not None:
        words[lay.sm_schedule_offset:lay.sm_schedule_offset + len(table)] = table
    ctr = machine.to_device(words)
    log = machine.zeros((L * max_tiles + 1,), np.uint32)
    unfinished = machine.zeros((n_copy,), np.uint32)
    loaded = machine.load_module(module)
    if table is None:
        S = machine.to_device(np.cumsum(counts.ravel()).astype(np.uint32))   # e*R + src
        loaded.kernel("fill").launch(1, FILL_THREADS, (ctr, S, n_copy))
    loaded.kernel("claim").launch(n_copy, 32, (ctr, log, unfinished))
    machine.drain()
    out = ctr.to_host()
    copied = log.to_host()
    return (out[lay.sm_schedule_offset:lay.sm_schedule_offset + cfg.n_sms].astype(np.int32),
            copied[:-1].reshape(L, max_tiles), int(copied[-1]),
            np.flatnonzero(unfinished.to_host()).tolist())


def _assert_every_tile_once(counts, copied, overflow, unfinished, ctx):
    assert not unfinished, f"{ctx}: copy blocks {unfinished} never ran out of work"
    assert overflow == 0, f"{ctx}: {overflow} claims past an expert's tiles"
    want = np.zeros_like(copied)
    for e, c in enumerate(np.asarray(counts).reshape(len(copied), -1).sum(axis=1)):
        want[e, :_tiles_of(c)] = 1
    bad = np.argwhere(copied != want)
    assert not bad.size, (f"{ctx}: (expert, tile) claimed a wrong number of times: "
                          + ", ".join(f"({e}, {t}): {copied[e, t]} (want {want[e, t]})"
                                      for e, t in bad[:8]))


def _ir_cases(rng, n_cases):
    """(counts [L, R], copy blocks, table entries): token counts with partial last tiles,
    empty experts, and one expert that holds almost everything."""
    for _ in range(n_cases):
        L, R = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        kind = rng.integers(3)
        if kind == 0:
            counts = rng.integers(0, 400, (L, R))
        elif kind == 1:                                        # mostly empty
            counts = rng.integers(0, 400, (L, R)) * (rng.random((L, R)) < 0.3)
        else:                                                  # skewed
            counts = rng.integers(0, 20, (L, R))
            counts[int(rng.integers(L))] += rng.integers(200, 700, R)
        n_copy = int(rng.integers(1, 12))
        yield counts, n_copy, n_copy + int(rng.integers(0, 3))


def test_ir_table_matches_the_exact_shares(seed):
    """fill_sm_schedule's IR writes the table of the independent model."""
    rng = np.random.default_rng(seed)
    for counts, n_copy, n_sms in _ir_cases(rng, 12):
        cfg = _cfg(counts.shape[0], n_sms, counts.shape[1])
        table, *_ = run_schedule_ir(cfg, counts, n_copy, seed)
        want = schedule_by_shares(counts.sum(axis=1), n_copy, cfg.n_sms)
        assert np.array_equal(table, want), \
            f"seed {seed}: counts {counts.tolist()}, {n_copy} copy blocks: {table} != {want}"


def test_ir_claims_cover_every_tile_once(seed):
    """The copy blocks, started from fill's table in the simulator's random interleaving,
    claim every tile of every expert exactly once (a last partial tile included) and all
    run out of work."""
    rng = np.random.default_rng(seed)
    for counts, n_copy, n_sms in _ir_cases(rng, 12):
        cfg = _cfg(counts.shape[0], n_sms, counts.shape[1])
        _, copied, overflow, unfinished = run_schedule_ir(cfg, counts, n_copy, seed)
        _assert_every_tile_once(counts, copied, overflow, unfinished,
                                f"seed {seed}: counts {counts.tolist()}, {n_copy} blocks")


@pytest.mark.parametrize("count", [1, 127, 128, 129, 255, 256, 257, 383])
def test_ir_claims_the_last_partial_tile(count, seed):
    """One expert of ``count`` tokens (of two ranks) among empty ones: ceil(count / 128)
    tiles, the last one partial unless count is a multiple of 128."""
    counts = np.zeros((3, 2), np.int64)
    counts[1] = (count // 2, count - count // 2)
    cfg = _cfg(3, 4)
    _, copied, overflow, unfinished = run_schedule_ir(cfg, counts, 4, seed)
    _assert_every_tile_once(counts, copied, overflow, unfinished, f"{count} tokens")


def test_ir_claims_with_any_start_at_or_before_the_first_expert(seed):
    """Coverage needs only a non-decreasing table starting at or before the first expert
    with tokens (e.g. a stale or zero table): the claim IR run from such tables."""
    tiles = [0, 3, 0, 5, 1]
    counts = np.array([[0], [300], [0], [600], [1]])          # 3, 5 and 1 tiles (R = 1)
    assert [_tiles_of(c) for c in counts[:, 0]] == tiles
    for table in ([0] * 6, [1, 1, 3, 4], [0, 4, 4, 4]):
        cfg = _cfg(5, len(table), R=1)
        _, copied, overflow, unfinished = run_schedule_ir(cfg, counts, len(table), seed,
                                                          table=table)
        _assert_every_tile_once(counts, copied, overflow, unfinished, f"table {table}")


@pytest.mark.parametrize("n_blocks", [1, 2, 131])
def test_no_tokens_means_an_all_zero_table(n_blocks):
    assert (sm_schedule(np.zeros(7, int), n_blocks, 132) == 0).all()
