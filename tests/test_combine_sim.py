"""The combine kernels (``ep_combine_async``, ``ep_combine_wait``; docs/combine.md) on the CPU
simulator: ``EmulatedWorld(cfg, backend="sim").combine`` after ``dispatch`` equals
``epgen.reference.combine`` bit for bit (weights random and None, several back-to-back
calls, 2 and 4 ranks), a corrupted ``src_info`` row is reported by name and writes nothing,
and the configurations not built yet are refused."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing
from epgen.combine_layout import CombineLayout
from epgen.kernels import build_combine_module
from epgen.presets import config_from_dict, load_preset, preset_data
from epgen.runtime import combine as combine_mod
from epgen.runtime.world import EmulatedWorld

from combine_checks import corrupted_row_check, expert_outputs, weights


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


@pytest.mark.parametrize("change, word", [
    ({"format": "BlockwiseFP8"}, "format"),
    ({"ep_final_layout": True}, "ep_final_layout"),
    ({"skip_a2a": True, "n_ranks": 1, "p2p_world_size": 1, "n_experts": 8}, "skip_a2a"),
])
def test_unsupported_configurations_are_refused(change, word):
    cfg = _cfg(**change)
    with pytest.raises(ValueError, match=word):
        combine_mod.check_supported(cfg)
    with pytest.raises(ValueError, match="only the BF16 format over P2P"):
        build_combine_module(cfg)


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
