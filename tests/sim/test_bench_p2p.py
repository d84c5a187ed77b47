"""CPU tests of the P2P benchmark (``epgen bench --world p2p``, ``epgen.bench.p2p``): the bytes
that cross the links, the per-GPU rates, the slowest-rank combination of the NCCL timings,
the NCCL job's numpy twin against the reference, the options, the skip with fewer than two
GPUs, and a whole run with the device phases replaced by host fakes (report, JSON)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from epgen import BF16Format, EPConfig, cli, reference, routing
from epgen.bench import baseline, common, driver, inputs, memory, options, p2p, runner, timing
from epgen.commands import bench as bench_command
from epgen.commands.common import config_from_args
from epgen.formats import make_format
from epgen.presets import load_preset

from sync_recorder import record_syncs


def tiny_cfg(T=8, H=16, K=2, R=2, E=4, sms=None, **flags):
    return EPConfig(num_threads=128, n_sms=sms or max(E // R, E // 4) + 1, n_experts=E,
                    n_ranks=R,
                    max_tokens_per_rank=T,
                    p2p_world_size=R, use_shmem=False, token_fmt=BF16Format(hid_dim=H, top_k=K),
                    **flags)


def bench_plan(*argv):
    parser = cli.build_parser()
    args = parser.parse_args(["bench", *argv])
    cfg, _ = config_from_args(args, default=bench_command.default_preset(args.world))
    return options.plan_from_args(args.parser, args, cfg, [cfg.max_tokens_per_rank],
                                  arch=args.arch)


# ---- bytes and rates -----------------------------------------------------------------------------
def test_link_bytes_by_hand():
    cfg = tiny_cfg()                          # L = 2: experts 0,1 on rank 0, 2,3 on rank 1
    assert cfg.token_fmt.msg_size() == 64
    ids = [np.array([[0, 2], [1, 3]]), np.array([[2, 3]])]
    assert p2p.pair_counts(cfg, ids).tolist() == [[2, 2], [0, 2]]
    b = p2p.link_bytes(cfg, ids)
    assert b["row_bytes"] == 64
    assert b["sent"] == [128, 0] and b["received"] == [0, 128]
    assert b["local"] == [128, 128] and b["total_remote"] == 128 and b["busiest"] == 128
    final = tiny_cfg(ep_final_layout=True)
    assert p2p.link_row_bytes(final) == 32 + final.layout.hdr_bytes
    assert p2p.link_bytes(final, ids)["busiest"] == 2 * (32 + final.layout.hdr_bytes)


def test_link_bytes_uniform_routing_is_mostly_remote(seed):
    cfg = tiny_cfg(T=64, R=4, E=16, K=4)
    rng = np.random.default_rng(seed)
    sets = [routing.routing(rng, cfg, 64) for _ in range(3)]
    b = p2p.sets_link_bytes(cfg, sets)
    routed = 64 * 4 * cfg.token_fmt.msg_size()          # one rank's messages
    assert 0.5 * 0.75 * routed < b["mean_sent"] <= b["busiest"] <= routed
    assert len(b["per_set"]) == 3


def test_gpu_rates():
    r = p2p.gpu_rates({"busiest": 2e9, "mean_sent": 1e9}, 2.0, 500.0)
    assert r == {"busiest_gpu_gbps": 1000.0, "mean_gpu_gbps": 500.0, "fraction_of_link": 2.0}
    assert p2p.gpu_rates({"busiest": 1, "mean_sent": 1}, 1.0, None)["fraction_of_link"] is None
    assert p2p.gpu_rates({"busiest": 1, "mean_sent": 1}, 0.0, 1.0)["busiest_gpu_gbps"] is None


def test_slowest_rank_times():
    assert p2p.slowest_rank_times([[1.0, 5.0], [3.0, 2.0], [2.0, 2.0]]) == [3.0, 5.0]
    with pytest.raises(ValueError, match="different iteration counts"):
        p2p.slowest_rank_times([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError):
        p2p.slowest_rank_times([])


# ---- the NCCL job's numpy twin -------------------------------------------------------------------
@pytest.mark.parametrize("R,E", [(1, 8), (2, 8), (4, 16), (8, 64)])
def test_alltoall_permute_matches_reference(R, E, seed):
    cfg = tiny_cfg(T=32, R=R, E=E, K=4)
    rng = np.random.default_rng(seed)
    # the NCCL baseline moves the unmasked routings the benchmark draws: no -1 slots
    for case in [c for c in routing.EDGE_CASES if not c.startswith("masked")]:
        toks, ids = routing.edge_case(rng, cfg, case)
        got = p2p.alltoall_permute_numpy(cfg, toks, ids)
        want = reference.dispatch(cfg, toks, ids)
        for w, g in zip(want, got):
            assert baseline.compare_grouping(cfg, w, g) == [], f"seed {seed}, {case}"


def test_alltoall_permute_detects_a_wrong_row(seed):
    cfg = tiny_cfg(T=16, R=2, E=8, K=2)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 16)
    res = p2p.alltoall_permute_numpy(cfg, toks, ids)[1]
    res.out_tokens[0] ^= 1
    assert baseline.compare_grouping(cfg, reference.dispatch(cfg, toks, ids)[1], res)


def test_bf16_config():
    cfg = EPConfig(num_threads=256, n_sms=9, n_experts=16, n_ranks=2, max_tokens_per_rank=32,
                   p2p_world_size=2, use_shmem=False, token_fmt=make_format("NVFP4", 256, 4))
    b = p2p.bf16_config(cfg)
    assert isinstance(b.token_fmt, BF16Format)
    assert (b.token_fmt.hid_dim, b.token_fmt.top_k, b.n_ranks) == (256, 4, 2)
    assert p2p.bf16_config(b) is b


# ---- options and skips ---------------------------------------------------------------------------
def test_p2p_plan_defaults():
    plan = bench_plan("--world", "p2p", "--tokens", "128,4096")
    assert plan.world == "p2p" and plan.devices is None
    assert (plan.base.n_ranks, plan.base.n_sms, plan.base.num_threads) == (8, 132, 1024)
    assert plan.tokens == (128, 4096)
    assert p2p.p2p_devices(plan) == tuple(range(8))
    assert plan.describe()["world"] == "p2p"
    assert bench_plan().world == "emulated"


def test_p2p_plan_devices():
    plan = bench_plan("--world", "p2p", "--devices", "7,6,5,4,3,2,1,0")
    assert plan.devices == (7, 6, 5, 4, 3, 2, 1, 0)
    assert p2p.p2p_devices(plan) == (7, 6, 5, 4, 3, 2, 1, 0)


@pytest.mark.parametrize("argv,message", [
    (["--devices", "0,1"], "argument --devices: only with --world p2p"),
    (["--world", "p2p", "--devices", "0,1"], "expected 8 GPU ordinals >= 0 (one per rank)"),
    (["--world", "p2p", "--devices", "a,b"], "expected GPU ordinals like 0,1,2,3"),
])
def test_p2p_options_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench_plan(*argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_skip_reason():
    plan = bench_plan("--world", "p2p")
    assert p2p.skip_reason(plan, 1) == ("the P2P benchmark needs at least 2 GPUs, this machine "
                                        "has 1")
    assert p2p.skip_reason(plan, 4) == "needs 8 GPUs for 8 ranks (devices 0,1,2,3,4,5,6,7), " \
                                       "this machine has 4"
    assert p2p.skip_reason(plan, 8) is None
    same = bench_plan("--world", "p2p", "--devices", "0,0,0,0,0,0,0,0")
    assert "uses fewer than 2 GPUs" in p2p.skip_reason(same, 8)
    two = bench_plan("--world", "p2p", "--devices", "0,0,0,0,1,1,1,1")
    assert p2p.skip_reason(two, 2) is None


def test_bench_p2p_with_one_gpu_is_skipped(monkeypatch, capsys):
    """Fewer than two GPUs: nothing runs, the report says why, exit status 0."""
    from backends import cuda
    monkeypatch.setattr(cuda, "gpu_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    status = cli.main(["bench", "--world", "p2p", "--tokens", "128,4096"])
    out = capsys.readouterr().out
    assert status == 0
    assert "skipped: the P2P benchmark needs at least 2 GPUs, this machine has 1" in out


def test_bench_p2p_without_gpu_is_a_clear_error(capsys):
    from backends import cuda
    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    assert cli.main(["bench", "--world", "p2p"]) == 1
    assert "GPU" in capsys.readouterr().err


# ---- a whole run, device phases faked --------------------------------------------------------------
GRAPH_SEEN = []


def _fake_world(cfg, sets, iters, warmup, gate, *, device=None, arch=None, post_check=True,
                progress=None, graph=False, world_factory=None, host_sync=False):
    assert callable(world_factory)
    # epgen is timed as NCCL is: host-synchronised, no gate, whatever --no-gate says
    assert host_sync and gate is None
    GRAPH_SEEN.append(graph)
    rt = 0.05 if cfg.ep_final_layout else 0.1
    s = timing.summarize
    return {"check": "ok", "post_check": "ok", "build_s": 0.1,
            "dispatch_async": s([rt / 2]), "dispatch_wait": s([rt / 2]),
            "round_trip": s([rt, rt * 1.1, rt * 0.9])}


def _fake_nccl(plan, T, sets, devices, progress, timeout_s=900.0):
    cfg = p2p.bf16_config(plan.config(T))
    toks, ids = sets[0]
    got = p2p.alltoall_permute_numpy(cfg, toks, ids)[plan.check_rank]
    want = reference.dispatch(cfg, toks, ids)[plan.check_rank]
    diffs = baseline.compare_grouping(cfg, want, got)
    return {"name": p2p.NCCL_NAME, "round_trip": timing.summarize([0.2, 0.25, 0.3]),
            "per_rank_median_ms": [0.2] * cfg.n_ranks,
            "check": "ok" if not diffs else "FAILED", "check_against": "reference"}


@pytest.fixture
def fake_gpus(monkeypatch):
    from backends import cuda
    monkeypatch.setattr(cuda, "gpu_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "get_device", lambda d=None: types.SimpleNamespace(name="Fake"))
    monkeypatch.setattr(cuda, "arch", lambda d=None: "sm_90")
    monkeypatch.setattr(cuda, "sm_count", lambda d=None: 132)
    monkeypatch.setattr(cuda, "can_access_peer", lambda a, b: True)
    enabled = []
    monkeypatch.setattr(cuda, "enable_peer_access", lambda a, b: enabled.append((a, b)))
    monkeypatch.setattr(memory, "mem_info", lambda device: (100 << 30, 141 << 30))
    monkeypatch.setattr(common, "import_torch",
                        lambda: (types.SimpleNamespace(__version__="0+fake"), None))
    monkeypatch.setattr(p2p, "measure_peer_copy", lambda devices, mib, iters, gate: {
        "size_mib": mib, "bytes_per_gpu": mib << 20, "devices": list(devices),
        "pair": {"gbps_per_gpu": 400.0}, "ring": {"gbps_per_gpu": 360.0},
        "gbps_per_gpu": 360.0})
    monkeypatch.setattr(runner, "measure_world", _fake_world)
    monkeypatch.setattr(p2p, "nccl_phase", _fake_nccl)
    return enabled


RUN = ("--world", "p2p", "--preset", "small", "--tokens", "16,32", "--no-gate",
       "--variant", "default", "--variant", "final=ep_final_layout,ep_prod_reserve")


def test_graph_variant_reaches_the_timing(fake_gpus, capsys):
    del GRAPH_SEEN[:]
    assert cli.main(["bench", "--world", "p2p", "--preset", "small", "--tokens", "16",
                     "--no-gate", "--variant", "default", "--variant", "g=graph"]) == 0
    assert GRAPH_SEEN == [False, True]


def test_whole_p2p_run_on_fakes(fake_gpus, tmp_path, capsys):
    path = tmp_path / "p2p.json"
    assert cli.main(["bench", *RUN, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    assert res["world"] == "p2p" and res["devices"] == [0, 1] and res["failures"] == []
    assert {(a, b) for a, b in fake_gpus} >= {(0, 1), (1, 0)}
    assert [s["tokens_per_rank"] for s in res["shapes"]] == [16, 32]
    for s in res["shapes"]:
        assert s["baseline"]["check"] == "ok"
        for v in s["variants"]:
            m = v["round_trip"]
            want = v["link_bytes"]["busiest"] / m["median_ms"] / 1e6
            assert m["busiest_gpu_gbps"] == pytest.approx(want)
            assert m["fraction_of_link"] == pytest.approx(want / 360.0)
            assert v["speedup_vs_baseline"] == pytest.approx(0.25 / m["median_ms"])
    lines = out.splitlines()
    assert lines[0].startswith("epgen bench --world p2p") and "GPUs 0,1 of 2" in lines[0]
    assert "ring 360.0 GB/s (the reference), pair 400.0 GB/s" in out
    assert "epgen and NCCL timed alike: from an idle device, host enqueue included" in out
    header = next(x for x in lines if x.startswith("shape"))
    assert "GB/s/GPU" in header and "frac link" in header and "vs NCCL" in header
    assert sum(p2p.NCCL_NAME in x for x in lines) == 2
    assert any(x.startswith("T=16 (uniform): recv_block_capacity") for x in lines), out
    row = next(x for x in lines if x.startswith("T=16") and "epgen final" in x)
    assert row.split()[-1] == "5.00x" and "50.0" in row.split()


def test_p2p_plot_and_nccl_rates(fake_gpus, tmp_path, capsys):
    """NCCL gets GB/s per GPU by the staged BF16 job's link bytes (the table shows them);
    ``--plot`` draws every variant and NCCL against tokens per rank."""
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "p2p.png", tmp_path / "p2p.json"
    assert cli.main(["bench", *RUN, "--json", str(js), "--plot", str(png)]) == 0
    res = json.loads(js.read_text())
    for s in res["shapes"]:
        b, default = s["baseline"], s["variants"][0]
        assert b["link_bytes"] == default["link_bytes"]      # the same job, BF16 staged
        assert b["round_trip"]["busiest_gpu_gbps"] == pytest.approx(
            b["link_bytes"]["busiest"] / b["round_trip"]["median_ms"] / 1e6)
    series = p2p.plot_series(res)
    assert list(series) == ["epgen default", "epgen final", p2p.NCCL_NAME]
    assert [t for t, _ in series[p2p.NCCL_NAME]] == [16, 32]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    nccl_row = next(x for x in out.splitlines() if p2p.NCCL_NAME in x and "16" in x.split())
    m = res["shapes"][0]["baseline"]["round_trip"]
    assert f"{m['busiest_gpu_gbps']:.1f}" in nccl_row.split()
    assert f"{m['fraction_of_link']:.3f}" in nccl_row.split()


def test_p2p_run_reports_failures(fake_gpus, monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("peer write faulted")
    monkeypatch.setattr(runner, "measure_world", boom)
    assert cli.main(["bench", *RUN]) == 1
    captured = capsys.readouterr()
    assert "peer write faulted" in captured.out and "epgen: error: bench:" in captured.err


def test_p2p_table_formatting():
    rows = [{"shape": "decode", "T": 128, "variant": "epgen default", "us": 55.5,
             "gbps": 300.0, "frac": 0.833, "speedup": 2.5},
            {"shape": "decode", "T": 128, "variant": p2p.NCCL_NAME, "us": 138.7,
             "speedup": 1.0},
            {"shape": "prefill", "T": 4096, "variant": "epgen x", "note": "skipped: why"}]
    text = p2p.format_table(rows)
    assert "     55.5     300.0     0.833    2.50x" in text
    assert "(skipped: why)" in text


def test_nccl_phase_reports_worker_errors(seed):
    """The process plumbing of the NCCL baseline on the CPU: the inputs written, one spawned
    worker per rank, their reports collected; without torch (or without GPUs) every worker
    reports its error and the phase fails with them, nothing hangs."""
    try:
        import torch  # noqa: F401
        pytest.skip("torch imports here: the workers would reach NCCL")
    except ImportError:
        pass
    plan = bench_plan("--world", "p2p", "--preset", "small", "--tokens", "8", "--iters", "2",
                      "--warmup", "0")
    sets = [routing.routing(np.random.default_rng(seed), plan.config(8), 8)]
    lines = []
    out = p2p.nccl_phase(plan, 8, sets, (0, 1), lines.append, timeout_s=120)
    assert out["name"] == p2p.NCCL_NAME and "round_trip" not in out
    assert "rank 0: ModuleNotFoundError: No module named 'torch'" in out["error"]
    assert "rank 1: ModuleNotFoundError" in out["error"]
    assert any("nccl FAILED" in x for x in lines)


# ---- nccl_dispatch itself, on a numpy stand-in for torch and torch.distributed ---------------------
class _T:
    """The few tensor operations ``nccl_dispatch`` uses, on numpy."""

    def __init__(self, a):
        self.a = np.asarray(a)

    shape = property(lambda self: self.a.shape)
    device = "cpu"

    def reshape(self, *s):
        return _T(self.a.reshape(*s))

    view = reshape

    def __floordiv__(self, k):
        return _T(self.a // k)

    def __mod__(self, k):
        return _T(self.a % k)

    def sum(self, dim):
        return _T(self.a.sum(axis=dim))

    def tolist(self):
        return self.a.tolist()

    def new_empty(self, shape):
        return _T(np.zeros(shape, self.a.dtype))

    def repeat(self, n):
        return _T(np.tile(self.a, n))

    def to(self, dtype):
        return _T(self.a.astype(dtype))


class _Torch:
    int32 = np.int32

    @staticmethod
    def argsort(t, stable):
        assert stable
        return _T(np.argsort(t.a, kind="stable"))

    @staticmethod
    def index_select(t, dim, idx):
        assert dim == 0
        return _T(t.a[idx.a])

    @staticmethod
    def bincount(t, minlength):
        return _T(np.bincount(t.a, minlength=minlength))

    @staticmethod
    def empty_like(t):
        return _T(np.zeros_like(t.a))

    @staticmethod
    def repeat_interleave(t, counts):
        return _T(np.repeat(t.a, counts.a))

    @staticmethod
    def arange(n, device=None):
        return _T(np.arange(n))

    @staticmethod
    def stack(ts, dim):
        return _T(np.stack([t.a for t in ts], axis=dim))


class _Dist:
    """``all_to_all_single`` across ranks running as threads."""

    def __init__(self, world):
        import threading
        self.world = world
        self.barrier = threading.Barrier(world)
        self.box = {}
        self.local = threading.local()

    def get_world_size(self):
        return self.world

    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None):
        r, R = self.local.rank, self.world
        ins = input_split_sizes or [input.shape[0] // R] * R
        offs = np.concatenate([[0], np.cumsum(ins)])
        self.box[r] = [input.a[offs[d]:offs[d + 1]] for d in range(R)]
        self.barrier.wait()
        got = np.concatenate([self.box[s][r] for s in range(R)])
        assert got.shape == output.a.shape, (got.shape, output.a.shape)
        if output_split_sizes is not None:
            assert [len(self.box[s][r]) for s in range(R)] == list(output_split_sizes)
        output.a[...] = got
        self.barrier.wait()
        if r == 0:
            self.box.clear()
        self.barrier.wait()


@pytest.mark.parametrize("R,E", [(2, 8), (4, 16)])
def test_nccl_dispatch_on_a_numpy_torch_matches_reference(R, E, seed):
    import threading
    cfg = tiny_cfg(T=16, R=R, E=E, K=4)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, [int(rng.integers(0, 17)) for _ in range(R)])
    dist = _Dist(R)
    results, errors = {}, []

    def rank(r):
        dist.local.rank = r
        try:
            rows, cnt, src = p2p.nccl_dispatch(_Torch, dist, cfg, _T(toks[r]),
                                               _T(ids[r].astype(np.int64)), with_src_info=True)
            results[r] = p2p.nccl_rank_result(cfg, r, rows.a, cnt.a, src.a)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            dist.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    want = reference.dispatch(cfg, toks, ids)
    for r in range(R):
        assert baseline.compare_grouping(cfg, want[r], results[r]) == [], f"seed {seed}"


def test_p2p_variant_that_does_not_fit_a_gpu_is_skipped(fake_gpus, monkeypatch, tmp_path):
    """A GPU whose free memory cannot hold its ranks' buffers and inputs skips the variant
    (as the emulated benchmark skips what does not fit) with the GPU, the need and the free
    memory named; the other GPU's fit is not enough."""
    wm = memory.world_memory(p2p.bf16_config(load_preset("small")))
    monkeypatch.setattr(memory, "mem_info",
                        lambda device: ((100 << 30) if device == 0 else wm["per_rank_total"] // 2,
                                        141 << 30))
    path = tmp_path / "p2p.json"
    assert cli.main(["bench", *RUN, "--json", str(path)]) == 0    # a skip is not a failure
    res = json.loads(path.read_text())
    assert res["failures"] == []
    for s in res["shapes"]:
        for v in s["variants"]:
            assert v["skipped"].startswith("GPU 1 needs "), v["skipped"]
            assert "of its" in v["skipped"] and "GPU 0" not in v["skipped"]


def test_gpu_memory_shortfalls_counts_the_ranks_a_gpu_holds(monkeypatch):
    cfg = p2p.bf16_config(load_preset("small"))
    plan = types.SimpleNamespace(sets=3, mem_fraction=0.9, op="dispatch")
    per_rank = memory.world_memory(cfg)["per_rank_total"] + \
        memory.staged_inputs_memory(cfg, 16, 3) // cfg.n_ranks
    monkeypatch.setattr(memory, "mem_info", lambda device: (int(1.5 * per_rank / 0.9), 0))
    assert p2p.gpu_memory_shortfalls(plan, cfg, 16, (0, 1)) == {}
    assert p2p.gpu_memory_shortfalls(plan, cfg, 16, (0, 0)) == {
        0: (2 * per_rank, int(1.5 * per_rank / 0.9))}


# ---- epgen timed as NCCL is: from an idle device, host enqueue included --------------------------
@pytest.mark.parametrize("host_sync", [False, True])
def test_measure_world_host_sync_on_the_simulator(host_sync, seed, monkeypatch):
    """``runner.measure_world(host_sync=True)``, the real measurement on the simulator with
    the event timing replaced: every sample starts after the host waited for every rank
    stream and the timing stream (no sample without); the checks pass either way."""
    from epgen.runtime.world import EmulatedWorld
    from test_final_layout_sim import SHAPES, make_cfg

    cfg = make_cfg(*SHAPES["R2-E4"])
    sets = inputs.make_input_sets(cfg, cfg.max_tokens_per_rank, 2, seed=seed)
    events, timer = record_syncs(monkeypatch)

    res = runner.measure_world(cfg, sets, 2, 1, None, progress=lambda m: None,
                               world_factory=lambda: EmulatedWorld(cfg, backend="sim",
                                                                   sim_seed=seed),
                               host_sync=host_sync, timer=timer)
    assert res["check"] == "ok" and res["post_check"] == "ok", f"seed {seed}"
    assert res["round_trip"]["n"] == 2 and res["round_trip"]["median_ms"] == 0.5
    samples = [i for i, e in enumerate(events) if e[0] == "sample"]
    assert len(samples) == 3 * (2 + 1)                    # async, wait, round trip
    for i in samples:
        want = events[i][1]
        before = {e[1] for e in events[i - len(want):i] if e[0] == "sync"}
        assert (before == set(want)) == host_sync, (i, events[i - len(want):i])


def test_measure_world_host_sync_takes_no_gate():
    with pytest.raises(ValueError, match="host_sync.*no gate"):
        runner.measure_world(None, [], 1, 0, object(), progress=print, host_sync=True)


def test_p2p_gate_is_the_peer_copies_only(fake_gpus, monkeypatch, tmp_path):
    """With the gate on, the peer copies are gated, epgen and NCCL are not (both timed
    host-synchronised); the JSON says so."""
    gates = []

    class FakeGate:
        def __init__(self, torch, device):
            gates.append(self)

        def describe(self):
            return {"initial_ms": 2.0}
    monkeypatch.setattr(p2p, "Gate", FakeGate)
    copy_gate = []
    monkeypatch.setattr(p2p, "measure_peer_copy", lambda devices, mib, iters, gate: (
        copy_gate.append(gate) or {"size_mib": mib, "bytes_per_gpu": mib << 20,
                                   "devices": list(devices), "pair": {"gbps_per_gpu": 400.0},
                                   "ring": {"gbps_per_gpu": 360.0}, "gbps_per_gpu": 360.0}))
    path = tmp_path / "p2p.json"
    run = [a for a in RUN if a != "--no-gate"]
    assert cli.main(["bench", *run, "--json", str(path)]) == 0
    assert len(gates) == 1 and copy_gate == gates             # _fake_world asserts gate None
    method = json.loads(path.read_text())["method"]
    assert method["timing"] == p2p.TIMING and method["gate"] == "peer copies only"
    assert "host enqueue included" in method["timing"] and "NCCL" in method["timing"]
