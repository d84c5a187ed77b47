"""Masked top-k slots (an id of ``-1``: the slot selects no expert) through the kernels on the
CPU simulator, every send path (warp, block-staged broadcast with and without the named
join, split tokens, the send buffer), layout, format, the fused kernels and transport:
dispatch equals ``reference.dispatch`` (nothing sent, no row reserved, counts and
``row_offsets`` without the masked slots), and combine equals ``reference.combine`` bit
for bit with NaN weights in every masked slot (the slot is skipped, never multiplied),
weighted with and without a residual and unreduced.
Each call has masked slots at random positions and a token whose slots are all ``-1``; the
second call also a rank whose every slot is ``-1``. ``ep_check_ids`` passes ``-1`` through
unreported."""

from __future__ import annotations

import numpy as np
import pytest

from ir import diag
from epgen import reference, routing
from epgen.kernels import send_policy
from epgen.kernels.check_ids import build_check_ids_module
from epgen.runtime.program import Program
from epgen.runtime.world import EmulatedWorld

from combine_checks import expert_outputs, residuals
from sim_world import sim_world
from world_checks import make_cfg

# (R, E, H, K, T, threads, sms): tiny grids (the simulator runs every thread)
SMALL = (2, 4, 64, 2, 4, 64, 5)
WIDE_K = (2, 8, 64, 3, 5, 64, 6)          # K = 3 of 8 experts: several slots per destination
FLAGS = {
    "staged": {},
    "ord_r": {"ep_ord_r": True, "has_rank_flag": True},
    "final_layout": {"ep_final_layout": True},
    "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
    "send_join_named": {"ep_send_join_named": True},
    "fused_se": {"fused_shared_expert": True},
}


def masked_inputs(rng, cfg, n_calls=2, devices=None):
    """Per call, every rank full: masked slots at random positions and a token all ``-1``
    (``routing.masked_routing``); from the second call on, also a rank whose every slot is
    ``-1``."""
    n = cfg.n_ranks if devices is None else devices
    out = []
    for call in range(n_calls):
        toks, ids = routing.masked_routing(rng, cfg, [cfg.max_tokens_per_rank] * n)
        if call:
            ids[int(rng.integers(n))][:] = -1
        out.append((toks, ids))
    return out


def masked_weights(rng, cfg, ids):
    """Router weights, NaN in every masked slot (a kernel that reads it returns NaN)."""
    ws = [rng.random((len(i), cfg.token_fmt.top_k), dtype=np.float32) for i in ids]
    for w, i in zip(ws, ids):
        w[i == -1] = np.nan
    return ws


def check_masked_round_trips(world, rng, seed, inputs, what, combine=True):
    """Each input: dispatch against the reference (and the masked slots' count, from the ids
    alone), then combine weighted + residual, weighted, unreduced against the reference."""
    cfg = world.cfg
    L = cfg.layout.n_local_experts
    for call, (toks, ids) in enumerate(inputs):
        got = world.dispatch(toks, ids)
        want = reference.dispatch(cfg, toks, ids, input_scale=world.input_scale)
        where = f"seed {seed} {what} call {call}"
        reference.assert_match(cfg, want, got)
        for d, res in enumerate(got):
            if cfg.skip_a2a:
                sent = int(((ids[d] >= d * L) & (ids[d] < d * L + L)).sum())
            else:
                sent = sum(int(((i >= d * L) & (i < d * L + L)).sum()) for i in ids)
            assert int(np.asarray(res.counts).sum()) == sent, f"{where} destination {d}"
        if not combine:
            continue
        ys = expert_outputs(rng, cfg, got)
        w = masked_weights(rng, cfg, ids)
        n_tok = [len(i) for i in ids]
        for form, wt, res in [("weighted+residual", w, residuals(rng, cfg, ids)),
                              ("weighted", w, None), ("unreduced", None, None)]:
            out = world.combine(ys, wt, residual=res)
            ref = reference.combine(cfg, got, ys, wt, residual=res, n_tokens=n_tok)
            for s, (g, r) in enumerate(zip(out, ref)):
                assert g.shape == r.shape and np.array_equal(g, r), \
                    f"{where} {form} source {s}: {np.count_nonzero(g != r)} elements differ"
            if wt is not None and res is None:
                for s, (g, i) in enumerate(zip(out, ids)):
                    # an all-masked token combines to zero (no shared expert here)
                    if not cfg.fused_shared_expert:
                        assert not g[(i == -1).all(axis=1)].any(), f"{where} source {s}"


@pytest.mark.parametrize("shape", ["SMALL", "WIDE_K"])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_masked_slots_round_trip(flags, shape, seed):
    cfg = make_cfg(*{"SMALL": SMALL, "WIDE_K": WIDE_K}[shape], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg), flags)


@pytest.mark.parametrize("flags", ["staged", "ord_r", "fused_se"])
def test_masked_slots_fused_launch(flags, seed):
    cfg = make_cfg(*SMALL, **FLAGS[flags])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed, fused=True) as world:
        check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg), f"fused {flags}")


@pytest.mark.parametrize("fmt,H", [("BlockwiseFP8", 128), ("NVFP4", 64), ("MXFP8", 64)])
@pytest.mark.parametrize("flags", ["staged", "prod_reserve"])
def test_masked_slots_quantising_formats(fmt, H, flags, seed):
    R, E, _, K, T, threads, sms = SMALL
    cfg = make_cfg(R, E, H, K, T, threads, sms, fmt=fmt, **FLAGS[flags])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg), f"{fmt} {flags}")


@pytest.mark.parametrize("fmt,H", [("BF16", 512), ("MXFP8", 512)])
@pytest.mark.parametrize("flags", ["staged", "ord_r"])
def test_masked_slots_block_broadcast(fmt, H, flags, seed):
    """The block-staged broadcast (prefill: every call counts as prefill-sized here)."""
    R, E, _, K, _, threads, sms = SMALL
    cfg = make_cfg(R, E, H, K, 8, threads, sms, fmt=fmt, **FLAGS[flags])
    cfg = cfg.replace(tuning=cfg.tuning.replace(block_broadcast_min_tokens_per_block=1))
    assert send_policy.uses_block_broadcast(cfg)
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg), f"block {fmt}")


@pytest.mark.parametrize("token_warps", [2])
def test_masked_slots_split_tokens(token_warps, seed):
    """Two warps share each token (``send_warps_per_token``): part 0 reserves the slots."""
    base = make_cfg(*SMALL)
    cfg = base.replace(num_threads=64 * token_warps, max_tokens_per_rank=base.n_sms * 2)
    cfg = cfg.replace(tuning=cfg.tuning.replace(send_warps_per_token_max=token_warps))
    assert send_policy.send_warps_per_token(cfg) == token_warps
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg), "split tokens")


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_masked_slots_skip_a2a(fused, seed):
    """Global ids over every device's experts; ``-1`` is no device's."""
    cfg = make_cfg(3, 6, 64, 2, 4, 64, 5, skip_a2a=True)
    rng = np.random.default_rng(seed)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=3, fused=fused or None)
    check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg, devices=3), "skip_a2a")


@pytest.mark.parametrize("R,P,flags", [(2, 1, {}), (4, 2, {}),
                                       (2, 1, {"ep_ord_r": True, "has_rank_flag": True})],
                         ids=["p2p1", "mixed", "p2p1-ord_r"])
def test_masked_slots_shmem(R, P, flags, seed):
    """Destinations outside the P2P group: the cross-group fan-out skips a masked slot, and
    the SHMEM combine sends back only delivered rows."""
    cfg = make_cfg(R, 2 * R, 256, 2, 4, 64, R + 2, **flags).replace(p2p_world_size=P,
                                                                   use_shmem=True)
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        check_masked_round_trips(world, rng, seed, masked_inputs(rng, cfg), f"shmem R{R} P{P}")


@pytest.mark.parametrize("wide", [False, True])
def test_check_ids_passes_masked_slots(wide, seed):
    """``-1`` (repeated, first, last, a whole token) is written unchanged and unreported; a
    repeat of a real expert and ``-2`` still are reported."""
    from backends.sim import Machine
    cfg = make_cfg(*WIDE_K)
    rng = np.random.default_rng(seed)
    _, ids = routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank)
    good = ids[0].astype(np.int64 if wide else np.int32)
    good[0] = [-1, 3, -1]
    machine = Machine()
    program = Program(build_check_ids_module(cfg), backend=machine)
    T, K = good.shape

    def run(x):
        out = machine.zeros((T, K), np.int32)
        err = machine.zeros(diag.BUFFER_WORDS, np.uint32)
        program.launch("ep_check_ids", 2, {
            "ids_in": machine.to_device(np.ascontiguousarray(x)), "ids_wide": int(wide),
            "ids_out": out, "n_tokens": T, "my_rank": 0, "err_buf": err,
            "timeout_ns": 10**9}, machine.create_stream())
        return out.to_host(), diag.decode_ids(err.to_host())

    out, recs = run(good)
    assert (good == -1).any() and recs == [], f"seed {seed}: {recs}"
    assert np.array_equal(out, good.astype(np.int32)), f"seed {seed}"
    bad = good.copy()
    bad[0] = [-1, 3, 3]
    bad[1] = [-2, -1, -1]
    out, recs = run(bad)
    assert sorted((r["t"], r["k"]) for r in recs) == [(0, 2), (1, 0)], f"seed {seed}: {recs}"
    assert list(out[0]) == [-1, 3, cfg.n_experts] and list(out[1]) == [cfg.n_experts, -1, -1]
