"""CPU tests of ``epgen bench --op combine|moe``: the combine's bytes, the PyTorch baseline's
computation (its numpy twin) and check against the reference, the epgen measurement run for
real on the simulator with only the event timing replaced, and whole runs with the device
phases faked: the table, the JSON and the option checks."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from epgen import cli
from epgen.bench import combine, combine_baseline, driver, inputs, report, timing, traffic
from epgen.bench.baseline import dispatch_numpy
from epgen.runtime.world import EmulatedWorld

from test_bench import bench_args, fake_gpu, quiet, tiny_cfg  # noqa: F401 - fixture
from test_final_layout_sim import SHAPES, make_cfg


def test_combine_bytes_by_hand():
    cfg = tiny_cfg(T=8, H=16, K=2, R=2)
    b = traffic.combine_bytes(cfg, 8)
    rows = 2 * 8 * 2 * 16 * 2              # R * T * K rows of H BF16
    out = 2 * 8 * 16 * 2
    assert (b["rows"], b["output"], b["total"]) == (rows, out, 3 * rows + out)
    assert b["async"] + b["wait"] == b["total"]
    assert traffic.combine_bytes(cfg, [8, 0])["total"] == (3 * rows + out) // 2
    assert traffic.op_bytes(cfg, 8, "combine") == b["total"]
    assert traffic.op_bytes(cfg, 8, "moe") == \
        traffic.round_trip_bytes(cfg, 8)["total"] + b["total"]
    assert traffic.op_bytes(cfg, 8, "dispatch") == traffic.round_trip_bytes(cfg, 8)["total"]


def test_numpy_combine_baseline_passes_the_check_and_a_corrupt_one_fails(seed):
    cfg = tiny_cfg(T=8, H=16, K=2, R=2)
    sets = inputs.make_input_sets(cfg, 8, 1, seed=seed)
    w = combine.weights(cfg, 8, seed)
    toks, ids = sets[0]
    rows, order = dispatch_numpy(np.stack(toks), np.stack(ids))
    slots, out = combine_baseline.combine_numpy(rows, order, np.stack(w), 2, 8, 2)
    for s in range(2):
        assert combine_baseline.check(cfg, sets, w, s, slots[s], out[s]) == [], f"seed {seed}"
    bad = slots[1].copy()
    bad[0, 0, 0] ^= 1
    assert "slots" in combine_baseline.check(cfg, sets, w, 1, bad, out[1])[0]
    far = out[0].copy()
    far[3] ^= np.uint16(0x4000)          # an exponent bit: far beyond one rounding
    assert "reduced rows" in combine_baseline.check(cfg, sets, w, 0, slots[0], far)[0]


def _fake_timer(ts, streams, gate, body):
    """``timing.fork_join`` without the events: run the body, a fixed 'time'."""
    body()
    return 0.25, False


def counting_timer(calls: list, run_first: int | None = None):
    """A ``timing.fork_join`` stand-in that runs the body (only in its first ``run_first``
    calls when given: the later samples then enqueue nothing), appends to ``calls`` and
    returns a fixed 'time'."""
    def timer(ts, streams, gate, body):
        if run_first is None or len(calls) < run_first:
            body()
        calls.append(1)
        return 0.25, False
    return timer


def fake_arm_measure(cfg, sets, w, iters, warmup, gate, *, op, combine_fp8=False,
                     combine_partial=False, **kw):
    """A ``combine.measure_world`` stand-in for whole runs: the plain combine at 0.6 ms and,
    when asked, the FP8 or partial-reduce arm at 0.4 ms, every check "ok"."""
    from epgen.bench import timing
    out = {"check": "ok", "post_check": "ok", "build_s": 0.1,
           "combine": timing.summarize([0.6, 0.6, 0.6])}
    for on, name in ((combine_fp8, "fp8"), (combine_partial, "partial")):
        if on:
            out[f"combine_{name}"] = timing.summarize([0.4, 0.4, 0.4])
            out[f"post_check_{name}"] = "ok"
    return out


def measure_on_sim(cfg, seed, timer, op="combine", **options):
    """``combine.measure_world`` of ``cfg`` on a simulator world (made on first use), 2 input
    sets, 3 timed iterations after 1 warm-up, ``timer`` instead of the events; ``options``:
    its other keywords (``graph``, ``combine_fp8``, ``combine_partial``). Returns the
    results and the world."""
    T = cfg.max_tokens_per_rank
    sets = inputs.make_input_sets(cfg, T, 2, seed=seed)
    w = combine.weights(cfg, T, seed)
    worlds = []

    def factory():
        worlds.append(EmulatedWorld(cfg, backend="sim", sim_seed=seed))
        return worlds[0]
    res = combine.measure_world(cfg, sets, w, 3, 1, None, op=op, world_factory=factory,
                                timer=timer, progress=lambda m: None, **options)
    return res, worlds[0]


@pytest.mark.parametrize("op, graph", [("combine", False), ("moe", False), ("moe", True)])
def test_measure_world_on_the_simulator(op, graph, seed):
    """The real measurement on the simulator, the event timing replaced: the checks before
    and after the timing pass, every sample ran the combine (its launches were recorded),
    the world's own buffers are back afterwards."""
    cfg = make_cfg(*SHAPES["R2-E4"])
    res, world = measure_on_sim(cfg, seed, _fake_timer, op=op, graph=graph)
    key = combine.PRIMARY[op]
    assert res["check"] == "ok" and res["post_check"] == "ok", f"seed {seed}"
    assert res[key]["n"] == 3 and res[key]["median_ms"] == 0.25
    halves = [f"{key}_send", f"{key}_reduce"]
    # the split combine's two kernels are also timed alone, in complete combines
    assert all(res[h]["n"] == 3 for h in halves) if op == "combine" else \
        not any(h in res for h in halves)
    comb = world.combiner()
    assert all(b.expert_out is not rk.out_tokens for b, rk in zip(comb.bufs, world.ranks))
    launched = [k for k, *_ in world.program.loaded.launched]
    assert "ep_dispatch_async" in launched


def test_a_combine_that_did_not_run_fails_the_post_check(seed):
    cfg = make_cfg(*SHAPES["R2-E4"])
    T = cfg.max_tokens_per_rank
    sets = inputs.make_input_sets(cfg, T, 2, seed=seed)
    w = combine.weights(cfg, T, seed)

    def no_combine(ts, streams, gate, body):
        return 0.25, False                 # the timed launches never enqueued
    with pytest.raises(AssertionError, match="combine differs from the reference"):
        combine.measure_world(cfg, sets, w, 2, 0, None, op="combine",
                              world_factory=lambda: EmulatedWorld(cfg, backend="sim",
                                                                  sim_seed=seed),
                              timer=no_combine, progress=lambda m: None)


def test_unsupported_configuration_is_refused_before_building(monkeypatch):
    def refuse(cfg):
        raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(combine, "check_supported", refuse)
    cfg = make_cfg(*SHAPES["R2-E4"])
    with pytest.raises(ValueError, match="testing"):
        combine.measure_world(cfg, [], [], 1, 0, None, op="combine",
                              world_factory=lambda: pytest.fail("built"),
                              progress=lambda m: None)


# ---- whole runs, device phases faked ---------------------------------------------------------
def _fake_measure(cfg, sets, w, iters, warmup, gate, *, op, device=None, arch=None,
                  post_check=True, progress=None, **world):
    ms = 0.5 if op == "combine" else 2.0
    return {"check": "ok", "post_check": "ok", "build_s": 0.1,
            combine.PRIMARY[op]: timing.summarize([ms, ms * 1.2, ms * 0.8])}


def _fake_baseline(torch, cfg, sets, w, iters, warmup, gate, device_index, check_rank,
                   progress, op="combine"):
    toks, ids = sets[0]
    rows, order = dispatch_numpy(np.stack(toks), np.stack(ids))
    R, T, K = np.stack(ids).shape
    slots, out = combine_baseline.combine_numpy(rows, order, np.stack(w), R, T, K)
    return {"check": combine_baseline.check(cfg, sets, w, check_rank, slots[check_rank],
                                            out[check_rank]),
            "round_trip": timing.summarize([4.0, 4.2, 3.8])}


@pytest.fixture
def fake_combine(fake_gpu, monkeypatch):  # noqa: F811 - the imported fixture
    monkeypatch.setattr(combine, "measure_world", _fake_measure)
    monkeypatch.setattr(combine_baseline, "measure", _fake_baseline)


RUN = ("--preset", "small", "--tokens", "16", "--no-gate")


@pytest.mark.parametrize("op", ["combine", "moe"])
def test_run_with_fake_phases(fake_combine, op):
    p = bench_args(*RUN, "--op", op)
    assert p.op == op
    res = driver.run(p, quiet())
    assert res["failures"] == [] and res["op"] == op
    s = res["shapes"][0]
    b = s["baseline"]
    assert b["name"] == combine_baseline.NAMES[op] and b["check"] == "ok"
    v = s["variants"][0]
    key = combine.PRIMARY[op]
    cfg = p.config(16, p.variants[0], s["recv_block_capacity"])
    nb = traffic.op_bytes(cfg, 16, op)
    m = v[key]
    assert m["bytes"] == nb == v["bytes"]["total"]
    ms = 0.5 if op == "combine" else 2.0
    assert m["gbps"] == pytest.approx(nb / ms / 1e6)
    assert m["fraction_of_copy"] == pytest.approx(m["gbps"] / 4000.0)
    assert v["speedup_vs_baseline"] == pytest.approx(4.0 / ms)
    assert "round_trip" not in v
    rows = report.table_rows(res)
    label = "combine" if op == "combine" else "dispatch + combine"
    mine = [r for r in rows if r["variant"] == f"epgen default {label}"]
    assert len(mine) == 1 and mine[0]["speedup"] == pytest.approx(4.0 / ms)
    assert any(r["variant"] == combine_baseline.NAMES[op] for r in rows)
    series = report.plot_series(res)
    assert set(series) == {"epgen default", combine_baseline.NAMES[op]}


def test_epgen_bench_op_combine_json(fake_combine, tmp_path, capsys):
    js = tmp_path / "c.json"
    status = cli.main(["bench", *RUN, "--op", "combine", "--json", str(js)])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "epgen default combine" in out and combine_baseline.NAMES["combine"] in out
    assert "per combine" in out
    data = json.loads(js.read_text())
    assert data["op"] == "combine" and data["plan"]["op"] == "combine"
    v = data["shapes"][0]["variants"][0]
    assert {"median_ms", "gbps", "fraction_of_copy", "bytes"} <= set(v["combine"])
    assert data["method"]["combine"].startswith("transform-free")


def test_a_wrong_baseline_fails_the_run(fake_combine, monkeypatch, capsys):
    def corrupt(*a, **k):
        r = _fake_baseline(*a, **k)
        r["check"] = ["rank 0 slots: 1 elements differ from the reference"]
        return r
    monkeypatch.setattr(combine_baseline, "measure", corrupt)
    status = cli.main(["bench", *RUN, "--op", "combine"])
    _, err = capsys.readouterr()
    assert status == 1 and "baseline: FAILED: rank 0 slots" in err


def test_dispatch_stays_the_default(fake_gpu):  # noqa: F811
    p = bench_args(*RUN)
    assert p.op == "dispatch"
    res = driver.run(p, quiet())
    assert res["op"] == "dispatch" and "round_trip" in res["shapes"][0]["variants"][0]


@pytest.mark.parametrize("argv, match", [
    (["--op", "moe", "--world", "p2p", "--variant", "g=graph"],
     "graph with --op moe .*EmulatedWorld.capture_moe.*not p2p"),
    (["--op", "combine", "--variant", "g=graph"], "graph times a whole replay"),
    (["--op", "bogus"], "invalid choice"),
])
def test_bad_op_arguments_are_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *RUN, *argv])
    assert info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_a_configuration_combine_does_not_take_is_a_usage_error(monkeypatch, capsys):
    from epgen.bench import plan

    def refuse(cfg):
        if cfg.ep_final_layout:
            raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(plan, "check_supported", refuse)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *RUN, "--op", "moe", "--variant", "f=ep_final_layout"])
    assert info.value.code == 2
    assert re.search("argument --op moe: variant f: .*testing", capsys.readouterr().err)
    bench_args(*RUN, "--op", "moe", "--variant", "default")          # accepted


@pytest.mark.parametrize("fmt", ["NVFP4", "BlockwiseFP8"])
def test_measure_world_with_a_quantising_format_on_the_simulator(fmt, seed):
    """A quantising format's rows are not BF16: fixed random BF16 expert outputs instead,
    checked like the transform-free ones."""
    import epgen
    from epgen.formats import make_format
    H = 128
    cfg = epgen.EPConfig(num_threads=64, n_sms=4, n_experts=4, n_ranks=2, max_tokens_per_rank=4,
                         p2p_world_size=2, use_shmem=False, token_fmt=make_format(fmt, H, 2))
    sets = inputs.make_input_sets(cfg, 4, 2, seed=seed)
    w = combine.weights(cfg, 4, seed)
    res = combine.measure_world(cfg, sets, w, 2, 0, None, op="moe",
                                world_factory=lambda: EmulatedWorld(cfg, backend="sim",
                                                                    sim_seed=seed),
                                timer=_fake_timer, progress=lambda m: None)
    assert res["check"] == "ok" and res["post_check"] == "ok", f"seed {seed}"
