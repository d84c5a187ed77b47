"""``TorchBootstrap`` over a ``torch.distributed`` process group (epgen/runtime/bootstrap.py,
``from_group``): three real gloo processes, a sub-group of two of them (global ranks 1 and
2, so the group's rank 0 is global rank 1): the broadcast from the group's rank 0, barriers,
a barrier with a member missing failing within its bound on either side, a non-member
refused; and, with ``torch.distributed`` replaced by a recorder, which calls a barrier makes
on a gloo and on a non-gloo group. Skipped without torch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from epgen.runtime import bootstrap

pytest.importorskip("torch.distributed")

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: argv: global rank, world size, port, a scratch directory, the mode. Every process joins
#: the default gloo group and makes the sub-group of global ranks 1 and 2. "ok": all three
#: broadcast and meet at a bounded barrier over the default group; then the members broadcast
#: and meet at barriers of the sub-group, and the group's rank 0 (global 1) waits at a
#: barrier its peer never joins; ranks 1 and 2 also meet at a barrier of the default group
#: without rank 0 (ranks=). "root-missing": global 2 waits at a barrier global 1 never joins. The
#: processes leave together (a file each writes when done) so that nobody's exit closes a
#: connection another one is still timing.
WORKER = r"""
import datetime, os, sys, time
import torch.distributed as dist
from epgen.runtime import bootstrap
rank, n, port, tmp, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=n, timeout=datetime.timedelta(seconds=20))
sub = dist.new_group([1, 2])


def wait_for(name):
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(tmp, name)):
        if time.monotonic() > deadline:
            print(f"never came: {name}", flush=True)
            os._exit(3)
        time.sleep(0.02)


def done(name):
    open(os.path.join(tmp, name), "w").close()


def timed_barrier(b, name):
    t = time.monotonic()
    try:
        b.barrier(name, timeout_s=1.0)
        print(f"passed {name}", flush=True)
    except bootstrap.BootstrapTimeoutError as e:
        print(f"timeout {name} {time.monotonic() - t:.2f} missing={list(e.missing)} {e}",
              flush=True)


if mode == "ok":                             # the default group: every process
    whole = bootstrap.TorchBootstrap(rank, n, timeout_s=10)
    got = whole.broadcast_bytes(b"all" if rank == 0 else None)
    whole.barrier("everyone", timeout_s=10)
    print(f"default group: {got.decode()}", flush=True)
    if rank:                                 # ranks 1 and 2 meet without rank 0 (masked)
        whole.barrier("some", timeout_s=10, ranks=[1, 2])
        print("ranks 1, 2 met", flush=True)
if rank == 0:
    try:
        bootstrap.from_group(sub)
        print("member", flush=True)
    except ValueError as e:
        print(f"refused: {e}", flush=True)
else:
    b = bootstrap.from_group(sub, timeout_s=10)
    print(f"group rank {b.rank} of {b.world_size}, src {b.src}, kind {b.kind}", flush=True)
    if mode == "ok":
        uid = b.broadcast_bytes(bytes(range(128)) if b.rank == 0 else None, "nvshmem-s0")
        print(f"uid {uid == bytes(range(128))}", flush=True)
        order = []
        for gen in range(3):
            if b.rank == gen % 2:
                time.sleep(0.2)              # a late member: nobody passes without it
            b.barrier("call", timeout_s=10)
            order.append(time.monotonic())
        b.barrier("plain")                   # no timeout: dist.barrier
        print("times " + " ".join(f"{t:.3f}" for t in order), flush=True)
        if b.rank == 0:
            timed_barrier(b, "alone")
    elif b.rank == 1:
        timed_barrier(b, "alone")
done(f"done-{rank}")
for k in range(n):
    wait_for(f"done-{k}")
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(tmp_path, mode: str, n: int = 3) -> list[str]:
    """The ``n`` processes of ``WORKER`` in ``mode``: each one's stdout (they must exit 0
    within 60 s)."""
    port = free_port()
    procs = [subprocess.Popen([PY, "-c", WORKER, str(k), str(n), str(port), str(tmp_path),
                               mode], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": REPO})
             for k in range(n)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for k, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {k}:\n{out}\n{err[-3000:]}"
    return [out for out, _ in outs]


def timeout_line(out: str, name: str) -> tuple[float, list[int], str]:
    line = next(x for x in out.splitlines() if x.startswith(("timeout " + name,
                                                             "passed " + name)))
    assert line.startswith("timeout"), line
    _, _, took, missing, text = line.split(" ", 4)
    return float(took), json.loads(missing.split("=", 1)[1]), text


def test_sub_group_broadcast_barriers_and_a_missing_member(tmp_path):
    t0 = time.monotonic()
    out0, out1, out2 = run_group(tmp_path, "ok")
    assert "refused: " in out0 and "not a member of the group" in out0
    assert all("default group: all" in o for o in (out0, out1, out2))
    # ranks=[1, 2] on the default group: the two meet (global 1 coordinating), rank 0 away
    assert "ranks 1, 2 met" in out1 and "ranks 1, 2 met" in out2
    assert "ranks 1, 2 met" not in out0
    # the group's ranks, and its rank 0 is global rank 1
    assert "group rank 0 of 2, src 1, kind torch" in out1
    assert "group rank 1 of 2, src 1, kind torch" in out2
    assert "uid True" in out1 and "uid True" in out2
    times = [list(map(float, next(x for x in o.splitlines() if x.startswith("times "))
                      .split()[1:])) for o in (out1, out2)]
    # generation g releases nobody before its late member arrived (0.2 s after the other)
    for g in range(1, 3):
        assert min(t[g] for t in times) >= max(t[g - 1] for t in times) + 0.15
    # the group's rank 0 alone at a barrier: it fails within its 1 s bound, naming rank 1
    took, missing, text = timeout_line(out1, "alone")
    assert 0.9 <= took < 5, took
    assert missing == [1]
    assert "rank 0: host barrier 'alone' timed out after 1 s; rank(s) 1 of 2 never" in text
    assert time.monotonic() - t0 < 30


def test_member_waiting_for_the_groups_rank_0(tmp_path):
    """The group's rank 1 at a barrier its rank 0 never joins: it fails within its bound."""
    out0, out1, out2 = run_group(tmp_path, "root-missing")
    took, missing, text = timeout_line(out2, "alone")
    assert 0.9 <= took < 5, took
    assert missing == []
    assert "rank 1: host barrier 'alone' timed out after 1 s: rank 0 of the group" in text



class RecordingDist:
    """What ``TorchBootstrap`` calls of ``torch.distributed``, recorded: this process is
    rank ``rank`` of a 2-rank group of backend ``backend`` whose rank 0 is global rank 5."""

    def __init__(self, backend: str, rank: int = 1):
        self.backend, self.rank, self.calls = backend, rank, []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return 2

    def get_global_rank(self, group, rank):
        return 5 + rank

    def get_backend(self, group=None):
        return self.backend

    def barrier(self, group=None):
        self.calls.append(("barrier", group))

    def monitored_barrier(self, *a, **k):
        raise AssertionError("monitored_barrier: its non-zero ranks ignore the timeout")

    def _work(self, what, peer, group, tag):
        calls = self.calls

        class Work:
            def wait(self, timeout=None):
                calls.append((what, peer, group, tag, 0 < timeout.total_seconds() <= 2.5))
        return Work()

    def isend(self, tensor, dst=None, group=None, tag=0):
        return self._work("isend", dst, group, tag)

    def irecv(self, tensor, src=None, group=None, tag=0):
        return self._work("irecv", src, group, tag)

    def broadcast_object_list(self, box, src=None, group=None):
        self.calls.append(("broadcast", src, group))
        box[0] = b"from-5"


def fake_dist(monkeypatch, fake):
    import torch.distributed

    for name in ("is_available", "is_initialized", "get_rank", "get_world_size",
                 "get_global_rank", "get_backend", "barrier", "monitored_barrier", "isend",
                 "irecv", "broadcast_object_list"):
        monkeypatch.setattr(torch.distributed, name, getattr(fake, name))


@pytest.mark.parametrize("group", ["G", None])
def test_non_gloo_group_takes_a_plain_barrier(monkeypatch, group):
    """A bounded barrier on a gloo group (or default group) is a token to the group's rank 0
    and its release back, each wait bounded; on a non-gloo group (NCCL has no bounded
    point-to-point wait on the host) a plain ``dist.barrier`` of that group; without a bound
    a plain barrier everywhere."""
    root = 5 if group is not None else 0
    tag = bootstrap.BARRIER_TAG
    for backend, want in (("nccl", [("barrier", group)]),
                          ("gloo", [("isend", root, group, tag, True),
                                    ("irecv", root, group, tag, True)])):
        fake = RecordingDist(backend)
        fake_dist(monkeypatch, fake)
        b = (bootstrap.from_group(group, timeout_s=30) if group is not None
             else bootstrap.TorchBootstrap(1, 2, timeout_s=30))
        assert (b.rank, b.world_size) == (1, 2)
        b.barrier("x", timeout_s=2.5)
        b.barrier("y")                                  # no bound: plain, on every backend
        assert b.broadcast_bytes(None) == b"from-5"
        assert fake.calls == want + [("barrier", group), ("broadcast", root, group)], backend


def test_group_arguments_refused(monkeypatch):
    import torch.distributed

    with pytest.raises(ValueError, match="from_group: group is None"):
        bootstrap.from_group(None)
    fake_dist(monkeypatch, RecordingDist("gloo"))
    with pytest.raises(ValueError, match="group= has rank 1 of 2, asked for 0 of 2"):
        bootstrap.TorchBootstrap(0, 2, group="G")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="group= needs an initialised torch.distributed"):
        bootstrap.from_group("G")
