"""GPU tests of the fused single-launch dispatch (``EmulatedWorld(cfg, fused=True)``), the
shared expert, the SM schedule and the ``ep_fused_roles`` test kernel, against the numpy
reference, bit-exact (rows inside an (expert, source) block may come in any order)."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.kernels.fused_roles import FusedRolesSpec, row_checksums
from epgen.kernels.schedule import sm_schedule
from world_checks import kinds, only_rank0_records

pytestmark = pytest.mark.gpu

# (R, E, H, K, max_tpr, num_threads, n_sms per rank); all ranks' grids must fit on the GPU
CONFIGS = [
    (1, 8, 128, 2, 16, 128, 9),
    (2, 32, 2048, 4, 64, 256, 17),
    (4, 64, 128, 8, 64, 512, 17),
    (8, 256, 2048, 8, 128, 512, 33),
    (8, 64, 7168, 4, 16, 512, 9),
]
SHAPE_IDS = ["R{}-E{}-H{}-K{}-T{}-thr{}-sm{}".format(*c) for c in CONFIGS]
SE = pytest.mark.parametrize("se", [False, True], ids=["routed", "shared_expert"])


def make_cfg(R, E, H, K, T, threads, sms, **flags):
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=epgen.BF16Format(hid_dim=H, top_k=K), **flags)


_worlds = {}


def world_for(cfg, fused=True):
    if (cfg, fused) not in _worlds:
        _worlds[cfg, fused] = epgen.EmulatedWorld(cfg, fused=fused)
    return _worlds[cfg, fused]


def run_and_compare(world, toks, ids, seed, what=""):
    got = world.dispatch(toks, ids)
    want = reference.dispatch(world.cfg, toks, ids)
    try:
        reference.assert_match(world.cfg, want, got)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}{what}: {exc}") from None
    return got, want


def wait_words(world, rank):
    """The dispatch_wait counter region of ``rank`` (host copy)."""
    lay = world.cfg.layout
    region = lay.dispatch_wait_region
    return world.ranks[rank].counters.to_host()[region.offset:region.end]


def random_counts(rng, cfg):
    return [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]


# ---- the fused kernel against the reference --------------------------------------------------
@SE
@pytest.mark.parametrize("shape", CONFIGS, ids=SHAPE_IDS)
def test_fused_random_routing(shape, se, seed):
    cfg = make_cfg(*shape, fused_shared_expert=se)
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    for call in range(3):
        toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg))
        run_and_compare(world, toks, ids, seed, f", call {call}")


@SE
@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("shape", [CONFIGS[2], CONFIGS[3]], ids=["R4-E64", "R8-E256"])
def test_fused_edge_cases(shape, case, se, seed):
    cfg = make_cfg(*shape, fused_shared_expert=se)
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, cfg, case)
    run_and_compare(world_for(cfg), toks, ids, seed, f", {case}")


def test_fused_shared_expert_back_to_back_1000_calls(seed):
    """1000 fused+SE calls on the same buffers; some ranks send nothing now and then (no SE
    packers, no send_buf_ready bumps). send_buf_ready and started (Regions F, G), the ready
    flag and the cleanup count are back at 0 after every call."""
    cfg = make_cfg(4, 32, 128, 4, 32, 256, 9, fused_shared_expert=True)
    lay = cfg.layout
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    rearmed = (lay.send_buf_ready_offset, lay.shared_expert_started_offset,
               lay.ready_flag_offset, lay.cleanup_counter_offset)
    for call in range(1000):
        counts = random_counts(rng, cfg)
        if call % 10 == 3:
            counts[int(rng.integers(cfg.n_ranks))] = 0
        toks, ids = routing.routing(rng, cfg, counts)
        run_and_compare(world, toks, ids, seed, f", call {call}")
        if call % 50 == 0 or call == 999:
            for r in range(cfg.n_ranks):
                w = wait_words(world, r)
                assert [int(w[o]) for o in rearmed] == [0, 0, 0, 0], \
                    f"seed {seed}, call {call}, rank {r}: F, G, ready flag, cleanup count"


def test_fused_missing_rank_times_out(seed):
    """Only rank 0's fused kernel runs: its aux block gives up on the peers' count words and
    names them; nothing hangs."""
    cfg = make_cfg(*CONFIGS[2], fused_shared_expert=True)
    world = epgen.EmulatedWorld(cfg, timeout_ns=100_000_000)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 8)
    found = kinds(only_rank0_records(world, toks, ids))
    assert ("ep_dispatch", "aux", "recv_count") in found, f"seed {seed}: {found}"


# ---- the SM schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_sm_schedule_follows_zipf_routing(fused, seed):
    """Skewed (Zipf) routing: each rank's schedule table equals the numpy model of its expert
    counts, the hot experts get more copy blocks, and the output is still exact."""
    cfg = make_cfg(4, 32, 256, 4, 128, 256, 33)
    world = world_for(cfg, fused)
    lay = cfg.layout
    n_copy = cfg.n_sms - 1
    rng = np.random.default_rng(seed)
    for call in range(3):
        weights = routing.zipf_weights(cfg.n_experts, 1.2, rng)
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank, weights)
        got, want = run_and_compare(world, toks, ids, seed, f", call {call}")
        for r in range(cfg.n_ranks):
            per_expert = want[r].counts.sum(axis=1)
            table = wait_words(world, r)[lay.sm_schedule_offset:][:cfg.n_sms]
            model = sm_schedule(per_expert, n_copy, cfg.n_sms)
            assert np.array_equal(table, model), \
                f"seed {seed}, call {call}, rank {r}: table {table.tolist()} != {model.tolist()}"
            # the spare blocks follow the counts (each expert within one block of its share)
            blocks = np.bincount(table[:n_copy], minlength=lay.n_local_experts)
            hot = int(np.argmax(per_expert))
            assert blocks[hot] >= max(2, blocks.max() - 1), \
                f"seed {seed}, rank {r}: counts {per_expert.tolist()}, blocks {blocks.tolist()}"


# ---- the fused-roles test kernel --------------------------------------------------------------
_runners = {}


def runner_for(cfg):
    from epgen.runtime.fused_roles_run import FusedRolesRunner
    if cfg not in _runners:
        _runners[cfg] = FusedRolesRunner(world_for(cfg, fused=False), FusedRolesSpec())
    return _runners[cfg]


@pytest.mark.parametrize("shape", [CONFIGS[2], CONFIGS[3]], ids=["R4-E64", "R8-E256"])
def test_fused_roles_consumer_sees_exactly_the_released_rows(shape, seed):
    """ep_fused_roles in place of dispatch_wait: the output is exact; each expert's L1
    arrival counter ends at delta * ceil(count / token_block) (pad words untouched); the ffn
    role, which read each expert's rows once its counter said they had landed, saw exactly
    the final rows (its checksums equal those of the output; the output was poisoned before
    the launch, so an early read would differ) and read no other row."""
    from epgen.runtime.fused_roles_run import POISON
    cfg = make_cfg(*shape)
    runner = runner_for(cfg)
    spec = runner.spec
    rng = np.random.default_rng(seed)
    for case in ("random", "one_hot_expert", "zero_tokens", "rank_without_tokens"):
        toks, ids = routing.edge_case(rng, cfg, case)
        out = runner.dispatch(toks, ids)
        want = reference.dispatch(cfg, toks, ids)
        where = f"seed {seed}, {case}"
        try:
            reference.assert_match(cfg, want, out.results)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        for r in range(cfg.n_ranks):
            counts = want[r].counts.sum(axis=1)
            np.testing.assert_array_equal(out.l1_counters[r],
                                          spec.expected_counters(cfg, counts),
                                          err_msg=f"{where}, rank {r}: L1 arrival counters")
            n = out.results[r].n_rows
            rows = out.results[r].out_tokens[:n]
            np.testing.assert_array_equal(out.ffn_out[r][:n], row_checksums(rows),
                                          err_msg=f"{where}, rank {r}: ffn checksums")
            poison = np.uint32(int.from_bytes(bytes([POISON] * 4), "little"))
            assert (out.ffn_out[r][n:] == poison).all(), f"{where}, rank {r}: stray ffn rows"


@pytest.mark.parametrize("devices", [2, 3])
def test_fused_shared_expert_with_skip_a2a(devices, seed):
    """skip_a2a devices (one rank each, global top-k ids) with the shared expert in the fused
    kernel: each device packs its allreduce slice of its tokens as group 0 (our fix of the
    reference's hazard: every send block publishes send_buf_ready, so a token with no local
    expert is staged before it is packed)."""
    cfg = make_cfg(1, 8, 256, 4, 32, 256, 9, skip_a2a=True, fused_shared_expert=True)
    world = epgen.EmulatedWorld(cfg, fused=True, devices=devices)
    rng = np.random.default_rng(seed)
    g = cfg.replace(skip_a2a=False, fused_shared_expert=False, n_experts=8 * devices,
                    n_ranks=devices, p2p_world_size=devices, n_sms=9)
    for call in range(3):
        counts = [int(rng.integers(0, 33)) for _ in range(devices)]
        toks, ids = routing.routing(rng, g, counts)
        got = world.dispatch(toks, ids)
        want = reference.dispatch(cfg, toks, ids, ranks=list(range(devices)))
        try:
            reference.assert_match(cfg, want, got)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} call {call}: {exc}") from None
        assert all(r.se_tokens == w.se_tokens for r, w in zip(got, want))
