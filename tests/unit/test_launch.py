"""``epgen launch`` (epgen/launch.py) with real subprocesses of ``python -c``: the rank
environment, the prefixed output, exit statuses, stopping the others at the first failure,
the overall timeout, and the CLI's usage errors."""

from __future__ import annotations

import io
import os
import sys
import time

import pytest

from epgen import cli, launch as launch_mod

PY = sys.executable


def run(code: str, n: int, **kw):
    out, err = io.StringIO(), io.StringIO()
    status = launch_mod.launch([PY, "-c", code], n, stdout=out, stderr=err, **kw)
    return status, out.getvalue(), err.getvalue()


def lines_of(text: str, k: int) -> list[str]:
    prefix = f"[rank {k}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_rank_environment_and_prefixes():
    code = ("import os, sys; e = os.environ; "
            "print(e['RANK'], e['WORLD_SIZE'], e['LOCAL_RANK'], e['LOCAL_WORLD_SIZE'], "
            "e['MASTER_ADDR'], e['MASTER_PORT'], e['EPGEN_LAUNCH_DIR'], "
            "os.path.isdir(e['EPGEN_LAUNCH_DIR']), "
            "e.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '-')); "
            "print('to stderr', e['RANK'], file=sys.stderr)")
    status, out, err = run(code, 3)
    assert status == 0
    seen = {}
    for k in range(3):
        (line,) = lines_of(out, k)
        rank, ws, lr, lws, addr, port, d, isdir, mps = line.split()
        assert (rank, ws, lr, lws, addr, isdir, mps) == (str(k), "3", str(k), "3", "127.0.0.1",
                                                          "True", "-")
        seen[k] = (port, d)
        assert lines_of(err, k) == [f"to stderr {k}"]
    assert len(set(seen.values())) == 1          # one port and one directory for all
    port, d = seen[0]
    assert 0 < int(port) < 65536
    assert not os.path.exists(d)                  # removed at the end
    assert len(out.splitlines()) == 3 and len(err.splitlines()) == 3


def test_mps_share():
    status, out, _ = run("import os; print(os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'])",
                         3, mps_share=True)
    assert status == 0
    assert [lines_of(out, k) for k in range(3)] == [["33"]] * 3


def test_lines_forwarded_whole_and_in_order():
    code = ("import sys\nfor i in range(200):\n    print('line', i, 'x' * 100)\n"
            "sys.stdout.write('no newline at the end')")
    status, out, _ = run(code, 2)
    assert status == 0
    for k in range(2):
        got = lines_of(out, k)
        assert got[:200] == [f"line {i} {'x' * 100}" for i in range(200)]
        assert got[200:] == ["no newline at the end"]


def test_first_nonzero_status_returned():
    status, _, _ = run("import os, sys; sys.exit(0 if os.environ['RANK'] != '1' else 7)", 3)
    assert status == 7
    status, _, _ = run("pass", 2)
    assert status == 0


def test_signal_death_counts_as_128_plus_signal():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    status, _, _ = run(code, 1)
    assert status == 128 + 9


def test_failure_stops_the_others_within_the_grace():
    # rank 0 fails at once; rank 1 ignores SIGTERM and sleeps: SIGKILL after the grace
    code = ("import os, signal, sys, time\n"
            "if os.environ['RANK'] == '0':\n    time.sleep(0.2); sys.exit(5)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    status, out, _ = run(code, 2, grace_s=1.0)
    assert status == 5
    assert time.monotonic() - t0 < 15
    # and one that exits on SIGTERM is gone without waiting for the grace
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n    time.sleep(0.2); sys.exit(2)\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    status, _, _ = run(code, 3, grace_s=30.0)
    assert status == 2 and time.monotonic() - t0 < 15


def test_keep_going_lets_the_others_finish():
    """``keep_going``: rank 1 dies at once (SIGKILL), rank 0 finishes its work afterwards
    (a survivor of a rank mask); the status is still the failure's."""
    code = ("import os, signal, time\n"
            "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(0.5); print('finished', flush=True)\n")
    status, out, _ = run(code, 2, keep_going=True)
    assert status == 128 + 9
    assert lines_of(out, 0) == ["finished"]


def test_timeout_kills_all_and_returns_124():
    t0 = time.monotonic()
    status, _, err = run("import time; time.sleep(60)", 2, timeout_s=1.0)
    assert status == launch_mod.TIMEOUT_STATUS == 124
    assert time.monotonic() - t0 < 15
    assert "timed out after 1 s" in err


def test_rank_env_pure():
    env = launch_mod.rank_env(2, 4, 1234, "/tmp/d", mps_share=True, base={"X": "1"})
    assert env == {"X": "1", "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2",
                   "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
                   "EPGEN_LAUNCH_DIR": "/tmp/d", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}


def test_cli(capfd):
    assert cli.main(["launch", "-n", "2", "--", PY, "-c", "print('ok')"]) == 0
    out = capfd.readouterr().out
    assert sorted(out.splitlines()) == ["[rank 0] ok", "[rank 1] ok"]
    assert cli.main(["launch", "-n", "1", PY, "-c", "import sys; sys.exit(3)"]) == 3
    assert cli.main(["launch", "-n", "1", "--timeout", "0.5", "--", PY, "-c",
                     "import time; time.sleep(30)"]) == 124


@pytest.mark.parametrize("argv", [["launch", "-n", "2"], ["launch", "-n", "2", "--"],
                                  ["launch", "-n", "0", "--", "true"],
                                  ["launch", "--", "true"]])
def test_cli_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2


def test_launcher_terminated_stops_the_ranks(tmp_path):
    """SIGTERM to the launcher (e.g. from ``timeout``) stops the ranks, which run in sessions
    of their own and would otherwise be orphaned."""
    import signal
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import os, time; open(os.path.join(%r, os.environ['RANK']), 'w')"
            ".write(str(os.getpid())); time.sleep(60)" % str(tmp_path))
    p = subprocess.Popen([PY, "-m", "epgen", "launch", "-n", "2", "--", PY, "-c", code],
                         cwd=repo, env={**os.environ, "PYTHONPATH": repo})
    deadline = time.monotonic() + 30
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    pids = [int((tmp_path / str(k)).read_text()) for k in range(2)]
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"rank process {pid} still alive")
