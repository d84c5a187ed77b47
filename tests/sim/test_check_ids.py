"""``ep_check_ids`` (``epgen.kernels.check_ids``) on the CPU simulator: valid ids pass through
unchanged (int32 and int64 inputs); each kind of bad id (negative other than -1, past the
experts, a huge int64, repeated within its token) becomes the sentinel and is reported as an
input record naming its token, slot and id; and a dispatch that reads the checked ids drops exactly the
bad slots: every other row arrives, nothing is written past the receive blocks, no wait
expires."""

from __future__ import annotations

import numpy as np
import pytest

from ir import diag
from epgen import reference, routing
from epgen.kernels.check_ids import (blocks_per_rank, build_check_ids_module, id_bound,
                                     kernel_name, param_name)
from epgen.presets import load_preset
from epgen.runtime.program import Program
from epgen.runtime.world import EmulatedWorld


def _run_check(machine, cfg, ids, rank=1):
    program = Program(build_check_ids_module(cfg), backend=machine)
    T, K = ids.shape
    out = machine.zeros((T, K), np.int32)
    err = machine.zeros(diag.BUFFER_WORDS, np.uint32)
    program.launch("ep_check_ids", 2, {
        "ids_in": machine.to_device(np.ascontiguousarray(ids)), "ids_wide": int(ids.itemsize == 8),
        "ids_out": out, "n_tokens": T, "my_rank": rank, "err_buf": err, "timeout_ns": 10**9},
        machine.create_stream())
    return out.to_host(), diag.decode_ids(err.to_host())


def _plant(rng, cfg, ids):
    """Bad ids at random (token, slot) places: one of each kind; returns the planted
    array (int64) and {(t, k): id}."""
    E = cfg.n_experts
    bad = ids.astype(np.int64)
    T, K = bad.shape
    places = rng.choice(T * K, size=4, replace=False)
    kinds = [-2, E, 1 << 40, None]          # None: repeat another slot of the token
    planted = {}
    for p, v in zip(places, kinds):
        t, k = divmod(int(p), K)
        if v is None:
            v = int(bad[t, (k + 1) % K])
        bad[t, k] = v
        planted[(t, k)] = v
    return bad, planted


@pytest.mark.parametrize("wide", [False, True])
def test_valid_ids_pass_and_bad_ones_are_reported(wide, seed):
    from backends.sim import Machine
    rng = np.random.default_rng(seed)
    cfg = load_preset("small")
    _, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    good = ids[0].astype(np.int64 if wide else np.int32)
    out, recs = _run_check(Machine(), cfg, good)
    assert np.array_equal(out, good) and recs == [], f"seed {seed}"
    bad, planted = _plant(rng, cfg, ids[0])
    if not wide:
        planted = {tk: v for tk, v in planted.items() if -2**31 <= v < 2**31}
        bad = np.where((bad >= -2**31) & (bad < 2**31), bad, -7).astype(np.int32)
        planted.update({(t, k): -7 for t, k in zip(*np.nonzero(bad == -7))})
    out, recs = _run_check(Machine(), cfg, bad)
    sentinel = id_bound(cfg)
    # a repeat is reported at its later slot: the planted place or the other one
    got = {(r["t"], r["k"]) for r in recs}
    for (t, k), v in planted.items():
        dup = v in np.delete(bad[t], k)
        assert (t, k) in got or (dup and any(rt == t for rt, _ in got)), \
            f"seed {seed}: bad id {v} at token {t} slot {k} not reported ({recs})"
    for r in recs:
        assert r["rank"] == 1 and out[r["t"], r["k"]] == sentinel, f"seed {seed}: {r}"
    keep = np.ones_like(out, bool)
    keep[[r["t"] for r in recs], [r["k"] for r in recs]] = False
    assert np.array_equal(out[keep], bad[keep].astype(np.int32)), f"seed {seed}"


def test_the_ranks_form_checks_each_rank_as_its_own_launch_would(seed):
    """``ep_check_ids_ranks3``: three ranks in one launch, of different token counts and id
    widths, one with no bad id; each rank's output and records are those of a one-rank
    launch of its ids (and name that rank), and nothing is written past a rank's tokens."""
    from backends.sim import Machine
    rng = np.random.default_rng(seed)
    cfg = load_preset("small")
    machine = Machine()
    n, T_max = 3, cfg.max_tokens_per_rank
    _, ids = routing.routing(rng, cfg, T_max)
    inputs, args, outs = [], {}, []
    for j, (T, wide) in enumerate([(T_max, True), (T_max // 2, False), (T_max - 1, True)]):
        bad = ids[j % len(ids)][:T].astype(np.int64)
        if j != 1:
            bad, _ = _plant(rng, cfg, bad)
        bad = bad if wide else np.where(np.abs(bad) < 2**31, bad, -7).astype(np.int32)
        inputs.append(bad)
        out = machine.to_device(np.full((T_max, bad.shape[1]), -99, np.int32))
        outs.append(out)
        for name, v in (("ids_in", machine.to_device(np.ascontiguousarray(bad))),
                        ("ids_wide", int(wide)), ("ids_out", out), ("n_tokens", T),
                        ("my_rank", 10 + j)):
            args[param_name(name, j, n)] = v
    err = machine.zeros(diag.BUFFER_WORDS, np.uint32)
    args.update(err_buf=err, timeout_ns=10**9)
    program = Program(build_check_ids_module(cfg, n), backend=machine)
    program.launch(kernel_name(n), n * blocks_per_rank(cfg), args, machine.create_stream())
    recs = diag.decode_ids(err.to_host())
    for j, bad in enumerate(inputs):
        want, want_recs = _run_check(Machine(), cfg, bad, rank=10 + j)
        got = outs[j].to_host()
        T = len(bad)
        assert np.array_equal(got[:T], want), f"seed {seed} rank {j}"
        assert (got[T:] == -99).all(), f"seed {seed} rank {j}: written past its {T} tokens"
        mine = sorted((r["t"], r["k"], r["id"]) for r in recs if r["rank"] == 10 + j)
        assert mine == sorted((r["t"], r["k"], r["id"]) for r in want_recs), \
            f"seed {seed} rank {j}: {mine} against {want_recs}"
        assert (j == 1) == (not mine), f"seed {seed} rank {j}"
    assert all(10 <= r["rank"] < 10 + n for r in recs), f"seed {seed}: {recs}"


def test_dispatch_of_checked_ids_drops_only_the_bad_slots(seed):
    rng = np.random.default_rng(seed)
    cfg = load_preset("small")
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    world.load_inputs(toks, ids)                # valid inputs in every buffer
    bad, planted = _plant(rng, cfg, ids[0])
    checked, recs = _run_check(world.cuda, cfg, bad)
    world.ranks[0].topk_ids.copy_from_host(checked)
    world.dispatch_async()
    world.dispatch_wait()
    world.check()
    got = world.results()
    assert recs, f"seed {seed}: nothing reported"
    want = reference.dispatch(cfg, toks, ids)
    L, E = cfg.layout.n_local_experts, cfg.n_experts
    from_0 = np.bincount(checked[checked < E].ravel(), minlength=E)   # what rank 0 sends
    for d in range(cfg.n_ranks):
        expect = want[d].counts.copy()
        expect[:, 0] = from_0[d * L:(d + 1) * L]
        assert np.array_equal(got[d].counts, expect), f"seed {seed} rank {d}"
        assert int(got[d].row_offsets[-1]) >= int(expect.sum()), f"seed {seed} rank {d}"
