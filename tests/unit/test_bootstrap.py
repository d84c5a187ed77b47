"""The file-based bootstrap (epgen/runtime/bootstrap.py) with several real processes: the
unique-id broadcast, barriers of several generations, the bounded waits naming what they
waited for; and the choice of bootstrap from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from epgen.runtime import bootstrap

from atomic_writes import record_replaces

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import os, sys, time
from epgen.runtime import bootstrap
rank, n = int(sys.argv[1]), int(sys.argv[2])
b = bootstrap.FileBootstrap(sys.argv[3], rank, n, timeout_s=float(sys.argv[4]))
if rank == 0:
    time.sleep(0.3)             # the others start waiting before the id exists
uid = b.broadcast_bytes(bytes(range(128)) if rank == 0 else None)
assert uid == bytes(range(128)), uid
order = []
for gen in range(5):
    if rank == gen % n:
        time.sleep(0.1)         # a late rank: nobody may pass without it
    t = time.monotonic()
    b.barrier("call")
    order.append(round(time.monotonic(), 3))
b.barrier("close")
print("done", rank, " ".join(map(str, order)), flush=True)
"""


def spawn(args, env=None):
    return subprocess.Popen([PY, "-c", WORKER, *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO, **(env or {})})


def test_broadcast_and_barriers_across_processes(tmp_path):
    n = 3
    procs = [spawn([k, n, tmp_path, 30]) for k in range(n)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    times = [list(map(float, out.split()[2:])) for out, _ in outs]
    # generation g's barrier releases nobody before the late rank arrived: every rank's
    # pass of generation g comes after every rank's pass of generation g-1
    for g in range(1, 5):
        assert min(t[g] for t in times) >= max(t[g - 1] for t in times) - 0.05
    names = sorted(os.listdir(tmp_path))
    assert "uid-nvshmem" in names
    assert {f"barrier-call-{g}-{k}" for g in range(5) for k in range(n)} <= set(names)
    assert not [x for x in names if x.startswith(".")]       # no temporary left


def test_barrier_names_the_missing_ranks(tmp_path):
    b = bootstrap.FileBootstrap(tmp_path, 1, 4, timeout_s=0.3)
    (tmp_path / "barrier-x-0-2").touch()           # rank 2 arrived, 0 and 3 did not
    t0 = time.monotonic()
    with pytest.raises(bootstrap.BootstrapTimeoutError) as e:
        b.barrier("x")
    assert 0.3 <= time.monotonic() - t0 < 5
    assert e.value.missing == (0, 3)
    assert "rank(s) 0, 3 of 4 never arrived" in str(e.value)
    assert "'x'" in str(e.value) and "generation 0" in str(e.value)
    assert isinstance(e.value, TimeoutError)


def test_a_barrier_over_some_ranks_waits_for_them_alone(tmp_path):
    """``ranks=``: the ranks a rank mask left alive meet without the others (rank 3 never
    comes); a member that does not come is named; the ranks must include this one."""
    b = bootstrap.FileBootstrap(tmp_path, 1, 4, timeout_s=0.3)
    for k in (0, 2):
        (tmp_path / f"barrier-call-0-{k}").touch()
    t0 = time.monotonic()
    b.barrier("call", ranks=[0, 1, 2])
    assert time.monotonic() - t0 < 0.25
    with pytest.raises(bootstrap.BootstrapTimeoutError) as e:
        b.barrier("call", ranks=[1, 2])            # generation 1: rank 2 not there
    assert e.value.missing == (2,)
    for bad in ([0, 2], [1, 4]):
        with pytest.raises(ValueError, match=r"ranks=.*including this one \(1\)"):
            b.barrier("other", ranks=bad)
    bootstrap.SoloBootstrap().barrier("x", ranks=[0])


def test_uid_wait_names_the_file(tmp_path):
    b = bootstrap.FileBootstrap(tmp_path, 2, 3, timeout_s=0.2)
    with pytest.raises(bootstrap.BootstrapTimeoutError) as e:
        b.broadcast_bytes(None)
    assert str(tmp_path / "uid-nvshmem") in str(e.value)
    assert e.value.missing == (0,)


def test_uid_written_atomically(tmp_path, monkeypatch):
    b = bootstrap.FileBootstrap(tmp_path, 0, 2)
    seen = record_replaces(monkeypatch)
    b.broadcast_bytes(b"\x01" * 128)
    (name, existed), = seen
    assert name.startswith(".uid-nvshmem.") and not existed
    assert (tmp_path / "uid-nvshmem").read_bytes() == b"\x01" * 128


def test_dead_peer_process(tmp_path):
    """Rank 1 never starts: rank 0's barrier fails within its bound, naming rank 1."""
    p = subprocess.run([PY, "-c", "import sys; from epgen.runtime import bootstrap; "
                        "b = bootstrap.FileBootstrap(sys.argv[1], 0, 2, timeout_s=0.5); "
                        "b.broadcast_bytes(b'x' * 128); b.barrier('start')", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode != 0
    assert "BootstrapTimeoutError" in p.stderr and "rank(s) 1 of 2 never arrived" in p.stderr


def test_from_env(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "EPGEN_LAUNCH_DIR", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="epgen launch"):
        bootstrap.from_env()
    assert bootstrap.from_env(0, 1).kind == "solo"
    with pytest.raises(RuntimeError, match="epgen launch -n 2"):
        bootstrap.from_env(0, 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("EPGEN_LAUNCH_DIR", str(tmp_path))
    b = bootstrap.from_env()
    assert (b.kind, b.rank, b.world_size) == ("files", 1, 2)
    assert bootstrap.local_rank() == 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert bootstrap.local_rank() == 0
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert not bootstrap.torchrun_env()        # the launcher's directory wins
    monkeypatch.delenv("EPGEN_LAUNCH_DIR")
    assert bootstrap.torchrun_env()
    with pytest.raises(ValueError, match="not in"):
        bootstrap.FileBootstrap(tmp_path, 2, 2)
    with pytest.raises(FileNotFoundError, match="epgen launch"):
        bootstrap.FileBootstrap(tmp_path / "nope", 0, 2)


def test_under_the_launcher(tmp_path):
    """The launcher's environment is what the bootstrap reads: 3 ranks exchange an id."""
    code = ("from epgen.runtime import bootstrap; b = bootstrap.from_env(timeout_s=30); "
            "u = b.broadcast_bytes(b'uid!' * 32 if b.rank == 0 else None); b.barrier(); "
            "print(b.kind, b.rank, b.world_size, u == b'uid!' * 32)")
    p = subprocess.run([PY, "-m", "epgen", "launch", "-n", "3", "--timeout", "60", "--",
                        PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=90,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == [f"[rank {k}] files {k} 3 True" for k in range(3)]
