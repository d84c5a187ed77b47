"""``ShmemWorld`` (epgen/runtime/shmem_world.py) on the CPU: the real world class on a
``backends.sim.Machine`` with a fake NVSHMEM host (symmetric "heap" = the sim's memory, a
``nvshmem_ptr`` that maps a buffer to the same buffer of the peer PE's world) and a fake
bootstrap. Two PEs' worlds live in one process here, so their round trip is driven step by
step (each enqueues, then the machine runs both); on the GPU each PE is its own process
(tests/gpu/test_shmem_gpu.py). Also the pure rules: rank, world size, GPU, transport."""

from __future__ import annotations

import gc
import re
import warnings

import numpy as np
import pytest

from backends import sim as sim_backend
from backends.cuda.errors import CudaUnavailableError
from backends.sim.machine import Pool
from epgen import presets, reference, routing
from epgen.errors import EPTimeoutError
from epgen.runtime import bootstrap as bootstrap_mod
from epgen.runtime import shmem_world as sw
from epgen.runtime.p2p_world import PeerAccessError

SYMMETRIC = ("send_buf", "recv_buf", "recv_count", "out_tokens", "hdr_buf", "prod_buf")
LOCAL = ("tokens", "topk_ids", "counters", "row_offsets", "expert_ids", "src_info")


def small(**changes):
    cfg = presets.config_from_dict(presets.preset_data("small"))
    return cfg.replace(**changes) if changes else cfg


class FakePool(Pool):
    """A PE's symmetric heap: ``allocs``, what ``SymmetricMachine`` allocated from it, in
    order (the same order on every PE, as ``nvshmem_malloc`` requires)."""

    def __init__(self, log):
        super().__init__(0, ())
        self.log = log
        self.allocs = []

    def free_all(self):
        self.log.append("free_all")


class FakeHost:
    """NVSHMEM stand-in shared by the PEs of one test: ``worlds[pe]`` is PE pe's world."""

    def __init__(self, log, null_peers=()):
        self.log, self.worlds, self.null_peers = log, {}, set(null_peers)
        self.pools = {}

    def view(self, pe):
        return _HostView(self, pe)


class _HostView:
    def __init__(self, shared, pe):
        self.shared, self.pe = shared, pe

    def get_uniqueid(self):
        return b"u" * 128

    initialized = False

    def init_uid(self, uid, rank, nranks, device=None):
        self.shared.log.append(("init", rank, nranks, device))
        self.initialized = True

    def symmetric_resource(self):
        pool = FakePool(self.shared.log)
        self.shared.pools[self.pe] = pool
        return pool

    def ptr(self, p, pe):
        if pe in self.shared.null_peers:
            return 0
        me = self.shared.worlds.get(self.pe)
        peer = self.shared.worlds.get(pe)
        if me is None or peer is None:     # the peer's world not built yet: a placeholder
            return 0x1000 + pe
        for attr in SYMMETRIC:
            if getattr(me.ranks[0], attr).ptr == p:
                return getattr(peer.ranks[0], attr).ptr
        # later symmetric allocations (the combine's): the same allocation of the peer's heap
        mine, theirs = self.shared.pools[self.pe].allocs, self.shared.pools[pe].allocs
        for i, a in enumerate(mine):
            if a.ptr <= p < a.ptr + a.nbytes and i < len(theirs):
                return theirs[i].ptr + (p - a.ptr)
        raise AssertionError(f"nvshmem_ptr of a non-symmetric address {p:#x}")

    def finalize(self):
        self.shared.log.append(("finalize", self.pe))
        self.initialized = False

    def cumodule_init(self, m):
        raise AssertionError("no NVSHMEM device code in these kernels")


class FakeBootstrap:
    def __init__(self, rank, n, log, fail=()):
        self.rank, self.world_size, self.log, self.fail = rank, n, log, set(fail)

    def broadcast_bytes(self, data, name="nvshmem"):
        return b"u" * 128

    def barrier(self, name="sync", timeout_s=None, ranks=None):
        self.log.append(("barrier", self.rank, name.split("-", 1)[1]))
        if ranks is not None:
            self.log.append(("barrier ranks", self.rank, name.split("-", 1)[1], tuple(ranks)))
        if name.split("-", 1)[1] in self.fail:
            raise bootstrap_mod.BootstrapTimeoutError(f"barrier {name}: rank(s) 1 missing",
                                                      name, (1,))


def make_worlds(cfg, machine, log, null_peers=(), **kw):
    host = FakeHost(log, null_peers)
    worlds = []
    for r in range(cfg.n_ranks):
        w = sw.ShmemWorld(cfg, r, bootstrap=FakeBootstrap(r, cfg.n_ranks, log),
                          host=host.view(r), backend=machine, **kw)
        host.worlds[r] = w
        worlds.append(w)
    for w in worlds:           # tables again, now that every PE's buffers exist
        w.build_pointer_tables()
    return worlds


def round_trip(worlds, machine, toks, ids):
    for w in worlds:           # every input in place before any launch (as the barriers do)
        w.load_inputs(toks[w.rank], ids[w.rank])
    for w in worlds:
        w.enqueue_round_trip()
    machine.drain()
    return [w.results()[0] for w in worlds]


@pytest.mark.parametrize("flags", [{}, {"ep_final_layout": True}])
def test_two_pes_match_the_reference(flags):
    cfg = small(**flags)
    machine = sim_backend.Machine(0)
    log = []
    worlds = make_worlds(cfg, machine, log)
    assert [e for e in log if e[0] == "init"] == [("init", 0, 2, None), ("init", 1, 2, None)]
    assert [e for e in log if e[0] == "barrier"] == [("barrier", 0, "ready"),
                                                     ("barrier", 1, "ready")]
    rng = np.random.default_rng(3)
    for call in range(2):
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        got = round_trip(worlds, machine, toks, ids)
        want = reference.dispatch(cfg, toks, ids)
        for r in range(2):
            assert got[r].rank == r
            assert reference.compare(cfg, want[r], got[r]) == []
    # the tables: own address first-hand, the peer's through nvshmem_ptr
    for w in worlds:
        table = w.recv_buf_ptrs[w.rank].to_host()
        assert list(np.asarray(table)) == [worlds[q].ranks[0].recv_buf.ptr for q in (0, 1)]
    for w in worlds:
        w.close()


def test_symmetric_buffers_are_the_peer_written_ones(monkeypatch):
    cfg = small()
    machine = sim_backend.Machine(0)
    placed = []
    real = machine.zeros

    def zeros(shape, dtype, device=None, stream=None, memory_resource=None):
        a = real(shape, dtype, device=device, stream=stream, memory_resource=memory_resource)
        placed.append((a.ptr, isinstance(memory_resource, FakePool)))
        return a
    monkeypatch.setattr(machine, "zeros", zeros)
    real_td = machine.to_device

    def to_device(host, device=None, stream=None, memory_resource=None):
        a = real_td(host, device=device, stream=stream, memory_resource=memory_resource)
        placed.append((a.ptr, isinstance(memory_resource, FakePool)))
        return a
    monkeypatch.setattr(machine, "to_device", to_device)
    log = []
    (w0, w1) = make_worlds(cfg, machine, log)
    sym = dict(placed)
    rk = w0.ranks[0]
    for attr in SYMMETRIC:
        assert sym[getattr(rk, attr).ptr], attr
    for attr in LOCAL:
        assert not sym[getattr(rk, attr).ptr], attr
    w0.close()
    w1.close()


def test_close_barrier_free_finalize_once_and_warns_when_dropped():
    cfg = small(n_ranks=1, p2p_world_size=1, n_experts=8)
    machine = sim_backend.Machine(0)
    log = []
    (w,) = make_worlds(cfg, machine, log)
    del log[:]
    with w:
        pass
    assert log == [("barrier", 0, "close"), "free_all", ("finalize", 0)]
    w.close()
    assert len(log) == 3                         # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.dispatch(np.zeros((0, 256), np.float32), np.zeros((0, 4), np.int32))
    (w2,) = make_worlds(cfg, machine, log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del w2
        gc.collect()
    assert any(issubclass(c.category, ResourceWarning) and "not closed" in str(c.message)
               for c in caught)


def test_one_pe_dispatch_returns_its_own_result():
    cfg = small(n_ranks=1, p2p_world_size=1, n_experts=8)
    machine = sim_backend.Machine(0)
    log = []
    (w,) = make_worlds(cfg, machine, log)
    rng = np.random.default_rng(0)
    toks, ids = routing.routing(rng, cfg, 16)
    got = w.dispatch(toks[0], ids[0])
    assert reference.compare(cfg, reference.dispatch(cfg, toks, ids)[0], got) == []
    assert log[-1] == ("barrier", 0, "call")            # every call ends at a barrier
    with pytest.raises(TypeError, match="own inputs"):
        w.dispatch(toks, ids)
    w.close()


def test_dead_peer_times_out_and_closes_without_collectives():
    """PE 1 never launches: PE 0's bounded waits expire (EPTimeoutError), its close barrier
    fails (the peer is gone), so nothing collective runs and the world is closed."""
    cfg = small(timeout_ns=200_000)
    machine = sim_backend.Machine(0, timeouts=True)
    log = []
    w0, w1 = make_worlds(cfg, machine, log)
    w0.bootstrap.fail = {"close"}
    rng = np.random.default_rng(1)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    del log[:]
    with pytest.raises(EPTimeoutError), pytest.warns(RuntimeWarning, match="not freed"):
        with w0:
            w0.dispatch(toks[0], ids[0])
    assert log == [("barrier", 0, "close")]               # no call barrier, no free, no finalize
    assert w0._closed
    w1._closed = True                                     # PE 1 "died"


def test_null_peer_pointer_is_a_clear_error():
    cfg = small()
    machine = sim_backend.Machine(0)
    log = []
    with pytest.raises(PeerAccessError, match=r"PE\(s\) 1 .*nvshmem_ptr is NULL"):
        make_worlds(cfg, machine, log, null_peers={1})
    # the half-built world was closed (barrier, free, finalize), not left to gc
    assert log[-3:] == [("barrier", 0, "close"), "free_all", ("finalize", 0)]


def test_rules(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cfg = small()
    with pytest.raises(ValueError, match="epgen launch -n 2"):
        sw.resolve_rank(cfg, None)
    assert sw.resolve_rank(small(n_ranks=1, p2p_world_size=1, n_experts=8), None) == 0
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 processes.*n_ranks=2"):
        sw.resolve_rank(cfg, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sw.resolve_rank(cfg, None) == 1
    with pytest.raises(ValueError, match="not in"):
        sw.resolve_rank(cfg, 2)
    assert sw.resolve_device(None, 8, 11) == 3
    assert sw.resolve_device(1, 2, 0) == 1
    with pytest.raises(CudaUnavailableError, match="no usable CUDA GPU"):
        sw.resolve_device(None, 0, 0)
    assert sw.local_sharers(0, 1, 4) == 4 and sw.local_sharers(1, 2, 4) == 2
    with pytest.raises(ValueError, match="use_shmem=True"):
        sw.check_transport(small(p2p_world_size=1, use_shmem=False))
    sw.check_transport(small(p2p_world_size=1, use_shmem=True))
    env = {"NVSHMEM_DISABLE_NVLS": "0"}
    assert sw.set_env_defaults(env) == {} and env["NVSHMEM_DISABLE_NVLS"] == "0"
    env = {}
    assert sw.set_env_defaults(env) == {"NVSHMEM_DISABLE_NVLS": "1"}
    assert sw.uses_nvshmem(".extern .global .align 8 .b8 nvshmemi_device_state_d[8];")
    assert not sw.uses_nvshmem(None) and not sw.uses_nvshmem(".entry ep_dispatch_async")


def test_exported_lazily():
    import epgen
    assert epgen.ShmemWorld is sw.ShmemWorld


SHMEM_RUN = ["run", "--world", "shmem", "--preset", "small", "--set", "use_shmem=true",
             "--set", "p2p_world_size=1"]


def test_cli_usage(capsys):
    from epgen import cli

    for argv in (SHMEM_RUN + ["--backend", "sim"], SHMEM_RUN + ["--graph"],
                 SHMEM_RUN + ["--drop-rank", "2"],
                 ["run", "--preset", "small", "--drop-rank", "1", "--backend", "sim"],
                 # without ShmemWorld, ranks outside the P2P group are refused
                 ["run", "--world", "p2p", "--preset", "small", "--set", "use_shmem=true",
                  "--set", "p2p_world_size=1"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
    err = capsys.readouterr().err
    assert "--drop-rank: must be in [0, n_ranks=2)" in err
    assert "use --world shmem under epgen launch" in err      # the p2p world's refusal


def test_bench_sent_bytes():
    from epgen.bench.shmem import sent_bytes

    cfg = small()                                  # 8 local experts per rank
    ids = np.array([[0, 1, 8, 9], [0, 1, 2, 3], [8, 9, 10, 11]])
    # one message per (token, k) slot on the other rank, as the transport sends them
    assert sent_bytes(cfg, ids, 0) == 6 * cfg.layout.msg_bytes     # 8, 9 and 8, 9, 10, 11
    assert sent_bytes(cfg, ids, 1) == 6 * cfg.layout.msg_bytes     # 0, 1 and 0, 1, 2, 3
    assert sent_bytes(cfg, np.zeros((0, 4), np.int32), 0) == 0


def test_cli_run_one_rank_on_the_simulator(monkeypatch, capsys):
    """``epgen run --world shmem``'s loop (seed through the bootstrap, this rank's part of
    the reference, the world closed at the end) with the world on the simulator."""
    from epgen import cli
    from epgen.commands import run_options

    log = []
    made = []

    def make_world(kind, cfg, **kw):
        assert kind == "shmem"
        host = FakeHost(log)
        w = sw.ShmemWorld(cfg, 0, bootstrap=FakeBootstrap(0, 1, log), host=host.view(0),
                          backend=sim_backend.Machine(0), fused=kw.get("fused"))
        host.worlds[0] = w
        made.append(w)
        return w
    monkeypatch.setattr(run_options, "make_world", make_world)
    argv = ["run", "--world", "shmem", "--preset", "small", "--set", "n_ranks=1", "--set",
            "p2p_world_size=1", "--set", "n_experts=8", "--tokens", "8", "--calls", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("matches the reference") == 2 and "rank 0 of 1 (ShmemWorld" in out
    assert made[0]._closed and log[-2:] == ["free_all", ("finalize", 0)]


@pytest.mark.parametrize("extra", [
    ["--set", "n_ranks=2", "--set", "p2p_world_size=1"],
    ["--set", "n_ranks=4", "--set", "p2p_world_size=2"],
    ["--set", "n_ranks=8", "--set", "p2p_world_size=1"],
    ["--set", "n_ranks=4", "--set", "p2p_world_size=2", "--set", "format=NVFP4"],
    ["--set", "n_ranks=4", "--set", "p2p_world_size=2", "--set", "format=MXFP8"],
    ["--set", "n_ranks=4", "--set", "p2p_world_size=2", "--set", "format=BlockwiseFP8"],
    ["--set", "n_ranks=4", "--set", "p2p_world_size=2", "--set", "ep_ord_r=true", "--set",
     "has_rank_flag=true"],
    ["--set", "n_ranks=2", "--set", "p2p_world_size=1", "--set", "timeout_ns=500000000",
     "--drop-rank", "1"],
])
def test_gpu_test_configurations_are_valid(extra):
    """The configurations tests/gpu/test_shmem_gpu.py launches pass the CLI's checks here, so a
    failure there is the GPU's, not a typo's."""
    from epgen import cli
    from epgen.commands.common import config_from_args

    args = cli.build_parser().parse_args(SHMEM_RUN[:5] + ["--set", "use_shmem=true"] + extra)
    cfg, _ = config_from_args(args)
    assert cfg.use_shmem and cfg.needs_shmem


def test_cli_run_dead_peer_exits_at_once(monkeypatch, capsys):
    """Rank 0 of 2 alone: its waits expire, the close barrier fails, NVSHMEM stays up, so
    ``epgen run`` reports the timeout and leaves with os._exit(1)."""
    from epgen import cli
    from epgen.commands import run_options, run_shmem

    log = []

    def make_world(kind, cfg, **kw):
        host = FakeHost(log)
        w = sw.ShmemWorld(cfg, 0, bootstrap=FakeBootstrap(0, 2, log, fail={"close"}),
                          host=host.view(0), backend=sim_backend.Machine(0, timeouts=True))
        host.worlds[0] = w
        w.build_pointer_tables()
        return w

    def exit_now(code):
        raise SystemExit(code)
    monkeypatch.setattr(run_options, "make_world", make_world)
    monkeypatch.setattr(run_shmem.os, "_exit", exit_now)
    monkeypatch.delenv("EPGEN_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e, pytest.warns(RuntimeWarning, match="not freed"):
        # p2p_world_size=2: kernels this branch builds (the SHMEM path comes with the kernels)
        cli.main(SHMEM_RUN + ["--set", "p2p_world_size=2", "--set", "timeout_ns=200000",
                              "--calls", "1", "--seed", "0"])
    assert e.value.code == 1
    assert "epgen: error: " in capsys.readouterr().err
    assert "finalize" not in str(log)


# ---- combine ------------------------------------------------------------------------------------

class SymmetricMachine(sim_backend.Machine):
    """A ``backends.sim.Machine`` that records each allocation from a ``FakePool`` in it."""

    def zeros(self, shape, dtype, device=None, stream=None, memory_resource=None):
        a = super().zeros(shape, dtype, device, stream, memory_resource)
        if isinstance(memory_resource, FakePool):
            memory_resource.allocs.append(a)
        return a

    def to_device(self, host, device=None, stream=None, memory_resource=None):
        a = super().to_device(host, device, stream, memory_resource)
        if isinstance(memory_resource, FakePool):
            memory_resource.allocs.append(a)
        return a


def collectively(machine, worlds, calls):
    """``calls[i]()`` (PE i's call) in a thread per PE, one thread at a time, as if each PE
    were its own process: a world's ``synchronize`` is collective (when every PE still
    running has reached one, every launch queued by all of them runs, as their GPUs would
    run them at once); host copies do not run the queue meanwhile (each PE's copies touch
    only its own buffers). Returns ``(results, errors)`` per PE."""
    import threading

    n = len(worlds)
    cond = threading.Condition()
    state = {"running": n, "waiting": 0, "generation": 0}
    real_drain = machine.drain

    def release_if_all_wait():
        if state["waiting"] and state["waiting"] == state["running"]:
            real_drain()
            state["waiting"] = 0
            state["generation"] += 1
            cond.notify_all()

    def sync():
        state["waiting"] += 1
        gen = state["generation"]
        release_if_all_wait()
        while state["generation"] == gen:
            if not cond.wait(timeout=300):
                raise TimeoutError("collectively: a PE never reached its synchronize")
    out, errors = [None] * n, [None] * n

    def worker(i):
        with cond:
            try:
                out[i] = calls[i]()
            except BaseException as e:      # noqa: BLE001 (reported to the test)
                errors[i] = e
            state["running"] -= 1
            release_if_all_wait()
    machine.drain = lambda: None
    for w in worlds:
        w.synchronize = sync
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        machine.drain = real_drain
        for w in worlds:
            del w.synchronize
    return out, errors


def combine_all(machine, worlds, ys, w=None, res=None):
    out, errors = collectively(machine, worlds, [
        (lambda i=i: worlds[i].combine(ys[i], None if w is None else w[i],
                                       None if res is None else res[i]))
        for i in range(len(worlds))])
    for e in errors:
        if e is not None:
            raise e
    return out


COMBINE_CFGS = {"p2p": {}, "shmem_p2p1": {"use_shmem": True, "p2p_world_size": 1}}


@pytest.mark.parametrize("flags", COMBINE_CFGS.values(), ids=list(COMBINE_CFGS))
def test_two_pes_combine_matches_the_reference(flags, seed):
    """Each PE combines its own part (the other PE's kernels running alongside): bit for bit
    ``reference.combine``, weights and None, a residual, back-to-back calls; the combine
    buffers are symmetric allocations, the table entry of a remote PE is this PE's own
    address, of an in-group PE its ``nvshmem_ptr``."""
    from combine_checks import expert_outputs, weights

    cfg = small(num_threads=64, n_sms=4, n_experts=4, max_tokens_per_rank=4, **flags)
    machine = SymmetricMachine(seed)
    log = []
    worlds = make_worlds(cfg, machine, log)
    rng = np.random.default_rng(seed)
    H = cfg.token_fmt.hid_dim
    for call in range(2):
        toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank, 3 - call])
        results = round_trip(worlds, machine, toks, ids)
        ys = expert_outputs(rng, cfg, results)
        wt = weights(rng, cfg, ids)
        res = [rng.integers(0, 1 << 16, size=(len(i), H), dtype=np.uint16) & np.uint16(0xBFFF)
               for i in ids]
        cases = [("weighted", wt, None), ("unreduced", None, None), ("residual", wt, res)]
        for what, w, rr in cases:
            got = combine_all(machine, worlds, ys, w, rr)
            want = reference.combine(cfg, results, ys, w, residual=rr,
                                     n_tokens=[len(i) for i in ids])
            for r in range(2):
                assert got[r].shape == want[r].shape and np.array_equal(got[r], want[r]), \
                    f"seed {seed} call {call} {what} rank {r}"
    assert sum(1 for e in log if e == ("barrier", 0, "combine-ready")) == 1
    for w in worlds:
        comb, pool = w._combiner, w.pool
        b = comb.bufs[0]
        for attr in ("recv", "arrival", "expert_out"):
            assert any(a.ptr == getattr(b, attr).ptr for a in pool.allocs), attr
        for attr in ("weights", "residual", "out"):
            assert not any(a.ptr == getattr(b, attr).ptr for a in pool.allocs), attr
        table = np.asarray(comb.recv_ptrs[0].to_host())
        peer = worlds[1 - w.rank]._combiner.bufs[0].recv.ptr
        assert table[w.rank] == b.recv.ptr
        assert table[1 - w.rank] == (b.recv.ptr if cfg.needs_shmem else peer)
    for w in worlds:
        w.close()


def test_combine_takes_this_ranks_own_arrays():
    cfg = small(n_ranks=1, p2p_world_size=1, n_experts=8)
    (w,) = make_worlds(cfg, SymmetricMachine(0), [])
    with pytest.raises(TypeError, match="own arrays"):
        w.combine([np.zeros((0, 256), np.uint16)])
    w.close()


def test_gpu_combine_program_checks_on_the_simulator(seed):
    """The PE program of tests/gpu/test_shmem_gpu.py's combine tests (``combine_rounds``) on two
    simulated PEs (a smaller grid): it says every call matched; and it can fail (a row of
    every expert output altered: a mismatch reported)."""
    import test_shmem_gpu as gpu

    for n, p in [(2, 1), (4, 2)]:           # the GPU tests' configurations are valid
        assert gpu.combine_config(n, p).needs_shmem
    assert not gpu.combine_config(2, 2).needs_shmem
    cfg = small(num_threads=64, n_sms=4, n_experts=4, max_tokens_per_rank=4, use_shmem=True,
                p2p_world_size=1)
    machine = SymmetricMachine(seed)
    worlds = make_worlds(cfg, machine, [])
    said = []
    ok, errors = collectively(machine, worlds, [
        (lambda w=w: gpu.combine_rounds(w, 3, seed, said.append)) for w in worlds])
    assert errors == [None, None] and ok == [True, True], (errors, said)
    assert sorted(said) == sorted(f"rank {r} call {c}: combine matches the reference"
                                  for r in range(2) for c in range(3))
    real = worlds[0].combine
    worlds[0].combine = lambda y, *a: real(y ^ np.uint16(1), *a)
    said.clear()
    ok, errors = collectively(machine, worlds, [
        (lambda w=w: gpu.combine_rounds(w, 1, seed, said.append)) for w in worlds])
    assert errors == [None, None] and False in ok, said
    assert any("combine differs" in line for line in said), said
    for w in worlds:
        w.close()


def test_combine_corrupted_row_for_a_remote_pe_is_reported_after_the_barrier(seed):
    """PE 1 corrupts a row whose source is PE 0 (a put): PE 1's combine raises
    ``EPInputError`` naming it after meeting PE 0 at the call barrier (the kernels finished on
    both), PE 0's call returns; the next call of both is exact."""
    from combine_checks import expert_outputs, weights
    from epgen.errors import EPInputError
    from epgen.reference_combine import source_of_rows

    cfg = small(num_threads=64, n_sms=4, n_experts=4, max_tokens_per_rank=4, use_shmem=True,
                p2p_world_size=1)
    T = cfg.max_tokens_per_rank
    machine = SymmetricMachine(seed)
    log = []
    worlds = make_worlds(cfg, machine, log)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        toks, ids = routing.routing(rng, cfg, [T, T])
        results = round_trip(worlds, machine, toks, ids)
        remote = np.flatnonzero(source_of_rows(results[1]) == 0)
        if len(remote):
            break
    assert len(remote), f"seed {seed}: no row from PE 0 to PE 1 in 20 routings"
    ys = expert_outputs(rng, cfg, results)
    row = int(rng.choice(remote))
    bad = results[1].src_info.copy()
    bad[row] = (T, 0)
    del log[:]
    out, errors = collectively(machine, worlds, [
        lambda: worlds[0].combine(ys[0], None),
        lambda: worlds[1].combine(ys[1], None, _src_info=bad)])
    assert errors[0] is None and out[0].shape == (T, cfg.token_fmt.top_k, 256)
    assert isinstance(errors[1], EPInputError), errors
    assert re.search(rf"rank 1 src_info\[{row}\] = \({T}, 0\)", str(errors[1]))
    assert sorted(e for e in log if e[0] == "barrier" and e[2] == "call") == \
        [("barrier", 0, "call"), ("barrier", 1, "call")]
    toks, ids = routing.routing(rng, cfg, [T, T])
    results = round_trip(worlds, machine, toks, ids)
    ys = expert_outputs(rng, cfg, results)
    w = weights(rng, cfg, ids)
    got = combine_all(machine, worlds, ys, w)
    for r, want in enumerate(reference.combine(cfg, results, ys, w)):
        assert np.array_equal(got[r], want), f"seed {seed} rank {r} after the error"
    for w_ in worlds:
        w_.close()


# ---- rank masks ---------------------------------------------------------------------------------

def _masked_worlds(seed, log, shrink=True, **flags):
    cfg = small(ep_rank_mask=True, **flags)
    machine = SymmetricMachine(seed % 1000, timeouts=True, max_spins=1000)
    return cfg, machine, make_worlds(cfg, machine, log, shrink=shrink)


def test_a_dead_pe_is_masked_under_shrink_and_the_others_meet_without_it(seed):
    """Rank masks on ``ShmemWorld`` (shrink): both PEs call once; then PE 1 is gone (it never
    launches again): PE 0's call completes with PE 1 masked by its kernels, its result the
    reference's without PE 1, and its end-of-call barrier meets PE 0 alone; its next call
    does not wait for PE 1 at all; ``close`` skips the collective steps."""
    from mask_checks import expected

    log = []
    cfg, machine, worlds = _masked_worlds(seed, log)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    got, errors = collectively(machine, worlds, [
        (lambda w=w: w.dispatch(toks[w.rank], ids[w.rank])) for w in worlds])
    assert errors == [None, None], errors
    for r in range(2):
        assert reference.compare(cfg, reference.dispatch(cfg, toks, ids)[r], got[r]) == []
    assert worlds[0].live_ranks() == [0, 1]
    for call in range(2):                       # PE 1 is gone
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        if call == 1:
            machine.sim.max_spins = 50          # nothing waits for PE 1 any more
        got, errors = collectively(machine, worlds[:1], [
            lambda: worlds[0].dispatch(toks[0], ids[0])])
        assert errors == [None], errors
        reference.assert_match(cfg, expected(cfg, toks, ids, {1})[0], got[0])
        assert worlds[0].masked_ranks == [1] and worlds[0].live_ranks() == [0]
    machine.sim.max_spins = 1000
    calls = [e for e in log if e[0] == "barrier ranks" and e[1] == 0 and e[2] == "call"]
    assert [e[3] for e in calls] == [(0, 1), (0,), (0,)]
    with pytest.warns(RuntimeWarning, match="lost"):
        worlds[0].close()
    assert "free_all" not in log
    worlds[1].close()                           # (the "dead" PE's world, in this process)


def test_a_pe_that_misses_the_end_of_call_barrier_is_masked_under_shrink(seed):
    """A PE that dies after the kernels (they did not need it) misses the barrier: under
    shrink the others mask it and go on; without shrink it is a ``BootstrapTimeoutError``."""
    for shrink in (True, False):
        log = []
        cfg, machine, worlds = _masked_worlds(seed, log, shrink=shrink)
        worlds[0].bootstrap.fail.add("call")
        toks, ids = routing.routing(np.random.default_rng(seed), cfg, cfg.max_tokens_per_rank)
        got, errors = collectively(machine, worlds, [
            (lambda w=w: w.dispatch(toks[w.rank], ids[w.rank])) for w in worlds])
        if shrink:
            assert errors == [None, None], errors
            assert worlds[0].masked_ranks == [1] and worlds[1].masked_ranks == []
        else:
            assert isinstance(errors[0], bootstrap_mod.BootstrapTimeoutError), errors
            assert worlds[0].masked_ranks == []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # the lost session's, shrink
            for w in worlds:
                w.close()


def test_a_mask_on_shmem_world_needs_one_p2p_group():
    """Destinations reached by NVSHMEM puts do not consult the mask: refused by name."""
    with pytest.raises(ValueError, match="ep_rank_mask with use_shmem and p2p_world_size=1"):
        small(ep_rank_mask=True, use_shmem=True, p2p_world_size=1).validate()
