"""Rank-batched launches on the GPU (``EmulatedWorld(batched=True)``): every rank's grid in one
launch, its arguments by value in the kernel's table (``cuLaunchKernelEx``), bit-exact
against the reference for BF16 and as the format's reference says for NVFP4; two kernels
(the wait a programmatic dependent launch) and the fused launch; stream calls and graph
replays; ``ep_final_layout`` + ``ep_prod_reserve`` with a new generation every call; and
``epgen run --batched``."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import cli
from world_checks import checked_calls, make_cfg

pytestmark = pytest.mark.gpu

SHAPE = (4, 32, 2048, 4, 32, 256, 9)     # (R, E, H, K, max_tpr, num_threads, n_sms)


def config(fmt: str, **flags):
    return make_cfg(*SHAPE, fmt=fmt, **flags)


def run_calls(world, rng, seed, graph: bool, calls: int = 3):
    """``calls`` checked round trips, new token counts per call (a graph keeps its own)."""
    cfg, T = world.cfg, world.cfg.max_tokens_per_rank
    counts = [int(rng.integers(0, T + 1)) for _ in range(cfg.n_ranks)]
    fresh = (lambda call: counts) if graph else \
        (lambda call: [int(rng.integers(0, T + 1)) for _ in range(cfg.n_ranks)])
    for _ in checked_calls(world, rng, seed, fresh, calls, graph):
        pass


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
def test_batched_round_trips_match(fmt, fused, graph, seed):
    world = epgen.EmulatedWorld(config(fmt), fused=fused, batched=True,
                                input_scale=0.75 if fmt == "NVFP4" else 1.0)
    run_calls(world, np.random.default_rng(seed), seed, graph)


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_batched_final_layout_with_prod_reserve(graph, seed):
    cfg = config("BF16", ep_final_layout=True, ep_prod_reserve=True)
    world = epgen.EmulatedWorld(cfg, batched=True)
    run_calls(world, np.random.default_rng(seed), seed, graph, calls=4)


@pytest.mark.parametrize("batched", [False, True], ids=["per_rank", "batched"])
def test_ord_r_both_launch_kinds(batched, seed):
    cfg = config("BF16", ep_ord_r=True, has_rank_flag=True)
    run_calls(epgen.EmulatedWorld(cfg, batched=batched), np.random.default_rng(seed), seed,
              graph=False)


def test_epgen_run_batched(capsys):
    assert cli.main(["run", "--preset", "decode", "--set", "format=NVFP4", "--tokens", "16",
                     "--calls", "2", "--batched", "--graph", "--fused", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "every rank in one launch" in out and out.count("matches the reference") == 2
