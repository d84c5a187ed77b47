"""``epgen bench --world p2p --op combine|moe``: the bytes the combine moves over the links,
the measurement on a simulated ``P2PWorld`` timed as the P2P dispatch is (from an idle
device: the host waits for every stream before each sample), and whole runs with the device
phases faked (rates by the op's bytes, no NCCL baseline, the report, the JSON, the memory
each GPU needs)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from epgen import cli
from epgen.bench import combine, inputs, memory, p2p, timing, traffic
from epgen.inspection import combine_buffers
from epgen.runtime.p2p_world import P2PWorld

from sync_recorder import record_syncs
from test_bench_p2p import bench_plan, fake_gpus, tiny_cfg  # noqa: F401 - fixture
from test_final_layout_sim import SHAPES, make_cfg


def test_link_bytes_of_combine_and_moe_by_hand():
    cfg = tiny_cfg(H=16)                      # L = 2; messages of 64 B, BF16 rows of 32 B
    ids = [np.array([[0, 2], [1, 3]]), np.array([[2, 3], [0, 1]])]
    # pairs: rank 0 -> rank 1: 2, rank 1 -> rank 0: 2; each keeps 2
    d = p2p.link_bytes(cfg, ids)
    assert (d["sent"], d["received"], d["local"]) == ([128, 128], [128, 128], [128, 128])
    c = p2p.link_bytes(cfg, ids, "combine")
    assert c["combine_row_bytes"] == 32
    assert (c["sent"], c["received"], c["local"]) == ([64, 64], [64, 64], [64, 64])
    one_way = [np.array([[0, 2], [1, 3]]), np.array([[2, 3], [2, 3]])]   # 1 -> 0: nothing
    c = p2p.link_bytes(cfg, one_way, "combine")
    assert (c["sent"], c["received"]) == ([0, 64], [64, 0])     # rank 1 sends 0's rows back
    m = p2p.link_bytes(cfg, one_way, "moe")
    assert (m["sent"], m["received"]) == ([128, 64], [64, 128]) and m["busiest"] == 128
    assert m["total_remote"] == 192
    with pytest.raises(ValueError, match="op must be"):
        p2p.link_bytes(cfg, ids, "bogus")


# ---- the measurement on simulated GPUs ------------------------------------------------------------
@pytest.mark.parametrize("op", ["combine", "moe"])
def test_combine_measure_world_host_sync_on_a_simulated_p2p_world(op, seed, monkeypatch):
    """``combine.measure_world(host_sync=True)`` on a ``P2PWorld`` of simulated GPUs, the
    event timing replaced: every sample starts after the host waited for every rank stream
    and the timing stream; the checks before and after the timing pass."""

    cfg = make_cfg(*SHAPES["R2-E4"])
    T = cfg.max_tokens_per_rank
    sets = inputs.make_input_sets(cfg, T, 2, seed=seed)
    w = combine.weights(cfg, T, seed)
    events, timer = record_syncs(monkeypatch)
    worlds = []

    def factory():
        worlds.append(P2PWorld(cfg, backend="sim", sim_seed=seed))
        return worlds[0]
    res = combine.measure_world(cfg, sets, w, 2, 1, None, op=op, host_sync=True,
                                world_factory=factory, timer=timer, progress=lambda m: None)
    assert res["check"] == "ok" and res["post_check"] == "ok", f"seed {seed}"
    assert res[combine.PRIMARY[op]]["n"] == 2
    samples = [i for i, e in enumerate(events) if e[0] == "sample"]
    # a combine is also timed by its send and reduce kernels alone
    assert len(samples) == (2 + 1) * (3 if op == "combine" else 1)
    for i in samples:
        want = set(events[i][1])
        synced = set()
        for e in reversed(events[:i]):            # the syncs since the previous sample
            if e[0] == "sample":
                break
            synced.add(e[1])
        assert want <= synced, (i, events[max(0, i - 6):i])
    assert len(worlds) == 1 and len(worlds[0].device_ids) == 2


def test_combine_measure_world_host_sync_takes_no_gate():
    with pytest.raises(ValueError, match="host_sync.*no gate"):
        combine.measure_world(None, [], [], 1, 0, object(), op="combine", progress=print,
                              host_sync=True)


# ---- whole runs, device phases faked --------------------------------------------------------------
SEEN = []


def _fake_combine(cfg, sets, w, iters, warmup, gate, *, op, device=None, arch=None,
                  post_check=True, progress=None, graph=False, world_factory=None,
                  host_sync=False, **kw):
    # timed as the P2P dispatch: host-synchronised, no gate, one GPU per rank
    assert host_sync and gate is None and callable(world_factory)
    assert len(w) == cfg.n_ranks and w[0].shape == (cfg.max_tokens_per_rank,
                                                    cfg.token_fmt.top_k)
    SEEN.append((op, graph))
    ms = 0.04 if op == "combine" else 0.1
    return {"check": "ok", "post_check": "ok", "build_s": 0.1,
            combine.PRIMARY[op]: timing.summarize([ms, 1.1 * ms, 0.9 * ms])}


@pytest.fixture
def fake_ops(fake_gpus, monkeypatch):  # noqa: F811 - the imported fixture
    del SEEN[:]
    monkeypatch.setattr(combine, "measure_world", _fake_combine)
    nccl = []
    monkeypatch.setattr(p2p, "nccl_phase", lambda *a, **k: nccl.append(a) or {})
    return nccl


RUN = ("--world", "p2p", "--preset", "small", "--tokens", "16,32", "--no-gate")


@pytest.mark.parametrize("op", ["combine", "moe"])
def test_whole_p2p_run_of_an_op_on_fakes(fake_ops, op, tmp_path, capsys):
    path = tmp_path / "p2p.json"
    assert cli.main(["bench", *RUN, "--op", op, "--variant", "default", "--variant", "fused",
                     "--json", str(path)]) == 0
    assert fake_ops == []                                   # no NCCL job for combine and moe
    assert SEEN == [(op, False)] * 4
    res = json.loads(path.read_text())
    assert res["op"] == op and res["failures"] == []
    key = combine.PRIMARY[op]
    ms = 0.04 if op == "combine" else 0.1
    for s in res["shapes"]:
        assert s["baseline"]["skipped"] == p2p.NO_COMBINE_BASELINE
        for v in s["variants"]:
            m = v[key]
            assert "round_trip" not in v and "speedup_vs_baseline" not in v
            cfg = bench_plan(*RUN, "--op", op).config(s["tokens_per_rank"])
            sets = inputs.make_input_sets(cfg, s["tokens_per_rank"], 3)
            want = p2p.sets_link_bytes(cfg, sets, op)["busiest"]
            assert v["link_bytes"]["busiest"] == pytest.approx(want)
            assert m["busiest_gpu_gbps"] == pytest.approx(want / ms / 1e6)
            assert m["fraction_of_link"] == pytest.approx(m["busiest_gpu_gbps"] / 360.0)
            assert v["bytes"]["total"] == traffic.op_bytes(cfg, s["tokens_per_rank"], op)
    out = capsys.readouterr().out
    label = p2p.OP_LABELS[op]
    rows = [x for x in out.splitlines() if x.startswith(("T=16", "T=32"))]
    mine = [x for x in rows if f"epgen default {label}" in x]
    assert len(mine) == 2 and f"{1e3 * ms:.1f}" in mine[0].split()
    assert all(p2p.NO_COMBINE_BASELINE in x for x in rows if p2p.NCCL_NAME in x)
    assert f"MB over the links per {label}" in out
    assert p2p.plot_series(res).keys() == {"epgen default", "epgen fused"}


def test_moe_graph_is_refused_on_p2p(fake_ops, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *RUN, "--op", "moe", "--variant", "g=graph"])
    assert e.value.code == 2 and "EmulatedWorld.capture_moe" in capsys.readouterr().err


def test_rank_memory_adds_the_combine_buffers():
    p = bench_plan(*RUN, "--op", "combine")
    d = bench_plan(*RUN)
    cfg = p.config(16)
    assert p2p.rank_memory(p, cfg, 16) - p2p.rank_memory(d, cfg, 16) == \
        combine_buffers(cfg)["bytes_per_rank"]["combine_total"]
    assert p2p.rank_memory(d, cfg, 16) == memory.world_memory(cfg)["per_rank_total"] + \
        memory.staged_inputs_memory(cfg, 16, 3) // cfg.n_ranks
