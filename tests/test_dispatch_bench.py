"""CPU tests of benchmarks/dispatch_bench.py's pure parts: the byte counts, the memory
estimates, the baseline's grouping (numpy, and torch on the CPU when torch imports) against
the reference model, the block capacity, argument parsing, and the orchestration of one shape
with the GPU phases replaced by host fakes."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from epgen import BF16Format, EPConfig, reference, routing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PATH = os.path.join(REPO, "benchmarks", "dispatch_bench.py")


def _load():
    name = "epgen_dispatch_bench_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()

# A tiny valid configuration: R=2, E=8 (L=4), H=64, K=2 (E <= threads, L <= n_sms - 1,
# ceildiv(E, threads // 32) < n_sms).
TINY = ["--ranks", "2", "--experts", "8", "--hidden", "64", "--topk", "2", "--threads", "128",
        "--sms", "6"]


def tiny_cfg(T=8, H=16, K=2, R=2, E=4, **flags):
    return EPConfig(num_threads=128, n_sms=3, n_experts=E, n_ranks=R, max_tokens_per_rank=T,
                    p2p_world_size=R, use_shmem=False, token_fmt=BF16Format(hid_dim=H, top_k=K),
                    **flags)


# ---- bytes -------------------------------------------------------------------------------------
def test_round_trip_bytes_by_hand():
    # H=16, K=2: payload 32 B, src-info field 16 B, top-k field align_up(4, 16) = 16 B -> 64 B
    cfg = tiny_cfg(T=8, H=16, K=2)
    assert cfg.token_fmt.msg_size() == 64
    b = bench.round_trip_bytes(cfg, [3, 5])          # 8 tokens, 16 routed (token, k) pairs
    assert b["n_tokens"] == 8 and b["n_routed"] == 16
    assert b["input"] == 8 * 32 == 256
    assert b["messages"] == 16 * 64 == 1024
    assert b["output"] == 16 * 32 == 512
    assert b["async"] == 256 + 1024
    assert b["wait"] == 1024 + 512
    assert b["total"] == 256 + 2 * 1024 + 512 == 2816
    assert bench.round_trip_bytes(cfg, 4)["total"] == b["total"]      # int: every rank
    assert bench.baseline_bytes(cfg, 4) == 2 * 16 * 32


@pytest.mark.parametrize("name,msg,row", [
    # H=256, K=2, A=16: message = payload + scales (each aligned to 16) + 16 + 16
    ("BlockwiseFP8", 256 + 16 + 32, 256 + 2 * 4),     # e4m3 row, 2 f32 scales
    ("NVFP4", 128 + 16 + 32, 128 + 16),              # packed e2m1 row, 16 e4m3 scales
    ("MXFP8", 256 + 16 + 32, 256 + 8),               # e4m3 row, 8 e8m0 scales
])
def test_round_trip_bytes_per_format(name, msg, row):
    from epgen.formats import make_format
    cfg = tiny_cfg(T=8, H=256, K=2).replace(token_fmt=make_format(name, 256, 2))
    assert cfg.token_fmt.msg_size() == msg
    b = bench.round_trip_bytes(cfg, [3, 5])
    assert b["input"] == 8 * 256 * 2                   # bf16 in, whatever the format
    assert b["messages"] == 16 * msg
    assert b["output"] == 16 * row
    assert b["total"] == 8 * 512 + 2 * 16 * msg + 16 * row
    m = bench.world_memory(cfg)["per_rank"]
    assert m["out_tokens"] == cfg.layout.max_out_rows * cfg.token_fmt.payload_bytes
    assert m["out_scales"] == cfg.layout.max_out_rows * (row - cfg.token_fmt.payload_bytes)
    assert bench.baseline_bytes(bench.bf16_config(cfg), 4) == 2 * 16 * 512


def test_round_trip_bytes_final_layout():
    cfg = tiny_cfg(T=8, H=16, K=2, ep_final_layout=True)
    b = bench.round_trip_bytes(cfg, [3, 5])
    assert b["layout"] == "final" and b["total"] == 256 + 512 and b["async"] is None


def test_round_trip_bytes_design_figures():
    """The floors quoted in issue 6 (copy 4.24 TB/s): ~2.8 ms staged and ~1.0 ms final layout
    at prefill, ~87 us staged at decode."""
    args = bench.parse_args([])
    prefill = bench.round_trip_bytes(bench.make_config(args, 4096), 4096)
    # 32768 tokens of 14336 B; 262144 messages of 14336 + 16 + 16 = 14368 B; 262144 rows
    assert prefill["input"] == 32768 * 14336
    assert prefill["messages"] == 262144 * 14368
    assert prefill["output"] == 262144 * 14336
    assert prefill["total"] == 11_760_828_416
    assert prefill["total"] / 4.24e12 == pytest.approx(2.77e-3, rel=0.01)
    decode = bench.round_trip_bytes(bench.make_config(args, 128), 128)
    assert decode["total"] / 4.24e12 == pytest.approx(86.7e-6, rel=0.01)
    assert (prefill["input"] + prefill["output"]) / 4.24e12 == pytest.approx(1.0e-3, rel=0.01)


# ---- memory ------------------------------------------------------------------------------------
def test_world_memory_matches_layout():
    cfg = tiny_cfg(T=8, H=16, K=2)
    lay = cfg.layout
    m = bench.world_memory(cfg)
    pr = m["per_rank"]
    assert pr["recv_buf"] == lay.n_local_experts * cfg.n_ranks * 8 * 64
    assert pr["out_tokens"] == lay.max_out_rows * 32
    assert pr["src_info"] == lay.max_out_rows * 8
    assert pr["send_buf"] == 8 * 64
    assert m["total"] >= cfg.n_ranks * sum(pr.values())


def test_prefill_memory_needs_a_bounded_block_capacity():
    args = bench.parse_args([])
    full = bench.world_memory(bench.make_config(args, 4096))
    assert full["per_rank"]["recv_buf"] == 32 * 8 * 4096 * 14368          # ~15 GB per rank
    assert full["total"] > 139 * bench.GiB                                # more than an H200
    fit = bench.world_memory(bench.make_config(args, 4096, 192))
    assert fit["per_rank"]["recv_buf"] == 32 * 8 * 192 * 14368
    assert fit["total"] < 20e9
    assert bench.make_config(args, 4096, 4096).recv_block_capacity is None   # = full
    assert bench.make_config(args, 4096, 5000).recv_block_capacity is None


# ---- block capacity ------------------------------------------------------------------------------
def test_fit_block_capacity():
    toks = [np.zeros((3, 16), np.uint16), np.zeros((1, 16), np.uint16)]
    ids = [np.array([[0, 1], [0, 2], [0, 3]], np.int32), np.array([[1, 0]], np.int32)]
    sets = [(toks, ids)]
    assert bench.block_counts(ids, 4).tolist() == [[3, 1, 1, 1], [1, 1, 0, 0]]
    assert bench.fit_block_capacity(sets, 4, 8, multiple=1) == 3
    assert bench.fit_block_capacity(sets, 4, 8, multiple=2) == 4
    assert bench.fit_block_capacity(sets, 4, 8) == 8                     # capped at T
    ids2 = [np.array([[1, 2]] * 3, np.int32), np.array([[1, 3]], np.int32)]
    assert bench.fit_block_capacity([(toks, ids), (toks, ids2)], 4, 8, multiple=1) == 3


def test_make_input_sets_shapes_and_zipf_skew():
    args = bench.parse_args(TINY + ["--tokens", "64"])
    cfg = bench.make_config(args, 64)
    sets = bench.make_input_sets(cfg, 64, 3, "uniform", seed=1)
    assert len(sets) == 3
    for toks, ids in sets:
        assert [t.shape for t in toks] == [(64, 64)] * 2
        assert [i.shape for i in ids] == [(64, 2)] * 2
        reference.validate_inputs(cfg, toks, ids)
    assert not np.array_equal(sets[0][1][0], sets[1][1][0])              # sets differ
    z = bench.make_input_sets(cfg, 64, 1, "zipf", zipf_s=2.0, seed=1)
    counts = bench.block_counts(z[0][1], cfg.n_experts).sum(axis=0)
    assert counts.max() > 2 * counts.mean()                               # a few hot experts
    with pytest.raises(ValueError, match="routing"):
        bench.make_input_sets(cfg, 64, 1, "bogus")


# ---- the baseline's grouping ---------------------------------------------------------------------
def _tiny_inputs(seed=0, R=2, E=8, H=64, K=2, T=16):
    args = bench.parse_args(["--ranks", str(R), "--experts", str(E), "--hidden", str(H),
                             "--topk", str(K), "--threads", "128", "--sms", "6",
                             "--tokens", str(T)])
    cfg = bench.make_config(args, T)
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    return cfg, toks, ids


def test_sort_key_is_a_stable_sort_of_the_expert_ids():
    rng = np.random.default_rng(3)
    R, T, K, E = 4, 32, 3, 16
    ids = np.stack([routing.random_topk(rng, T, E, K) for _ in range(R)])
    key = bench.baseline_sort_key(ids, E // R, R)
    # the formula, written out once more for one element
    r, t, k = 2, 5, 1
    dst, e = divmod(int(ids[r, t, k]), E // R)
    assert key[(r * T + t) * K + k] == (((dst * (E // R) + e) * R + r) * T * K) + t * K + k
    assert len(np.unique(key)) == key.size
    np.testing.assert_array_equal(np.argsort(key), np.argsort(ids.reshape(-1), kind="stable"))
    with pytest.raises(ValueError):
        bench.baseline_sort_key(ids, E // R, R + 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_baseline_grouping_matches_reference(seed):
    cfg, toks, ids = _tiny_inputs(seed)
    want = reference.dispatch(cfg, toks, ids)
    rows, order = bench.baseline_dispatch_numpy(np.stack(toks), np.stack(ids))
    ids3 = np.stack(ids)
    got = []
    for rank in range(cfg.n_ranks):
        start, end = bench.baseline_rank_range(cfg, ids3, rank)
        got.append(bench.baseline_rank_result(cfg, ids3, order, rank, rows[start:end]))
    assert sum(r.n_rows for r in got) == rows.shape[0]
    reference.assert_match(cfg, want, got)
    # the within-(expert, source) order is free: a permuted block still matches
    g = got[0]
    e, s, start, c = max(g.blocks(), key=lambda b: b[3])
    assert c >= 2
    g.out_tokens[start:start + c] = g.out_tokens[start:start + c][::-1].copy()
    g.src_info[start:start + c] = g.src_info[start:start + c][::-1].copy()
    assert reference.compare(cfg, want[0], g) == []
    # a wrong row does not
    g.out_tokens[start] ^= 1
    assert reference.compare(cfg, want[0], g)


def test_baseline_rank_result_rejects_foreign_rows():
    cfg, toks, ids = _tiny_inputs(4)
    rows, order = bench.baseline_dispatch_numpy(np.stack(toks), np.stack(ids))
    with pytest.raises(AssertionError, match="outside"):
        bench.baseline_rank_result(cfg, np.stack(ids), order[::-1].copy(), 0, rows)


def test_compare_grouping_capacity_strided():
    """ep_final_layout alone puts group j at row j * R * max_tpr; the baseline's grouping is
    compact: the blocks must still agree."""
    cfg, toks, ids = _tiny_inputs(6)
    cfg_f = cfg.replace(ep_final_layout=True)
    assert cfg_f.layout.capacity_strided
    want = reference.dispatch(cfg_f, toks, ids)
    rows, order = bench.baseline_dispatch_numpy(np.stack(toks), np.stack(ids))
    ids3 = np.stack(ids)
    for rank in range(cfg.n_ranks):
        start, end = bench.baseline_rank_range(cfg, ids3, rank)
        got = bench.baseline_rank_result(cfg_f, ids3, order, rank, rows[start:end])
        assert reference.compare(cfg_f, want[rank], got)          # offsets differ by design
        assert bench.compare_grouping(cfg_f, want[rank], got) == []
        got.out_tokens[0] ^= 1
        assert bench.compare_grouping(cfg_f, want[rank], got)
        assert bench.compare_grouping(cfg, reference.dispatch(cfg, toks, ids)[rank], got)


def test_torch_baseline_on_cpu_matches_reference():
    torch = pytest.importorskip("torch")
    cfg, toks, ids = _tiny_inputs(5, R=4, E=16, K=4, T=32)
    # staged exactly as bench_baseline stages them (bf16 bits through int16)
    x = torch.from_numpy(np.stack(toks).view(np.int16)).view(torch.bfloat16)
    a = torch.from_numpy(np.stack(ids).astype(np.int64))
    R, T, K = a.shape
    out = torch.empty((R * T * K, cfg.token_fmt.hid_dim), dtype=torch.bfloat16)
    rows, order = bench.baseline_dispatch_torch(x, a, out=out)
    assert rows.data_ptr() == out.data_ptr()
    np_rows, np_order = bench.baseline_dispatch_numpy(np.stack(toks), np.stack(ids))
    np.testing.assert_array_equal(order.numpy(), np_order)
    host_rows = rows.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(host_rows, np_rows)
    rows2, _ = bench.baseline_dispatch_torch(x, a)                    # without out=
    assert torch.equal(rows2.view(torch.int16), rows.view(torch.int16))
    want = reference.dispatch(cfg, toks, ids)
    ids3 = np.stack(ids)
    for rank in range(cfg.n_ranks):
        start, end = bench.baseline_rank_range(cfg, ids3, rank)
        got = bench.baseline_rank_result(cfg, ids3, order.numpy(), rank,
                                         rows[start:end].view(torch.int16).numpy()
                                         .view(np.uint16))
        assert reference.compare(cfg, want[rank], got) == []


# ---- arguments -----------------------------------------------------------------------------------
def test_parse_args_defaults():
    a = bench.parse_args([])
    assert (a.ranks, a.hidden, a.topk, a.experts) == (8, 7168, 8, 256)
    assert a.tokens == [128, 4096]
    assert (a.threads, a.sms) == (512, 33)
    assert a.iters is None and a.warmup is None and a.sets == 3
    assert a.routing == "uniform" and a.block_capacity == "fit" and a.json is None
    assert not a.no_gate and a.flag == []
    assert bench.default_iters(128) == 100 and bench.default_iters(4096) == 20
    assert bench.default_warmup(128) == 10 and bench.default_warmup(4096) == 3
    assert bench.shape_name(128) == "decode" and bench.shape_name(4096) == "prefill"
    assert bench.shape_name(1000) == "T=1000"
    cfg = bench.make_config(a, 128)
    assert (cfg.n_ranks, cfg.n_experts, cfg.num_threads, cfg.n_sms) == (8, 256, 512, 33)
    assert cfg.max_tokens_per_rank == 128 and cfg.p2p_world_size == 8
    assert cfg.token_fmt == BF16Format(hid_dim=7168, top_k=8)
    assert bench.variant_name(a.flag) == "staged"


def test_parse_args_overrides():
    a = bench.parse_args(["--ranks", "4", "--hidden", "2048", "--topk", "4", "--experts", "64",
                          "--tokens", "256,1024", "--threads", "256", "--sms", "17",
                          "--iters", "7", "--warmup", "0", "--json", "x.json", "--routing",
                          "zipf", "--zipf-s", "1.2", "--block-capacity", "256", "--sets", "4",
                          "--flag", "ep_final_layout", "--no-gate"])
    assert (a.ranks, a.hidden, a.topk, a.experts) == (4, 2048, 4, 64)
    assert a.tokens == [256, 1024] and (a.threads, a.sms) == (256, 17)
    assert (a.iters, a.warmup, a.json, a.sets) == (7, 0, "x.json", 4)
    assert a.routing == "zipf" and a.zipf_s == 1.2 and a.block_capacity == 256
    assert a.flag == ["ep_final_layout"] and a.no_gate
    assert bench.variant_name(a.flag) == "ep_final_layout"
    assert bench.parse_args(["--tokens", "128", "4096"]).tokens == [128, 4096]
    assert bench.parse_args(["--block-capacity", "full"]).block_capacity == "full"


@pytest.mark.parametrize("argv", [
    ["--routing", "skewed"], ["--tokens", "0"], ["--tokens", "x"], ["--block-capacity", "big"],
    ["--block-capacity", "0"], ["--experts", "100"], ["--iters", "0"], ["--warmup", "-1"],
    ["--mem-fraction", "1.5"], ["--check-rank", "8"], ["--flag", "no_such_flag"],
    ["--threads", "100"], ["--zipf-s", "0"],
])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


# ---- orchestration of one shape, GPU phases faked on the host -----------------------------------
def _fake_epgen(cfg, sets, iters, warmup, gate, *, device=None, check_rank=0, post_check=True,
                progress=None, input_scale=1.0):
    want = reference.dispatch(cfg, *sets[0], input_scale=input_scale)
    s = bench.summarize
    return {"check": "ok", "post_check": "ok", "check_result": want[check_rank],
            "dispatch_async": s([0.5, 0.4, 0.6]), "dispatch_wait": s([0.7, 0.8, 0.6]),
            "round_trip": s([1.0, 1.2, 0.8])}


def _fake_baseline(torch, cfg, sets, iters, warmup, gate, device_index, check_rank,
                   progress=None, *, corrupt=False):
    toks, ids = sets[0]
    rows, order = bench.baseline_dispatch_numpy(np.stack(toks), np.stack(ids))
    ids3 = np.stack(ids)
    start, end = bench.baseline_rank_range(cfg, ids3, check_rank)
    rank_rows = rows[start:end].copy()
    if corrupt:
        rank_rows[0] ^= 1
    return {"check_result": bench.baseline_rank_result(cfg, ids3, order, check_rank, rank_rows),
            "round_trip": bench.summarize([4.0, 4.2, 3.8])}


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(bench, "mem_info", lambda device: (100 << 30, 141 << 30))
    monkeypatch.setattr(bench, "bench_epgen", _fake_epgen)
    monkeypatch.setattr(bench, "bench_baseline", _fake_baseline)
    monkeypatch.setattr(bench, "log", lambda msg: None)


def _report(shapes):
    results = {"date": "2026-11-29T00:00:00+00:00", "git_commit": "abc1234", "git_dirty": False,
               "device": {"name": "NVIDIA H200", "arch": "sm_90", "sm_count": 132},
               "copy": {"size_mib": 1024, "gbps": 4000.0, "torch": {"gbps": 4000.0},
                        "cupy": {"skipped": "no"}},
               "shapes": shapes}
    buf = io.StringIO()
    bench.print_report(results, file=buf)
    return results, buf.getvalue()


def test_run_shape_with_fake_phases(fake_gpu):
    args = bench.parse_args(TINY + ["--tokens", "16", "--iters", "3", "--warmup", "0"])
    out = bench.run_shape(args, 16, object(), None, 4000.0, progress=lambda m: None)
    assert out["epgen"]["check"] == "ok"
    assert out["baseline"]["check"] == "ok"
    assert out["baseline"]["check_against"].startswith("epgen")
    assert out["speedup_vs_baseline"] == pytest.approx(4.0 / 1.0)
    nb = bench.round_trip_bytes(bench.make_config(args, 16), 16)
    rt = out["epgen"]["round_trip"]
    assert rt["bytes"] == nb["total"]
    assert rt["gbps"] == pytest.approx(nb["total"] / 1.0 / 1e6)
    assert rt["fraction_of_copy"] == pytest.approx(rt["gbps"] / 4000.0)
    assert out["epgen"]["dispatch_async"]["bytes"] == nb["async"]
    assert out["epgen"]["dispatch_wait"]["bytes"] == nb["wait"]
    assert 1 <= out["recv_block_capacity"] <= 16
    assert out["recv_block_capacity"] >= out["largest_block"]
    json.dumps(out, default=bench._jsonable)                             # serializable
    results, text = _report([out])
    lines = text.splitlines()
    assert "baseline check: ok (vs epgen, rank 0, set 0)" in text
    table = lines[lines.index("") + 1:]
    assert table[0].split()[:2] == ["shape", "T"]
    assert len(table) == 1 + 4                                  # 3 epgen rows, 1 baseline
    assert "round trip" in table[1] and table[1].rstrip().endswith("4.00x")
    assert table[4].rstrip().endswith("1.00x")


@pytest.mark.parametrize("fmt", ["BlockwiseFP8", "NVFP4"])
def test_run_shape_quantised_format(fake_gpu, fmt):
    args = bench.parse_args(TINY + ["--hidden", "128", "--tokens", "16", "--format", fmt,
                                    "--input-scale", "0.5"])
    out = bench.run_shape(args, 16, object(), None, 4000.0, progress=lambda m: None)
    assert out["format"] == fmt and out["epgen"]["check"] == "ok"
    assert out["baseline"]["check"] == "ok"
    assert out["baseline"]["check_against"].startswith("reference (BF16 rows)")
    cfg = bench.make_config(args, 16)
    assert cfg.token_fmt.name == fmt
    assert out["bytes"] == bench.round_trip_bytes(cfg, 16)
    assert out["baseline_bytes"] == bench.baseline_bytes(bench.bf16_config(cfg), 16)
    _results, text = _report([out])
    assert f"epgen {fmt} staged round trip" in text


def test_parse_args_format():
    a = bench.parse_args([])
    assert a.format == "BF16" and a.input_scale == 1.0
    assert bench.make_config(a, 128).token_fmt.name == "BF16"
    a = bench.parse_args(["--format", "MXFP8"])
    assert bench.make_config(a, 128).token_fmt.msg_size() == 7424
    for argv in (["--format", "FP16"], ["--format", "NVFP4", "--input-scale", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_run_shape_reports_a_wrong_baseline(fake_gpu, monkeypatch):
    monkeypatch.setattr(bench, "bench_baseline",
                        lambda *a, **k: _fake_baseline(*a, **k, corrupt=True))
    args = bench.parse_args(TINY + ["--tokens", "16"])
    out = bench.run_shape(args, 16, object(), None, 4000.0, progress=lambda m: None)
    assert out["baseline"]["check"].startswith("FAILED")


def test_run_shape_skips_what_does_not_fit(fake_gpu, monkeypatch):
    monkeypatch.setattr(bench, "mem_info", lambda device: (1 << 20, 141 << 30))
    args = bench.parse_args(TINY + ["--tokens", "16"])
    out = bench.run_shape(args, 16, object(), None, 4000.0, progress=lambda m: None)
    assert "more than 90%" in out["epgen_skipped"]
    assert "more than 90%" in out["baseline_skipped"]
    assert "epgen" not in out and "baseline" not in out
    _results, text = _report([out])
    assert "more than 90%" in text


def test_run_shape_capacity_too_small_and_no_torch(fake_gpu):
    args = bench.parse_args(TINY + ["--tokens", "16", "--block-capacity", "1"])
    out = bench.run_shape(args, 16, None, None, None, progress=lambda m: None)
    assert "smaller than the largest" in out["epgen_skipped"]
    assert out["baseline_skipped"] == "torch with CUDA is not available"


def test_run_shape_epgen_failure_is_reported(fake_gpu, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("dispatch results differ")
    monkeypatch.setattr(bench, "bench_epgen", boom)
    args = bench.parse_args(TINY + ["--tokens", "16"])
    out = bench.run_shape(args, 16, object(), None, 4000.0, progress=lambda m: None)
    assert "dispatch results differ" in out["epgen_error"]
    assert out["baseline"]["check"] == "ok"                      # checked against the reference
    assert out["baseline"]["check_against"].startswith("reference")
    assert "speedup_vs_baseline" not in out


# ---- small helpers -------------------------------------------------------------------------------
def test_summarize_and_rate():
    s = bench.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["n"] == 4 and s["median_ms"] == 2.5 and s["min_ms"] == 1.0 and s["max_ms"] == 10.0
    assert bench.summarize([]) == {"n": 0}
    gbps, frac = bench.rate(2e9, 1.0, 4000.0)              # 2 GB in 1 ms
    assert gbps == pytest.approx(2000.0) and frac == pytest.approx(0.5)
    assert bench.rate(None, 1.0, 4000.0) == (None, None)
    assert bench.rate(1e9, 1.0, None) == (pytest.approx(1000.0), None)


def test_sample_discards_overruns():
    class G:
        grown = 0

        def grow(self):
            self.grown += 1
    g = G()
    seq = iter([(9.0, True), (1.0, False), (2.0, False), (9.0, True), (3.0, False), (4.0, False)])
    assert bench.sample(lambda i: next(seq), iters=2, warmup=2, gate=g) == [3.0, 4.0]
    assert g.grown == 2


def test_git_commit(tmp_path):
    commit, dirty = bench.git_commit()
    assert commit == "unknown" or (commit.isalnum() and 4 <= len(commit) <= 40)
    assert dirty in (True, False, None)
    assert bench.git_commit(str(tmp_path)) == ("unknown", None)      # not a repository


def test_import_is_light():
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('b', {BENCH_PATH!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m; "
            "spec.loader.exec_module(m); "
            "print(sorted(x for x in ('torch', 'cupy', 'cuda.core', 'backends.cuda') "
            "if x in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_main_without_gpu_says_so():
    from backends import cuda
    if cuda.gpu_available():
        pytest.skip("a GPU is available here")
    with pytest.raises(SystemExit) as info:
        bench.main(["--tokens", "128"])
    assert "no usable CUDA GPU" in str(info.value.code)
