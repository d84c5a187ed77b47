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
