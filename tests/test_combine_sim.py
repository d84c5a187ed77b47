"""The combine kernels (``ep_combine_async``, ``ep_combine_wait``; docs/combine.md) on the CPU
simulator: ``EmulatedWorld(cfg, backend="sim").combine`` after ``dispatch`` equals
``epgen.reference.combine`` bit for bit (weights random and None, several back-to-back
calls, 2 and 4 ranks), a corrupted ``src_info`` row is reported by name and writes nothing,
and the configurations not built yet are refused."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing
from epgen.errors import EPInputError
from epgen.kernels import build_combine_module
from epgen.presets import config_from_dict, load_preset, preset_data
from epgen.reference_combine import source_of_rows
from epgen.runtime import combine as combine_mod
from epgen.runtime.world import EmulatedWorld


def _cfg(**change):
    return config_from_dict({**preset_data("small"), **change})


def _small(n_ranks: int):
    if n_ranks == 2:
        return load_preset("small")
    return _cfg(n_ranks=n_ranks, p2p_world_size=n_ranks, n_sms=5, max_tokens_per_rank=16)


def expert_outputs(rng, cfg, results):
    """Per destination: each row scaled by a per-expert factor plus a random BF16 row (finite,
    so the sums are ordinary numbers; sign and exponent vary)."""
    H = cfg.token_fmt.hid_dim
    ys = []
    for res in results:
        n = len(res.src_info)
        rnd = rng.integers(0, 1 << 16, size=(n, H), dtype=np.uint16) & np.uint16(0xBFFF)
        ys.append(rnd)
    return ys


def weights(rng, cfg, ids):
    return [rng.standard_normal((len(i), cfg.token_fmt.top_k)).astype(np.float32)
            for i in ids]


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
    rng = np.random.default_rng(seed)
    cfg = _small(2)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = world.dispatch(toks, ids)
    ys = expert_outputs(rng, cfg, results)
    world.combine(ys, None)              # builds the buffers
    d = 1
    res = results[d]
    row = int(rng.integers(0, len(res.src_info)))
    bad = res.src_info.copy()
    bad[row] = (cfg.max_tokens_per_rank, 0)
    src = source_of_rows(res)[row]
    comb = world._combiner
    pattern = np.full(comb.bufs[0].recv_bytes + combine_mod.GUARD_BYTES, 0xA5, np.uint8)
    for b in comb.bufs:
        b.recv.copy_from_host(pattern)
    with pytest.raises(EPInputError, match=rf"rank {d} src_info\[{row}\] = "
                                           rf"\({cfg.max_tokens_per_rank}, 0\)"):
        world.combine(ys, None, _src_info=[None, bad])
    K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    for s, b in enumerate(comb.bufs):
        mem = b.recv.to_host()
        assert np.all(mem[comb.bufs[0].recv_bytes:] == 0xA5), f"rank {s}: guard bytes written"
        slots = mem[:b.recv_bytes].view(np.uint16).reshape(cfg.max_tokens_per_rank, K, H)
        written = np.zeros((cfg.max_tokens_per_rank, K), bool)
        expect = np.zeros((cfg.max_tokens_per_rank, K, H), np.uint16)
        for dd, (rr, y) in enumerate(zip(results, ys)):
            srcs = source_of_rows(rr)
            for i in range(len(rr.src_info)):
                if srcs[i] == s and not (dd == d and i == row):
                    t, k = rr.src_info[i]
                    written[t, k] = True
                    expect[t, k] = y[i]
        assert np.array_equal(slots[written], expect[written]), f"rank {s}: rows wrong"
        assert np.all(slots[~written].view(np.uint8) == 0xA5), \
            f"rank {s}: a slot no valid row targets was written"
        if s == src:
            t, k = res.src_info[row]
            assert not written[t, k]
    # the world is usable again: the next call is exact
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = world.dispatch(toks, ids)
    ys = expert_outputs(rng, cfg, results)
    w = weights(rng, cfg, ids)
    for g, r in zip(world.combine(ys, w), reference.combine(cfg, results, ys, w)):
        assert np.array_equal(g, r)


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


def test_residual_is_refused_not_ignored(seed):
    cfg = _small(2)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 4)
    results = world.dispatch(toks, ids)
    with pytest.raises(ValueError, match="residual"):
        world.combine(expert_outputs(rng, cfg, results), None,
                      residual=[np.zeros((4, cfg.token_fmt.hid_dim), np.uint16)] * 2)
