"""The benchmarks' link bytes under ``ep_rank_dedup`` (one message per (token, destination
rank) plus two 4-byte words per slot, in the index and slot tables) and the FP8 combine,
counted by hand here: the SHMEM benchmark's bytes a PE sends (``shmem.sent_bytes``), the P2P
benchmark's bytes per GPU (``p2p.link_bytes``), and ``epgen bench``'s JSON ``link_bytes`` of a ``--variant
dedup=ep_rank_dedup`` / ``--set ep_rank_dedup=true`` run and of ``--op combine
--combine-fp8`` (device phases faked on the host, ``test_bench.fake_gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

from epgen.bench import driver, inputs, p2p, shmem

from test_bench import bench_args, fake_gpu, quiet, tiny_cfg  # noqa: F401 (fixture)

#: rank 0: token 0 -> experts 0 (local) and 2 (rank 1), token 1 -> 2 and 3 (both rank 1);
#: rank 1: token 0 -> 0 and 1 (both rank 0), token 1 -> 1 (rank 0) and 3 (local). L = 2.
IDS = [np.array([[0, 2], [2, 3]]), np.array([[0, 1], [1, 3]])]
MSG = 32 + 16 + 16          # BF16 H=16, K=2: payload, src-info field, top-k field


def test_shmem_sent_bytes_with_dedup_by_hand():
    cfg = tiny_cfg(T=2, H=16, K=2, R=2, E=4, ep_rank_dedup=True)
    # rank 0: 3 remote slots, 2 (token, rank 1) pairs; rank 1: 3 remote slots, 2 pairs
    assert shmem.sent_bytes(cfg, IDS[0], 0) == 2 * MSG + 3 * 8
    assert shmem.sent_bytes(cfg, IDS[1], 1) == 2 * MSG + 3 * 8
    assert shmem.sent_bytes(cfg, np.array([[-1, 2], [-1, -1]]), 0) == MSG + 8
    assert shmem.sent_bytes(cfg, np.array([[0, 1], [1, -1]]), 0) == 0       # all local
    # the combine is not deduplicated: a BF16 row back per remote slot
    assert shmem.combine_sent_bytes(cfg, IDS, 0) == 3 * 16 * 2
    plain = tiny_cfg(T=2, H=16, K=2, R=2, E=4)
    assert shmem.sent_bytes(plain, IDS[0], 0) == 3 * MSG


def test_p2p_link_bytes_with_dedup_by_hand():
    cfg = tiny_cfg(T=2, H=16, K=2, R=2, E=4, ep_rank_dedup=True)
    d = p2p.link_bytes(cfg, IDS, "dispatch")
    assert d["sent"] == d["received"] == [2 * MSG + 24, 2 * MSG + 24]
    assert d["local"] == [MSG + 8, MSG + 8]     # one local (token, rank) and slot each
    assert d["total_remote"] == 2 * (2 * MSG + 24)
    row = 16 * 2
    c = p2p.link_bytes(cfg, IDS, "combine")
    assert c["sent"] == c["received"] == [3 * row, 3 * row] and c["local"] == [row, row]
    m = p2p.link_bytes(cfg, IDS, "moe")
    assert m["sent"] == [2 * MSG + 24 + 3 * row] * 2
    plain = p2p.link_bytes(tiny_cfg(T=2, H=16, K=2, R=2, E=4), IDS, "dispatch")
    assert plain["sent"] == [3 * MSG, 3 * MSG] and plain["local"] == [MSG, MSG]


def _remote_counts(cfg, sets):
    """Per input set: (remote (token, k) slots, remote (token, rank) pairs), visiting every
    slot."""
    L = cfg.n_experts // cfg.n_ranks
    out = []
    for _toks, ids in sets:
        slots = pairs = 0
        for s, a in enumerate(ids):
            for row in np.asarray(a):
                ranks = [int(e) // L for e in row if e >= 0 and int(e) // L != s]
                slots += len(ranks)
                pairs += len(set(ranks))
        out.append((slots, pairs))
    return out


@pytest.mark.parametrize("spec", [("--variant", "dedup=ep_rank_dedup"),
                                  ("--set", "ep_rank_dedup=true")], ids=["variant", "set"])
def test_a_dedup_run_reports_deduplicated_link_bytes(fake_gpu, spec):  # noqa: F811
    plan = bench_args("--preset", "small", "--tokens", "16", "--no-gate", *spec)
    assert plan.config(16, plan.variants[-1]).ep_rank_dedup
    res = driver.run(plan, quiet())
    assert res["failures"] == []
    s = res["shapes"][0]
    v = s["variants"][-1]
    cfg = plan.config(16, plan.variants[-1], s["recv_block_capacity"])
    sets = inputs.make_input_sets(cfg, 16, plan.sets, plan.routing, plan.zipf_s, plan.seed)
    # BF16 H=256, K=4, no padding: payload, source and top-k fields, the K f32 weights
    msg = cfg.token_fmt.hid_dim * 2 + 16 + 16 + 4 * 4
    per_set = [p * msg + 8 * n for n, p in _remote_counts(cfg, sets)]
    assert v["link_bytes"]["options"]["dedup"] is True
    assert v["link_bytes"]["per_set_link"] == per_set
    assert v["link_bytes"]["link"] == pytest.approx(np.mean(per_set))
    assert v["round_trip"]["link_bytes"] == v["link_bytes"]["link"]


def test_combine_fp8_reports_fp8_link_bytes(fake_gpu, monkeypatch):  # noqa: F811
    from epgen.bench import combine, combine_baseline, timing
    monkeypatch.setattr(combine, "measure_world", lambda *a, **k: {
        "check": "ok", "post_check": "ok", "combine": timing.summarize([2.0, 2.0, 2.0]),
        "combine_fp8": timing.summarize([1.0, 1.0, 1.0])})
    monkeypatch.setattr(combine_baseline, "measure", lambda *a, **k: {
        "check": [], "round_trip": timing.summarize([4.0, 4.0, 4.0])})
    plan = bench_args("--preset", "small", "--tokens", "16", "--no-gate", "--op", "combine",
                      "--combine-fp8")
    res = driver.run(plan, quiet())
    s = res["shapes"][0]
    v = s["variants"][0]
    cfg = plan.config(16, plan.variants[0], s["recv_block_capacity"])
    sets = inputs.make_input_sets(cfg, 16, plan.sets, plan.routing, plan.zipf_s, plan.seed)
    H = cfg.token_fmt.hid_dim
    slots = np.mean([n for n, _p in _remote_counts(cfg, sets)])
    assert v["link_bytes"]["link"] == pytest.approx(slots * 2 * H)       # BF16 rows
    assert v["combine_fp8"]["link_bytes"] == pytest.approx(slots * (H + H // 128 * 4))
    assert v["combine_fp8"]["link_gbps"] == pytest.approx(slots * (H + H // 128 * 4) / 1e6)


def test_the_shmem_benchmark_takes_dedup_by_set():
    """The SHMEM benchmark takes no --variant: ``--set ep_rank_dedup=true`` builds both
    worlds of a ``--compare-p2p`` run with it, and the bytes a PE sends follow it."""
    from test_bench_shmem import shmem_plan
    p = shmem_plan("--world", "shmem", "--preset", "small", "--set", "use_shmem=true",
                   "--set", "ep_rank_dedup=true", "--compare-p2p", "1,2", "--tokens", "16")
    assert p.sizes == (1, 2)
    assert all(p.config(size).ep_rank_dedup for size in p.sizes)


def test_the_shmem_benchmark_script_runs_each_build_of_flags(tmp_path):
    """benchmarks/shmem_bench.sh with ``FLAGS="- ep_rank_dedup"`` (a recording stand-in for
    python): each (shape, PE count, op) launched for the plain build, then with
    ``--set ep_rank_dedup=true`` and its own JSON name; each parses into its plan."""
    import os
    import subprocess

    from test_bench_shmem import shmem_plan
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@" >> "$OUT/calls.txt"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path), "PES": "2",
           "OPS": "dispatch", "FLAGS": "- ep_rank_dedup", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", os.path.join(repo, "benchmarks", "shmem_bench.sh")],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    got = []
    for call in calls:
        argv = call.split(" -- ", 1)[1].split()
        p = shmem_plan(*argv[4:])
        got.append((p.tokens, p.base.ep_rank_dedup, os.path.basename(argv[-1])))
    assert got == [((128,), False, "shmem-decode-2pe-dispatch.json"),
                   ((128,), True, "shmem-decode-2pe-dispatch-ep_rank_dedup.json"),
                   ((4096,), False, "shmem-prefill-2pe-dispatch.json"),
                   ((4096,), True, "shmem-prefill-2pe-dispatch-ep_rank_dedup.json")]
