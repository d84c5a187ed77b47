"""The SM schedule (``epgen.kernels.schedule``): the numpy model of the table against an
independent exact-arithmetic model and its stated properties, and a simulation of the copy
blocks' claim protocol (start on the table's expert, move on to later experts) under random
interleavings: every tile claimed exactly once, every block finishes."""

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


def simulate_claims(table, tiles, rng):
    """The copy blocks' protocol (``claim_next_tile``), one atomic step at a time in a random
    order: a block claims on its current expert (``fetch_add``); past the last tile it probes
    the later experts' counters and moves to the first one with unclaimed tiles, or stops.
    Returns how often each (expert, tile) was copied."""
    L = len(tiles)
    counter = [0] * L
    copied = {}
    state = [int(e) for e in table]                       # current expert per block
    live = [b for b in range(len(table)) if state[b] < L]
    while live:
        b = live[int(rng.integers(len(live)))]
        e = state[b]
        claim = counter[e]
        counter[e] += 1
        if claim < tiles[e]:
            copied[(e, claim)] = copied.get((e, claim), 0) + 1
            continue
        nxt = next((x for x in range(e + 1, L) if counter[x] < tiles[x]), L)
        state[b] = nxt
        if nxt == L:
            live.remove(b)
    return copied


def test_claim_protocol_covers_every_tile_once(seed):
    rng = np.random.default_rng(seed)
    for counts, n_blocks, n_entries in list(_cases(rng, 120)):
        counts = np.minimum(counts, 3000)
        tiles = [(int(c) + 127) // 128 for c in counts]
        table = sm_schedule(counts, n_blocks, n_entries)[:n_blocks]
        copied = simulate_claims(table, tiles, rng)
        want = {(e, t) for e, n in enumerate(tiles) for t in range(n)}
        assert set(copied) == want, f"seed {seed}: tiles missed or invented"
        assert all(v == 1 for v in copied.values()), f"seed {seed}: a tile copied twice"


def test_claim_protocol_with_any_start_at_or_before_the_first_expert(seed):
    """Coverage needs only a non-decreasing table starting at or before the first expert
    with tokens (e.g. a stale or zero table)."""
    rng = np.random.default_rng(seed)
    tiles = [0, 3, 0, 5, 1]
    for table in ([0] * 6, [1, 1, 3, 4], [0, 4, 4, 4]):
        copied = simulate_claims(np.array(table), tiles, rng)
        assert sorted(copied) == [(e, t) for e, n in enumerate(tiles) for t in range(n)]
        assert set(copied.values()) == {1}


@pytest.mark.parametrize("n_blocks", [1, 2, 131])
def test_no_tokens_means_an_all_zero_table(n_blocks):
    assert (sm_schedule(np.zeros(7, int), n_blocks, 132) == 0).all()
