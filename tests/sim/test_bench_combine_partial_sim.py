"""``epgen bench --op combine --combine-partial`` measured for real on the simulator with only
the event timing replaced: the plain and the partial-reduce combine both timed on one
``ep_rank_dedup`` world, every partial sample ran the partial-reduce kernels, both checked
against the reference before and after the timing, a partial combine that did not run fails
its check; a whole run (device phases faked) reports the partial figure on the variant with
``ep_rank_dedup`` and says why not on the other, whose plain combine still runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

import epgen
from epgen import cli
from epgen.bench import combine, link_bytes
from epgen.bench.report import format_table, table_rows
from epgen.formats import make_format

from test_bench import fake_gpu  # noqa: F401 - fixture
from test_bench_combine import fake_combine  # noqa: F401 - fixture
from test_bench_combine import counting_timer, fake_arm_measure, measure_on_sim


def _cfg(**flags):
    return epgen.EPConfig(num_threads=64, n_sms=4, n_experts=4, n_ranks=2,
                          max_tokens_per_rank=4, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format("BF16", 128, 2), **flags)


def _measure(cfg, seed, timer):
    return measure_on_sim(cfg, seed, timer, combine_partial=True)


def test_both_combines_timed_and_checked(seed):
    calls = []
    fake_timer = counting_timer(calls)
    res, world = _measure(_cfg(ep_rank_dedup=True), seed, fake_timer)
    assert res["check"] == res["post_check"] == res["post_check_partial"] == "ok", \
        f"seed {seed}"
    # each combine timed whole, then its send and reduce kernels alone
    timed = [f"{c}{h}" for c in ("combine", "combine_partial") for h in ("", "_send", "_reduce")]
    assert all(res[k]["n"] == 3 for k in timed), {k: res.get(k) for k in timed}
    assert len(calls) == len(timed) * (3 + 1)        # warm-up + iterations, each timing
    partial = world.combiner().partial_side.program.loaded.launched
    # the set-0 check's call, the 4 samples of the whole combine and of each half (a half's
    # sample is a whole combine too), on each of the 2 ranks
    for name in ("ep_combine_async_partial", "ep_combine_wait_partial"):
        assert sum(1 for k, *_ in partial if k == name) == 2 * (1 + 3 * 4), name


def test_a_partial_combine_that_did_not_run_fails_the_check(seed):
    # the plain combine's 12 samples (whole, send, reduce) run; the later ones enqueue nothing
    partial_skipped = counting_timer([], run_first=12)
    with pytest.raises(AssertionError, match="partial.*combine differs from the reference"):
        _measure(_cfg(ep_rank_dedup=True), seed, partial_skipped)


def test_measure_world_refuses_it_without_dedup(seed):
    with pytest.raises(ValueError, match="partial_reduce: needs ep_rank_dedup=True"):
        _measure(_cfg(), seed, lambda *a: (0.25, False))


def test_partial_combine_bytes_by_hand():
    cfg = _cfg(ep_rank_dedup=True)                  # 2 experts per rank, H = 128
    # rank 0: token 0 -> experts 0, 1 (rank 0 twice); token 1 -> 0 (rank 0), 2 (rank 1)
    # rank 1: token 0 -> experts 2, 3 (rank 1 twice); token 1 -> 1 (rank 0), 3 (rank 1)
    ids = [np.array([[0, 1], [0, 2]], np.int32), np.array([[2, 3], [1, 3]], np.int32)]
    b = combine.partial_combine_bytes(cfg, [(None, ids)])
    row = 128 * 2
    assert b["rows_read"] == 8 * row                  # every (token, k) slot
    assert b["partial_rows"] == 6 * row               # (token, rank) pairs: 2 + 1 + 1 + 2
    assert b["output"] == 4 * row                     # 4 tokens
    assert b["total"] == b["rows_read"] + 2 * b["partial_rows"] + b["output"]
    assert b["link_ratio"] == 1.0                     # remote: 2 slots, 2 pairs
    model = link_bytes.link_bytes(cfg, ids, dedup=True, partial_reduce=True)
    assert model.combine_link == 2 * row


def test_a_whole_run_reports_the_partial_figure(fake_combine, monkeypatch, tmp_path, capsys):
    """``epgen bench --op combine --combine-partial --variant default --variant
    dedup=ep_rank_dedup`` with the device phases faked: the dedup variant's partial figure,
    its bytes, link bytes and speed-up reach the JSON, the progress lines and the table; the
    default variant's plain combine runs and its partial combine says why not."""
    monkeypatch.setattr(combine, "measure_world", fake_arm_measure)
    js = tmp_path / "partial.json"
    status = cli.main(["bench", "--preset", "small", "--tokens", "16", "--no-gate", "--op",
                       "combine", "--combine-partial", "--variant", "default", "--variant",
                       "dedup=ep_rank_dedup", "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err
    results = json.loads(js.read_text())
    plain, dedup = results["shapes"][0]["variants"]
    assert "median_ms" in plain["combine"]
    assert "ep_rank_dedup" in plain["combine_partial"]["skipped"]
    assert "partial_speedup_vs_plain" not in plain
    m = dedup["combine_partial"]
    assert dedup["partial_speedup_vs_plain"] == pytest.approx(0.6 / 0.4)
    assert m["bytes"] == dedup["bytes"]["combine_partial"]["total"]
    # the link bytes are the model's with partial_reduce, below the plain combine's
    assert m["link_bytes"] < dedup["combine"]["link_bytes"]
    assert m["link_gbps"] == pytest.approx(m["link_bytes"] / 0.4 / 1e6)
    assert "combine_partial 400.0 us (1.50x the plain combine" in err, err
    assert "combine_partial skipped (--combine-partial: partial_reduce: needs " \
           "ep_rank_dedup" in err, err
    table = format_table(table_rows(results))
    assert "epgen dedup combine (partial)" in table and "epgen default combine (partial)" \
        in table, table
