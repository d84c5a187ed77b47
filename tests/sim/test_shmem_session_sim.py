"""Several ``ShmemWorld``\\ s on one ``ShmemSession`` (epgen/runtime/shmem_session.py) on the
CPU: the real world class on a ``backends.sim.Machine``, NVSHMEM and the bootstrap faked
(tests/support/shmem_session_fakes.py: one symmetric heap per PE, shared by every world of
it). Two PEs live in one process here, so each round trip is driven step by step (every PE
enqueues, then the machine runs them); on the GPU each PE is its own process
(tests/gpu/test_shmem_session_gpu.py).

Checked: a BF16 and a BlockwiseFP8 world alive at once on each PE's session, calls
interleaved, each against the reference; one NVSHMEM init and one finalize per PE; each
world's symmetric allocations its own and freed by its own close, collectively after its
barrier; barrier names distinct per world; the session closing the worlds still open; the
rules a world on a session is held to; a lost peer; the private session of a world made
without ``session=``."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import presets, reference, routing
from epgen.runtime import bootstrap as bootstrap_mod
from epgen.runtime import shmem_world as sw
from epgen.runtime.shmem_session import ShmemSession
from shmem_session_fakes import FakeBootstrap, HeapMachine, SharedHeap


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EPGEN_LAUNCH_DIR",
              "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)


def small(fmt="BF16", **changes):
    """A grid small enough to simulate quickly; ``p2p_world_size == n_ranks``: every peer
    through ``nvshmem_ptr`` stores."""
    table = {**presets.preset_data("small"), "format": fmt, "num_threads": 64, "n_sms": 4,
             "n_experts": 4, "max_tokens_per_rank": 4, **changes}
    return presets.config_from_dict(table)


def sessions(machine, heap, n=2, fail=()):
    """One session per PE (as each PE's process would make)."""
    return [ShmemSession(bootstrap=FakeBootstrap(pe, n, heap.log, fail), host=heap.view(pe),
                         backend=machine) for pe in range(n)]


def worlds_on(cfg, ss):
    """Every PE's world of ``cfg`` on its session, the pointer tables built again once every
    PE's buffers exist (each PE's process would have them all at its ready barrier)."""
    ws = [sw.ShmemWorld(cfg, session=s) for s in ss]
    for w in ws:
        w.build_pointer_tables()
    return ws


def round_trip(machine, ws, rng):
    """One dispatch of every PE of ``ws``: each PE's result compared with the reference."""
    cfg = ws[0].cfg
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    for w in ws:
        w.load_inputs(toks[w.rank], ids[w.rank])
    for w in ws:
        w.enqueue_round_trip()
    machine.drain()
    want = reference.dispatch(cfg, toks, ids)
    for w in ws:
        got = w.results()[0]
        assert reference.compare(cfg, want[w.rank], got) == [], \
            f"{cfg.token_fmt.name} rank {w.rank}"


def barriers(heap, pe):
    return [e[2] for e in heap.log if e[0] == "barrier" and e[1] == pe]


def test_two_formats_on_one_session_interleaved(seed):
    machine = HeapMachine(seed)
    heap = SharedHeap()
    ss = sessions(machine, heap)
    bf16 = worlds_on(small("BF16"), ss)
    fp8 = worlds_on(small("BlockwiseFP8"), ss)
    for pe in range(2):
        assert heap.count("init", pe) == 1 and heap.count("finalize", pe) == 0
        assert ss[pe].worlds == (bf16[pe], fp8[pe])
        assert bf16[pe].host is fp8[pe].host is ss[pe].host
        assert bf16[pe].pool is not fp8[pe].pool
        # one heap per PE: the BF16 world's allocations, then the FP8 world's
        heap_ptrs = [a.ptr for a in heap.heaps[pe]]
        assert heap_ptrs == [a.ptr for a in bf16[pe].pool.allocs + fp8[pe].pool.allocs]
    assert bf16[0].index != fp8[0].index
    assert barriers(heap, 0) == [f"w{bf16[0].index}-ready", f"w{fp8[0].index}-ready"]
    rng = np.random.default_rng(seed)
    for _ in range(2):
        round_trip(machine, bf16, rng)
        round_trip(machine, fp8, rng)
    # the BF16 world closes first: its close barrier, then its own frees; NVSHMEM stays up
    n_bf16 = len(bf16[0].pool.allocs)
    del heap.log[:]
    for w in bf16:
        w.close()
    for pe in range(2):
        assert heap.log.count(("barrier", pe, f"w{bf16[pe].index}-close")) == 1
        assert heap.count("free", pe) == n_bf16 and heap.count("finalize", pe) == 0
        assert ss[pe].worlds == (fp8[pe],) and not ss[pe].closed
    first_free = next(i for i, e in enumerate(heap.log) if e[:2] == ("free", 0))
    assert heap.log.index(("barrier", 0, f"w{bf16[0].index}-close")) < first_free
    # the FP8 world still runs with the BF16 world's memory freed
    round_trip(machine, fp8, rng)
    n_fp8 = len(fp8[0].pool.allocs)
    del heap.log[:]
    for s in ss:
        s.close()                              # closes the FP8 world, then finalises
    for pe in range(2):
        mine = [e for e in heap.log if e[1] == pe]
        assert mine[0] == ("barrier", pe, f"w{fp8[pe].index}-close")
        assert [e[0] for e in mine[1:]] == ["free"] * n_fp8 + ["barrier", "finalize"]
        assert mine[-2] == ("barrier", pe, f"{ss[pe].name}-close")
        assert fp8[pe]._closed and ss[pe].worlds == () and heap.heaps[pe] == []
    for w in bf16 + fp8:                       # closing again: nothing
        w.close()
    assert heap.count("finalize") == 2


def test_session_close_closes_every_world_last_first():
    machine = HeapMachine(0)
    heap = SharedHeap()
    (s,) = sessions(machine, heap, n=1)
    cfg = small(n_ranks=1, p2p_world_size=1, n_sms=5)
    a, b = sw.ShmemWorld(cfg, session=s), sw.ShmemWorld(cfg, session=s)
    assert not a.owns_session and a.session is s
    del heap.log[:]
    with s:
        pass
    assert barriers(heap, 0) == [f"w{b.index}-close", f"w{a.index}-close", f"{s.name}-close"]
    assert heap.log[-1] == ("finalize", 0) and heap.count("finalize") == 1
    assert a._closed and b._closed and a.finalized
    with pytest.raises(RuntimeError, match="session= is closed"):
        sw.ShmemWorld(cfg, session=s)


def test_a_world_on_a_session_is_held_to_its_rules():
    machine = HeapMachine(0, n_gpus=2)
    heap = SharedHeap()
    s0, s1 = sessions(machine, heap)
    cfg = small()
    for kw, message in [
        (dict(rank=0), "rank=0, but session= is rank 1"),
        (dict(device=1), "device=1, but session= runs on GPU 0"),
        (dict(bootstrap=s1.bootstrap), "bootstrap= with session="),
        (dict(host=s1.host), "host= with session="),
        (dict(backend="cuda"), "backend='cuda', but session= runs on"),
    ]:
        with pytest.raises(ValueError, match=message):
            sw.ShmemWorld(cfg, session=s1, **kw)
    with pytest.raises(ValueError, match="cfg.n_ranks=4, but session= has n_ranks=2 PEs"):
        sw.ShmemWorld(small(n_ranks=4, p2p_world_size=4), session=s1)
    with pytest.raises(ValueError, match="session= must be a ShmemSession"):
        sw.ShmemWorld(cfg, session=object())
    assert heap.count("malloc") == 0 and s1.worlds == ()     # nothing built
    # the session's own values may be repeated
    w = sw.ShmemWorld(cfg, 1, session=s1, device=0, backend=machine)
    assert (w.rank, w.device_id) == (1, 0)
    w.close()
    s0.close()
    s1.close()


def test_a_peer_lost_at_one_world_close():
    """The first world's close barrier fails (the peer is gone): it raises, frees nothing and
    marks the session lost; the second world then closes without a barrier or a free, and
    the session does not finalise (each would wait for the dead peer), warning instead."""
    machine = HeapMachine(0)
    heap = SharedHeap()
    (s,) = sessions(machine, heap, n=1)
    cfg = small(n_ranks=1, p2p_world_size=1, n_sms=5)
    a, b = sw.ShmemWorld(cfg, session=s), sw.ShmemWorld(cfg, session=s)
    s.bootstrap.fail = {f"w{a.index}-close"}
    del heap.log[:]
    with pytest.raises(bootstrap_mod.BootstrapTimeoutError):
        a.close()
    assert s.lost and s.worlds == (b,) and heap.count("free") == 0
    with pytest.warns(RuntimeWarning, match="lost earlier; symmetric buffers not freed$"):
        b.close()
    with pytest.warns(RuntimeWarning, match="NVSHMEM not finalised"):
        s.close()
    assert barriers(heap, 0) == [f"w{a.index}-close"]
    assert heap.count("free") == 0 and heap.count("finalize") == 0 and not s.finalized


def test_a_world_without_session_makes_and_finalises_its_own():
    machine = HeapMachine(0)
    heap = SharedHeap()
    cfg = small(n_ranks=1, p2p_world_size=1, n_sms=5)
    w = sw.ShmemWorld(cfg, 0, bootstrap=FakeBootstrap(0, 1, heap.log), host=heap.view(0),
                      backend=machine)
    s = w.session
    assert w.owns_session and s.worlds == (w,) and s.name == f"w{w.index}"
    assert heap.log[:2] == [("uid", 0), ("broadcast", 0, f"nvshmem-w{w.index}")]
    n = len(w.pool.allocs)
    del heap.log[:]
    w.close()
    # its close barrier, its frees, the finalize: no second barrier
    assert heap.log[0] == ("barrier", 0, f"w{w.index}-close")
    assert [e[0] for e in heap.log] == ["barrier"] + ["free"] * n + ["finalize"]
    assert s.closed and s.worlds == ()


def test_gpu_session_program_on_the_simulator(seed):
    """The flow of tests/gpu/test_shmem_session_gpu.py's PE program on two simulated PEs: a
    BF16 and a BlockwiseFP8 world on each PE's session, dispatch + combine rounds
    (``test_shmem_gpu.combine_rounds``) interleaved between them, every call matching; the
    combine buffers, allocated on each world's first combine, come from that world's own pool
    on the one heap of its PE. The GPU test's configurations are valid."""
    import test_shmem_gpu as gpu
    import test_shmem_session_gpu as gpu_session
    from test_shmem_world import collectively

    for n, p2p in [(2, 1), (4, 2), (8, 2)]:
        for fmt in gpu_session.FORMATS:
            cfg = gpu_session.session_config(fmt, n, p2p)
            assert cfg.use_shmem and cfg.needs_shmem and cfg.token_fmt.name == fmt
    machine = HeapMachine(seed)
    heap = SharedHeap()
    ss = sessions(machine, heap)
    worlds = {fmt: worlds_on(small(fmt), ss) for fmt in gpu_session.FORMATS}
    before = {fmt: len(ws[0].pool.allocs) for fmt, ws in worlds.items()}
    said = []
    for call in range(2):
        for fmt, ws in worlds.items():
            ok, errors = collectively(machine, ws, [
                (lambda w=w: gpu.combine_rounds(w, 1, seed * 1000 + call, said.append))
                for w in ws])
            assert errors == [None, None] and ok == [True, True], (fmt, errors, said)
    assert len(said) == 2 * 2 * 2
    for fmt, ws in worlds.items():
        for w in ws:
            b = w._combiner.bufs[0]
            mine = [a.ptr for a in w.pool.allocs[before[fmt]:]]
            assert b.recv.ptr in mine and b.arrival.ptr in mine, fmt
    # one heap per PE holding every world's allocations, made in the same order on both PEs
    # (BF16's dispatch buffers, FP8's, then each one's combine buffers at its first combine)
    for pe in range(2):
        pools = [a.ptr for ws in worlds.values() for a in ws[pe].pool.allocs]
        assert sorted(a.ptr for a in heap.heaps[pe]) == sorted(pools)
    assert [a.nbytes for a in heap.heaps[0]] == [a.nbytes for a in heap.heaps[1]]
    for s in ss:
        s.close()
    assert heap.count("finalize") == 2 and all(heap.heaps[pe] == [] for pe in range(2))


def test_exported_lazily():
    import epgen

    assert epgen.ShmemSession is ShmemSession and "ShmemSession" in epgen.__all__
