"""EmulatedWorld against the numpy reference, bit-exact (rows inside an (expert, source) block
may come in any order), on random routings, the edge cases and a back-to-back stress loop."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from world_checks import kinds, make_cfg, only_rank0_records, world_for

pytestmark = pytest.mark.gpu

# (R, E, H, K, max_tpr, num_threads, n_sms per rank)
# (n_local_experts <= n_sms - 1, and all ranks' grids must fit on the GPU at once)
CONFIGS = [
    (1, 8, 128, 2, 16, 128, 9),
    (2, 32, 2048, 4, 64, 256, 17),
    (4, 64, 128, 8, 64, 512, 17),
    (4, 128, 7168, 8, 32, 1024, 33),
    (8, 256, 2048, 8, 128, 512, 33),
    (8, 64, 7168, 4, 16, 512, 9),
]


def run_and_compare(cfg, toks, ids, seed):
    world = world_for(cfg)
    got = world.dispatch(toks, ids)
    want = reference.dispatch(cfg, toks, ids)
    try:
        reference.assert_match(cfg, want, got)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None


@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "R{}-E{}-H{}-K{}-T{}-thr{}-sm{}".format(*c))
def test_random_routing(shape, seed):
    cfg = make_cfg(*shape)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        toks, ids = routing.routing(rng, cfg, counts)
        run_and_compare(cfg, toks, ids, seed)


@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("shape", [CONFIGS[2], CONFIGS[4]], ids=["R4-E64", "R8-E256"])
def test_edge_cases(shape, case, seed):
    cfg = make_cfg(*shape)
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, cfg, case)
    run_and_compare(cfg, toks, ids, seed)


def test_back_to_back_1000_calls(seed):
    cfg = make_cfg(4, 32, 128, 4, 32, 256, 9)
    rng = np.random.default_rng(seed)
    for call in range(1000):
        counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        toks, ids = routing.routing(rng, cfg, counts)
        try:
            run_and_compare(cfg, toks, ids, seed)
        except AssertionError as exc:
            raise AssertionError(f"call {call}: {exc}") from None


def test_invalid_input_launches_nothing(seed):
    cfg = make_cfg(*CONFIGS[2])
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 4)
    ids[1][0, 1] = ids[1][0, 0]                          # duplicate expert in one token
    with pytest.raises(ValueError, match="unique"):
        world.dispatch(toks, ids)
    toks, ids = routing.routing(rng, cfg, 4)             # the world still works afterwards
    run_and_compare(cfg, toks, ids, seed)


def test_missing_rank_times_out(seed):
    """Only rank 0's kernels run: its dispatch_wait gives up and names what it waited on."""
    cfg = make_cfg(*CONFIGS[2])
    world = epgen.EmulatedWorld(cfg, timeout_ns=100_000_000)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 8)
    records = only_rank0_records(world, toks, ids)
    assert ("ep_dispatch_wait", "aux", "recv_count") in kinds(records)


def test_recv_block_capacity(seed):
    """A receive buffer of 64 slots per (expert, source) block instead of max_tokens_per_rank."""
    cfg = make_cfg(8, 256, 2048, 8, 512, 512, 33, recv_block_capacity=64)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 512)
    run_and_compare(cfg, toks, ids, seed)


def test_cli_run_small_preset(capsys, seed):
    from epgen import cli
    assert cli.main(["run", "--preset", "small", "--calls", "2", "--seed", str(seed)]) == 0
    assert capsys.readouterr().out.count("matches the reference") == 2
