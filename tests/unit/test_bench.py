"""CPU tests of ``epgen.bench`` and ``epgen bench``: the byte counts per variant, the memory
estimates, the input sets and block capacity, the baseline's grouping (numpy, and torch on the
CPU when torch imports) against the reference model, the shape/variant syntax, argument
parsing, and whole runs with the device phases replaced by host fakes: the report table, the
JSON round trip and the PNG plot."""

from __future__ import annotations

import io
import json
import os
import types

import numpy as np
import pytest
from world_checks import assert_imports_light

from epgen import BF16Format, EPConfig, cli, presets, reference, routing
from epgen.commands import bench as bench_command
from epgen.commands.common import config_from_args
from epgen.formats import make_format
from epgen.bench import (baseline, common, driver, inputs, memory, options, plan, report, runner,
                         timing, traffic)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECODE = presets.load_preset("decode")


def tiny_cfg(T=8, H=16, K=2, R=2, E=4, **flags):
    return EPConfig(num_threads=128, n_sms=3, n_experts=E, n_ranks=R, max_tokens_per_rank=T,
                    p2p_world_size=R, use_shmem=False, token_fmt=BF16Format(hid_dim=H, top_k=K),
                    **flags)


def bench_args(*argv):
    """``epgen bench *argv`` parsed into a ``Plan`` (as ``epgen.commands.bench.run`` does,
    without running)."""
    parser = cli.build_parser()
    args = parser.parse_args(["bench", *argv])
    cfg, _ = config_from_args(args, default=bench_command.BENCH_PRESET)
    return options.plan_from_args(args.parser, args, cfg, [cfg.max_tokens_per_rank],
                                  arch=args.arch)


# ---- bytes -------------------------------------------------------------------------------------
def test_round_trip_bytes_by_hand():
    # H=16, K=2: payload 32 B, src-info field 16 B, top-k field align_up(4, 16) = 16 B -> 64 B
    cfg = tiny_cfg(T=8, H=16, K=2)
    assert cfg.token_fmt.msg_size() == 64
    b = traffic.round_trip_bytes(cfg, [3, 5])          # 8 tokens, 16 routed (token, k) pairs
    assert b["layout"] == "staged"
    assert b["n_tokens"] == 8 and b["n_routed"] == 16
    assert b["input"] == 8 * 32 == 256
    assert b["messages"] == 16 * 64 == 1024
    assert b["output"] == 16 * 32 == 512
    assert b["async"] == 256 + 1024
    assert b["wait"] == 1024 + 512
    assert b["total"] == 256 + 2 * 1024 + 512 == 2816
    assert traffic.round_trip_bytes(cfg, 4)["total"] == b["total"]      # int: every rank
    assert traffic.baseline_bytes(cfg, 4) == 2 * 16 * 32


def test_round_trip_bytes_final_layout():
    for flags in ({"ep_final_layout": True}, {"ep_final_layout": True, "ep_prod_reserve": True}):
        b = traffic.round_trip_bytes(tiny_cfg(T=8, H=16, K=2, **flags), [3, 5])
        assert b["layout"] == "final" and b["total"] == 256 + 512 and b["async"] is None
        assert b["messages"] == 0 and b["wait"] is None


def test_bytes_per_variant_of_a_plan():
    """The small preset (R=2, H=256, K=4) at 16 tokens per rank, by hand: 32 tokens of 512 B,
    128 routed rows of 512 B, messages of 512 + 16 + 16 = 544 B."""
    p = bench_args("--preset", "small", "--tokens", "16", "--variant", "default",
                   "--variant", "fl=ep_final_layout,ep_prod_reserve")
    staged, final = (traffic.round_trip_bytes(p.config(16, v), 16) for v in p.variants)
    assert p.config(16).token_fmt.msg_size() == 544
    assert staged["total"] == 32 * 512 + 2 * 128 * 544 + 128 * 512 == 221_184
    assert (staged["async"], staged["wait"]) == (32 * 512 + 128 * 544, 128 * 544 + 128 * 512)
    assert final["total"] == 32 * 512 + 128 * 512 == 81_920


def test_round_trip_bytes_design_figures():
    """The byte floors (copy 4.24 TB/s): ~2.8 ms staged and ~1.0 ms final layout
    at prefill, ~87 us staged and ~31 us final layout at decode."""
    # at the reference alignment (16); the decode preset's 128 is checked below
    reference_fmt = make_format("BF16", 7168, 8)
    p = plan.Plan(base=DECODE.replace(token_fmt=reference_fmt), tokens=(128, 4096))
    prefill = traffic.round_trip_bytes(p.config(4096), 4096)
    # 32768 tokens of 14336 B; 262144 messages of 14336 + 16 + 16 = 14368 B; 262144 rows
    assert prefill["input"] == 32768 * 14336
    assert prefill["messages"] == 262144 * 14368
    assert prefill["output"] == 262144 * 14336
    assert prefill["total"] == 11_760_828_416
    assert prefill["total"] / 4.24e12 == pytest.approx(2.77e-3, rel=0.01)
    final = plan.parse_variant("ep_final_layout")
    assert traffic.round_trip_bytes(p.config(4096, final), 4096)["total"] / 4.24e12 == \
        pytest.approx(1.0e-3, rel=0.01)
    assert traffic.round_trip_bytes(p.config(128), 128)["total"] / 4.24e12 == \
        pytest.approx(86.7e-6, rel=0.01)
    assert traffic.round_trip_bytes(p.config(128, final), 128)["total"] / 4.24e12 == \
        pytest.approx(31e-6, rel=0.02)
    # the decode preset's 128-byte fields: 14336 + 128 + 128 = 14592 B per message
    preset = traffic.round_trip_bytes(plan.Plan(base=DECODE, tokens=(4096,)).config(4096), 4096)
    assert preset["messages"] == 262144 * 14592
    assert preset["total"] - prefill["total"] == 2 * 262144 * (14592 - 14368)


# ---- memory ------------------------------------------------------------------------------------
def test_world_memory_matches_layout():
    cfg = tiny_cfg(T=8, H=16, K=2)
    lay = cfg.layout
    m = memory.world_memory(cfg)
    pr = m["per_rank"]
    assert pr["recv_buf"] == lay.n_local_experts * cfg.n_ranks * 8 * 64
    assert pr["out_tokens"] == lay.max_out_rows * 32
    assert pr["src_info"] == lay.max_out_rows * 8
    assert pr["send_buf"] == 8 * 64
    assert m["total"] >= cfg.n_ranks * sum(pr.values())
    fin = memory.world_memory(cfg.replace(ep_final_layout=True, ep_prod_reserve=True))["per_rank"]
    assert fin["recv_buf"] == 0                       # sources write the output directly
    assert fin["hdr_buf"] == lay.max_out_rows * cfg.layout.hdr_bytes
    assert fin["prod_buf"] == 16 * cfg.n_experts + 8    # early counts, mailboxes, generation


def test_prefill_memory_needs_a_bounded_block_capacity():
    p = plan.Plan(base=DECODE, tokens=(4096,))
    full = memory.world_memory(p.config(4096))
    msg = DECODE.layout.msg_bytes                     # 14592: the preset's 128-byte fields
    assert full["per_rank"]["recv_buf"] == 32 * 8 * 4096 * msg             # ~15 GB per rank
    assert full["total"] > 139 * memory.GiB                                # more than an H200
    fit = memory.world_memory(p.config(4096, block_capacity=192))
    assert fit["per_rank"]["recv_buf"] == 32 * 8 * 192 * msg
    assert fit["total"] < 20e9
    assert p.config(4096, block_capacity=4096).recv_block_capacity is None   # = full
    assert p.config(4096, block_capacity=5000).recv_block_capacity is None


# ---- inputs and block capacity -------------------------------------------------------------------
def test_fit_block_capacity():
    toks = [np.zeros((3, 16), np.uint16), np.zeros((1, 16), np.uint16)]
    ids = [np.array([[0, 1], [0, 2], [0, 3]], np.int32), np.array([[1, 0]], np.int32)]
    sets = [(toks, ids)]
    assert inputs.block_counts(ids, 4).tolist() == [[3, 1, 1, 1], [1, 1, 0, 0]]
    assert inputs.fit_block_capacity(sets, 4, 8, multiple=1) == 3
    assert inputs.fit_block_capacity(sets, 4, 8, multiple=2) == 4
    assert inputs.fit_block_capacity(sets, 4, 8) == 8                     # capped at T
    ids2 = [np.array([[1, 2]] * 3, np.int32), np.array([[1, 3]], np.int32)]
    assert inputs.fit_block_capacity([(toks, ids), (toks, ids2)], 4, 8, multiple=1) == 3
    assert inputs.block_capacity("fit", sets, 4, 8) == (3, 8)
    assert inputs.block_capacity("full", sets, 4, 8) == (3, 8)
    assert inputs.block_capacity(2, sets, 4, 8) == (3, 2)
    assert inputs.block_capacity(20, sets, 4, 8) == (3, 8)


def test_make_input_sets_shapes_and_zipf_skew():
    cfg = presets.load_preset("small").replace(max_tokens_per_rank=64)
    sets = inputs.make_input_sets(cfg, 64, 3, "uniform", seed=1)
    assert len(sets) == 3
    for toks, ids in sets:
        assert [t.shape for t in toks] == [(64, 256)] * 2
        assert [i.shape for i in ids] == [(64, 4)] * 2
        reference.validate_inputs(cfg, toks, ids)
    assert not np.array_equal(sets[0][1][0], sets[1][1][0])              # sets differ
    z = inputs.make_input_sets(cfg, 64, 1, "zipf", zipf_s=2.0, seed=1)
    counts = inputs.block_counts(z[0][1], cfg.n_experts).sum(axis=0)
    assert counts.max() > 2 * counts.mean()                               # a few hot experts
    with pytest.raises(ValueError, match="routing"):
        inputs.make_input_sets(cfg, 64, 1, "bogus")


# ---- the baseline's grouping ---------------------------------------------------------------------
def _tiny_inputs(seed=0, R=2, E=8, H=64, K=2, T=16):
    cfg = EPConfig(num_threads=128, n_sms=6, n_experts=E, n_ranks=R, max_tokens_per_rank=T,
                   p2p_world_size=R, use_shmem=False, token_fmt=BF16Format(hid_dim=H, top_k=K))
    toks, ids = routing.routing(np.random.default_rng(seed), cfg, T)
    return cfg, toks, ids


def test_sort_key_is_a_stable_sort_of_the_expert_ids():
    rng = np.random.default_rng(3)
    R, T, K, E = 4, 32, 3, 16
    ids = np.stack([routing.random_topk(rng, T, E, K) for _ in range(R)])
    key = baseline.sort_key(ids, E // R, R)
    # the formula, written out once more for one element
    r, t, k = 2, 5, 1
    dst, e = divmod(int(ids[r, t, k]), E // R)
    assert key[(r * T + t) * K + k] == (((dst * (E // R) + e) * R + r) * T * K) + t * K + k
    assert len(np.unique(key)) == key.size
    np.testing.assert_array_equal(np.argsort(key), np.argsort(ids.reshape(-1), kind="stable"))
    with pytest.raises(ValueError):
        baseline.sort_key(ids, E // R, R + 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_baseline_grouping_matches_reference(seed):
    cfg, toks, ids = _tiny_inputs(seed)
    want = reference.dispatch(cfg, toks, ids)
    rows, order = baseline.dispatch_numpy(np.stack(toks), np.stack(ids))
    ids3 = np.stack(ids)
    got = []
    for rank in range(cfg.n_ranks):
        start, end = baseline.rank_range(cfg, ids3, rank)
        got.append(baseline.rank_result(cfg, ids3, order, rank, rows[start:end]))
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
    rows, order = baseline.dispatch_numpy(np.stack(toks), np.stack(ids))
    with pytest.raises(AssertionError, match="outside"):
        baseline.rank_result(cfg, np.stack(ids), order[::-1].copy(), 0, rows)


def test_compare_grouping_capacity_strided():
    """ep_final_layout alone puts group j at row j * R * max_tpr; the baseline's grouping is
    compact: the blocks must still agree."""
    cfg, toks, ids = _tiny_inputs(6)
    cfg_f = cfg.replace(ep_final_layout=True)
    assert cfg_f.layout.capacity_strided
    want = reference.dispatch(cfg_f, toks, ids)
    rows, order = baseline.dispatch_numpy(np.stack(toks), np.stack(ids))
    ids3 = np.stack(ids)
    for rank in range(cfg.n_ranks):
        start, end = baseline.rank_range(cfg, ids3, rank)
        got = baseline.rank_result(cfg_f, ids3, order, rank, rows[start:end])
        assert reference.compare(cfg_f, want[rank], got)          # offsets differ by design
        assert baseline.compare_grouping(cfg_f, want[rank], got) == []
        got.out_tokens[0] ^= 1
        assert baseline.compare_grouping(cfg_f, want[rank], got)
        assert baseline.compare_grouping(cfg, reference.dispatch(cfg, toks, ids)[rank], got)


def test_torch_baseline_on_cpu_matches_reference():
    torch = pytest.importorskip("torch")
    cfg, toks, ids = _tiny_inputs(5, R=4, E=16, K=4, T=32)
    # staged exactly as baseline.measure stages them (bf16 bits through int16)
    x = torch.from_numpy(np.stack(toks).view(np.int16)).view(torch.bfloat16)
    a = torch.from_numpy(np.stack(ids).astype(np.int64))
    R, T, K = a.shape
    out = torch.empty((R * T * K, cfg.token_fmt.hid_dim), dtype=torch.bfloat16)
    rows, order = baseline.dispatch_torch(x, a, out=out)
    assert rows.data_ptr() == out.data_ptr()
    np_rows, np_order = baseline.dispatch_numpy(np.stack(toks), np.stack(ids))
    np.testing.assert_array_equal(order.numpy(), np_order)
    host_rows = rows.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(host_rows, np_rows)
    rows2, _ = baseline.dispatch_torch(x, a)                    # without out=
    assert torch.equal(rows2.view(torch.int16), rows.view(torch.int16))
    want = reference.dispatch(cfg, toks, ids)
    ids3 = np.stack(ids)
    for rank in range(cfg.n_ranks):
        start, end = baseline.rank_range(cfg, ids3, rank)
        got = baseline.rank_result(cfg, ids3, order.numpy(), rank,
                                   rows[start:end].view(torch.int16).numpy().view(np.uint16))
        assert reference.compare(cfg, want[rank], got) == []


# ---- shapes and variants -------------------------------------------------------------------------
def test_parse_tokens_and_sweep():
    assert plan.parse_tokens("128,4096") == [128, 4096]
    assert plan.parse_tokens(" 7 ") == [7]
    assert plan.parse_sweep("32,...,4096") == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert plan.parse_sweep("32,64,...,4096") == plan.parse_sweep("32,...,4096")
    assert plan.parse_sweep("128,512,...,8192") == [128, 512, 2048, 8192]
    assert plan.parse_sweep("64,...,64") == [64]
    for bad in ("0", "x", ",", "-4"):
        with pytest.raises(ValueError):
            plan.parse_tokens(bad)
    for bad in ("32,4096", "32,...,100", "32,48,...,4096", "32,32,...,64", "...,64",
                "32,...", "32,...,64,128", "0,...,64", "32,64,128,...,256"):
        with pytest.raises(ValueError):
            plan.parse_sweep(bad)


def test_parse_variant():
    v = plan.parse_variant("default")
    assert (v.label, v.spec, v.overrides) == ("default", "default", ())
    v = plan.parse_variant("final=ep_final_layout, ep_prod_reserve")
    assert v.label == "final" and dict(v.overrides) == {"ep_final_layout": True,
                                                        "ep_prod_reserve": True}
    v = plan.parse_variant("ep_final_layout,num_threads:1024,ep_ord_r:false,n_sms:0x21")
    assert v.label == "ep_final_layout,num_threads:1024,ep_ord_r:false,n_sms:0x21"
    assert dict(v.overrides) == {"ep_final_layout": True, "num_threads": 1024,
                                 "ep_ord_r": False, "n_sms": 33}
    assert json.loads(json.dumps(v.describe()))["overrides"]["num_threads"] == 1024
    for bad, words in (("nope", "nope"), ("n_experts:64", "--set"), ("num_threads", "value"),
                       ("ep_ord_r:maybe", "true or false"), ("x=", "LABEL"), ("=default", "LABEL"),
                       ("ep_ord_r,ep_ord_r", "twice"), ("n_sms:many", "integer")):
        with pytest.raises(ValueError, match=words):
            plan.parse_variant(bad)


def test_variant_tuning():
    """``tune.FIELD:VALUE`` in a variant sets that field of the base's tuning; the JSON's
    config records it."""
    v = plan.parse_variant("w1=tune.send_warps_per_token_max:1,tune.trace:true")
    assert dict(v.overrides) == {"tune.send_warps_per_token_max": 1, "tune.trace": True}
    p = plan.Plan(base=DECODE, tokens=(128,))
    cfg = p.config(128, v)
    assert cfg.tuning.send_warps_per_token_max == 1 and cfg.tuning.trace
    assert p.config(128).tuning == DECODE.tuning
    assert cfg.describe()["tuning"]["send_warps_per_token_max"] == 1
    for bad, words in (("tune.nope:1", "unknown field"), ("tune.trace", "needs a value"),
                       ("tune.send_warps_per_token_max:3", "power of two"),
                       ("tune.trace:1,tune.trace:0", "twice")):
        with pytest.raises(ValueError, match=words):
            plan.parse_variant(bad)


def test_variant_alignment():
    """``alignment:16`` in a variant rebuilds the token format with that alignment (the final
    layout's header rows and the messages shrink), everything else as the base."""
    v = plan.parse_variant("prod=ep_final_layout,ep_prod_reserve,alignment:16")
    assert dict(v.overrides)["alignment"] == 16
    p = plan.Plan(base=DECODE, tokens=(4096,))
    assert p.config(4096).token_fmt.alignment == 128              # the preset's
    cfg = p.config(4096, v)
    assert cfg.token_fmt.alignment == 16 and cfg.ep_final_layout and cfg.ep_prod_reserve
    assert (cfg.token_fmt.name, cfg.token_fmt.hid_dim, cfg.token_fmt.top_k) == ("BF16", 7168, 8)
    assert cfg.layout.msg_bytes == 14368 and p.config(4096).layout.msg_bytes == 14592
    with pytest.raises(ValueError, match="alignment needs a value"):
        plan.parse_variant("alignment")
    with pytest.raises(ValueError, match="power of two"):
        p.config(4096, plan.parse_variant("alignment:24"))


def test_plan_configs_and_defaults():
    assert plan.shape_name(128) == "decode" and plan.shape_name(4096) == "prefill"
    assert plan.shape_name(1000) == "T=1000"
    p = plan.Plan(base=DECODE, tokens=(128, 4096))
    assert (p.iters_for(128), p.warmup_for(128), p.iters_for(4096), p.warmup_for(4096)) == \
        (100, 10, 20, 3)
    p2 = plan.Plan(base=DECODE, tokens=(128,), iters=7, warmup=0)
    assert (p2.iters_for(4096), p2.warmup_for(4096)) == (7, 0)
    cfg = p.config(4096, plan.parse_variant("ep_final_layout,num_threads:1024"), 192)
    assert cfg.max_tokens_per_rank == 4096 and cfg.recv_block_capacity == 192
    assert cfg.ep_final_layout and cfg.num_threads == 1024 and cfg.n_sms == 33
    assert not p.config(4096).ep_final_layout and p.config(4096).num_threads == 512
    d = json.loads(json.dumps(p.describe()))
    assert d["tokens"] == [128, 4096] and d["variants"][0]["label"] == "default"
    assert d["base"]["token_fmt"]["hid_dim"] == 7168


# ---- epgen bench arguments -----------------------------------------------------------------------
def test_bench_arguments_defaults():
    p = bench_args()
    assert p.base == DECODE                                       # the bench preset
    assert p.tokens == (128,)                                     # its max_tokens_per_rank
    assert [v.label for v in p.variants] == ["default"]
    assert p.routing == "uniform" and p.sets == 3 and p.block_capacity == "fit"
    assert p.iters is None and p.warmup is None and p.gate and p.baseline and p.post_check
    assert p.arch == "sm_90"
    assert bench_args("--preset", "prefill").tokens == (4096,)


def test_bench_arguments_overrides():
    p = bench_args("--preset", "small", "--set", "n_sms=12", "--tokens", "16,32", "64",
                   "--routing", "zipf", "--zipf-s", "1.2", "--iters", "7", "--warmup", "0",
                   "--sets", "4", "--block-capacity", "full", "--no-gate", "--no-baseline",
                   "--no-post-check", "--variant", "default", "--variant",
                   "f=ep_final_layout,ep_prod_reserve", "--seed", "5", "--device", "1",
                   "--check-rank", "1", "--copy-mib", "64", "--copy-iters", "5",
                   "--mem-fraction", "0.5")
    assert p.base.n_sms == 12 and p.base.n_ranks == 2
    assert p.tokens == (16, 32, 64)
    assert (p.routing, p.zipf_s, p.iters, p.warmup, p.sets, p.seed) == ("zipf", 1.2, 7, 0, 4, 5)
    assert p.block_capacity == "full" and not (p.gate or p.baseline or p.post_check)
    assert [v.label for v in p.variants] == ["default", "f"]
    assert (p.device, p.check_rank, p.copy_mib, p.copy_iters, p.mem_fraction) == \
        (1, 1, 64, 5, 0.5)
    assert bench_args("--sweep-tokens", "32,...,256").tokens == (32, 64, 128, 256)
    assert bench_args("--tokens", "128,128").tokens == (128,)
    assert bench_args("--block-capacity", "256").block_capacity == 256


@pytest.mark.parametrize("argv, option", [
    (["--tokens", "0"], "--tokens"), (["--tokens", "x"], "--tokens"),
    (["--sweep-tokens", "32,100"], "--sweep-tokens"),
    (["--sweep-tokens", "32,...,100"], "--sweep-tokens"),
    (["--tokens", "128", "--sweep-tokens", "32,...,64"], "--sweep-tokens"),
    (["--routing", "skewed"], "--routing"),
    (["--variant", "nope"], "--variant"), (["--variant", "n_experts:64"], "--variant"),
    (["--variant", "a=ep_ord_r,has_rank_flag", "--variant", "a=default"], "--variant"),
    (["--variant", "ep_prod_reserve"], "--variant"),
    (["--variant", "num_threads:100"], "--variant"),
    (["--block-capacity", "big"], "--block-capacity"), (["--block-capacity", "0"],
                                                        "--block-capacity"),
    (["--iters", "0"], "--iters"), (["--warmup", "-1"], "--warmup"), (["--sets", "0"], "--sets"),
    (["--mem-fraction", "1.5"], "--mem-fraction"), (["--check-rank", "8"], "--check-rank"),
    (["--zipf-s", "0"], "--zipf-s"), (["--copy-mib", "-1"], "--copy-mib"),
    (["--json", "/no/such/dir/x.json"], "--json"), (["--plot", "/no/such/dir/x.png"], "--plot"),
    (["--preset", "nope"], "--preset"), (["--set", "n_sms=2"], "--set"),
    (["--set", "recv_block_capacity=64"], "--block-capacity"),
])
def test_bench_rejects_bad_values(argv, option, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "epgen bench: error:" in err and option in err, err


def test_bench_plot_needs_matplotlib(monkeypatch, capsys):
    monkeypatch.setattr(options, "have_matplotlib", lambda: False)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--plot", "x.png"])
    assert info.value.code == 2
    assert "--plot: needs matplotlib" in capsys.readouterr().err


def test_bench_without_gpu_is_a_clear_error(capsys):
    from backends import cuda
    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    status = cli.main(["bench", "--preset", "small"])
    out, err = capsys.readouterr()
    assert status == 1 and out == ""
    assert err.startswith("epgen: error:") and "GPU" in err


# ---- whole runs, device phases faked on the host -------------------------------------------------
def _fake_measure_world(cfg, sets, iters, warmup, gate, *, device=None, arch=None,
                        post_check=True, progress=None):
    rt = 0.5 if cfg.ep_final_layout else 1.0
    s = timing.summarize
    return {"check": "ok", "post_check": "ok", "build_s": 0.1,
            "dispatch_async": s([0.5, 0.4, 0.6]), "dispatch_wait": s([0.7, 0.8, 0.6]),
            "round_trip": s([rt, rt * 1.2, rt * 0.8])}


def _fake_baseline(torch, cfg, sets, iters, warmup, gate, device_index, check_rank, progress,
                   *, corrupt=False):
    toks, ids = sets[0]
    rows, order = baseline.dispatch_numpy(np.stack(toks), np.stack(ids))
    ids3 = np.stack(ids)
    start, end = baseline.rank_range(cfg, ids3, check_rank)
    rank_rows = rows[start:end].copy()
    if corrupt:
        rank_rows[0] ^= 1
    return {"check_result": baseline.rank_result(cfg, ids3, order, check_rank, rank_rows),
            "round_trip": timing.summarize([4.0, 4.2, 3.8])}


FAKE_COPY = {"size_mib": 1024, "bytes_per_copy": 2 << 30, "gbps": 4000.0,
             "torch": {"gbps": 4000.0}, "cupy": {"skipped": "ImportError: no cupy"}}


@pytest.fixture
def fake_gpu(monkeypatch):
    """The device parts of a run replaced: a GPU 'present', torch a stub, the copy, the world
    and the baseline timings fixed numbers (the checks against the reference still run)."""
    from backends import cuda
    monkeypatch.setattr(cuda, "gpu_available", lambda: True)
    monkeypatch.setattr(cuda, "get_device", lambda d=None: types.SimpleNamespace(name="Fake"))
    monkeypatch.setattr(cuda, "arch", lambda d=None: "sm_90")
    monkeypatch.setattr(cuda, "sm_count", lambda d=None: 132)
    fake_torch = types.SimpleNamespace(__version__="0+fake",
                                       cuda=types.SimpleNamespace(set_device=lambda d: None))
    monkeypatch.setattr(common, "import_torch", lambda: (fake_torch, None))
    monkeypatch.setattr(memory, "mem_info", lambda device: (100 << 30, 141 << 30))
    monkeypatch.setattr(runner, "measure_copy", lambda *a: dict(FAKE_COPY))
    monkeypatch.setattr(runner, "measure_world", _fake_measure_world)
    monkeypatch.setattr(baseline, "measure", _fake_baseline)


def quiet():
    return report.Progress(total=99, stream=io.StringIO())


SMALL_RUN = ("--preset", "small", "--tokens", "16,32", "--no-gate", "--variant", "default",
             "--variant", "final=ep_final_layout,ep_prod_reserve")


def test_run_with_fake_phases(fake_gpu):
    p = bench_args(*SMALL_RUN)
    res = driver.run(p, quiet())
    assert res["failures"] == [] and res["copy"]["gbps"] == 4000.0
    assert [s["tokens_per_rank"] for s in res["shapes"]] == [16, 32]
    s = res["shapes"][0]
    assert s["baseline"]["check"] == "ok"
    assert s["baseline"]["check_against"] == "reference, rank 0, set 0"
    assert s["baseline"]["round_trip"]["bytes"] == traffic.baseline_bytes(p.config(16), 16)
    staged, final = s["variants"]
    assert (staged["label"], final["label"]) == ("default", "final")
    assert staged["speedup_vs_baseline"] == pytest.approx(4.0)
    assert final["speedup_vs_baseline"] == pytest.approx(8.0)
    nb = traffic.round_trip_bytes(p.config(16), 16)
    rt = staged["round_trip"]
    assert staged["bytes"] == nb and rt["bytes"] == nb["total"]
    assert rt["gbps"] == pytest.approx(nb["total"] / 1.0 / 1e6)
    assert rt["fraction_of_copy"] == pytest.approx(rt["gbps"] / 4000.0)
    assert rt["byte_floor_us"] == pytest.approx(nb["total"] / 4000.0 / 1e3)
    assert staged["dispatch_async"]["bytes"] == nb["async"]
    assert staged["dispatch_wait"]["bytes"] == nb["wait"]
    assert final["bytes"]["layout"] == "final" and final["dispatch_async"]["gbps"] is None
    assert final["config"]["ep_prod_reserve"] and not staged["config"]["ep_final_layout"]
    assert 1 <= s["recv_block_capacity"] <= 16 and s["recv_block_capacity"] >= s["largest_block"]


def test_run_reports_a_wrong_baseline(fake_gpu, monkeypatch):
    monkeypatch.setattr(baseline, "measure", lambda *a, **k: _fake_baseline(*a, **k, corrupt=True))
    res = driver.run(bench_args("--preset", "small", "--tokens", "16", "--no-gate"), quiet())
    assert res["shapes"][0]["baseline"]["check"].startswith("FAILED")
    assert len(res["failures"]) == 1 and "baseline" in res["failures"][0]


def test_run_skips_what_does_not_fit(fake_gpu, monkeypatch):
    monkeypatch.setattr(memory, "mem_info", lambda device: (1 << 20, 141 << 30))
    res = driver.run(bench_args("--preset", "small", "--tokens", "16", "--no-gate"), quiet())
    s = res["shapes"][0]
    assert "more than 90%" in s["baseline"]["skipped"]
    assert "more than 90%" in s["variants"][0]["skipped"]
    assert "round_trip" not in s["baseline"] and "round_trip" not in s["variants"][0]
    assert res["failures"] == []                                  # skipped is not failed
    text = io.StringIO()
    report.print_report(res, file=text)
    assert "more than 90%" in text.getvalue()


def test_run_capacity_too_small_and_no_torch(fake_gpu, monkeypatch):
    monkeypatch.setattr(common, "import_torch", lambda: (None, "no torch here"))
    res = driver.run(bench_args("--preset", "small", "--tokens", "16", "--block-capacity", "1"),
                     quiet())
    s = res["shapes"][0]
    assert "smaller than the largest" in s["variants"][0]["skipped"]
    assert s["baseline"]["skipped"] == "torch with CUDA is not available"
    assert "copy" not in res and res["torch"] == "unavailable: no torch here"


def test_run_epgen_failure_is_reported(fake_gpu, monkeypatch):
    def boom(cfg, *a, **k):
        if cfg.ep_final_layout:
            raise AssertionError("dispatch results differ")
        return _fake_measure_world(cfg, *a, **k)
    monkeypatch.setattr(runner, "measure_world", boom)
    res = driver.run(bench_args(*SMALL_RUN), quiet())
    staged, final = res["shapes"][0]["variants"]
    assert "dispatch results differ" in final["error"] and "speedup_vs_baseline" not in final
    assert staged["check"] == "ok"                                   # the other variant ran
    assert res["failures"] == [f"T={T} epgen final: AssertionError: dispatch results differ"
                               for T in (16, 32)]


def test_progress_lines():
    t = iter([10.0, 12.5, 13.0])
    buf = io.StringIO()
    pr = report.Progress(total=3, stream=buf, clock=lambda: next(t))
    pr("copy")
    pr.step("T=16: epgen default")
    assert buf.getvalue().splitlines() == ["[     2.5s] copy",
                                           "[     3.0s] [1/3] T=16: epgen default"]


# ---- report: table, JSON, plot -------------------------------------------------------------------
@pytest.fixture
def fake_results(fake_gpu):
    return driver.run(bench_args(*SMALL_RUN), quiet())


def test_report_table(fake_results):
    text = io.StringIO()
    report.print_report(fake_results, file=text)
    lines = text.getvalue().splitlines()
    assert lines[0].startswith("epgen bench ") and "Fake (sm_90, 132 SMs)" in lines[0]
    assert "reference 4000.0 GB/s" in lines[1]
    assert "T=16 (uniform): recv_block_capacity" in lines[2]
    assert "baseline check: ok (vs reference, rank 0, set 0)" in lines[2]
    assert lines[3].startswith("  default: staged layout") and "checks: ok" in lines[3]
    assert lines[4].startswith("  final: final layout")
    table = lines[lines.index("") + 1:]
    assert table[0].split()[:2] == ["shape", "T"] and table[0].rstrip().endswith("vs torch")
    assert len(table) == 1 + 2 * (3 + 3 + 1)           # per shape: 2 variants x 3, baseline
    first = table[1].split()
    assert first[:7] == ["T=16", "16", "uniform", "epgen", "default", "round", "trip"]
    assert first[7] == "1000.0" and first[-1] == "4.00x"
    nb = traffic.round_trip_bytes(bench_args(*SMALL_RUN).config(16), 16)["total"]
    assert float(first[8]) == pytest.approx(nb / 1e6, abs=0.05)              # GB/s at 1 ms
    assert float(first[9]) == pytest.approx(nb / 1e6 / 4000, abs=5e-4)
    assert "epgen final round trip" in table[4] and table[4].rstrip().endswith("8.00x")
    assert "epgen final dispatch_async" in table[5] and table[5].split()[-3:] == ["-", "-", "-"]
    assert table[7].split()[3:6] == ["torch", "argsort+index_select", "4000.0"]
    assert table[7].rstrip().endswith("1.00x")


def test_report_table_round_trip_only_variant(fake_results):
    """A variant timed as a round trip only (the fused kernel) gets one row, not an error."""
    final = fake_results["shapes"][0]["variants"][1]
    del final["dispatch_async"], final["dispatch_wait"]
    rows = [r["variant"] for r in report.table_rows(fake_results)
            if r["T"] == fake_results["shapes"][0]["tokens_per_rank"]]
    assert rows.count("epgen final round trip") == 1
    assert not any(v.startswith("epgen final dispatch") for v in rows)
    assert "epgen default dispatch_async" in rows


def test_format_table_notes_and_missing_numbers():
    rows = [{"shape": "decode", "T": 128, "routing": "zipf", "variant": "epgen x round trip",
             "note": "needs 9 GB"},
            {"shape": "decode", "T": 128, "routing": "zipf", "variant": "y", "us": 12.34,
             "gbps": None, "frac": 0.5, "speedup": None}]
    lines = report.format_table(rows).splitlines()
    assert lines[1].endswith("(needs 9 GB)") and lines[1].split()[-7:-3] == ["-"] * 4
    assert lines[2].split()[-4:] == ["12.3", "-", "0.500", "-"]


def test_json_round_trip(fake_results, tmp_path):
    path = str(tmp_path / "bench.json")
    report.write_json(fake_results, path)
    back = report.read_json(path)
    assert back["shapes"][0]["variants"][1]["label"] == "final"
    assert back["plan"]["variants"][1]["overrides"] == {"ep_final_layout": True,
                                                        "ep_prod_reserve": True}
    a, b = io.StringIO(), io.StringIO()
    report.print_report(fake_results, file=a)
    report.print_report(back, file=b)
    assert a.getvalue() == b.getvalue()
    assert report.plot_series(back) == report.plot_series(fake_results)


def test_plot_series(fake_results):
    series = report.plot_series(fake_results)
    assert list(series) == ["epgen default", "epgen final", baseline.NAME]
    assert [t for t, _ in series["epgen final"]] == [16, 32]
    s16 = fake_results["shapes"][0]
    assert series[baseline.NAME][0] == (16, s16["baseline"]["round_trip"]["gbps"])
    s16["variants"][0].pop("round_trip")                # a variant without a number: left out
    assert [t for t, _ in report.plot_series(fake_results)["epgen default"]] == [32]


def test_plot_writes_a_png(fake_results, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bw.png"
    report.plot(fake_results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_epgen_bench_end_to_end(fake_gpu, tmp_path, capsys):
    """``epgen bench`` through the CLI, device phases faked: table on stdout, progress on
    stderr, JSON and (with matplotlib) the PNG."""
    have_mpl = options.have_matplotlib()
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["bench", *SMALL_RUN, "--json", str(js)] + (["--plot", str(png)] if have_mpl else [])
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "epgen final round trip" in out and "torch argsort+index_select" in out
    assert "[2/6] T=16: epgen default" in err and f"wrote {js}" in err
    assert json.loads(js.read_text())["plan"]["tokens"] == [16, 32]
    if have_mpl:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_epgen_bench_fails_on_a_failed_check(fake_gpu, monkeypatch, capsys):
    monkeypatch.setattr(baseline, "measure", lambda *a, **k: _fake_baseline(*a, **k, corrupt=True))
    status = cli.main(["bench", "--preset", "small", "--tokens", "16", "--no-gate"])
    out, err = capsys.readouterr()
    assert status == 1 and "torch argsort+index_select" in out
    assert "epgen: error: bench: T=16 baseline: FAILED" in err


# ---- small helpers -------------------------------------------------------------------------------
def test_summarize_and_rate():
    s = timing.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["n"] == 4 and s["median_ms"] == 2.5 and s["min_ms"] == 1.0 and s["max_ms"] == 10.0
    assert timing.summarize([]) == {"n": 0}
    gbps, frac = timing.rate(2e9, 1.0, 4000.0)              # 2 GB in 1 ms
    assert gbps == pytest.approx(2000.0) and frac == pytest.approx(0.5)
    assert timing.rate(None, 1.0, 4000.0) == (None, None)
    assert timing.rate(1e9, 1.0, None) == (pytest.approx(1000.0), None)


def test_sample_discards_overruns():
    class G:
        grown = 0

        def grow(self):
            self.grown += 1
    g = G()
    seq = iter([(9.0, True), (1.0, False), (2.0, False), (9.0, True), (3.0, False), (4.0, False)])
    assert timing.sample(lambda i: next(seq), iters=2, warmup=2, gate=g) == [3.0, 4.0]
    assert g.grown == 2


def test_git_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("EPGEN_COMMIT", raising=False)
    commit, dirty = report.git_commit()
    assert commit == "unknown" or (commit.isalnum() and 4 <= len(commit) <= 40)
    assert dirty in (True, False, None)
    assert report.git_commit(str(tmp_path)) == ("unknown", None)      # not a repository
    monkeypatch.setenv("EPGEN_COMMIT", "abc1234")
    assert report.git_commit(str(tmp_path)) == ("abc1234", None)


def test_import_is_light():
    assert_imports_light("import sys, epgen.cli, epgen.bench.driver, epgen.bench.options; "
                         "epgen.cli.build_parser()", REPO)


def test_round_trip_bytes_of_quantising_formats():

    """Per format (H=7168, K=8): input bf16 read once, messages of the format written and read
    once, output rows plus their scales written once."""
    import epgen
    from epgen.bench import traffic
    from epgen.formats import make_format
    H, K, T, R = 7168, 8, 128, 8
    rows = {"BF16": (14368, 2 * H), "BlockwiseFP8": (7424, H + 4 * H // 128),
            "NVFP4": (4064, H // 2 + H // 16), "MXFP8": (7424, H + H // 32)}
    for name, (msg, out) in rows.items():
        cfg = epgen.EPConfig(num_threads=512, n_sms=33, n_experts=256, n_ranks=R,
                             max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                             token_fmt=make_format(name, H, K))
        b = traffic.round_trip_bytes(cfg, T)
        n = R * T * K
        assert b["total"] == R * T * 2 * H + 2 * n * msg + n * out, name


def test_fused_variant_is_a_world_option_not_a_config_field():
    from epgen.bench import plan as P
    v = P.parse_variant("one=fused")
    assert v.world_options == {"fused": True}
    v2 = P.parse_variant("x=fused:false,ep_send_join_named")
    assert v2.world_options == {"fused": False}
    v3 = P.parse_variant("g=graph,ep_ord_r,has_rank_flag")
    assert v3.world_options == {"graph": True}
    assert not hasattr(P.Plan(base=DECODE, tokens=(128,), variants=(v3,)).config(128, v3),
                       "graph")
    p = P.Plan(base=DECODE, tokens=(128,), variants=(v,))
    cfg = p.config(128, v)
    assert not hasattr(cfg, "fused")


def usage_error(capsys, *argv) -> str:
    """``epgen bench ARGV`` exits with status 2 (a usage error): its stderr."""
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err
