"""``all_gather_bytes`` of the bootstraps (epgen/runtime/bootstrap.py): the file bootstrap's
gather across threads, each rank's bytes in rank order on every rank and again in a second
generation, the bounded wait naming the ranks missing, the atomic write; one process alone;
and the torch bootstrap's call of ``all_gather_object`` over its group (``torch.distributed``
replaced by a recorder)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from epgen.runtime import bootstrap

from atomic_writes import record_replaces


def test_file_gather_every_rank_in_order_twice(tmp_path):
    n = 3
    boots = [bootstrap.FileBootstrap(tmp_path, r, n, timeout_s=30) for r in range(n)]
    got, errors = [None] * n, []

    def rank(r):
        try:
            out = []
            for gen in range(2):
                if r == (gen + 1) % n:
                    time.sleep(0.2)              # a late rank: nobody may read without it
                out.append(boots[r].all_gather_bytes(f"{gen}:{r}".encode() * (r + 1), "x"))
            got[r] = out
        except Exception as e:                   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    want = [[f"{gen}:{r}".encode() * (r + 1) for r in range(n)] for gen in range(2)]
    assert got == [want] * n
    names = set(os.listdir(tmp_path))
    assert {f"gather-x-{g}-{r}" for g in range(2) for r in range(n)} <= names
    assert not [x for x in names if x.startswith(".")]         # no temporary left


def test_file_gather_names_the_missing_ranks(tmp_path):
    b = bootstrap.FileBootstrap(tmp_path, 1, 4, timeout_s=0.3)
    (tmp_path / "gather-t-0-2").write_bytes(b"here")           # rank 2 sent, 0 and 3 did not
    t0 = time.monotonic()
    with pytest.raises(bootstrap.BootstrapTimeoutError) as e:
        b.all_gather_bytes(b"mine", "t")
    assert 0.3 <= time.monotonic() - t0 < 5
    assert e.value.missing == (0, 3)
    assert "rank(s) 0, 3 of 4 never sent theirs" in str(e.value)
    assert (tmp_path / "gather-t-0-1").read_bytes() == b"mine"


def test_file_gather_written_atomically(tmp_path, monkeypatch):
    b = bootstrap.FileBootstrap(tmp_path, 0, 1)
    seen = record_replaces(monkeypatch)
    assert b.all_gather_bytes(b"\x02" * 5, "a") == [b"\x02" * 5]
    (name, existed), = seen
    assert name.startswith(".gather-a-0-0.") and not existed


def test_solo_gather():
    assert bootstrap.SoloBootstrap().all_gather_bytes(bytearray(b"ab")) == [b"ab"]


def test_torch_gather_is_all_gather_object_over_the_group(monkeypatch):
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist

    calls = []
    for name, fn in (("is_available", lambda: True), ("is_initialized", lambda: True),
                     ("get_rank", lambda group=None: 1),
                     ("get_world_size", lambda group=None: 2),
                     ("get_global_rank", lambda group, r: 5 + r),
                     ("get_backend", lambda group=None: "gloo")):
        monkeypatch.setattr(dist, name, fn)

    def all_gather_object(out, obj, group=None):
        calls.append((obj, group))
        out[:] = [b"from-5", obj]
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    b = bootstrap.from_group("G", timeout_s=5)
    assert b.all_gather_bytes(b"mine", "bench") == [b"from-5", b"mine"]
    assert calls == [(b"mine", "G")]
