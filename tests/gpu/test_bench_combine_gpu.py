"""``epgen bench --op combine|moe`` on the GPU, small and quick: the checks before and after
the timing pass, the figures and the JSON are there, the PyTorch baseline runs and passes its
check where torch with CUDA is installed (else it is skipped with the reason)."""

from __future__ import annotations

import json

import pytest

from epgen import cli

pytestmark = pytest.mark.gpu

QUICK = ["--preset", "small", "--tokens", "32", "--iters", "5", "--warmup", "2",
         "--copy-mib", "64", "--copy-iters", "3"]


@pytest.mark.parametrize("op, variants", [
    ("combine", ["--variant", "default", "--variant", "fused"]),
    ("moe", ["--variant", "default", "--variant", "g=graph"]),
])
def test_bench_op_on_the_gpu(op, variants, tmp_path, capsys):
    js = tmp_path / f"{op}.json"
    status = cli.main(["bench", *QUICK, "--op", op, *variants, "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    data = json.loads(js.read_text())
    assert data["op"] == op and data["failures"] == []
    key = "combine" if op == "combine" else "moe"
    for v in data["shapes"][0]["variants"]:
        assert v["check"] == "ok" and v["post_check"] == "ok", v
        m = v[key]
        assert m["median_ms"] > 0 and m["gbps"] > 0 and m["bytes"] == v["bytes"]["total"]
        if "copy" in data:
            assert 0 < m["fraction_of_copy"] < 10
    b = data["shapes"][0]["baseline"]
    assert b.get("check") == "ok" or "skipped" in b, b


def test_bench_api_torch_reports_host_time_and_graph_ratio(tmp_path, capsys):
    pytest.importorskip("torch")
    js = tmp_path / "torch.json"
    status = cli.main(["bench", *QUICK, "--op", "combine", "--api", "torch", "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    recs = json.loads(js.read_text())["torch_api"]
    assert [(r["tokens_per_rank"], r["kernels"]) for r in recs] == [(32, "staged"), (32, "fused")]
    for r in recs:
        assert 0 < r["host_us_dispatch_per_rank"] < 1000 and 0 < r["host_us_combine_per_rank"] < 1000
        assert 0 < r["host_us_dispatch_one_rank_handle"] < 1000
        assert 0 < r["host_us_combine_one_rank_handle"] < 1000
        assert r["round_trip_us_graph"] > 0
        assert r["stream_over_graph"] == pytest.approx(
            r["round_trip_us_stream"] / r["round_trip_us_graph"])
    assert "staged kernels" in out and "fused kernels" in out


def test_bench_api_deepep_reports_both_apis_on_the_same_kernels(tmp_path, capsys):
    pytest.importorskip("torch")
    js = tmp_path / "deepep.json"
    status = cli.main(["bench", *QUICK, "--api", "deepep", "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    recs = json.loads(js.read_text())["deepep_api"]
    assert [(r["tokens_per_rank"], r["format"]) for r in recs] == [(32, "BF16"), (32, "FP8")]
    for r in recs:
        for key in ("host_us_dispatch_deepep", "host_us_dispatch_epgen",
                    "host_us_combine_deepep", "host_us_combine_epgen"):
            assert 0 < r[key] < 1000, (key, r)
        assert r["round_trip_us_deepep"] > 0 and r["round_trip_us_epgen"] > 0
        assert r["device_ratio"] == pytest.approx(r["round_trip_us_deepep"]
                                                  / r["round_trip_us_epgen"])
        assert r["graph_round_trip_us_deepep"] > 0 and r["graph_round_trip_us_epgen"] > 0
        assert r["graph_device_ratio"] == pytest.approx(r["graph_round_trip_us_deepep"]
                                                        / r["graph_round_trip_us_epgen"])
    assert "deepep api, 32 tokens/rank" in out


def test_bench_combine_partial_on_the_gpu(tmp_path, capsys):
    """``--combine-partial``: the dedup variant's partial-reduce combine checked and timed
    after its plain one, its link bytes below the plain combine's; the default variant's
    plain combine runs and its partial one says why not."""
    js = tmp_path / "partial.json"
    status = cli.main(["bench", *QUICK, "--op", "combine", "--combine-partial", "--variant",
                       "default", "--variant", "dedup=ep_rank_dedup", "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    data = json.loads(js.read_text())
    assert data["failures"] == [] and data["plan"]["combine_partial"] is True
    plain, dedup = data["shapes"][0]["variants"]
    assert plain["check"] == plain["post_check"] == "ok" and plain["combine"]["median_ms"] > 0
    assert "ep_rank_dedup" in plain["combine_partial"]["skipped"]
    assert dedup["check"] == dedup["post_check"] == dedup["post_check_partial"] == "ok"
    m = dedup["combine_partial"]
    assert m["median_ms"] > 0 and m["bytes"] == dedup["bytes"]["combine_partial"]["total"]
    assert m["link_bytes"] < dedup["combine"]["link_bytes"]
    assert dedup["partial_speedup_vs_plain"] == pytest.approx(
        dedup["combine"]["median_ms"] / m["median_ms"])
    assert "combine (partial)" in out
