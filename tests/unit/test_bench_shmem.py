"""CPU tests of ``epgen bench --world shmem`` (``epgen.bench.shmem``) and of the options every
world now shares for ``--op combine|moe``: the ``--compare-p2p`` syntax, the SHMEM plan and
what it refuses (usage errors naming the option, before NVSHMEM starts), the bytes a PE
sends, the expert rows that name their slot, the combination of the PEs' timings and the
comparison, the report; and a whole run of two PEs with the worlds and the measurement
faked (the order of the worlds, the lines, the JSON)."""

from __future__ import annotations

import io
import json
import re
import types

import numpy as np
import pytest

from epgen import cli, reference, routing
from epgen.bench import options, plan, shmem
from epgen.bench.plan import ShmemPlan
from epgen.commands import bench as bench_command
from epgen.commands.common import config_from_args
from epgen.reference_combine import source_of_rows

from test_bench import bench_args, tiny_cfg

SMALL_SHMEM = ["--world", "shmem", "--preset", "small", "--set", "use_shmem=true"]


def shmem_plan(*argv):
    """``epgen bench *argv`` (with ``--world shmem``) parsed into a ``ShmemPlan``, as
    ``epgen.commands.bench.run`` does before NVSHMEM starts."""
    parser = cli.build_parser()
    args = parser.parse_args(["bench", *argv])
    options.apply_compare_p2p(args)
    cfg, _ = config_from_args(args, default=bench_command.default_preset(args.world))
    return options.shmem_plan_from_args(args.parser, args, cfg, arch=args.arch)


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


# ---- options -----------------------------------------------------------------------------------
def test_parse_p2p_sizes():
    assert plan.parse_p2p_sizes("1,4") == (1, 4)
    assert plan.parse_p2p_sizes("4, 1,2") == (1, 2, 4)
    for bad in ("4", "1,1", "0,2", "-1,2", "a,b", ""):
        with pytest.raises(ValueError, match="p2p_world_size"):
            plan.parse_p2p_sizes(bad)


def test_shmem_plan_defaults_and_overrides():
    p = shmem_plan(*SMALL_SHMEM, "--set", "p2p_world_size=1")
    assert (p.op, p.sizes, p.reference_size, p.iters, p.warmup, p.check) == \
        ("dispatch", (1,), 1, plan.SHMEM_ITERS, plan.SHMEM_WARMUP, True)
    assert p.tokens == (p.base.max_tokens_per_rank,)
    p = shmem_plan(*SMALL_SHMEM, "--op", "moe", "--compare-p2p", "2,1", "--tokens", "16,32",
                   "16", "--iters", "7", "--warmup", "0", "--no-post-check", "--seed", "3")
    assert (p.op, p.sizes, p.reference_size, p.tokens) == ("moe", (1, 2), 2, (16, 32))
    assert (p.iters, p.warmup, p.check, p.seed) == (7, 0, False, 3)
    assert [p.config(s).p2p_world_size for s in p.sizes] == [1, 2]
    assert {p.config(s).max_tokens_per_rank for s in p.sizes} == {32}
    assert p.describe()["p2p_sizes"] == [1, 2] and p.describe()["tokens"] == [16, 32]


@pytest.mark.parametrize("option, extra", [
    ("--variant", ["--variant", "fused"]),
    ("--routing", ["--routing", "zipf"]),
    ("--sets", ["--sets", "2"]),
    ("--block-capacity", ["--block-capacity", "full"]),
    ("--devices", ["--devices", "0,0"]),
    ("--device", ["--device", "1"]),
    ("--check-rank", ["--check-rank", "1"]),
    ("--plot", ["--plot", "x.png"]),
    ("--copy-mib", ["--copy-mib", "64"]),
    ("--copy-iters", ["--copy-iters", "3"]),
    ("--mem-fraction", ["--mem-fraction", "0.5"]),
])
def test_shmem_refuses_what_it_would_ignore(option, extra, capsys):
    err = usage_error(capsys, SMALL_SHMEM + ["--set", "p2p_world_size=1", *extra])
    assert f"argument {option}: not with --world shmem" in err, err
    assert option in {o for o, _dest, _why in options.SHMEM_REFUSED}


@pytest.mark.parametrize("argv, match", [
    (["--compare-p2p", "1,4"], r"argument --compare-p2p: p2p_world_size=4: .*must divide"),
    # the configuration is built at the smallest size (appended to --set), then each world
    (["--compare-p2p", "3,4"], r"--set p2p_world_size=3: invalid EPConfig.*must divide"),
    (["--compare-p2p", "1,2", "--set", "use_shmem=false"],
     r"--set p2p_world_size=1: .*p2p_world_size=1 < n_ranks=2: .*set use_shmem=True"),
    (["--set", "p2p_world_size=1", "--set", "use_shmem=false"],     # the configuration's
     r"p2p_world_size=1 < n_ranks=2: .*set use_shmem=True"),
    (["--set", "p2p_world_size=1", "--warmup", "-1"], "argument --warmup: must be >= 0"),
    (["--compare-p2p", "2"], "argument --compare-p2p: expected at least two distinct"),
    (["--set", "p2p_world_size=1", "--json", "/no/such/dir/x.json"], "--json"),
])
def test_shmem_bad_values_are_usage_errors(argv, match, capsys):
    assert re.search(match, usage_error(capsys, SMALL_SHMEM + argv), re.S)


def test_shmem_combine_refuses_what_combine_does_not_take(monkeypatch, capsys):
    def refuse(cfg):
        raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(plan, "check_supported", refuse)
    err = usage_error(capsys, SMALL_SHMEM + ["--op", "combine", "--compare-p2p", "1,2"])
    assert "argument --compare-p2p: p2p_world_size=1: world.combine: not supported" in err
    shmem_plan(*SMALL_SHMEM, "--compare-p2p", "1,2")                # dispatch: accepted


@pytest.mark.parametrize("world", ["emulated", "p2p"])
def test_compare_p2p_only_with_the_shmem_world(world, capsys):
    err = usage_error(capsys, ["--world", world, "--preset", "small", "--compare-p2p", "1,2"])
    assert "argument --compare-p2p: only with --world shmem" in err


def test_the_emulated_plan_refuses_the_shmem_world(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["bench", *SMALL_SHMEM])
    cfg, _ = config_from_args(args)
    with pytest.raises(SystemExit):
        options.plan_from_args(args.parser, args, cfg, [16])
    assert "one process per PE" in capsys.readouterr().err


@pytest.mark.parametrize("op", ["combine", "moe"])
def test_p2p_takes_combine_and_moe(op):
    p = bench_args("--world", "p2p", "--preset", "small", "--op", op, "--tokens", "16",
                   "--variant", "default", "--variant", "fused")
    assert (p.world, p.op) == ("p2p", op)


def test_compare_p2p_builds_the_configuration_at_its_smallest_size(capsys):
    """A preset whose own p2p_world_size does not divide the PE count runs with
    --compare-p2p alone (the decode preset's 8 on 4 PEs); no note that the configuration
    makes no NVSHMEM call (its smallest size does)."""
    p = shmem_plan("--world", "shmem", "--preset", "decode", "--set", "n_ranks=4", "--set",
                   "n_experts=28", "--set", "n_sms=8", "--set", "use_shmem=true", "--tokens",
                   "128", "--compare-p2p", "1,4")
    assert (p.sizes, p.base.p2p_world_size, p.base.n_ranks) == ((1, 4), 1, 4)
    assert p.config(1).needs_shmem and not p.config(4).needs_shmem
    assert "no NVSHMEM call" not in capsys.readouterr().err


def test_symmetric_bytes_by_the_layouts():
    from epgen.combine_layout import CombineLayout
    from epgen.runtime.combine import GUARD_BYTES

    cfg = tiny_cfg(T=8, H=16, K=2, R=2, E=4).replace(use_shmem=True, p2p_world_size=1)
    lay, H = cfg.layout, 16
    dispatch = lay.send_buf_bytes + lay.recv_buf_bytes + lay.recv_count_bytes + \
        lay.max_out_rows * H * 2 + lay.hdr_buf_bytes + lay.prod_buf_bytes
    assert shmem.symmetric_bytes(cfg, "dispatch") == dispatch
    clay = CombineLayout(cfg)
    assert clay.arrival_word_bytes == 8                     # u64 under the SHMEM transport
    assert shmem.symmetric_bytes(cfg, "moe") == shmem.symmetric_bytes(cfg, "combine") == \
        dispatch + clay.recv_bytes + GUARD_BYTES + 8 * clay.arrival_words + \
        lay.max_out_rows * H * 2


# ---- bytes and rows ----------------------------------------------------------------------------
def test_sent_bytes_by_hand():
    cfg = tiny_cfg(T=2, H=16, K=2, R=2, E=4)            # L = 2
    ids = [np.array([[0, 2], [2, 3]]), np.array([[0, 1], [1, 3]])]
    msg = cfg.layout.msg_bytes
    # a message per remote slot: rank 0's (0, 1), (1, 0), (1, 1); rank 1's (0, 0), (0, 1), (1, 0)
    assert shmem.sent_bytes(cfg, ids[0], 0) == 3 * msg
    assert shmem.sent_bytes(cfg, ids[1], 1) == 3 * msg
    assert shmem.sent_bytes(cfg, np.array([[-1, 2], [-1, -1]]), 0) == msg   # -1 sends nothing
    row = 16 * 2
    # rank 0 sends back the rows rank 1 routed to it: (0, 0), (0, 1), (1, 0)
    assert shmem.combine_sent_bytes(cfg, ids, 0) == 3 * row
    assert shmem.combine_sent_bytes(cfg, ids, 1) == 3 * row      # (0,1), (1,0), (1,1)
    assert shmem.op_sent_bytes(cfg, ids, 0, "dispatch") == 3 * msg
    assert shmem.op_sent_bytes(cfg, ids, 0, "combine") == 3 * row
    assert shmem.op_sent_bytes(cfg, ids, 0, "moe") == 3 * msg + 3 * row


def test_expert_rows_name_their_slot(seed):
    cfg = tiny_cfg(T=6, H=16, K=2, R=2, E=4)
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, 6)
    res = reference.dispatch(cfg, toks, ids)
    for d in range(2):
        src = source_of_rows(res[d])
        rows = shmem.expert_rows(res[d], toks)
        only = shmem.expert_rows(res[d], toks, only_source=1)
        for i, s in enumerate(src):
            t, k = res[d].src_info[i]
            want = np.roll(toks[s][t], k) if s >= 0 else np.zeros(16, np.uint16)
            assert np.array_equal(rows[i], want), (seed, d, i)
            assert np.array_equal(only[i], want if s == 1 else 0 * want), (seed, d, i)


# ---- combining the PEs, comparing, the report -----------------------------------------------------
def pe(rank, times, sent=7_000_000):
    return {"rank": rank, "sent_bytes": sent, "check": "ok", "post_check": "ok",
            "times_ms": times}


DIRECT = [pe(0, [0.30, 0.35, 0.40]), pe(1, [0.32, 0.30, 0.50])]   # slowest: .32 .35 .50
PUTS = [pe(0, [1.0, 1.4, 1.2]), pe(1, [1.1, 1.3, 1.5])]           # slowest: 1.1 1.4 1.5


def results_of(runs, sizes=(1, 2), op="dispatch"):
    ref = max(sizes)
    return {"n_pes": 2, "op": op, "date": "2026-12-05T00:00:00+00:00", "git_commit": "abc",
            "git_dirty": False, "device": "Fake GPU", "mps_thread_percentage": "50",
            "plan": {"iters": 3, "warmup": 1, "p2p_sizes": list(sizes), "reference_size": ref},
            "runs": runs, "comparisons": shmem.comparisons(runs, ref), "failures": []}


def test_combine_pes_takes_the_slowest_pe_per_call():
    e = shmem.combine_pes(DIRECT, 2, 2, 128)
    assert (e["path"], e["shape"], e["p2p_world_size"]) == ("direct stores", "decode", 2)
    assert e["summary"]["median_ms"] == pytest.approx(0.35) and e["summary"]["n"] == 3
    assert [x["median_ms"] for x in e["per_pe"]] == pytest.approx([0.35, 0.32])
    assert e["gbps_per_pe"] == pytest.approx(7e6 / 0.35 / 1e6)
    assert "times_ms" not in e["per_pe"][0] and "error" not in e
    late = [dict(DIRECT[0]), dict(DIRECT[1], post_check="FAILED: rank 1 differs")]
    assert shmem.combine_pes(late, 2, 2, 128)["error"] == \
        "rank 1 after timing: FAILED: rank 1 differs"
    assert [shmem.path_name(p, 8) for p in (8, 1, 4)] == [
        "direct stores", "SHMEM puts", "stores in groups of 4, puts between"]


def test_comparisons_by_hand():
    runs = [shmem.combine_pes(PUTS, 1, 2, 128), shmem.combine_pes(DIRECT, 2, 2, 128)]
    (c,) = shmem.comparisons(runs, 2)
    assert (c["p2p_world_size"], c["reference_p2p_world_size"]) == (1, 2)
    assert (c["median_us"], c["reference_median_us"]) == pytest.approx((1400.0, 350.0))
    assert c["of_reference"] == pytest.approx(0.25)
    assert c["per_pe_of_reference"] == pytest.approx([0.35 / 1.2, 0.32 / 1.3])
    # a shape whose reference world did not time: nothing to compare
    failed = dict(shmem.combine_pes(DIRECT, 2, 2, 64))
    failed.pop("summary")
    assert shmem.comparisons([shmem.combine_pes(PUTS, 1, 2, 64), failed], 2) == []


def test_report_table_and_comparison_lines():
    runs = [shmem.combine_pes(PUTS, 1, 2, 128), shmem.combine_pes(DIRECT, 2, 2, 128)]
    res = results_of(runs)
    lines = shmem.format_table(res).splitlines()
    assert lines[0].split()[:4] == ["shape", "T", "p2p", "path"]
    assert lines[0].endswith("x of direct stores")
    puts, direct = lines[1].split(), lines[2].split()
    assert puts[:3] == ["decode", "128", "1"] and " SHMEM puts " in lines[1]
    assert puts[-4:] == ["1400.0", "1200.0-1300.0", "5.00", "0.250x"]
    assert direct[-4:] == ["350.0", "320.0-350.0", "20.00", "1.000x"]
    (line,) = shmem.comparison_lines(res)
    assert line == ("T=128 round trip: p2p_world_size=1 (SHMEM puts) 1400.0 us against "
                    "p2p_world_size=2 (direct stores) 350.0 us: 0.25x of direct stores "
                    "(per PE 0.29, 0.25)")
    out = io.StringIO()
    shmem.print_report(res, out)
    text = out.getvalue()
    assert text.startswith("epgen bench --world shmem --op dispatch  2026-12-05")
    assert "2 PEs, Fake GPU, MPS 50% per PE" in text and "3 calls after 1" in text
    single = results_of([runs[1]], sizes=(2,))
    assert "x of" not in shmem.format_table(single) and shmem.comparison_lines(single) == []
    assert shmem.of_label(2, 4) == "of p2p_world_size=2"


def test_rank_lines():
    e = shmem.combine_pes(DIRECT, 2, 2, 128)
    assert shmem.rank_line(e, 1, "combine", 2) == (
        "rank 1: 128 tokens/rank, 2 PEs (p2p_world_size=2): combine median 320.0 us, min "
        "300.0 us over 3 calls, 21.88 GB/s sent")
    bad = [dict(p, check="FAILED: rank 0: x") for p in DIRECT]
    for p in bad:
        p.pop("times_ms")
    e = shmem.combine_pes(bad, 1, 2, 16)
    assert shmem.rank_line(e, 0, "moe", 2) == \
        "rank 0: 16 tokens/rank, 2 PEs (p2p_world_size=1): FAILED: rank 0: x"
    row = shmem.format_table(results_of([e], sizes=(1,))).splitlines()[1]
    assert row.split()[:3] == ["T=16", "16", "1"] and row.endswith("(FAILED: rank 0: x)")


# ---- a whole run of two PEs, the worlds and the measurement faked ----------------------------------
class FakeGather:
    """Rank 0 of two PEs: PE 1's value is PE 0's with its times 1.5 x (slower)."""

    def __init__(self):
        self.names = []

    def all_gather_bytes(self, data, name="gather", timeout_s=None):
        self.names.append(name)
        mine = json.loads(data)
        other = json.loads(data)
        if isinstance(other, dict) and "times_ms" in other:
            other = dict(other, rank=1, times_ms=[1.5 * t for t in other["times_ms"]])
        return [json.dumps(mine).encode(), json.dumps(other).encode()]


def test_run_of_two_pes_on_fakes(monkeypatch, tmp_path):
    events = []

    class World:
        def __init__(self, cfg, session=None, arch=None):
            self.cfg, self.rank, self.device = cfg, session.rank, types.SimpleNamespace(
                name="Fake GPU")
            events.append(("open", cfg.p2p_world_size, cfg.max_tokens_per_rank))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append(("close", self.cfg.p2p_world_size))
            return False

    def measure(world, plan_, T, toks, ids, w, *, exchange):
        assert (w is None) == (plan_.op == "dispatch") and len(toks) == 2
        base = 1.0 if world.cfg.p2p_world_size == 1 else 0.25   # ms
        events.append(("measure", world.cfg.p2p_world_size, T))
        return pe(world.rank, [base * T / 16] * 3, sent=1000)

    monkeypatch.setattr(shmem, "ShmemWorld", World)
    monkeypatch.setattr(shmem, "measure_shape", measure)
    gather = FakeGather()
    session = types.SimpleNamespace(rank=0, bootstrap=gather)
    cfg = tiny_cfg(T=16, H=16, K=2, R=2, E=4).replace(use_shmem=True)
    p = ShmemPlan(base=cfg, tokens=(16, 32), op="combine", p2p_sizes=(1, 2), iters=3,
                  warmup=0)
    out = io.StringIO()
    js = tmp_path / "s.json"
    res = shmem.run(p, session=session, json_path=str(js), out=out)
    assert events == [("open", 1, 32), ("measure", 1, 16), ("measure", 1, 32), ("close", 1),
                      ("open", 2, 32), ("measure", 2, 16), ("measure", 2, 32), ("close", 2)]
    assert gather.names == ["bench"] * 4 and res["failures"] == []
    (c16, c32) = res["comparisons"]
    # the slowest PE is PE 1 (1.5x): the ratio is 0.25 either way, per PE too
    assert [c["tokens_per_rank"] for c in (c16, c32)] == [16, 32]
    assert c16["median_us"] == pytest.approx(1500.0) and c16["of_reference"] == \
        pytest.approx(0.25)
    assert c32["per_pe_of_reference"] == pytest.approx([0.25, 0.25])
    text = out.getvalue()
    assert text.count("rank 0: ") == 4 and "combine median 1000.0 us" in text
    assert "T=32 combine: p2p_world_size=1 (SHMEM puts) 3000.0 us against p2p_world_size=2 " \
           "(direct stores) 750.0 us: 0.25x of direct stores (per PE 0.25, 0.25)" in text
    data = json.loads(js.read_text())
    assert data["world"] == "shmem" and data["n_pes"] == 2 and data["device"] == "Fake GPU"
    assert [(r["p2p_world_size"], r["tokens_per_rank"]) for r in data["runs"]] == [
        (1, 16), (1, 32), (2, 16), (2, 32)]
    assert data["plan"]["reference_size"] == 2 and data["comparisons"] == res["comparisons"]


def test_run_stops_every_world_at_a_failed_check(monkeypatch):
    opened = []

    class World:
        def __init__(self, cfg, session=None, arch=None):
            self.cfg, self.rank, self.device = cfg, 0, None
            opened.append(cfg.p2p_world_size)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def measure(world, plan_, T, toks, ids, w, *, exchange):
        return {"rank": 0, "sent_bytes": 0, "check": "FAILED: rank 1: differs"}
    monkeypatch.setattr(shmem, "ShmemWorld", World)
    monkeypatch.setattr(shmem, "measure_shape", measure)
    cfg = tiny_cfg(T=16, R=2).replace(use_shmem=True)
    p = ShmemPlan(base=cfg, tokens=(16, 32), p2p_sizes=(1, 2))
    out = io.StringIO()
    res = shmem.run(p, session=types.SimpleNamespace(rank=0, bootstrap=FakeGather()), out=out)
    assert opened == [1] and len(res["runs"]) == 1
    assert res["failures"] == ["p2p_world_size=1, T=16: FAILED: rank 1: differs"]
    assert "FAILED: p2p_world_size=1, T=16" in out.getvalue()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", ["dispatch", "combine", "moe"])
def test_gpu_test_arguments_are_valid(n, op):
    """The arguments tests/gpu/test_bench_worlds_gpu.py launches parse into the plans they
    mean, so a failure there is the GPU's, not a typo's."""
    import test_bench_worlds_gpu as gpu

    p = shmem_plan(*gpu.shmem_bench_args(n, op, f"1,{n}"))
    assert (p.op, p.sizes, p.tokens, p.iters, p.warmup) == (op, (1, n), (32,), 5, 2)
    assert p.base.n_ranks == n and p.base.use_shmem
    one = shmem_plan(*gpu.shmem_bench_args(n, op, None))
    assert one.sizes == (1,) and one.config(1).needs_shmem


def test_the_benchmark_script_launches_valid_runs(tmp_path):
    """benchmarks/shmem_bench.sh with a recording stand-in for python: one launch per PE
    count, shape and op, each a bench command that parses into the plan it means."""
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@" >> "$OUT/calls.txt"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path), "PES": "2 4",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", os.path.join(repo, "benchmarks", "shmem_bench.sh")],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 * 2 * 3
    seen = set()
    for call in calls:
        launch, bench = call.split(" -- ", 1)
        n = int(launch.split()[launch.split().index("-n") + 1])
        argv = bench.split()
        assert argv[:3] == [str(fake), "-m", "epgen"] and argv[3] == "bench"
        p = shmem_plan(*argv[4:])
        assert (p.base.n_ranks, p.sizes, p.base.layout.n_local_experts) == (n, (1, n), 7)
        assert p.check == (p.tokens == (128,)) and p.iters == 50
        seen.add((n, p.tokens, p.op))
    assert seen == {(n, t, op) for n in (2, 4) for t in ((128,), (4096,))
                    for op in ("dispatch", "combine", "moe")}


# ---- --copy-rate -------------------------------------------------------------------------------
def test_copy_rate_option_sets_the_plan_and_needs_the_shmem_world(capsys):
    assert shmem_plan(*SMALL_SHMEM, "--compare-p2p", "1,2", "--copy-rate").copy_rate
    assert not shmem_plan(*SMALL_SHMEM, "--compare-p2p", "1,2").copy_rate
    for world in ("emulated", "p2p"):
        err = usage_error(capsys, ["--world", world, "--preset", "small", "--copy-rate"])
        assert "argument --copy-rate: only with --world shmem" in err


def test_copy_messages_are_the_busiest_pes_dispatch_bytes_in_messages():
    """Two ranks of two local experts: rank 0 sends 3 remote slots, rank 1 sends 1."""
    cfg = tiny_cfg(T=4, H=16, K=2, R=2, E=4).replace(use_shmem=True)
    ids = [np.array([[2, 3], [0, 2], [1, -1], [0, 1]], np.int32),
           np.array([[2, 3], [0, 3], [3, -1], [2, 3]], np.int32)]
    row = shmem.dispatch_row_bytes(cfg)
    assert shmem.sent_bytes(cfg, ids[0], 0) == 3 * row
    assert shmem.copy_messages(cfg, ids) == 3 * row // cfg.layout.msg_bytes
    none = [np.full((4, 2), -1, np.int32)] * 2
    assert shmem.copy_messages(cfg, none) == 1


def test_run_times_the_copy_rate_on_the_smallest_world_after_each_shape(monkeypatch):
    events = []

    class World:
        def __init__(self, cfg, session=None, arch=None):
            self.cfg, self.rank, self.device = cfg, 0, None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def measure(world, plan_, T, toks, ids, w, *, exchange):
        events.append(("measure", world.cfg.p2p_world_size, T))
        return pe(world.rank, [1.0] * 3, sent=1000)

    def copy(world, n_msgs, iters, warmup, exchange):
        events.append(("copy", world.cfg.p2p_world_size, n_msgs, iters, warmup))
        modes = {"stores": {"check": "ok", "median_us": 10.0, "gbps_per_pe": 5.0,
                            "of_stores": 1.0},
                 "puts": {"check": "FAILED: PE 1: 1 of 3 checked slots differ"}}
        return {"n_msgs": n_msgs, "msg_bytes": 64, "grid": 2, "threads": 64, "modes": modes}
    monkeypatch.setattr(shmem, "ShmemWorld", World)
    monkeypatch.setattr(shmem, "measure_shape", measure)
    monkeypatch.setattr(shmem.copy_rate, "measure", copy)
    monkeypatch.setattr(shmem, "copy_messages", lambda cfg, ids: 9)
    cfg = tiny_cfg(T=16, R=2).replace(use_shmem=True)
    p = ShmemPlan(base=cfg, tokens=(16, 32), p2p_sizes=(1, 2), copy_rate=True, iters=4,
                  warmup=1)
    out = io.StringIO()
    res = shmem.run(p, session=types.SimpleNamespace(rank=0, bootstrap=FakeGather()), out=out)
    # the failed copy check stops the run: no second shape, no second world
    assert events == [("measure", 1, 16), ("copy", 1, 9, 4, 1)]
    assert res["failures"] == ["T=16: copy rate puts: FAILED: PE 1: 1 of 3 checked slots "
                               "differ"]
    assert res["copy_rate"][0]["tokens_per_rank"] == 16
    text = out.getvalue()
    assert text.count("T=16 copy rate (9 messages of 64 B per PE, 2 blocks of 64 threads): "
                      "stores 10.0 us (5.0 GB/s per PE, 1.000x of stores); puts FAILED") == 2
