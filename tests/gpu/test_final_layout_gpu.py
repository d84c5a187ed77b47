"""``ep_final_layout`` alone (capacity-strided) and with ``ep_prod_reserve`` (deterministic
rank-major rows) on the GPU: EmulatedWorld against the numpy reference, bit-exact (rows inside
an (expert, source) block may come in any order; capacity-strided blocks in any order that
tiles the expert's range), on random routings, the edge cases, 1000 back-to-back calls with
the re-armed cursors and advancing generations checked, a generation wrap and a missing rank.

Grids are small (R 2 or 4, at most 17 blocks per rank), so every rank's dispatch_async and
dispatch_wait grids fit on the GPU at once (the reservation and the reserver wait across
ranks). docs/final-layout.md describes the protocol.
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.layout import RECV_COUNT_SENTINEL
from world_checks import kinds, make_cfg, only_rank0_records, world_for

pytestmark = pytest.mark.gpu

FLAGS = {
    "final_layout": {"ep_final_layout": True},
    "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
}

# (R, E, H, K, max_tpr, num_threads, n_sms per rank); n_local_experts <= n_sms - 1
CONFIGS = [
    (2, 16, 2048, 4, 64, 256, 9),
    (4, 32, 7168, 8, 32, 512, 9),
    (4, 64, 128, 8, 128, 256, 17),
    (2, 8, 128, 2, 256, 128, 9),        # more than one 128-row tile per expert in the wait
    (1, 8, 128, 2, 16, 128, 9),         # one rank: every block is its own
]
STRESS = (4, 32, 128, 4, 32, 256, 9)


def run_and_compare(cfg, toks, ids, seed, world=None):
    world = world or world_for(cfg)
    got = world.dispatch(toks, ids)
    want = reference.dispatch(cfg, toks, ids)
    try:
        reference.assert_match(cfg, want, got)
        if cfg.ep_prod_reserve:       # the standard layout: blocks exactly rank-major
            for w, g in zip(want, got):
                assert (g.block_starts == w.block_starts).all(), \
                    f"rank {g.rank} block_starts {g.block_starts.tolist()}"
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None
    return got


def check_rearmed(world, context: str):
    """The state the next call needs: cursors and hand-off words back at 0; with
    ep_prod_reserve every early count tagged with this call's generation."""
    cfg, lay = world.cfg, world.cfg.layout
    gens = world.prod_generations() if cfg.ep_prod_reserve else [None] * len(world.ranks)
    for rk, gen in zip(world.ranks, gens):
        rc = rk.recv_count.to_host()
        assert (rc[:lay.rank_flag_base] == RECV_COUNT_SENTINEL).all(), context
        assert (rc[lay.rc_cursor_base:] == 0).all(), f"{context}: rank {rk.rank} cursors {rc}"
        ctr = rk.counters.to_host()
        region = lay.final_layout_region
        assert (ctr[region.offset:region.end] == 0).all(), f"{context}: hand-off words"
        if cfg.ep_prod_reserve:
            early = rk.prod_buf.to_host()[lay.prod_early_count_offset:][:cfg.n_experts]
            assert ((early >> np.uint64(32)) == gen).all(), \
                f"{context}: rank {rk.rank} early-count tags {early >> np.uint64(32)}, gen {gen}"


@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
@pytest.mark.parametrize("shape", CONFIGS,
                         ids=lambda c: "R{}-E{}-H{}-K{}-T{}-thr{}-sm{}".format(*c))
def test_random_routing(shape, flags, seed):
    cfg = make_cfg(*shape, **FLAGS[flags])
    rng = np.random.default_rng(seed)
    for _ in range(3):
        counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        toks, ids = routing.routing(rng, cfg, counts)
        run_and_compare(cfg, toks, ids, seed)
    check_rearmed(world_for(cfg), f"seed {seed}")


@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
@pytest.mark.parametrize("shape", [CONFIGS[1], CONFIGS[2]], ids=["R4-E32", "R4-E64"])
def test_edge_cases(shape, flags, case, seed):
    cfg = make_cfg(*shape, **FLAGS[flags])
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, cfg, case)
    run_and_compare(cfg, toks, ids, seed)


def test_skewed_routing(seed):
    """A few hot experts: some (expert, source) blocks full, most empty."""
    for flags in FLAGS.values():
        cfg = make_cfg(*CONFIGS[2], **flags)
        rng = np.random.default_rng(seed)
        weights = routing.zipf_weights(cfg.n_experts, 2.0, rng=rng)
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank, weights)
        run_and_compare(cfg, toks, ids, seed)


@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
def test_back_to_back_1000_calls(flags, seed):
    """1000 calls on the same buffers: the cursors and hand-off words re-armed, the
    generation advanced every call (checked on the device every 100 calls)."""
    cfg = make_cfg(*STRESS, **FLAGS[flags])
    world = epgen.EmulatedWorld(cfg)
    rng = np.random.default_rng(seed)
    gen0 = world.prod_generations() if cfg.ep_prod_reserve else None
    for call in range(1000):
        counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        toks, ids = routing.routing(rng, cfg, counts)
        try:
            run_and_compare(cfg, toks, ids, seed, world)
        except AssertionError as exc:
            raise AssertionError(f"call {call}: {exc}") from None
        if call % 100 == 99:
            check_rearmed(world, f"seed {seed}, call {call}")
    if cfg.ep_prod_reserve:
        assert world.prod_generations() == [g + 1000 for g in gen0]


def test_generation_wrap(seed):
    """The 32-bit generation wraps on the device: tags 0xFFFFFFFE, 0xFFFFFFFF, then 1 (0 is
    skipped) with no host work; every call stays correct."""
    cfg = make_cfg(*STRESS, **FLAGS["prod_reserve"])
    world = epgen.EmulatedWorld(cfg)
    rng = np.random.default_rng(seed)
    world.set_prod_generations(2**32 - 3)
    gens = []
    for _ in range(4):
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        run_and_compare(cfg, toks, ids, seed, world)
        (gen,) = set(world.prod_generations())
        gens.append(gen)
        check_rearmed(world, f"seed {seed}, gen {gens[-1]:#x}")
    assert gens == [2**32 - 2, 2**32 - 1, 1, 2]


def test_row_order_is_rank_major_with_prod_reserve(seed):
    """ep_prod_reserve: the output rows of each expert are grouped by source rank in rank
    order; rows from one source may come in any order."""
    cfg = make_cfg(*CONFIGS[1], **FLAGS["prod_reserve"])
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    for res in run_and_compare(cfg, toks, ids, seed):
        starts, counts = res.block_starts, res.counts
        for e in range(counts.shape[0]):
            expect = int(res.row_offsets[e])
            for s in range(cfg.n_ranks):
                assert starts[e, s] == expect, f"seed {seed}: expert {e} source {s}"
                expect += int(counts[e, s])
            assert expect == res.row_offsets[e + 1], f"seed {seed}: expert {e}"


# Which wait expires first depends on timing (tests/sim/test_final_layout_sim.py says why).
@pytest.mark.parametrize("flags,where", [
    ("final_layout", {("ep_dispatch_wait", "aux", "recv_count")}),
    ("prod_reserve", {("ep_dispatch_async", "monitor", "prod_early_count"),
                      ("ep_dispatch_async", "monitor", "expert_finished_counter"),
                      ("ep_dispatch_async", "comm", "prod_mailbox")}),
])
def test_missing_rank_times_out(flags, where, seed):
    """Only rank 0 runs: with ep_prod_reserve its reserver gives up waiting for the other
    ranks' early counts; capacity-strided, its dispatch_wait for their count words."""
    cfg = make_cfg(*CONFIGS[1], **FLAGS[flags])
    world = epgen.EmulatedWorld(cfg, timeout_ns=100_000_000)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 8)
    found = kinds(only_rank0_records(world, toks, ids))
    assert where & found, f"seed {seed}: {found}"
    world.reset()                                       # and the world works again
    toks, ids = routing.routing(rng, cfg, 8)
    run_and_compare(cfg, toks, ids, seed, world)


@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
def test_cli_run_small_preset(flags, capsys, seed):
    from epgen import cli
    sets = [arg for f in FLAGS[flags] for arg in ("--set", f"{f}=true")]
    assert cli.main(["run", "--preset", "small", *sets, "--calls", "2", "--seed", str(seed)]) == 0
    assert capsys.readouterr().out.count("matches the reference") == 2
