"""``benchmarks/gpu_session.sh sanitizer`` on the CPU: a fake ``compute-sanitizer`` on the
PATH prints the tool's summary line (no kernel runs), so the run list, the error counting,
the summary table and the exit status are checked here; the GPU machine runs the real one.
``benchmarks/sanitizer_runs.py``'s runs are checked to be valid ``epgen run`` command
lines. The real tool on the GPU: tests/gpu/test_sanitizer_session_gpu.py."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import sanitizer_runs  # noqa: E402

FAKE = """#!/bin/sh
# --tool TOOL --print-limit N python3 -m epgen run ARGS...
if [ "$1" = --version ]; then echo "Fake compute-sanitizer"; exit 0; fi
tool=$2
shift 4
echo "$tool $*" >>"$FAKE_LOG"
case "$tool $*" in
    $FAKE_FAIL) echo "========= Program hit CUDA_ERROR_INVALID_VALUE"
                echo "========= ERROR SUMMARY: 2 errors"; exit 0 ;;
esac
echo "========= ERROR SUMMARY: 0 errors"
"""


def _session(tmp_path, fail_pattern: str, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    out = tmp_path / "out"
    log = tmp_path / "calls.log"
    run_env = {**os.environ, "OUT": str(out), "FAKE_LOG": str(log), "FAKE_FAIL": fail_pattern,
               "PATH": f"{bin_dir}:{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
               **env}
    proc = subprocess.run(["bash", "benchmarks/gpu_session.sh", "sanitizer"], cwd=REPO,
                          env=run_env, capture_output=True, text=True, timeout=300)
    with tarfile.open(out / "sanitizer.tar.gz") as tar:
        table = tar.extractfile("./sanitizer-summary.txt").read().decode()
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, table, calls


def _rows(table: str) -> list[list[str]]:
    return [line.split(None, 4) for line in table.splitlines()[1:]]


def test_every_run_under_every_tool_and_a_clean_pass(tmp_path):
    proc, table, calls = _session(tmp_path, "nothing-matches")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [n for n, _ in sanitizer_runs.runs()]
    rows = _rows(table)
    want = [("memcheck", n) for n in names] + [
        (t, n) for t in ("racecheck", "initcheck", "synccheck") for n in names
        if n in sanitizer_runs.SLOW]
    assert [(r[0], r[1]) for r in rows] == want
    assert all(r[2] == "0" and r[4] == "ok" for r in rows), table
    assert len(calls) == len(want)
    assert all(" --calls 1 " in c and "--preset small" in c for c in calls)


def test_errors_are_counted_and_fail_the_session(tmp_path):
    proc, table, _ = _session(tmp_path, "racecheck*--fused*")
    assert proc.returncode == 1
    bad = [r for r in _rows(table) if r[4] != "ok"]
    assert [(r[0], r[1], r[2], r[4]) for r in bad] == [("racecheck", "fused", "2",
                                                          "2 errors")]
    assert "racecheck  fused" in proc.stdout


def test_budget_and_run_filter(tmp_path):
    proc, table, calls = _session(tmp_path, "nothing-matches", SANITIZER_RUNS="small nvfp4",
                                  SANITIZER_BUDGET_S="100", SANITIZER_LIMIT="60")
    assert {r[1] for r in _rows(table)} == {"small", "nvfp4"}
    assert proc.returncode == 0 and len(calls) == 8
    # less than 10 s of the budget left: the run is left out, and the session fails
    proc, table, calls = _session(tmp_path, "nothing-matches", SANITIZER_RUNS="small",
                                  SANITIZER_BUDGET_S="5")
    assert proc.returncode == 1 and _rows(table)
    assert all("time budget" in r[4] for r in _rows(table))
    proc, table, _ = _session(tmp_path, "nothing-matches", SANITIZER_RUNS="fused",
                              SANITIZER_TOOLS="synccheck initcheck")
    assert proc.returncode == 0
    assert [(r[0], r[1]) for r in _rows(table)] == [("synccheck", "fused"),
                                                    ("initcheck", "fused")]


def test_the_runs_are_valid_command_lines():
    """Each run parses as ``epgen run`` and its configuration builds; every variant of
    ``epgen variants`` on the small preset that one GPU runs is among them."""
    from epgen import cli
    from epgen.commands.common import config_from_args
    from epgen.ep_goldens import FLAG_VARIANTS

    runs = dict(sanitizer_runs.runs())
    assert set(FLAG_VARIANTS) <= set(runs)
    assert {"small", "fp8", "nvfp4", "mxfp8", "fused", "fused_se", "batched", "graph"} <= \
        set(runs)
    assert set(sanitizer_runs.SLOW) <= set(runs)
    for name, args in runs.items():
        parsed = cli.build_parser().parse_args(["run", *args])
        cfg, _ = config_from_args(parsed)
        assert parsed.calls == 1 and cfg.timeout_ns == 60 * 10**9, name
        assert parsed.combine, f"{name}: the combine kernels build for every variant here"


def test_no_compute_sanitizer_fails_the_session(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out),
           "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", "benchmarks/gpu_session.sh", "sanitizer"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    if "no compute-sanitizer" not in proc.stdout:
        pytest.skip("a compute-sanitizer is installed under /usr/local/cuda*")
    assert proc.returncode == 1
    with tarfile.open(out / "sanitizer.tar.gz") as tar:
        assert "no compute-sanitizer" in tar.extractfile("./sanitizer-summary.txt").read().decode()
