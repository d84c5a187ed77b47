"""``ep_rank_dedup`` (one message per (token, destination rank); docs/flags.md) on the CPU
simulator: the dispatch equals ``epgen.reference.dispatch`` (the plain dispatch's ground truth)
for every registered format on each send path (the warp path with one and with two warps per
token, the block-staged broadcast, the send-buffer path), 2 and 4 ranks, back-to-back calls;
routings with ``-1`` slots, several and all of a token's experts on one rank; the fused
kernel; rank masks; the message area receives exactly one message per (token, destination
rank), counted from the simulator's stores; and the combine after it equals the combine
after the plain dispatch, bit for bit."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import epgen
import ir
from backends import sim as sim_backend
from epgen import reference, round_trips
from epgen.formats import make_format
from epgen.kernels import dispatch_wait, send_policy
from epgen.kernels.staged_copy import L1Release
from epgen.runtime.program import Program

import format_cases
from combine_checks import assert_combine_ignores_flag, weights
from format_cases import case_ids
from mask_checks import mask_cfg
from sim_world import launch_wait_with_l1, sim_world
from test_rank_mask_sim import MAX_SPINS, _call

#: every registered format at the simulator's sizes
CASES = [(f, 64) for f in format_cases.PLAIN] + format_cases.sim_cases()
PATHS = ("warp", "warp_split", "block", "buffer")


def make_cfg(fmt="BF16", H=64, R=2, K=2, L=2, T=4, path="warp_split", **flags):
    """``R`` ranks of ``L`` experts, top-``K``, ``T`` tokens per rank, 64 threads on 5 blocks
    (more where the experts or ``warp_split`` need them)
    with ``ep_rank_dedup``, sending by ``path``: ``warp_split`` (the warp path, two warps per
    token at 4 tokens), ``warp`` (one warp per token: 16 tokens), ``block`` (the block-staged
    broadcast: ``ep_send_join_named``), ``buffer`` (the send-buffer path: the fused shared
    expert)."""
    extra = {"block": {"ep_send_join_named": True},
             "buffer": {"fused_shared_expert": True}}.get(path, {})
    # a monitor warp per expert and a comm block; two warps per token need a warp pair per
    # token of a full call: T blocks
    n_sms = max(5, -(-L * R // 2) + 1, T if path == "warp_split" else 0)
    cfg = epgen.EPConfig(num_threads=64, n_sms=n_sms, n_experts=L * R, n_ranks=R,
                         max_tokens_per_rank=max(T, 16) if path == "warp" else T,
                         p2p_world_size=R, use_shmem=False,
                         token_fmt=make_format(fmt, H, K), ep_rank_dedup=True,
                         **{**flags, **extra})
    warp = send_policy.uses_warp_send(cfg)
    assert warp == path.startswith("warp"), path
    if warp:
        assert (send_policy.send_warps_per_token(cfg) > 1) == (path == "warp_split"), path
    assert send_policy.uses_block_broadcast(cfg) == (path == "block"), path
    return cfg


def _run(cfg, seed, inputs, **world_kwargs):
    with sim_world(cfg, seed, **world_kwargs) as world:
        n = 0
        for _ in round_trips.checked_calls(world, inputs, seed=f"{seed} ({cfg.token_fmt.name})"):
            n += 1
        assert n == len(inputs)


def _random_calls(cfg, seed, n_calls=3):
    rng = np.random.default_rng(seed)

    def counts(call):
        return [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    return list(round_trips.drawn_inputs(rng, cfg, counts, n_calls))


def _edge_ids(rng, cfg, T):
    """``T`` tokens' ids of one rank over ``R`` ranks of ``L`` experts, top-``K`` (``K <=
    L``): all ``K`` on one rank, ``K - 1`` on one rank and a ``-1``, two ranks with several
    each, a token of ``-1`` only, one expert and ``-1``s, repeated in a random order."""
    R, K = cfg.n_ranks, cfg.token_fmt.top_k
    L = cfg.n_experts // R
    rows = []
    for i in range(T):
        kind = i % 5
        d = int(rng.integers(R))
        on_d = (d * L + rng.permutation(L)[:K]).tolist()
        if kind == 0:
            ids = on_d
        elif kind == 1:
            ids = on_d[:K - 1] + [-1]
        elif kind == 2:
            other = (d + 1) % R
            ids = on_d[:K // 2] + (other * L + rng.permutation(L)[:K - K // 2]).tolist()
        elif kind == 3:
            ids = [-1] * K
        else:
            ids = [on_d[0]] + [-1] * (K - 1)
        rows.append(rng.permutation(ids))
    return np.array(rows, np.int32).reshape(T, K)


def _edge_calls(cfg, seed, n_calls=3):
    rng = np.random.default_rng(seed)
    T, H = cfg.max_tokens_per_rank, cfg.token_fmt.hid_dim
    calls = []
    for _ in range(n_calls):
        toks, ids = [], []
        for _r in range(cfg.n_ranks):
            n = int(rng.integers(T // 2, T + 1))
            toks.append(epgen.routing.random_tokens(rng, n, H))
            ids.append(_edge_ids(rng, cfg, n))
        calls.append((toks, ids))
    return calls


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,H", CASES, ids=case_ids(CASES))
def test_every_format_and_send_path_matches_the_reference(fmt, H, path, R, seed):
    cfg = make_cfg(fmt, H, R=R, path=path)
    _run(cfg, seed, _random_calls(cfg, seed))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
def test_several_and_all_experts_on_one_rank_and_masked_slots(fmt, path, seed):
    """Top-4 over 2 ranks of 4 experts: tokens with all four experts on one rank, three and
    a ``-1``, two and two, only ``-1``, one expert; three calls (re-arming)."""
    cfg = make_cfg(fmt, 64, R=2, K=4, L=4, T=8, path=path)
    _run(cfg, seed, _edge_calls(cfg, seed))


@pytest.mark.parametrize("path", ["warp_split", "block", "buffer"])
def test_fused_kernel(path, seed):
    cfg = make_cfg("BF16", 64, R=4, K=2, L=2, T=4, path=path)
    _run(cfg, seed, _random_calls(cfg, seed, n_calls=2), fused=True)


@pytest.mark.parametrize("flags", [{"ep_ord_r": True, "has_rank_flag": True},
                                   {"ep_rank_mask": True}], ids=["ord_r", "rank_mask_on"])
def test_with_other_flags(flags, seed):
    cfg = make_cfg("BF16", 64, R=2, path="warp_split", **flags)
    _run(cfg, seed, _edge_calls(cfg, seed, n_calls=2))


def test_masked_rank_gets_nothing_and_is_not_waited_for(seed):
    rng = np.random.default_rng(seed)
    cfg = mask_cfg(ep_rank_dedup=True)
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed, max_spins=MAX_SPINS))
    assert _call(world, rng, []) == ([], [])
    world.update_mask(1, True)
    assert _call(world, rng, [1]) == ([], [])
    world.update_mask(1, False)
    assert _call(world, rng, []) == ([], [])


def _expected_messages(cfg, ids_per_rank, dst):
    """The (source, token) pairs with at least one expert on ``dst``, from the ids alone."""
    L = cfg.n_experts // cfg.n_ranks
    return {(src, t) for src, ids in enumerate(ids_per_rank)
            for t, row in enumerate(np.asarray(ids)) if any(0 <= g and g // L == dst
                                                            for g in row)}


@contextlib.contextmanager
def message_area_bytes(world, cfg, access: str, payload_only: bool = False):
    """``with message_area_bytes(world, cfg, "write" | "read") as got:`` while the body runs,
    ``got[d][row]`` counts the bytes the simulator's memory stores into (``"write"``) or
    serves from (``"read"``: 16-byte loads only; host reads are larger) rank ``d``'s
    message-area row ``row``; ``payload_only``: only the bytes inside the format's
    payload."""
    lay = cfg.layout
    limit = cfg.token_fmt.payload_vectors * 16 if payload_only else lay.dedup_row_bytes
    mem = world.cuda.mem
    areas = [(rk.recv_buf.ptr, rk.recv_buf.ptr + lay.dedup_msg_rows * lay.dedup_row_bytes)
             for rk in world.ranks]
    got = [dict() for _ in world.ranks]
    plain = getattr(mem, access)

    def count(addr, n):
        for d, (lo, hi) in enumerate(areas):
            if lo <= addr < hi and (addr - lo) % lay.dedup_row_bytes < limit:
                assert addr + n <= hi
                row = (addr - lo) // lay.dedup_row_bytes
                got[d][row] = got[d].get(row, 0) + n

    def counting_write(addr, data):
        count(addr, len(data))
        plain(addr, data)

    def counting_read(addr, n):
        if n == 16:
            count(addr, n)
        return plain(addr, n)
    setattr(mem, access, counting_write if access == "write" else counting_read)
    try:
        yield got
    finally:
        setattr(mem, access, plain)


@pytest.mark.parametrize("path", PATHS)
def test_one_message_per_token_and_destination_rank(path, seed):
    """Every store the simulator makes into a rank's message area is counted by row: each
    (source, token) with an expert on that rank gets exactly its message and its ``K``
    weights (``msg_bytes + 4 K`` bytes; the send-buffer path copies the whole staged row,
    ``dedup_row_bytes``), once, and no other row is written; the plain build writes one
    message per top-k slot."""
    cfg = make_cfg("BF16", 64, R=4, K=4, L=4, T=8, path=path)
    lay = cfg.layout
    calls = _edge_calls(cfg, seed, n_calls=1)
    with sim_world(cfg, seed) as world, message_area_bytes(world, cfg, "write") as written:
        for _ in round_trips.checked_calls(world, calls, seed=seed):
            pass
    toks, ids = calls[0]
    n_slots = 0
    for d in range(cfg.n_ranks):
        want = {lay.dedup_msg_row(src, t) for src, t in _expected_messages(cfg, ids, d)}
        assert set(written[d]) == want, f"rank {d}: rows written"
        row_bytes = lay.dedup_row_bytes if path == "buffer" else lay.msg_bytes + 4 * lay.top_k
        assert all(n == row_bytes for n in written[d].values()), f"rank {d}: bytes"
        n_slots += sum(int(((np.asarray(i) // (cfg.n_experts // cfg.n_ranks)) == d)
                           [np.asarray(i) >= 0].sum()) for i in ids)
    assert sum(len(w) for w in written) < n_slots      # the edge routings repeat ranks


@pytest.mark.parametrize("path", ["warp_split", "buffer"])
def test_the_receive_reads_each_message_once(path, seed):
    """The message-major receive: every 16-byte load the simulator serves from a message's
    payload is counted by row; each message a rank received has its payload read exactly
    once (BF16, whose warp copy loads each vector once), however many of its slots live on
    that rank, and the routings do put several slots of a token on one rank. The output is
    checked against the reference on the way (``checked_calls``)."""
    cfg = make_cfg("BF16", 64, R=4, K=4, L=4, T=8, path=path)
    lay, payload = cfg.layout, cfg.token_fmt.payload_vectors * 16
    calls = _edge_calls(cfg, seed, n_calls=1)
    with sim_world(cfg, seed) as world, \
            message_area_bytes(world, cfg, "read", payload_only=True) as read:
        for _ in round_trips.checked_calls(world, calls, seed=seed):
            pass
    toks, ids = calls[0]
    L = cfg.n_experts // cfg.n_ranks
    repeated = 0
    for d in range(cfg.n_ranks):
        want = {lay.dedup_msg_row(src, t) for src, t in _expected_messages(cfg, ids, d)}
        assert set(read[d]) == want, f"rank {d}: messages read"
        assert all(n == payload for n in read[d].values()), f"rank {d}: payload bytes read"
        repeated += sum(int(np.sum((np.asarray(row) >= 0) & (np.asarray(row) // L == d))) > 1
                        for i in ids for row in np.asarray(i))
    assert repeated, "the edge routings put several slots of a token on one rank"


def test_l1_release_copies_each_slot_into_its_own_row(seed):
    """dispatch_wait's copy role with L1 releases (``L1Release``: each tile's rows are
    published as they land, so a tile's rows must be its own warps' stores): the receive
    copies slot by slot, every message's payload read once per slot of it on the rank; the
    output equals the reference and each expert's counter ends at its token blocks."""
    cfg = make_cfg("BF16", 64, R=2, K=4, L=4, T=8, path="warp_split")
    lay, payload, L, tb = cfg.layout, cfg.token_fmt.payload_vectors * 16, 4, 2
    kb = ir.KernelBuilder(dispatch_wait.KERNEL_NAME, cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    l1 = kb.param("l1_arrival_ptr", ir.types.ptr_global)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last)) as r:
        dispatch_wait.copy_received_tokens_to_output(r, cfg, p,
                                                     l1_release=L1Release(l1, token_block=tb))
    with kb.role("aux", blocks=(last, None)) as r:
        dispatch_wait.wait_for_arrivals_and_compute_offsets(r, cfg, p)
    kernel = kb.build()
    (toks, ids), = _edge_calls(cfg, seed, n_calls=1)
    with sim_world(cfg, seed, fused=False) as world:
        prog = Program(ir.Module("l1", (kernel,)), device=world.device, backend=world.cuda)
        world.load_inputs(toks, ids)
        world.dispatch_async()
        with message_area_bytes(world, cfg, "read", payload_only=True) as read:
            counters = launch_wait_with_l1(world, prog, kernel, L)
        results = world.results()
    want = reference.dispatch(cfg, toks, ids)
    reference.assert_match(cfg, want, results)
    for d in range(cfg.n_ranks):
        blocks = -(-want[d].counts.sum(axis=1).astype(np.int64) // tb)
        np.testing.assert_array_equal(counters[d].to_host(), blocks, err_msg=f"seed {seed}")
        for src, t in _expected_messages(cfg, ids, d):
            n_here = int(np.sum((ids[src][t] >= 0) & (ids[src][t] // L == d)))
            assert read[d][lay.dedup_msg_row(src, t)] == n_here * payload, (d, src, t)


@pytest.mark.parametrize("R", [2, 4])
def test_combine_after_dedup_equals_combine_after_plain(R, seed):
    rng = np.random.default_rng(seed)
    dedup = make_cfg("BF16", 64, R=R, K=2, L=2, T=4)
    calls = _edge_calls(dedup, seed, n_calls=2)
    ws = [weights(rng, dedup, ids) for _, ids in calls]
    assert_combine_ignores_flag(
        dedup, "ep_rank_dedup",
        lambda c: epgen.EmulatedWorld(c, backend="sim", sim_seed=seed), calls, ws)


@pytest.mark.parametrize("path", ["warp_split", "buffer"])
def test_receive_blocks_smaller_than_a_call(path, seed):
    """``recv_block_capacity`` below ``max_tokens_per_rank`` (the largest block of the drawn
    routings): the index table's blocks are that many words apart, the message area keeps a
    row per source token."""
    base = make_cfg("BF16", 64, R=2, K=4, L=4, T=8, path=path)
    calls = _edge_calls(base, seed)
    L = base.layout.n_local_experts
    need = max(int(np.sum(np.asarray(i) == g)) for _, ids in calls for i in ids
               for g in range(base.n_experts))
    cap = max(need, 1)
    if cap >= base.max_tokens_per_rank:
        pytest.skip(f"the drawn routings fill a block ({cap} tokens)")
    cfg = base.replace(recv_block_capacity=cap)
    assert cfg.layout.dedup_index_words == L * cfg.n_ranks * cap
    _run(cfg, seed, calls)
