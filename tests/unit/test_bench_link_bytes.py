"""``epgen bench`` reports link bytes (the bytes crossing between ranks) apart from total
bytes: for every variant of every shape, from the input sets the run timed (uniform and
Zipf routing), in the JSON and in the printed lines, with their rate over the timed figure;
the device phases faked on the host (``test_bench.fake_gpu``)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from epgen.bench import driver, inputs, report
from epgen.bench import link_bytes as lb

from test_bench import SMALL_RUN, bench_args, fake_gpu, quiet  # noqa: F401 (fixture)


def _mean_link(cfg, T, plan, key):
    """The mean of ``key`` over the run's input sets, drawn again here as the run draws
    them."""
    sets = inputs.make_input_sets(cfg, T, plan.sets, plan.routing, plan.zipf_s, plan.seed)
    return float(np.mean([getattr(lb.link_bytes(cfg, ids), key) for _t, ids in sets]))


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_every_variant_reports_its_link_bytes(fake_gpu, routing, tmp_path):  # noqa: F811
    plan = bench_args(*SMALL_RUN, "--routing", routing)
    res = driver.run(plan, quiet())
    assert res["failures"] == []
    for s in res["shapes"]:
        T = s["tokens_per_rank"]
        for v, variant in zip(s["variants"], plan.variants):
            cfg = plan.config(T, variant, s["recv_block_capacity"])
            want = _mean_link(cfg, T, plan, "dispatch_link")
            assert v["link_bytes"]["link"] == pytest.approx(want) and want > 0
            assert v["link_bytes"]["dispatch_link"] == v["link_bytes"]["link"]
            assert v["link_bytes"]["options"] == {"dedup": False, "fp8": False,
                                                  "partial_reduce": False}
            assert len(v["link_bytes"]["per_set_link"]) == plan.sets
            rt = v["round_trip"]
            assert rt["link_bytes"] == v["link_bytes"]["link"]
            assert rt["link_gbps"] == pytest.approx(want / rt["median_ms"] / 1e6)
            assert rt["link_bytes"] < v["bytes"]["total"]
    path = tmp_path / "r.json"
    report.write_json(res, str(path))
    back = json.loads(path.read_text())
    assert back["shapes"][0]["variants"][0]["link_bytes"]["link"] == \
        res["shapes"][0]["variants"][0]["link_bytes"]["link"]
    assert "link_bytes" in back["method"]


def test_the_printed_lines_show_total_and_link_bytes(fake_gpu):  # noqa: F811
    res = driver.run(bench_args(*SMALL_RUN), quiet())
    text = io.StringIO()
    report.print_report(res, file=text)
    lines = [ln for ln in text.getvalue().splitlines() if ln.startswith("  default:")]
    v = res["shapes"][0]["variants"][0]
    assert f"{v['bytes']['total'] / 1e9:.2f} GB per round trip" in lines[0]
    assert f", {v['link_bytes']['link'] / 1e9:.2f} GB across ranks " \
           f"({v['round_trip']['link_gbps']:.1f} GB/s)" in lines[0]


def test_op_link_bytes_by_op(rng):
    cfg = bench_args("--preset", "small", "--tokens", "16").config(16)
    sets = inputs.make_input_sets(cfg, 16, 2, seed=int(rng.integers(1 << 30)))
    per = [lb.link_bytes(cfg, ids) for _t, ids in sets]
    d = np.mean([p.dispatch_link for p in per])
    c = np.mean([p.combine_link for p in per])
    assert lb.op_link_bytes(cfg, sets, "dispatch")["link"] == pytest.approx(d)
    assert lb.op_link_bytes(cfg, sets, "combine")["link"] == pytest.approx(c)
    assert lb.op_link_bytes(cfg, sets, "moe")["link"] == pytest.approx(d + c)
    assert lb.op_link_bytes(cfg, sets, "combine", fp8=True)["link"] < c
    with pytest.raises(ValueError, match="op_link_bytes: op must be one of dispatch, combine, "
                                         "moe, got 'both'"):
        lb.op_link_bytes(cfg, sets, "both")


@pytest.mark.parametrize("op", ["combine", "moe"])
def test_combine_and_moe_report_their_link_bytes(fake_gpu, monkeypatch, op):  # noqa: F811
    from epgen.bench import combine, combine_baseline, timing
    key = combine.PRIMARY[op]
    monkeypatch.setattr(combine, "measure_world", lambda *a, **k: {
        "check": "ok", "post_check": "ok", key: timing.summarize([2.0, 2.0, 2.0])})
    monkeypatch.setattr(combine_baseline, "measure", lambda *a, **k: {
        "check": [], "round_trip": timing.summarize([4.0, 4.0, 4.0])})
    plan = bench_args("--preset", "small", "--tokens", "16", "--no-gate", "--op", op)
    res = driver.run(plan, quiet())
    s = res["shapes"][0]
    v = s["variants"][0]
    cfg = plan.config(16, plan.variants[0], s["recv_block_capacity"])
    want = _mean_link(cfg, 16, plan, "combine_link")
    if op == "moe":
        want += _mean_link(cfg, 16, plan, "dispatch_link")
    assert v["link_bytes"]["link"] == pytest.approx(want) and want > 0
    assert v[key]["link_gbps"] == pytest.approx(want / 2.0 / 1e6)
    text = io.StringIO()
    report.print_report(res, file=text)
    assert f"{want / 1e9:.2f} GB across ranks" in text.getvalue()
