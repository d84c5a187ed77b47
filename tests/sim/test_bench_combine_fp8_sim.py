"""``epgen bench --op combine --combine-fp8`` measured for real on the simulator with only the
event timing replaced: the BF16 and the FP8 combine both timed on one world, every FP8 sample
ran the FP8 kernels, both checked against the reference before and after the timing, and an
FP8 combine that did not run fails its check."""

from __future__ import annotations

import epgen
import pytest

from epgen.bench import combine
from epgen.formats import make_format

from test_bench import fake_gpu  # noqa: F401 - fixture
from test_bench_combine import fake_combine  # noqa: F401 - fixture
from test_bench_combine import counting_timer, fake_arm_measure, measure_on_sim


def _cfg():
    return epgen.EPConfig(num_threads=64, n_sms=4, n_experts=4, n_ranks=2,
                          max_tokens_per_rank=4, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format("BF16", 128, 2))


def _measure(cfg, seed, timer):
    return measure_on_sim(cfg, seed, timer, combine_fp8=True)


def test_both_combines_timed_and_checked(seed):
    calls = []
    fake_timer = counting_timer(calls)
    res, world = _measure(_cfg(), seed, fake_timer)
    assert res["check"] == res["post_check"] == res["post_check_fp8"] == "ok", f"seed {seed}"
    # each combine timed whole, then its send and reduce kernels alone
    timed = [f"{c}{h}" for c in ("combine", "combine_fp8") for h in ("", "_send", "_reduce")]
    assert all(res[k]["n"] == 3 for k in timed), {k: res.get(k) for k in timed}
    assert len(calls) == len(timed) * (3 + 1)        # warm-up + iterations, each timing
    fp8 = world.combiner().fp8_side.program.loaded.launched
    assert sum(1 for k, *_ in fp8 if k == "ep_combine_async_fp8") >= 2 * 4


def test_an_fp8_combine_that_did_not_run_fails_the_check(seed):
    # the BF16 combine's 12 samples (whole, send, reduce) run; the later ones enqueue nothing
    fp8_skipped = counting_timer([], run_first=12)
    with pytest.raises(AssertionError, match="fp8.*combine differs from the reference"):
        _measure(_cfg(), seed, fp8_skipped)


def test_a_whole_run_reports_both_figures(fake_combine, monkeypatch, tmp_path, capsys):
    """``epgen bench --op combine --combine-fp8`` with the device phases faked: the FP8
    figure, its bytes and its speed-up over the BF16 combine reach the JSON and the progress
    lines."""
    import json

    from epgen import cli
    monkeypatch.setattr(combine, "measure_world", fake_arm_measure)
    js = tmp_path / "fp8.json"
    status = cli.main(["bench", "--preset", "small", "--tokens", "16", "--no-gate", "--op",
                       "combine", "--combine-fp8", "--json", str(js)])
    _, err = capsys.readouterr()
    assert status == 0, err
    v = json.loads(js.read_text())["shapes"][0]["variants"][0]
    b = v["bytes"]["combine_fp8"]
    assert b["link_ratio"] == pytest.approx(272 / 512)
    assert v["combine_fp8"]["bytes"] == b["total"]
    assert v["fp8_speedup_vs_bf16"] == pytest.approx(0.6 / 0.4)
    assert "combine_fp8 400.0 us (1.50x the BF16 combine" in err, err
