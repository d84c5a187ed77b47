"""``epgen bench --op combine``'s check against ``reference.combine`` (``bench.combine._check``):
every token of every source at small shapes; above ``PREFILL_CHECK_TOKENS`` tokens per rank
the first and the last source, ``check_tokens`` of their tokens (spread evenly, the first
and the last included). A wrong row among them fails the check, with each combine form; a
wrong row outside them is not seen (what the sampling gives up)."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.bench import combine as bench_combine
from epgen.formats import make_format


def _case(seed, R=3, T=12, **flags):
    cfg = epgen.EPConfig(num_threads=256, n_sms=9, n_experts=2 * R, n_ranks=R,
                         max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                         token_fmt=make_format("BF16", 128, 2), **flags)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, T)
    res = reference.dispatch(cfg, toks, ids)
    w = [rng.random((T, 2), dtype=np.float32) for _ in range(R)]
    return cfg, res, w


def test_check_tokens_spreads_evenly_and_keeps_the_ends(monkeypatch):
    monkeypatch.setattr(bench_combine, "PREFILL_CHECK_TOKENS", 4)
    assert bench_combine.check_tokens(3).tolist() == [0, 1, 2]
    assert bench_combine.check_tokens(4).tolist() == [0, 1, 2, 3]
    assert bench_combine.check_tokens(10).tolist() == [0, 3, 6, 9]
    monkeypatch.setattr(bench_combine, "PREFILL_CHECK_TOKENS", 512)
    got = bench_combine.check_tokens(4096)
    assert len(got) == 512 and got[0] == 0 and got[-1] == 4095 and (np.diff(got) > 0).all()


@pytest.mark.parametrize("flags", [{}, {"fp8": True}, {"partial_reduce": True}],
                         ids=["plain", "fp8", "partial"])
def test_a_wrong_sampled_row_fails_and_an_unsampled_one_is_not_seen(flags, seed,
                                                                    monkeypatch):
    monkeypatch.setattr(bench_combine, "PREFILL_CHECK_TOKENS", 4)
    cfg, res, w = _case(seed, **({"ep_rank_dedup": True} if flags else {}))
    rows = [r.out_tokens for r in res]
    good = reference.combine(cfg, res, rows, w, **flags)
    bench_combine._check(cfg, good, res, w, "set 0", **flags)          # passes
    picked = bench_combine.check_tokens(12)                              # [0, 4, 7, 11]
    for s, t, seen in [(0, int(picked[1]), True), (2, 11, True), (0, 5, False),
                       (1, 0, False)]:
        bad = [g.copy() for g in good]
        bad[s][t, 3] ^= np.uint16(1)
        if seen:
            with pytest.raises(AssertionError, match=f"rank {s} combine differs"):
                bench_combine._check(cfg, bad, res, w, "set 0", **flags)
        else:
            bench_combine._check(cfg, bad, res, w, "set 0", **flags)


def test_small_shapes_check_every_token(seed):
    cfg, res, w = _case(seed)
    rows = [r.out_tokens for r in res]
    bad = reference.combine(cfg, res, rows, w)
    bad[1][5, 0] ^= np.uint16(1)
    with pytest.raises(AssertionError, match="rank 1 combine differs"):
        bench_combine._check(cfg, bad, res, w, "set 0")
