"""The flags of docs/flags.md on the GPU: EmulatedWorld against the numpy reference,
bit-exact (rows inside an (expert, source) block in any order), on random routings and the
edge cases: ``ep_send_join_named``; ``ep_copy_role_split`` on the geometry that enables it;
``ep_ord_r`` + ``has_rank_flag`` (alone and with ``ep_send_join_named``), with the state it
re-arms checked after every call and a 1000-call loop; ``skip_a2a`` with 2-4 independent
devices. Same patterns as tests/gpu/test_dispatch_gpu.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from world_checks import kinds, only_rank0_records

pytestmark = pytest.mark.gpu

ORD_R = dict(ep_ord_r=True, has_rank_flag=True)

# (R, E, H, K, max_tpr, num_threads, n_sms per rank); n_local_experts <= n_sms - 1 and all
# ranks' grids co-resident
SHAPES = [
    (2, 32, 2048, 4, 64, 256, 17),
    (4, 64, 128, 8, 64, 512, 17),
    (8, 256, 2048, 8, 128, 512, 33),
]
# the role split's geometry: 384 threads (8 copy warps + 4 publishers), H = 6144 = 8 * 3 * 256
ROLE_SPLIT_SHAPES = [
    (2, 16, 6144, 4, 32, 384, 9),
    (4, 32, 6144, 8, 32, 384, 9),   # K = 8: each publisher warp takes slots p and p + 4
]
# skip_a2a: (devices, n_local_experts, H, K, max_tpr, num_threads, n_sms)
SKIP_SHAPES = [
    (2, 8, 256, 4, 32, 256, 9),
    (3, 4, 128, 8, 16, 128, 5),     # K > L: a token has several experts on one device
    (4, 16, 2048, 8, 64, 512, 17),
]


def shape_id(c):
    return "R{}-E{}-H{}-K{}-T{}-thr{}-sm{}".format(*c)


def skip_id(c):
    return "D{}-L{}-H{}-K{}-T{}-thr{}-sm{}".format(*c)


def make_cfg(R, E, H, K, T, threads, sms, **flags):
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=epgen.BF16Format(hid_dim=H, top_k=K), **flags)


def make_skip_cfg(D, L, H, K, T, threads, sms, **flags):
    """A skip_a2a configuration in the per-device form (n_ranks = 1, n_experts = L) and its
    device count."""
    return make_cfg(1, L, H, K, T, threads, sms, skip_a2a=True, **flags), D


def make_global_skip_cfg(D, L, H, K, T, threads, sms, **flags):
    """The same devices in skip_a2a's global form: n_ranks = D, n_experts = D * L."""
    return make_cfg(D, D * L, H, K, T, threads, sms, skip_a2a=True, **flags), D


_worlds = {}


def world_for(cfg, devices=None):
    key = (cfg, devices)
    if key not in _worlds:
        _worlds[key] = epgen.EmulatedWorld(cfg, devices=devices)
    return _worlds[key]


def assert_rearmed(world, seed, where=""):
    """Between calls every receive-count word and rank flag is the sentinel again (cursors 0)
    and every dispatch_async counter (reserved, finished, election) is back to 0."""
    lay = world.cfg.layout
    region = lay.dispatch_async_region
    for rk in world.ranks:
        words = rk.recv_count.to_host()
        bad = np.flatnonzero(words != lay.recv_count_initial())
        assert not bad.size, (f"seed {seed}{where}: rank {rk.rank} recv_count words {bad[:8]} "
                              f"not re-armed: {words[bad[:8]]}")
        ctr = rk.counters.to_host()[region.offset:region.end]
        assert not ctr.any(), (f"seed {seed}{where}: rank {rk.rank} dispatch_async counters "
                               f"{np.flatnonzero(ctr)[:8]} not back to 0")


def run_and_compare(cfg, toks, ids, seed, devices=None, where=""):
    world = world_for(cfg, devices)
    got = world.dispatch(toks, ids)
    ranks = None if devices is None else list(range(devices))
    want = reference.dispatch(cfg, toks, ids, ranks=ranks)
    try:
        reference.assert_match(cfg, want, got)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}{where}: {exc}") from None
    assert_rearmed(world, seed, where)


def random_counts(rng, cfg, n):
    return [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(n)]


def check_random(cfg, seed, calls=3):
    rng = np.random.default_rng(seed)
    for call in range(calls):
        toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg, cfg.n_ranks))
        run_and_compare(cfg, toks, ids, seed, where=f" call {call}")


def check_edge_case(cfg, case, seed):
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, cfg, case)
    run_and_compare(cfg, toks, ids, seed, where=f" case {case}")


# ---- ep_send_join_named ------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_send_join_named_random(shape, seed):
    check_random(make_cfg(*shape, ep_send_join_named=True), seed)


@pytest.mark.parametrize("case", routing.EDGE_CASES)
def test_send_join_named_edge_cases(case, seed):
    check_edge_case(make_cfg(*SHAPES[1], ep_send_join_named=True), case, seed)


# ---- ep_copy_role_split -------------------------------------------------------------------
def role_split_cfg(shape):
    cfg = make_cfg(*shape, ep_copy_role_split=True)
    assert cfg.layout.role_split.enabled, "the test geometry must enable the role split"
    return cfg


@pytest.mark.parametrize("shape", ROLE_SPLIT_SHAPES, ids=shape_id)
def test_role_split_random(shape, seed):
    check_random(role_split_cfg(shape), seed)


@pytest.mark.parametrize("case", routing.EDGE_CASES)
def test_role_split_edge_cases(case, seed):
    check_edge_case(role_split_cfg(ROLE_SPLIT_SHAPES[1]), case, seed)


# ---- ep_ord_r + has_rank_flag (+ ep_send_join_named) ---------------------------------------
ORD_R_FLAGS = [ORD_R, dict(ORD_R, ep_send_join_named=True)]
ORD_R_IDS = ["ord_r", "ord_r+send_join_named"]


@pytest.mark.parametrize("flags", ORD_R_FLAGS, ids=ORD_R_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_ord_r_random(shape, flags, seed):
    check_random(make_cfg(*shape, **flags), seed)


@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("flags", ORD_R_FLAGS, ids=ORD_R_IDS)
def test_ord_r_edge_cases(flags, case, seed):
    check_edge_case(make_cfg(*SHAPES[1], **flags), case, seed)


def test_ord_r_rank_flags_raised_then_rearmed(seed):
    """After dispatch_async alone every destination holds L in each source's rank flag and
    the plain count words; every election counter is back to 0. dispatch_wait then matches
    the reference and restores the sentinels."""
    cfg = make_cfg(*SHAPES[1], **ORD_R)
    lay = cfg.layout
    L, R = lay.n_local_experts, cfg.n_ranks
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg, R))
    want = reference.dispatch(cfg, toks, ids)
    world.load_inputs(toks, ids)
    world.dispatch_async()
    world.synchronize()
    for rk, ref in zip(world.ranks, want):
        words = rk.recv_count.to_host()
        flags = words[lay.rank_flag_base:lay.rank_flag_base + R]
        assert (flags == L).all(), f"seed {seed}: rank {rk.rank} rank flags {flags}, want {L}"
        counts = words[:L * R].reshape(L, R)
        np.testing.assert_array_equal(counts, ref.counts, err_msg=f"seed {seed}: rank "
                                      f"{rk.rank} count words")
        region = lay.dispatch_async_region
        assert not rk.counters.to_host()[region.offset:region.end].any(), \
            f"seed {seed}: rank {rk.rank} counters (election included) not back to 0"
    world.dispatch_wait()
    world.check()
    try:
        reference.assert_match(cfg, want, world.results())
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None
    assert_rearmed(world, seed)


def test_ord_r_missing_rank_times_out_on_its_flag(seed):
    """Only rank 0's kernels run: its ORD-R wait gives up on a rank flag, not a count word."""
    cfg = make_cfg(*SHAPES[1], **ORD_R)
    world = epgen.EmulatedWorld(cfg, timeout_ns=100_000_000)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 8)
    records = only_rank0_records(world, toks, ids)
    assert ("ep_dispatch_wait", "aux", "rank_flag") in kinds(records)
    assert not [r for r in records if r.buffer == "recv_count"]
    lay = cfg.layout
    missing = set(range(lay.rank_flag_offset(1), lay.rank_flag_offset(cfg.n_ranks - 1) + 1))
    assert {r.index for r in records if r.buffer == "rank_flag"} <= missing
    assert all(r.rank == 0 for r in records)


def test_ord_r_back_to_back_1000_calls(seed):
    """The rank flags, count words and election counters are re-armed by the kernels on
    every call (checked after each one)."""
    cfg = make_cfg(4, 32, 128, 4, 32, 256, 9, **ORD_R)
    rng = np.random.default_rng(seed)
    for call in range(1000):
        toks, ids = routing.routing(rng, cfg, random_counts(rng, cfg, cfg.n_ranks))
        run_and_compare(cfg, toks, ids, seed, where=f" call {call}")


# ---- skip_a2a -------------------------------------------------------------------------------
def global_view(cfg, devices):
    """What the routing generators need to draw global top-k ids over ``devices`` devices of
    ``n_local_experts`` experts each (skip_a2a kernels see ``n_ranks = 1``)."""
    L = cfg.layout.n_local_experts
    return types.SimpleNamespace(n_experts=devices * L, n_ranks=devices, token_fmt=cfg.token_fmt,
                                 max_tokens_per_rank=cfg.max_tokens_per_rank)


def check_skip_random(cfg, devices, seed, calls=3):
    rng = np.random.default_rng(seed)
    view = global_view(cfg, devices)
    for call in range(calls):
        toks, ids = routing.routing(rng, view, random_counts(rng, cfg, devices))
        run_and_compare(cfg, toks, ids, seed, devices, where=f" call {call}")


@pytest.mark.parametrize("shape", SKIP_SHAPES, ids=skip_id)
def test_skip_a2a_random(shape, seed):
    check_skip_random(*make_skip_cfg(*shape), seed)


@pytest.mark.parametrize("case", routing.EDGE_CASES)
def test_skip_a2a_edge_cases(case, seed):
    cfg, devices = make_skip_cfg(*SKIP_SHAPES[2])
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, global_view(cfg, devices), case)
    run_and_compare(cfg, toks, ids, seed, devices, where=f" case {case}")


@pytest.mark.parametrize("shape", SKIP_SHAPES[:2], ids=skip_id)
def test_skip_a2a_with_ord_r(shape, seed):
    check_skip_random(*make_skip_cfg(*shape, **ORD_R), seed)


@pytest.mark.parametrize("flags", [{}, ORD_R], ids=["legacy", "ord_r"])
@pytest.mark.parametrize("shape", SKIP_SHAPES, ids=skip_id)
def test_skip_a2a_global_form(shape, flags, seed):
    """n_ranks and n_experts global: the count grid's rank-0 column, one source per device."""
    check_skip_random(*make_global_skip_cfg(*shape, **flags), seed)


def test_skip_a2a_pointer_tables_are_local(seed):
    """Each device's tables hold only its own receive buffer and count words, and a device
    whose tokens all go elsewhere receives nothing."""
    cfg, devices = make_skip_cfg(*SKIP_SHAPES[0])
    world = world_for(cfg, devices)
    assert [rk.rank for rk in world.ranks] == list(range(devices))
    for rk in world.ranks:
        assert world.recv_buf_ptrs[rk.rank].to_host().tolist() == [rk.recv_buf.ptr]
        assert world.recv_count_ptrs[rk.rank].to_host().tolist() == [rk.recv_count.ptr]
    rng = np.random.default_rng(seed)
    L, T = cfg.layout.n_local_experts, cfg.max_tokens_per_rank
    toks = [routing.random_tokens(rng, T, cfg.token_fmt.hid_dim) for _ in range(devices)]
    # every device routes only to the next device's experts: nobody keeps a token
    ids = [((d + 1) % devices * L + routing.random_topk(rng, T, L, cfg.token_fmt.top_k))
           .astype(np.int32) for d in range(devices)]
    got = world.dispatch(toks, ids)
    assert all(int(r.row_offsets[-1]) == 0 for r in got), [r.row_offsets for r in got]
    run_and_compare(cfg, toks, ids, seed, devices)
