"""``ep_final_layout`` and ``ep_prod_reserve`` on the CPU: the real ``EmulatedWorld`` (its
buffers, pointer tables, generations and result extraction) runs the generated kernels in
the IR simulator (``backends.sim``), against the numpy reference, over back-to-back calls.

The simulator is sequentially consistent: these tests check the protocol's logic (rows,
offsets, reservations, hand-offs, re-arming, generations, deadlock freedom), not its memory
ordering (tests/ptx/test_final_layout_ptx.py pins the orderings; the GPU tests run it for real).
The staged (default) variant runs too, as a check of the simulator itself; the mutation tests
show that a broken re-arm or a frozen generation fails these tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.kernels import final_layout
from epgen.tuning import Tuning
from epgen.runtime.results import region_a_blocks

from backends.sim import SimHang
from sim_world import sim_world
from world_checks import run_checked

# (R, E, H, K, max_tpr, num_threads, n_sms): tiny grids (the simulator runs every thread)
SHAPES = {"R2-E4": (2, 4, 16, 2, 4, 64, 4), "R4-E8": (4, 8, 16, 2, 3, 64, 6),
          # the warp send path's other code shapes: 64 payload vectors (two per lane in
          # flight, no tail loop) and K = 8 (a round of 4 tokens fills the 32 lanes)
          "R2-E4-H512": (2, 4, 512, 2, 4, 64, 4), "R2-E8-K8": (2, 8, 16, 8, 5, 64, 5)}
FLAGS = {
    "staged": {},
    "ord_r": {"ep_ord_r": True, "has_rank_flag": True},
    "final_layout": {"ep_final_layout": True},
    "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
}


def make_cfg(R, E, H, K, T, threads, sms, **flags):
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=epgen.BF16Format(hid_dim=H, top_k=K), **flags)


def run_calls(world, cfg, rng, inputs, seed):
    """Each of ``inputs`` one checked call of ``world`` (``world_checks.run_checked``: with
    ``ep_prod_reserve``, the reference's block starts exactly)."""
    run_checked(world, inputs, seed)


def random_inputs(rng, cfg, n_calls):
    return [routing.routing(rng, cfg, [int(rng.integers(0, cfg.max_tokens_per_rank + 1))
                                       for _ in range(cfg.n_ranks)]) for _ in range(n_calls)]


CASES = [(shape, flags) for shape in ("R2-E4", "R4-E8") for flags in ("final_layout",
                                                                      "prod_reserve")]
CASES.append(("R4-E8", "staged"))        # the simulator itself, on the GPU-tested kernels
CASES += [(shape, flags) for shape in ("R2-E4-H512", "R2-E8-K8")
          for flags in ("staged", "ord_r", "prod_reserve")]


@pytest.mark.parametrize("shape,flags", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_back_to_back_calls_match_reference(shape, flags, seed):
    cfg = make_cfg(*SHAPES[shape], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        run_calls(world, cfg, rng, random_inputs(rng, cfg, 3), seed)


@pytest.mark.parametrize("flags", ["final_layout", "prod_reserve"])
def test_edge_cases(flags, seed):
    """Every edge case, one after another on the same buffers."""
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    inputs = [routing.edge_case(rng, cfg, case) for case in routing.EDGE_CASES]
    with sim_world(cfg, seed) as world:
        run_calls(world, cfg, rng, inputs, seed)


def test_capacity_strided_blocks_land_in_reservation_order(seed):
    """Sources reserve in whichever order their monitors get there: over a few calls both
    orders of a two-source expert show up, and every one tiles the expert's dense range."""
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS["final_layout"])
    rng = np.random.default_rng(seed)
    orders = set()
    with sim_world(cfg, seed) as world:
        for _ in range(5):
            toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
            got = world.dispatch(toks, ids)
            reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
            for res in got:
                for e in range(res.counts.shape[0]):
                    if (res.counts[e] > 0).all():
                        orders.add(tuple(np.argsort(res.block_starts[e])))
                        assert res.block_starts[e].min() == res.row_offsets[e], f"seed {seed}"
    assert len(orders) == 2, f"seed {seed}: block orders seen {orders}"


def test_generation_wraps_on_the_device(seed):
    """The generation words start two below the 32-bit limit: the kernels advance them
    through the wrap (skipping 0) and every call still matches the reference."""
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS["prod_reserve"])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        world.set_prod_generations(2**32 - 3)
        seen = []
        for toks, ids in random_inputs(rng, cfg, 4):
            run_calls(world, cfg, rng, [(toks, ids)], seed)
            seen.append(world.prod_generations())
    assert seen == [[2**32 - 2] * 2, [2**32 - 1] * 2, [1] * 2, [2] * 2], f"seed {seed}"


def test_region_a_blocks():
    L, R = 2, 2
    # pair (e, src): [2w] = 1024 + end, [2w+1] = count
    region_a = np.array([1024 + 5, 2, 1024 + 3, 3, 1024 + 8, 0, 1024 + 12, 4], np.int32)
    counts, starts = region_a_blocks(region_a, L, R)
    assert counts.tolist() == [[2, 3], [0, 4]]
    assert starts.tolist() == [[3, 0], [8, 8]]


MUTATIONS = {
    # the destination forgets to re-arm its reservation cursors: the next call's blocks start
    # past the rows of the last one
    "cursor_not_rearmed": ("final_layout", lambda mp: mp.setattr(
        final_layout.CapacityStridedRows, "rearm_arrivals", lambda *a, **k: None)),
    # the monitor leaves its hand-off word valid: the next call's comm warps may read the
    # last call's base
    "handoff_not_rearmed": ("final_layout", lambda mp: mp.setattr(
        final_layout.CapacityStridedRows, "rearm", lambda *a, **k: None)),
    # the generation never advances: last call's early counts and mailboxes satisfy this
    # call's waits
    "generation_frozen": ("prod_reserve", lambda mp: mp.setattr(
        final_layout, "advance_generation", lambda *a, **k: None)),
    # the reserver ignores the earlier experts' rows: blocks of different experts overlap
    "expert_start_ignored": ("prod_reserve", lambda mp: mp.setattr(
        final_layout, "_padded", lambda cfg, n: 0)),
}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=list(MUTATIONS))
def test_broken_protocol_is_caught(mutation, monkeypatch):
    flags, apply = MUTATIONS[mutation]
    apply(monkeypatch)
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags])
    for seed in range(3):
        rng = np.random.default_rng(seed)
        try:
            with sim_world(cfg, seed, max_spins=2000) as world:
                run_calls(world, cfg, rng, [routing.routing(rng, cfg, cfg.max_tokens_per_rank)
                                            for _ in range(4)], seed)
        except (AssertionError, SimHang):
            return
    pytest.fail(f"{mutation} went unnoticed over 3 seeds of 4 calls")


# The wait that expires first depends on the interleaving: with prod_reserve the monitor's
# wait for the missing rank's early count, or its wait for its own comm warps, which are
# themselves stuck on the missing reserver's mailbox, or those comm warps. Each names the
# missing peer's effect.
@pytest.mark.parametrize("flags,where", [
    ("final_layout", {("ep_dispatch_wait", "aux", "recv_count")}),
    ("prod_reserve", {("ep_dispatch_async", "monitor", "prod_early_count"),
                      ("ep_dispatch_async", "monitor", "expert_finished_counter"),
                      ("ep_dispatch_async", "comm", "prod_mailbox")}),
])
def test_missing_rank_times_out_then_recovers(flags, where, seed):
    """Only rank 0 runs: its bounded waits expire (simulated), the world raises
    EPTimeoutError naming what was waited on, and after reset() every rank works again."""
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed, max_spins=300, timeouts=True) as world:
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        world.load_inputs(toks, ids)
        others = world.ranks[1:]
        world.ranks = world.ranks[:1]
        try:
            world.dispatch_async()
            world.dispatch_wait()
            with pytest.raises(epgen.EPTimeoutError) as info:
                world.check()
        finally:
            world.ranks += others
        kinds = {(r.kernel, r.role, r.buffer) for r in info.value.records}
        assert where & kinds, f"seed {seed}: {kinds}"
        assert all(r.rank == 0 for r in info.value.records)
        world.reset()
        run_calls(world, cfg, rng, random_inputs(rng, cfg, 2), seed)


def test_dispatch_wait_is_a_programmatic_dependent_launch(seed):
    """Each rank's dispatch_wait is launched with PDL, its dispatch_async never (its
    predecessors are other ranks' waits, joined by events); results match the reference."""
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS["staged"])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        run_calls(world, cfg, rng, random_inputs(rng, cfg, 2), seed)
        launched = world.program.loaded.launched
    assert sorted(set(launched)) == [("ep_dispatch_async", False), ("ep_dispatch_wait", True)]
    assert len(launched) == 2 * 2 * cfg.n_ranks


@pytest.mark.parametrize("fmt", ["BF16", "BlockwiseFP8"])
def test_header_pass_over_several_tiles(fmt, seed):
    """dispatch_wait's header pass (a thread per row) where an expert has more rows than one
    tile: 64 threads, up to 96 rows of one expert (``one_hot_expert``, ``full``);
    BlockwiseFP8's transposed scales are written from the header rows tile by tile, in two
    chunks of 32 rows a tile (``tuning.scale_chunk_rows``)."""
    from epgen.formats import make_format
    R, E, H, K, T = 2, 4, 512, 2, 48
    cfg = epgen.EPConfig(num_threads=64, n_sms=4, n_experts=E, n_ranks=R,
                         max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                         token_fmt=make_format(fmt, H, K), ep_final_layout=True,
                         ep_prod_reserve=True, tuning=Tuning(scale_chunk_rows=32))
    rng = np.random.default_rng(seed)
    inputs = [routing.edge_case(rng, cfg, case) for case in ("one_hot_expert", "full")]
    rows = max(np.bincount(np.concatenate([a.ravel() for a in ids]), minlength=E).max()
               for _, ids in inputs)                  # one expert's rows, all sources
    assert rows > cfg.num_threads                     # the pass claims a second tile
    with sim_world(cfg, seed) as world:
        run_calls(world, cfg, rng, inputs, seed)
