"""``epgen bench`` of every op on the worlds beyond one process's emulated ranks, small and
quick: ``--world shmem`` (one process per PE under ``epgen launch``, every PE on the GPUs this
machine has; best under MPS, see benchmarks/shmem_session.sh) with ``--compare-p2p 1,N``:
every PE's line of each world, the checks before and after the timing, rank 0's JSON with
the comparison; and ``--world p2p --op combine|moe`` on two GPUs (skipped with fewer): the
checks, the rates over the links, no NCCL baseline.

``EPGEN_SHMEM_PES`` (default ``2,4``) lists the PE counts, ``EPGEN_SHMEM_TIMEOUT`` (default
300) bounds each launch in seconds, as for tests/gpu/test_shmem_gpu.py; the SHMEM tests skip
without the NVSHMEM wheel (``nvshmem_wheel``, tests/conftest.py).

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_bench_worlds_gpu.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PES = [int(x) for x in os.environ.get("EPGEN_SHMEM_PES", "2,4").split(",") if x]
TIMEOUT = float(os.environ.get("EPGEN_SHMEM_TIMEOUT", "300"))
LABELS = {"dispatch": "round trip", "combine": "combine", "moe": "dispatch + combine"}
#: blocks per PE when 8 PEs share one GPU (as tests/gpu/test_shmem_gpu.py's N_SMS_8_PES)
N_SMS_8_PES = 6


def shmem_bench_args(n: int, op: str, sizes: str | None) -> list[str]:
    """The ``epgen bench --world shmem`` arguments of the SHMEM tests (tests/unit/
    test_bench_shmem.py checks that they parse): the small preset on ``n`` PEs, ``op``,
    ``--compare-p2p sizes`` (None: every peer by puts alone)."""
    sms = ["--set", f"n_sms={N_SMS_8_PES}"] if n >= 8 else []
    which = ["--compare-p2p", sizes] if sizes else ["--set", "p2p_world_size=1"]
    return ["--world", "shmem", "--preset", "small", "--set", "use_shmem=true", "--set",
            f"n_ranks={n}", *sms, "--op", op, *which, "--tokens", "32", "--iters", "5",
            "--warmup", "2"]


def launch_bench(n: int, args: list[str], timeout: float = TIMEOUT):
    """``epgen launch -n n -- python -m epgen bench ARGS``: the completed process."""
    env = {**os.environ, "PYTHONPATH": REPO, "NVSHMEM_REMOTE_TRANSPORT": "none",
           "NVSHMEM_DISABLE_NVLS": "1"}
    mps = ["--mps-share"] if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else []
    cmd = [sys.executable, "-m", "epgen", "launch", "-n", str(n), "--timeout", str(timeout),
           "--grace", "10", *mps, "--", sys.executable, "-m", "epgen", "bench", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout + 60)


@pytest.mark.parametrize("op", ["dispatch", "combine", "moe"])
@pytest.mark.parametrize("n", PES)
def test_shmem_bench_compares_puts_with_direct_stores(n, op, nvshmem_wheel, tmp_path):
    js = tmp_path / "shmem.json"
    proc = launch_bench(n, shmem_bench_args(n, op, f"1,{n}") + ["--json", str(js)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    for r in range(n):
        for p in (1, n):
            line = (rf"^\[rank {r}\] rank {r}: 32 tokens/rank, {n} PEs \(p2p_world_size={p}\)"
                    rf": {re.escape(LABELS[op])} median [0-9.]+ us, min [0-9.]+ us over 5 "
                    rf"calls, [0-9.]+ GB/s sent$")
            assert len(re.findall(line, proc.stdout, re.M)) == 1, (r, p, text[-6000:])
    data = json.loads(js.read_text())
    assert data["world"] == "shmem" and data["op"] == op and data["n_pes"] == n
    assert data["failures"] == []
    assert [r["p2p_world_size"] for r in data["runs"]] == [1, n]
    for run in data["runs"]:
        assert run["summary"]["n"] == 5 and run["summary"]["median_ms"] > 0
        assert [pe["rank"] for pe in run["per_pe"]] == list(range(n))
        for pe in run["per_pe"]:
            assert pe["check"] == "ok" and pe["post_check"] == "ok", pe
            assert pe["sent_bytes"] > 0 and pe["median_ms"] <= run["summary"]["median_ms"]
    (c,) = data["comparisons"]
    assert (c["p2p_world_size"], c["reference_p2p_world_size"]) == (1, n)
    assert c["of_reference"] == pytest.approx(c["reference_median_us"] / c["median_us"])
    assert 0 < c["of_reference"] < 100 and len(c["per_pe_of_reference"]) == n
    assert re.search(rf"^\[rank 0\] T=32 {re.escape(LABELS[op])}: p2p_world_size=1 "
                     rf"\(SHMEM puts\) .*x of direct stores", proc.stdout, re.M), text[-6000:]


def test_shmem_bench_of_one_world(nvshmem_wheel, tmp_path):
    """Without ``--compare-p2p``: the configuration's world alone, no comparison."""
    js = tmp_path / "one.json"
    proc = launch_bench(2, shmem_bench_args(2, "moe", None) + ["--json", str(js)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads(js.read_text())
    assert [r["p2p_world_size"] for r in data["runs"]] == [1] and data["comparisons"] == []
    assert all(pe["post_check"] == "ok" for pe in data["runs"][0]["per_pe"])


@pytest.mark.parametrize("n", PES)
def test_shmem_bench_copy_rate(n, nvshmem_wheel, tmp_path):
    """``--copy-rate``: every mode's copy checked on every PE, a figure for each, the stores
    1.0x of themselves, rank 0's line."""
    js = tmp_path / "copy.json"
    proc = launch_bench(n, shmem_bench_args(n, "dispatch", f"1,{n}")
                        + ["--copy-rate", "--json", str(js)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    data = json.loads(js.read_text())
    assert data["failures"] == []
    (entry,) = data["copy_rate"]
    assert (entry["tokens_per_rank"], entry["p2p_world_size"]) == (32, 1)
    assert entry["n_msgs"] >= 1
    assert list(entry["modes"]) == ["stores", "puts", "put_signals"]
    for mode, fig in entry["modes"].items():
        assert fig["check"] == "ok" and fig["median_us"] > 0, (mode, fig)
        assert len(fig["pe_median_us"]) == n
    assert entry["modes"]["stores"]["of_stores"] == pytest.approx(1.0)
    assert re.search(r"^\[rank 0\] T=32 copy rate \(\d+ messages of \d+ B per PE, .*"
                     r"put_signals [0-9.]+ us", proc.stdout, re.M), text[-6000:]


@pytest.mark.multigpu(2)
@pytest.mark.parametrize("op", ["combine", "moe"])
def test_p2p_bench_op(op, tmp_path, capsys):
    from epgen import cli
    from epgen.bench import p2p

    js = tmp_path / f"p2p-{op}.json"
    status = cli.main(["bench", "--world", "p2p", "--preset", "small", "--tokens", "32",
                       "--op", op, "--variant", "default", "--variant", "fused", "--iters",
                       "5", "--warmup", "2", "--copy-mib", "64", "--copy-iters", "3",
                       "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    data = json.loads(js.read_text())
    assert data["op"] == op and data["failures"] == [] and data["devices"] == [0, 1]
    key = "combine" if op == "combine" else "moe"
    (shape,) = data["shapes"]
    assert shape["baseline"]["skipped"] == p2p.NO_COMBINE_BASELINE
    for v in shape["variants"]:
        assert v["check"] == "ok" and v["post_check"] == "ok", v
        m = v[key]
        assert m["n"] == 5 and m["median_ms"] > 0 and m["busiest_gpu_gbps"] > 0
        assert 0 < m["fraction_of_link"] < 10
    assert f"epgen default {p2p.OP_LABELS[op]}" in out
