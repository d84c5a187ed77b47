"""``ShmemSession`` (epgen/runtime/shmem_session.py) by itself: one NVSHMEM initialisation
per session with a fake host and bootstrap (tests/support/shmem_session_fakes.py) on a
``backends.sim.Machine`` (used only for its GPU count): the rank rules, the refusals before
anything is initialised, the world rules, close (worlds last first, barrier, one finalize),
a lost peer, the context manager; and ``NvshmemHost`` refusing a second live initialisation
in one process. The worlds themselves on a session: tests/sim/test_shmem_session_sim.py."""

from __future__ import annotations

import types
import warnings

import pytest

from backends import sim as sim_backend
from backends.cuda import nvshmem_host as nh
from epgen.runtime import bootstrap as bootstrap_mod
from epgen.runtime.shmem_session import ShmemSession
from shmem_session_fakes import FakeBootstrap, SharedHeap


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EPGEN_LAUNCH_DIR",
              "MASTER_ADDR", "EPGEN_BARRIER_TIMEOUT_S"):
        monkeypatch.delenv(k, raising=False)


def session(rank=0, n=2, heap=None, fail=(), **kw):
    heap = heap or SharedHeap()
    kw.setdefault("backend", sim_backend.Machine(0, n_gpus=2))
    s = ShmemSession(bootstrap=FakeBootstrap(rank, n, heap.log, fail), host=heap.view(rank),
                     **kw)
    return s, heap


class FakeWorld:
    """What ``ShmemSession.close`` uses of a world: ``close(_raise)``, which releases it."""

    def __init__(self, s, name, log, error=None):
        self.session, self.name, self.log, self.error = s, name, log, error
        s.register(self)

    def close(self, _raise=True):
        self.log.append(("close", self.name, _raise))
        self.session.release(self)
        if self.error is not None and _raise:
            raise self.error


def test_one_init_and_one_finalize():
    s, heap = session(rank=1, n=2, name="mine")
    assert (s.rank, s.n_ranks, s.device_id, s.sharers) == (1, 2, 0, 1)
    # rank 1 takes no id; the broadcast is named after the session
    assert heap.log == [("broadcast", 1, "nvshmem-mine"), ("init", 1, 1, 2)]
    assert not s.closed and not s.finalized and s.worlds == ()
    s.barrier("step")
    assert heap.log[-1] == ("barrier", 1, "mine-step")
    del heap.log[-1]
    with s:
        pass
    assert heap.log[2:] == [("barrier", 1, "mine-close"), ("finalize", 1)]
    assert s.closed and s.finalized
    s.close()
    assert heap.count("finalize") == 1                   # idempotent
    s0, heap0 = session(rank=0, n=2)
    assert heap0.log[:2] == [("uid", 0), ("broadcast", 0, f"nvshmem-{s0.name}")]
    assert s0.name.startswith("s") and s0.name != session()[0].name  # a name per session
    s0.close()


def test_rank_rules_refused_before_anything(monkeypatch):
    heap = SharedHeap()
    machine = sim_backend.Machine(0)
    cases = [
        (dict(rank=1, bootstrap=FakeBootstrap(0, 2, heap.log)),
         "rank=1, but the bootstrap is rank 0: they must agree"),
        (dict(n_ranks=4, bootstrap=FakeBootstrap(0, 2, heap.log)),
         "n_ranks=4, but the bootstrap has world_size=2: they must agree"),
        (dict(rank=2, n_ranks=2), r"rank 2 is not in \[0, n_ranks=2\)"),
        (dict(n_ranks=2), "no rank .RANK unset. of n_ranks=2"),
        (dict(n_ranks=0), "n_ranks must be >= 1"),
        (dict(rank=True), "rank must be an integer"),
        (dict(device=-1), r"device = -1 is not a GPU ordinal"),
        (dict(device=3), r"device 3 is not a GPU of this machine \(ordinals 0..0\)"),
        (dict(backend="sim"), "backend must be 'cuda' or a backends.sim.Machine"),
    ]
    for kw, message in cases:
        kw.setdefault("backend", machine)
        with pytest.raises(ValueError, match=message):
            ShmemSession(host=heap.view(0), **kw)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 processes, but n_ranks=2"):
        ShmemSession(0, 2, host=heap.view(0), backend=machine)
    assert heap.log == []                    # nothing broadcast, nothing initialised


def test_rank_from_the_environment(monkeypatch, tmp_path):
    heap = SharedHeap()
    machine = sim_backend.Machine(0, n_gpus=2)
    s = ShmemSession(host=heap.view(0), backend=machine)      # nothing set: PE 0 of 1
    assert (s.rank, s.n_ranks, s.bootstrap.kind) == (0, 1, "solo")
    s.close()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("EPGEN_LAUNCH_DIR", str(tmp_path))
    (tmp_path / "uid-nvshmem-env").write_bytes(b"u" * 128)
    s = ShmemSession(host=heap.view(1), backend=machine, name="env")
    # GPU LOCAL_RANK % 2, shared with the node's other PE of odd LOCAL_RANK
    assert (s.rank, s.n_ranks, s.device_id, s.sharers, s.bootstrap.kind) == (1, 2, 1, 2, "files")
    # a bootstrap's own rank and size win over the environment's (a sub-group)
    s2, _ = session(rank=0, n=3, backend=machine)
    assert (s2.rank, s2.n_ranks) == (0, 3)


def test_world_rules():
    s, heap = session(rank=1, n=2)
    cfg = types.SimpleNamespace(n_ranks=2)
    s.check_world(cfg)
    s.check_world(cfg, rank=1, device=0, backend=s.backend)
    cases = [
        (dict(rank=0), "rank=0, but session= is rank 1: a world on a session is the "
                       "session's rank"),
        (dict(device=1), "device=1, but session= runs on GPU 0"),
        (dict(bootstrap=FakeBootstrap(1, 2, [])), "bootstrap= with session=: a world on a "
                                                  "session uses the session's bootstrap"),
        (dict(host=heap.view(1)), "host= with session="),
        (dict(backend="cuda"), "backend='cuda', but session= runs on"),
        (dict(backend=sim_backend.Machine(0)), "but session= runs on"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            s.check_world(cfg, **kw)
    with pytest.raises(ValueError, match="cfg.n_ranks=4, but session= has n_ranks=2 PEs: a "
                                         "world on a session spans every PE of it"):
        s.check_world(types.SimpleNamespace(n_ranks=4))
    s.close()
    with pytest.raises(RuntimeError, match="session= is closed"):
        s.check_world(cfg)
    with pytest.raises(RuntimeError, match="is closed"):
        FakeWorld(s, "late", [])


def test_close_closes_the_worlds_last_first_then_finalizes():
    s, heap = session(rank=0, n=2)
    a, b, c = (FakeWorld(s, name, heap.log) for name in "abc")
    assert s.worlds == (a, b, c)
    b.close()                                            # a world may close on its own
    assert s.worlds == (a, c)
    del heap.log[:]
    s.close()
    assert heap.log == [("close", "c", True), ("close", "a", True),
                        ("barrier", 0, f"{s.name}-close"), ("finalize", 0)]
    assert s.worlds == ()


def test_close_in_a_with_block_that_raises():
    s, heap = session(rank=0, n=2)
    FakeWorld(s, "a", heap.log)
    with pytest.raises(KeyError):
        with s:
            raise KeyError("user error")
    # the worlds are closed without raising (another error propagates), then finalised
    assert heap.log[-3:] == [("close", "a", False), ("barrier", 0, f"{s.name}-close"),
                             ("finalize", 0)]


def test_a_world_close_error_is_raised_after_the_rest():
    s, heap = session(rank=0, n=2)
    FakeWorld(s, "a", heap.log)
    FakeWorld(s, "b", heap.log, error=OSError("b failed"))
    with pytest.raises(OSError, match="b failed"):
        s.close()
    assert [e[1] for e in heap.log if e[0] == "close"] == ["b", "a"]
    assert heap.count("finalize") == 1


def test_lost_peer_skips_the_barrier_and_finalize():
    s, heap = session(rank=0, n=2)
    FakeWorld(s, "a", heap.log)
    s.mark_lost()
    with pytest.warns(RuntimeWarning, match="a peer was lost earlier; NVSHMEM not finalised"):
        s.close()
    assert heap.log[-1] == ("close", "a", True)          # no barrier, no finalize
    assert s.closed and not s.finalized


def test_close_barrier_timeout():
    s, heap = session(rank=0, n=2, name="t", fail={"t-close"})
    with pytest.raises(bootstrap_mod.BootstrapTimeoutError, match="'t-close'"):
        s.close()
    assert heap.count("finalize") == 0 and s.lost and s.closed
    s, heap = session(rank=0, n=2, name="u", fail={"u-close"})
    with pytest.raises(KeyError), pytest.warns(RuntimeWarning, match="NVSHMEM not finalised"):
        with s:
            raise KeyError("user error")
    assert heap.count("finalize") == 0


def test_default_barrier_timeout(monkeypatch):
    s, _ = session()
    assert s.barrier_timeout_s == bootstrap_mod.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("EPGEN_BARRIER_TIMEOUT_S", "7.5")
    assert session()[0].barrier_timeout_s == 7.5
    assert session(barrier_timeout_s=3)[0].barrier_timeout_s == 3.0


class FakeLibrary:
    """The functions ``NvshmemHost.init_uid`` and ``finalize`` call, recorded; NVSHMEM
    reports PE ``pe`` of ``n``."""

    def __init__(self, pe, n, calls):
        self.pe, self.n, self.calls = pe, n, calls

    def nvshmemx_vendor_get_version_info(self, *out):
        pass

    def nvshmemx_set_attr_uniqueid_args(self, rank, nranks, uid, attr):
        return 0

    def nvshmemx_hostlib_init_attr(self, flags, attr):
        self.calls.append("init")
        return 0

    def nvshmem_my_pe(self):
        return self.pe

    def nvshmem_n_pes(self):
        return self.n

    def nvshmemx_hostlib_finalize(self):
        self.calls.append("finalize")


def test_nvshmem_initialises_once_per_process():
    """A second ``NvshmemHost`` of the same library cannot initialise while the first is
    up (refused before the library is called); after the first finalises it can."""
    try:
        first, second = nh.NvshmemHost(), nh.NvshmemHost()
    except nh.NvshmemUnavailableError as e:
        pytest.skip(f"no NVSHMEM host library: {e}")
    calls = []
    first.lib = FakeLibrary(0, 1, calls)
    second.lib = FakeLibrary(0, 1, calls)
    first.init_uid(b"u" * 128, 0, 1)
    try:
        with pytest.raises(nh.NvshmemError, match="already initialised in this process by "
                                                  "another NvshmemHost: it initialises once"):
            second.init_uid(b"u" * 128, 0, 1)
        assert calls == ["init"] and not second.initialized
    finally:
        first.finalize()
    second.init_uid(b"u" * 128, 0, 1)
    second.finalize()
    assert calls == ["init", "finalize", "init", "finalize"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first.finalize()                                 # not initialised: nothing
    assert calls[-1] == "finalize" and len(calls) == 4
