"""``ep_rank_dedup`` (one message per (token, destination rank); docs/flags.md) on the GPU:
EmulatedWorld against ``epgen.reference.dispatch``, bit-exact (rows inside an (expert,
source) block in any order), for every registered format on each send path (the warp path,
the block-staged broadcast, the send-buffer path of the fused shared expert), on random
routings, every routing edge case and back-to-back calls (a 200-call loop re-arms nothing of
its own, checked anyway); the fused kernel; the combine after it equal to the combine after
the plain dispatch, bit for bit; and the SHMEM transport (one process per PE, as
tests/gpu/test_shmem_gpu.py runs it). The simulator tests (tests/sim/test_rank_dedup_sim.py,
tests/sim/test_rank_dedup_shmem_sim.py) run the same at small sizes."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import round_trips, routing
from epgen.kernels import send_policy

from format_cases import ALL
from world_checks import make_cfg
from combine_checks import assert_combine_ignores_flag

pytestmark = pytest.mark.gpu

# (R, E, H, K, max_tpr, num_threads, n_sms per rank); every rank's grid co-resident
SHAPES = [
    (2, 32, 2048, 8, 64, 256, 17),     # 16 experts per rank: most tokens repeat a rank
    (4, 64, 7168, 8, 128, 512, 17),
    (8, 256, 2048, 8, 128, 512, 33),   # DeepSeek-V3's routing over 8 ranks
]
PATHS = ("warp", "block", "buffer")


def shape_id(c):
    return "R{}-E{}-H{}-K{}-T{}-thr{}-sm{}".format(*c)


def dedup_cfg(shape, fmt, path, **flags):
    """``shape`` in ``fmt`` with ``ep_rank_dedup``, sending by ``path``: the warp path, the
    block-staged broadcast (``ep_send_join_named``), the send-buffer path (the fused shared
    expert)."""
    extra = {"block": {"ep_send_join_named": True},
             "buffer": {"fused_shared_expert": True}}.get(path, {})
    cfg = make_cfg(*shape, fmt=fmt, ep_rank_dedup=True, **extra, **flags)
    assert send_policy.uses_warp_send(cfg) == (path == "warp")
    assert send_policy.uses_block_broadcast(cfg) == (path == "block")
    return cfg


_worlds = {}


def world_for(cfg, fused=None):
    key = (cfg, fused)
    if key not in _worlds:
        _worlds[key] = epgen.EmulatedWorld(cfg, fused=fused)
    return _worlds[key]


def _check(world, inputs, seed):
    n = sum(1 for _ in round_trips.checked_calls(world, inputs, seed=seed))
    assert n == len(inputs)


def _random_inputs(rng, cfg, calls):
    def counts(call):
        return [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    return list(round_trips.drawn_inputs(rng, cfg, counts, calls))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_every_format_and_send_path_random(shape, fmt, path, seed):
    cfg = dedup_cfg(shape, fmt, path)
    _check(world_for(cfg), _random_inputs(np.random.default_rng(seed), cfg, 3), seed)


@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
def test_edge_cases(fmt, path, case, seed):
    cfg = dedup_cfg(SHAPES[0], fmt, path)
    rng = np.random.default_rng(seed)
    _check(world_for(cfg), [routing.edge_case(rng, cfg, case) for _ in range(2)], seed)


@pytest.mark.parametrize("path", ["warp", "block"])
def test_fused_kernel(path, seed):
    cfg = dedup_cfg(SHAPES[1], "BF16", path)
    _check(world_for(cfg, fused=True), _random_inputs(np.random.default_rng(seed), cfg, 3),
           seed)


@pytest.mark.parametrize("path", PATHS)
def test_200_back_to_back_calls(path, seed):
    cfg = dedup_cfg(SHAPES[2], "BF16", path)
    _check(world_for(cfg), _random_inputs(np.random.default_rng(seed), cfg, 200), seed)


@pytest.mark.parametrize("flags", [{"ep_ord_r": True, "has_rank_flag": True},
                                   {"ep_rank_mask": True}], ids=["ord_r", "rank_mask_on"])
def test_with_other_flags(flags, seed):
    cfg = dedup_cfg(SHAPES[2], "BF16", "warp", **flags)
    _check(world_for(cfg), _random_inputs(np.random.default_rng(seed), cfg, 3), seed)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=shape_id)
def test_combine_after_dedup_equals_combine_after_plain(shape, seed):
    rng = np.random.default_rng(seed)
    dedup = dedup_cfg(shape, "BF16", "warp")
    inputs = _random_inputs(rng, dedup, 3)
    ws = [[rng.standard_normal(i.shape).astype(np.float32) for i in ids] for _, ids in inputs]
    assert_combine_ignores_flag(dedup, "ep_rank_dedup", world_for, inputs, ws)


# ---- the SHMEM transport: one process per PE under ``epgen launch`` (test_shmem_gpu.py)
@pytest.mark.usefixtures("nvshmem_wheel")
@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
@pytest.mark.parametrize("p2p", [1, 2], ids=["every_peer_by_shmem", "p2p_groups"])
def test_shmem_transport(p2p, fmt):
    from test_shmem_gpu import PES, assert_all_match, group, launch
    n = max(p for p in PES if p <= 4)
    if n < 2 * p2p:
        pytest.skip(f"groups of {p2p} need {2 * p2p} PEs, EPGEN_SHMEM_PES allows {n}")
    proc = launch(n, group(n, p2p) + ["--set", "ep_rank_dedup=true", "--set", f"format={fmt}",
                                      "--calls", "3", "--seed", "4"])
    assert_all_match(proc, n, 3)


@pytest.mark.usefixtures("nvshmem_wheel")
def test_shmem_transport_fused():
    from test_shmem_gpu import assert_all_match, group, launch
    proc = launch(2, group(2, 1) + ["--set", "ep_rank_dedup=true", "--fused", "--calls", "2"])
    assert_all_match(proc, 2, 2)
