"""``P2PWorld`` on real GPUs (one per rank) against the numpy reference, bit-exact (rows inside
an (expert, source) block may come in any order): every flag variant and token format on 1, 2,
4 and 8 GPUs as the machine has them (``multigpu(n)``: skipped with "needs n GPUs"), the
routing edge cases, 1000 back-to-back calls, the round trip as a CUDA graph across the GPUs,
missing ranks timing out on several GPUs, inputs on the wrong GPU, and the CLI.

On one GPU: ``P2PWorld`` with one rank (the ``n_gpus=1`` cases), and several ranks sharing
GPU 0 (``devices=[0, 0, ...]``: the per-GPU programs, pools, pointer tables and error buffers
without peer access).

Run: ``pytest -m gpu tests/gpu/test_p2p_gpu.py`` (docs/multi-gpu.md).
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from epgen.runtime.p2p_world import PeerAccessError
import format_cases
from world_checks import run_only

pytestmark = pytest.mark.gpu

GPU_COUNTS = (1, 2, 4, 8)

# n_ranks -> (E, H, K, max_tpr, num_threads, n_sms per rank). One rank per GPU: each rank's
# grid has its GPU to itself; n_local_experts <= n_sms - 1.
SHAPES = {
    1: (8, 2048, 4, 64, 256, 17),
    2: (32, 2048, 4, 64, 256, 17),
    4: (64, 7168, 8, 64, 512, 33),
    8: (256, 7168, 8, 128, 512, 66),
}
STRESS = {1: (8, 128, 2, 32, 256, 9), 2: (16, 128, 4, 32, 256, 9),
          4: (32, 128, 4, 32, 256, 9), 8: (64, 128, 4, 32, 256, 9)}

# every variant the kernels have on this branch (after merging the flag branches, add e.g.
# dict(ep_ord_r=True, has_rank_flag=True), dict(ep_copy_role_split=True),
# dict(ep_send_join_named=True)); "fused" is the world option, the rest EPConfig flags
FLAGS = {
    "staged": {},
    "fused": {"fused": True},
    "fused_shared_expert": {"fused_shared_expert": True},
    "final_layout": {"ep_final_layout": True},
    "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
    "recv_block_capacity": {"recv_block_capacity": 48},
}
#: every registered format (tests/sim/test_p2p_world.py checks each one's configurations)
FORMATS = format_cases.ALL
WORLD_KWARGS = ("fused",)


def by_gpus(counts=GPU_COUNTS):
    return pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.multigpu(n),
                                                      id=f"{n}gpu") for n in counts])


def make_cfg(n, shape=None, fmt="BF16", **flags):
    E, H, K, T, threads, sms = (shape or SHAPES)[n]
    flags = {k: v for k, v in flags.items() if k not in WORLD_KWARGS}
    if "recv_block_capacity" in flags:
        flags["recv_block_capacity"] = min(flags["recv_block_capacity"], T)
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=n,
                          max_tokens_per_rank=T, p2p_world_size=n, use_shmem=False,
                          token_fmt=make_format(fmt, H, K), **flags)


_worlds = {}


def world_for(cfg, devices=None, **kw):
    key = (cfg, tuple(devices) if devices else None, tuple(sorted(kw.items())))
    if key not in _worlds:
        _worlds.clear()                 # one world at a time: the big shapes hold GBs
        _worlds[key] = epgen.P2PWorld(cfg, devices=devices, **kw)
    return _worlds[key]


def run_and_compare(world, toks, ids, seed, what="", input_scale=1.0):
    got = world.dispatch(toks, ids, input_scale=input_scale)
    want = reference.dispatch(world.cfg, toks, ids, input_scale=input_scale)
    try:
        reference.assert_match(world.cfg, want, got)
        if world.cfg.ep_prod_reserve:          # the standard layout exactly
            for w, g in zip(want, got):
                assert (g.block_starts == w.block_starts).all(), f"rank {g.rank} block_starts"
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}{what}: {exc}") from None
    return got


def random_counts(rng, cfg):
    return [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]


def flag_kwargs(flags):
    return {k: v for k, v in FLAGS[flags].items() if k in WORLD_KWARGS}


# ---- every flag variant, BF16 ----------------------------------------------------------------
@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
@by_gpus()
def test_flags_random_routing(n, flags, seed):
    cfg = make_cfg(n, **FLAGS[flags])
    world = world_for(cfg, **flag_kwargs(flags))
    assert world.devices == tuple(range(n))
    rng = np.random.default_rng(seed)
    for call in range(3):
        toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg))
        run_and_compare(world, toks, ids, seed, f", {flags}, call {call}")


@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("flags", ["staged", "fused_shared_expert", "prod_reserve"])
@by_gpus((2, 4, 8))
def test_edge_cases(n, flags, case, seed):
    cfg = make_cfg(n, **FLAGS[flags])
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, cfg, case)
    run_and_compare(world_for(cfg, **flag_kwargs(flags)), toks, ids, seed, f", {case}")


def test_skewed_routing_8_gpus_or_fewer(seed):
    """Zipf routing (a few hot experts) on as many GPUs as there are, up to 8."""
    from backends import cuda
    n = max(c for c in GPU_COUNTS if c <= cuda.device_count())
    for flags in ("staged", "prod_reserve"):
        cfg = make_cfg(n, **FLAGS[flags])
        rng = np.random.default_rng(seed)
        weights = routing.zipf_weights(cfg.n_experts, 1.2, rng=rng)
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank, weights)
        run_and_compare(world_for(cfg), toks, ids, seed, f", {flags}, {n} GPUs")


# ---- formats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", format_cases.QUANT)
@by_gpus()
def test_formats_random_routing(n, fmt, seed):
    cfg = make_cfg(n, fmt=fmt)
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    scales = (1.0, 0.37) if cfg.token_fmt.uses_input_scale else (1.0,)
    for input_scale in scales:
        for call in range(2):
            toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg))
            run_and_compare(world, toks, ids, seed, f", {fmt}, call {call}", input_scale)


@pytest.mark.parametrize("flags", [f for f in FLAGS if f != "staged"])
@pytest.mark.parametrize("fmt", format_cases.QUANT)
@by_gpus((1, 2, 8))
def test_formats_with_flags(n, fmt, flags, seed):
    """Each quantising format with each other variant (their EmulatedWorld counterparts are
    GPU-tested only plain: a failure here may be the combination, not P2P)."""
    cfg = make_cfg(n, fmt=fmt, **FLAGS[flags])
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg))
    run_and_compare(world_for(cfg, **flag_kwargs(flags)), toks, ids, seed, f", {fmt}+{flags}")


# ---- stress ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", ["staged", "fused_shared_expert", "prod_reserve"])
@by_gpus()
def test_back_to_back_1000_calls(n, flags, seed):
    """1000 calls on the same buffers, some ranks sending nothing now and then; the
    ordering between calls is the world's cross-GPU event waits."""
    cfg = make_cfg(n, STRESS, **FLAGS[flags])
    world = epgen.P2PWorld(cfg, **flag_kwargs(flags))
    rng = np.random.default_rng(seed)
    gen0 = world.prod_generations() if cfg.ep_prod_reserve else None
    for call in range(1000):
        counts = random_counts(rng, cfg)
        if call % 10 == 3:
            counts[int(rng.integers(cfg.n_ranks))] = 0
        toks, ids = routing.routing(rng, cfg, counts)
        run_and_compare(world, toks, ids, seed, f", {flags}, call {call}")
    if cfg.ep_prod_reserve:
        assert world.prod_generations() == [g + 1000 for g in gen0]


# ---- several ranks on one GPU (runs on the one-GPU machine) ------------------------------------------
@pytest.mark.parametrize("flags", ["staged", "fused_shared_expert", "final_layout", "prod_reserve"])
@pytest.mark.parametrize("n", [2, 4])
def test_ranks_sharing_gpu0(n, flags, seed):
    cfg = make_cfg(n, STRESS, **FLAGS[flags])
    world = world_for(cfg, devices=[0] * n, **flag_kwargs(flags))
    assert world.device_ids == [0]
    rng = np.random.default_rng(seed)
    for call in range(20):
        toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg))
        run_and_compare(world, toks, ids, seed, f", {flags}, call {call}")


@pytest.mark.parametrize("flags", ["staged", "fused", "prod_reserve"])
@by_gpus()
def test_graph_replays(n, flags, seed):
    """The round trip captured once as a CUDA graph across the GPUs (``RoundTripGraph``) and
    replayed with new inputs, a stream call between replays: every call matches."""
    cfg = make_cfg(n, STRESS, **FLAGS[flags])
    world = world_for(cfg, **flag_kwargs(flags))
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    toks, ids = routing.routing(rng, cfg, T)
    world.load_inputs(toks, ids)
    graph = world.capture_round_trip()
    try:
        for call in range(4):
            toks, ids = routing.routing(rng, cfg, T)
            if call == 1:
                got = world.dispatch(toks, ids)
            else:
                world.load_inputs(toks, ids)
                graph.launch()
                world.check()
                got = world.results()
            try:
                reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, {flags}, call {call}: {exc}") from None
    finally:
        graph.close()


def test_one_rank_matches_emulated_world(seed):
    """n_ranks=1: P2PWorld and EmulatedWorld give the same result as the reference."""
    cfg = make_cfg(1)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    p2p = run_and_compare(world_for(cfg), toks, ids, seed)
    emu = epgen.EmulatedWorld(cfg).dispatch(toks, ids)
    for a, b in zip(p2p, emu):
        assert not reference.compare(cfg, a, b), f"seed {seed}"


# ---- peers, inputs, timeouts -------------------------------------------------------------------------
@by_gpus((2, 4, 8))
def test_peer_access_matches_the_driver(n):
    """Every pair reachable: the world builds; else it refuses naming the pair."""
    from backends import cuda
    cfg = make_cfg(n, STRESS)
    bad = [(a, b) for a in range(n) for b in range(n) if a != b and not cuda.can_access_peer(a, b)]
    if not bad:
        world = epgen.P2PWorld(cfg)
        assert sorted(world.pools) == list(range(n))
        for d, pool in world.pools.items():
            assert {int(p.device_id) for p in pool.peer_accessible_by} == set(range(n)) - {d}
        return
    with pytest.raises(PeerAccessError) as info:
        epgen.P2PWorld(cfg)
    a, b = bad[0]
    assert f"GPU {a} (rank {a}) cannot access the memory of GPU {b}" in str(info.value)


@by_gpus((2,))
def test_device_inputs(n, seed):
    """Device arrays on each rank's GPU work; one on another rank's GPU is refused."""
    from backends import cuda
    cfg = make_cfg(n, STRESS)
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    on_gpu = [cuda.to_device(x, device=d) for x, d in zip(toks, world.devices)]
    for d in world.device_ids:          # the copies ran on the default streams
        cuda.get_device(d).sync()
    got = world.dispatch(on_gpu, ids)
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
    swapped = [on_gpu[1], on_gpu[0]]
    with pytest.raises(ValueError, match=r"tokens\[0\] is in the memory of GPU 1, but rank 0 "
                                         r"runs on GPU 0"):
        world.dispatch(swapped, ids)


@pytest.mark.parametrize("flags", ["staged", "prod_reserve"])
@by_gpus((2, 4))
def test_missing_ranks_time_out_then_recover(n, flags, seed):
    """Only the first half of the ranks run: each gives up on its own GPU's deadline (the
    abort word does not cross GPUs); one EPTimeoutError holds the records of every GPU that
    timed out, all error buffers are re-armed, and the world works again."""
    cfg = make_cfg(n, STRESS, **FLAGS[flags])
    world = epgen.P2PWorld(cfg, timeout_ns=100_000_000)
    rng = np.random.default_rng(seed)
    world.load_inputs(*routing.routing(rng, cfg, 8))
    running = set(range(n // 2))
    err = run_only(world, running)
    assert {r.rank for r in err.records} <= running and err.records, f"seed {seed}: {err}"
    if flags == "staged":            # every running rank waits on a missing one's counts
        assert {r.rank for r in err.records} == running, f"seed {seed}: {err}"
    for d in world.device_ids:
        assert not world.errs[d].array.to_host().any()
    world.reset()
    toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg))
    run_and_compare(world, toks, ids, seed, ", after the timeout")


@by_gpus((2,))
def test_cli_run_p2p(n, capsys, seed):
    from epgen import cli
    assert cli.main(["run", "--preset", "small", "--world", "p2p", "--calls", "2",
                     "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    assert "2 ranks on GPUs 0,1 (P2P)" in out and out.count("matches the reference") == 2


def test_cli_run_p2p_one_gpu(capsys, seed):
    from epgen import cli
    assert cli.main(["run", "--preset", "small", "--world", "p2p", "--devices", "0,0",
                     "--calls", "2", "--seed", str(seed)]) == 0
    assert capsys.readouterr().out.count("matches the reference") == 2


# ---- combine ---------------------------------------------------------------------------------------
def _combine_and_compare(world, rng, seed, call, counts):
    """One dispatch then one combine (weights on even calls, None on odd ones, a residual
    every fourth call) against ``reference.combine``, bit for bit."""
    from combine_checks import combine_matches

    cfg = world.cfg
    toks, ids = routing.routing(rng, cfg, counts)
    results = run_and_compare(world, toks, ids, seed, f", call {call}")
    combine_matches(world, rng, seed, call, results, ids)


@by_gpus()
def test_combine_matches_the_reference(n, seed):
    """``P2PWorld.combine`` after each dispatch: the receive buffers and arrival words in the
    peer pools, written by the peers' GPUs."""
    cfg = make_cfg(n)
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    for call in range(6):
        counts = cfg.max_tokens_per_rank if call < 4 else random_counts(rng, cfg)
        _combine_and_compare(world, rng, seed, call, counts)


@by_gpus((2, 4, 8))
def test_combine_200_back_to_back_calls(n, seed):
    cfg = make_cfg(n, STRESS)
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    for call in range(200):
        _combine_and_compare(world, rng, seed, call, random_counts(rng, cfg))


@pytest.mark.parametrize("n", [2, 4])
def test_combine_ranks_sharing_gpu0(n, seed):
    cfg = make_cfg(n, STRESS)
    world = world_for(cfg, devices=[0] * n)
    rng = np.random.default_rng(seed)
    for call in range(8):
        _combine_and_compare(world, rng, seed, call, random_counts(rng, cfg))


@by_gpus((2, 4))
def test_combine_corrupted_src_info_row_is_reported(n, seed):
    from combine_checks import corrupted_row_check

    corrupted_row_check(world_for(make_cfg(n, STRESS)), np.random.default_rng(seed), d=n - 1)
