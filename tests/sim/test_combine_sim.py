"""The combine kernels (``ep_combine_async``, ``ep_combine_wait``; docs/combine.md) on the CPU
simulator: ``EmulatedWorld(cfg, backend="sim").combine`` after ``dispatch`` equals
``epgen.reference.combine`` bit for bit (weights random and None, several back-to-back
calls, 2 and 4 ranks), a corrupted ``src_info`` row is reported by name and writes nothing,
and the configurations not built yet are refused; then, on tiny grids, every quantising
dispatch format, both final layouts, ``skip_a2a`` devices, the fused ``ep_combine`` and
``fused_shared_expert`` (``combine_checks.check_round_trips``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.combine_layout import CombineLayout
from epgen.formats import make_format
from epgen.kernels import build_combine_module
from epgen.presets import config_from_dict, load_preset, preset_data
from epgen.runtime import combine as combine_mod
from epgen.runtime.world import EmulatedWorld

import format_cases
from combine_checks import (check_round_trips, corrupted_row_check, expert_outputs,
                            round_trip_inputs, weights)


def _cfg(**change):
    return config_from_dict({**preset_data("small"), **change})


def _small(n_ranks: int):
    if n_ranks == 2:
        return load_preset("small")
    return _cfg(n_ranks=n_ranks, p2p_world_size=n_ranks, n_sms=5, max_tokens_per_rank=16)


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_combine_matches_the_reference_bit_for_bit(n_ranks, seed):
    rng = np.random.default_rng(seed)
    cfg = _small(n_ranks)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    for call in range(3):
        n_tok = int(rng.integers(0, cfg.max_tokens_per_rank + 1)) if call == 1 else \
            cfg.max_tokens_per_rank
        toks, ids = routing.routing(rng, cfg, n_tok)
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        got = world.combine(ys, w)
        want = reference.combine(cfg, results, ys, w)
        for s, (g, r) in enumerate(zip(got, want)):
            assert g.shape == r.shape and np.array_equal(g, r), \
                f"call {call} rank {s}: {np.count_nonzero(g != r)} elements differ"
        got = world.combine(ys, None)
        want = reference.combine(cfg, results, ys, None, n_tokens=[len(i) for i in ids])
        for s, (g, r) in enumerate(zip(got, want)):
            assert g.shape == r.shape and np.array_equal(g, r), f"unreduced call {call} rank {s}"


def test_a_corrupted_src_info_row_is_reported_and_writes_nothing(seed):
    cfg = _small(2)
    corrupted_row_check(EmulatedWorld(cfg, backend="sim", sim_seed=seed),
                        np.random.default_rng(seed))


def test_unsupported_configurations_are_refused():
    # no format takes a hid_dim off the 8-element grid today: a stand-in config
    odd = SimpleNamespace(token_fmt=SimpleNamespace(hid_dim=12), needs_shmem=False)
    with pytest.raises(ValueError, match="hid_dim=12"):
        combine_mod.check_supported(odd)
    with pytest.raises(ValueError, match=r"hid_dim must be a multiple of 8.*hid_dim=12"):
        build_combine_module(odd)


def test_residual_is_added_before_the_rounding(seed):
    rng = np.random.default_rng(seed)
    cfg = _small(2)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    H = cfg.token_fmt.hid_dim
    for call in range(2):
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank - call)
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        res = [rng.integers(0, 1 << 16, size=(len(i), H), dtype=np.uint16) & np.uint16(0xBFFF)
               for i in ids]
        got = world.combine(ys, w, residual=res)
        want = reference.combine(cfg, results, ys, w, residual=res)
        for s, (g, r) in enumerate(zip(got, want)):
            assert np.array_equal(g, r), f"call {call} rank {s}"
        # and the next call without a residual adds none
        got = world.combine(ys, w)
        for g, r in zip(got, reference.combine(cfg, results, ys, w)):
            assert np.array_equal(g, r)
    with pytest.raises(ValueError, match="residual: needs topk_weights"):
        world.combine(ys, None, residual=res)


def test_combine_layout_sizes():
    cfg = _small(2)
    d = CombineLayout(cfg).describe()
    assert d["combine_recv_bytes"] == 32 * 4 * 256 * 2
    assert d["combine_arrival_words"] == 2
    lay = cfg.layout
    assert d["combine_done_counter_offset"] == lay.combine_rank_completion_region.offset
    assert d["combine_wait_counter_offset"] == lay.combine_wait_region.offset
    assert combine_mod.combine_sizes(cfg) == d


# ---- every dispatch format, layout and flag; the fused kernel --------------------------------
def _tiny(fmt="BF16", H=64, R=2, K=2, **flags):
    """A grid the simulator runs quickly: 64 threads x 5 blocks, 4 tokens per rank."""
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=2 * R, n_ranks=R,
                          max_tokens_per_rank=4, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format(fmt, H, K), **flags)


FORMATS = [(f, format_cases.smallest_hid_dim(f)) for f in format_cases.QUANT]


@pytest.mark.parametrize("fmt,H", FORMATS, ids=[f for f, _ in FORMATS])
def test_every_dispatch_format(fmt, H, seed):
    """The quantising formats quantize only the dispatch: combine takes BF16 expert outputs
    of the grouped output's rows, and the reduce is the BF16 one."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(fmt, H)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2), fmt)


@pytest.mark.parametrize("flags", [{"ep_final_layout": True},
                                   {"ep_final_layout": True, "ep_prod_reserve": True}],
                         ids=["final_layout", "prod_reserve"])
def test_final_layout(flags, seed):
    """Rows come back from where the sources wrote them (capacity-strided blocks in
    reservation order, or the prod-reserve standard layout): Region A and ``src_info``."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=4, **flags)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 3), "final layout")


@pytest.mark.parametrize("fmt,H", FORMATS, ids=[f for f, _ in FORMATS])
def test_final_layout_quantised(fmt, H, seed):
    """Every quantising format's dispatch in the final layout (prod reserve), combined."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(fmt, H, ep_final_layout=True, ep_prod_reserve=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2), f"final+prod {fmt}")


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_skip_a2a_reduces_only_local_slots(fused, seed):
    """Three independent devices: each keeps the tokens routed to its own experts; the
    slots whose expert lives on another device add nothing (and stay zero unreduced)."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=1, K=4, skip_a2a=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=3, fused=fused)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2, devices=3), "skip_a2a")
    want = {"ep_combine"} if fused else {"ep_combine_async", "ep_combine_wait"}
    assert {k for k, _ in world._combiner.program.loaded.launched} == want


@pytest.mark.parametrize("R", [2, 4])
def test_fused_kernel(R, seed):
    """``ep_combine`` (one launch per rank) when the world runs the fused dispatch."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=R, H=512)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=True)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 3), "fused")
    assert {k for k, _ in world._combiner.program.loaded.launched} == {"ep_combine"}


@pytest.mark.parametrize("devices", [None, 3], ids=["ranks", "skip_a2a"])
def test_fused_shared_expert(devices, seed):
    """The shared expert's row of token ``t`` (group 0 of the source's own grouped output)
    joins the sum after the routed slots, before the residual; under ``skip_a2a`` each
    device adds its slice of the tokens."""
    rng = np.random.default_rng(seed)
    skip = devices is not None
    cfg = _tiny(R=1 if skip else 2, skip_a2a=skip, fused_shared_expert=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=devices)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2, devices=devices), "fused SE")
    assert [k.name for k in world._combiner.program.module.kernels] == ["ep_combine"]


def test_a_corrupted_src_info_row_in_the_fused_kernel(seed):
    cfg = _tiny(R=2)
    corrupted_row_check(EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=True),
                        np.random.default_rng(seed))
