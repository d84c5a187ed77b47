"""The partial-reduce combine under ``ep_rank_dedup`` (docs/combine.md, "Partial reduce") on
the CPU simulator, and what the dispatch gives it (docs/flags.md, ``ep_rank_dedup``): the
router weights travel in each message-area row after the message, and dispatch_wait's row
map names the grouped-output row of every (message, local slot). The combine equals
``reference.combine(..., partial_reduce=True)`` bit for bit on 2 and 4 ranks, each send
path (the fused kernel with the shared expert on the send-buffer path), tokens with
several, all and no slots on one rank and ``-1`` slots, the residual, a quantising dispatch
format, the fused kernel, the SHMEM transport, calls alternating with the plain combine, a
rank masked by hand; the summation order against hand arithmetic; its link bytes, counted
by the simulator, are the model's; refusals."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing
from epgen.bench import link_bytes as lb
from epgen.errors import EPInputError
from epgen.reference_combine import source_of_rows

from combine_checks import expert_outputs, residuals, weights
from sim_world import sim_world
from test_link_bytes_sim import COMBINE_PAYLOAD, DATA, SIGNALS, counted_world
from test_rank_dedup_shmem_sim import make_cfg as shmem_cfg
from test_rank_dedup_sim import PATHS, _edge_calls, make_cfg


def _dispatch(world, cfg, call, rng):
    """``call``'s dispatch with random weights (NaN in ``-1`` slots); checked against the
    reference; returns ``(weights, results)``."""
    toks, ids = call
    ws = weights(rng, cfg, ids)
    got = world.dispatch(toks, ids, topk_weights=ws)
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
    return ws, got


@pytest.mark.parametrize("path", PATHS)
def test_weights_travel_in_the_message_row(path, seed):
    """Every (source, token) with an expert on a rank finds the token's ``K`` weights, bit
    for bit, at ``dedup_weights_offset`` of its message-area row there, on every send
    path, two calls in a row (each call's own weights)."""
    cfg = make_cfg("BF16", 64, R=4, K=4, L=4, T=8, path=path)
    lay, L, K = cfg.layout, cfg.layout.n_local_experts, cfg.token_fmt.top_k
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        for call in _edge_calls(cfg, seed, n_calls=2):
            ws, _ = _dispatch(world, cfg, call, rng)
            ids = call[1]
            for d, rk in enumerate(world.ranks):
                buf = rk.recv_buf.to_host()
                for s, (i, w) in enumerate(zip(ids, ws)):
                    for t, row in enumerate(np.asarray(i)):
                        if not any(g >= 0 and g // L == d for g in row):
                            continue
                        at = lay.dedup_msg_row(s, t) * lay.dedup_row_bytes \
                            + lay.dedup_weights_offset
                        got = buf[at:at + 4 * K].view(np.uint32)
                        assert np.array_equal(got, w[t].view(np.uint32)), (d, s, t)


@pytest.mark.parametrize("path", PATHS)
def test_row_map_names_each_slots_output_row(path, seed):
    """``row_map[dedup_msg_row(s, t) * K + k]`` is the grouped-output row whose ``src_info``
    is ``(t, k)`` from source ``s``, for every routed row of every rank."""
    cfg = make_cfg("BF16", 64, R=2, K=4, L=4, T=8, path=path)
    lay, K = cfg.layout, cfg.token_fmt.top_k
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        for call in _edge_calls(cfg, seed, n_calls=2):
            _, results = _dispatch(world, cfg, call, rng)
            for rk, res in zip(world.ranks, results):
                row_map = rk.row_map.to_host()
                src = source_of_rows(res)
                rows = np.nonzero(src >= 0)[0]
                assert len(rows)
                for row in rows:
                    t, k = (int(v) for v in res.src_info[row])
                    assert row_map[lay.dedup_msg_row(int(src[row]), t) * K + k] == row


def test_dispatch_without_weights_carries_zero(seed):
    """A dispatch given no weights carries zeros (the world's zero buffer), even after a
    call that carried weights."""
    cfg = make_cfg("BF16", 64, R=2, K=2, L=2, T=4, path="warp_split")
    lay, L = cfg.layout, cfg.layout.n_local_experts
    rng = np.random.default_rng(seed)
    (call1, call2) = _edge_calls(cfg, seed, n_calls=2)
    with sim_world(cfg, seed) as world:
        _dispatch(world, cfg, call1, rng)
        world.dispatch(*call2)
        assert world.last_weights is None
        for d, rk in enumerate(world.ranks):
            buf = rk.recv_buf.to_host()
            for s, i in enumerate(call2[1]):
                for t, row in enumerate(np.asarray(i)):
                    if any(g >= 0 and g // L == d for g in row):
                        at = lay.dedup_msg_row(s, t) * lay.dedup_row_bytes \
                            + lay.dedup_weights_offset
                        assert not buf[at:at + 4 * lay.top_k].any()


def _round_trips(world, cfg, seed, calls, plain_every=0):
    """Each call: dispatch with weights, then the partial-reduce combine (with a residual on
    odd calls) against the reference; with ``plain_every``, every such call is followed by
    a plain BF16 combine of the same dispatch (weights given to it) against its reference,
    and the next call's partial reduce must not see it."""
    rng = np.random.default_rng(seed)
    n = 0
    for i, call in enumerate(calls):
        ws, results = _dispatch(world, cfg, call, rng)
        ys = expert_outputs(rng, cfg, results)
        res = residuals(rng, cfg, call[1]) if i % 2 else None
        got = world.combine(ys, residual=res, partial_reduce=True)
        want = reference.combine(cfg, results, ys, ws, residual=res, partial_reduce=True)
        for s, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"seed {seed} call {i} source {s}"
        n += 1
        if plain_every and i % plain_every == 0:
            ws2 = weights(rng, cfg, call[1])
            got = world.combine(ys, ws2)
            want = reference.combine(cfg, results, ys, ws2)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), f"plain call {i}"
    assert n == len(calls)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("path", PATHS)
def test_partial_reduce_matches_the_reference(path, R, seed):
    """Top-4 of 4 experts per rank: all four slots on one rank, three and a ``-1``, two and
    two, only ``-1``, one; three calls, the residual on the second."""
    cfg = make_cfg("BF16", 64, R=R, K=4, L=4, T=8, path=path)
    with sim_world(cfg, seed) as world:
        _round_trips(world, cfg, seed, _edge_calls(cfg, seed))


def test_quantising_dispatch_format(seed):
    """An NVFP4 dispatch: the expert outputs are BF16 all the same."""
    cfg = make_cfg("NVFP4", 64, R=2, K=4, L=4, T=8, path="warp")
    with sim_world(cfg, seed) as world:
        _round_trips(world, cfg, seed, _edge_calls(cfg, seed, n_calls=2))


def test_fused_kernel(seed):
    """``ep_combine_partial``, the fused single launch, after the fused dispatch."""
    cfg = make_cfg("BF16", 64, R=2, K=4, L=4, T=8, path="warp_split")
    with sim_world(cfg, seed, fused=True) as world:
        assert world.combiner().fused
        _round_trips(world, cfg, seed, _edge_calls(cfg, seed, n_calls=2))


def test_alternating_with_the_plain_combine(seed):
    """Partial reduce, plain BF16 combine of the same dispatch, partial reduce again: each
    call's own kernels and buffers, no state left behind."""
    cfg = make_cfg("BF16", 64, R=2, K=4, L=4, T=8, path="warp_split")
    with sim_world(cfg, seed) as world:
        _round_trips(world, cfg, seed, _edge_calls(cfg, seed), plain_every=1)


@pytest.mark.parametrize("R,P", [(2, 1), (4, 2)])
def test_shmem_transport(R, P, seed):
    """Sources outside the P2P group get their partial sums by one put-with-signal each
    (staged first); in-group ones by peer stores."""
    cfg = shmem_cfg(R=R, P=P, K=3, L=3, T=6)
    with sim_world(cfg, seed) as world:
        _round_trips(world, cfg, seed, _edge_calls(cfg, seed, n_calls=2))


@pytest.mark.parametrize("case", ["R2", "R4", "R4-shmem-mixed"])
def test_counted_link_bytes_equal_the_model(case, seed):
    """The bytes each rank's threads store or put into another rank's combine receive
    buffer (and the signals of the puts) equal ``link_bytes(..., dedup=True,
    partial_reduce=True)``: one row per (token, remote rank)."""
    R = 4 if case.startswith("R4") else 2
    shmem = case.endswith("shmem-mixed")
    cfg = shmem_cfg(R=R, P=2, K=3, L=2, T=4) if shmem else \
        make_cfg("BF16", 64, R=R, K=3, L=2, T=4, path="warp_split")
    rng = np.random.default_rng(seed)
    world, machine = counted_world(cfg, seed)
    for call in range(2):
        toks, ids = routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank, fraction=0.25) \
            if call else routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        ws = weights(rng, cfg, ids)
        results = world.dispatch(toks, ids, topk_weights=ws)
        want = lb.link_bytes(cfg, ids, dedup=True, partial_reduce=True)
        got = machine.link_traffic(reset=True)
        assert got.total(kinds=DATA, buffers=("recv_buf",)) == want.dispatch_link
        ys = expert_outputs(rng, cfg, results)
        out = world.combine(ys, partial_reduce=True)
        got = machine.link_traffic(reset=True)
        assert got.total(kinds=DATA, buffers=COMBINE_PAYLOAD) == want.combine_link, call
        assert got.total(kinds=SIGNALS, buffers=("combine.arrival",)) == \
            want.combine_signal, call
        assert got.total(kinds=DATA, buffers=COMBINE_PAYLOAD, remote=False) == \
            want.combine_local, call
        assert want.combine_link <= lb.link_bytes(cfg, ids).combine_link
        ref = reference.combine(cfg, results, ys, ws, partial_reduce=True)
        assert all(np.array_equal(g, w) for g, w in zip(out, ref))


def test_refusals_leave_the_world_usable(seed):
    """``partial_reduce`` refused by name, before anything runs: not a bool, with
    ``topk_weights``, with ``fp8``, after a dispatch given no weights; ``topk_weights`` of
    the wrong shape refused by the dispatch; then a good call still matches."""
    cfg = make_cfg("BF16", 128, R=2, K=2, L=2, T=4, path="warp_split")
    rng = np.random.default_rng(seed)
    (call,) = _edge_calls(cfg, seed, n_calls=1)
    toks, ids = call
    with sim_world(cfg, seed) as world:
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        with pytest.raises(EPInputError, match="last dispatch was given no topk_weights"):
            world.combine(ys, partial_reduce=True)
        ws = weights(rng, cfg, ids)
        with pytest.raises(EPInputError, match=r"topk_weights\[1\]: must be"):
            world.dispatch(toks, ids, topk_weights=[ws[0], ws[1][:, :1]])
        results = world.dispatch(toks, ids, topk_weights=ws)
        with pytest.raises(EPInputError, match="partial_reduce: must be True or False"):
            world.combine(ys, partial_reduce=1)
        with pytest.raises(EPInputError, match="topk_weights: must be None with "
                                               "partial_reduce=True"):
            world.combine(ys, ws, partial_reduce=True)
        with pytest.raises(ValueError, match="partial_reduce: not with fp8=True"):
            world.combine(ys, fp8=True, partial_reduce=True)
        got = world.combine(ys, partial_reduce=True)
        want = reference.combine(cfg, results, ys, ws, partial_reduce=True)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        # a round trip of new inputs without weights (the stream form) forgets them
        world.load_inputs(toks, ids)
        world.enqueue_round_trip()
        world.check()
        with pytest.raises(EPInputError, match="last dispatch was given no topk_weights"):
            world.combine(ys, partial_reduce=True)


def test_refused_without_ep_rank_dedup(seed):
    """A plain configuration refuses ``partial_reduce`` and a dispatch's ``topk_weights``
    by name."""
    import epgen
    from epgen.formats import make_format
    cfg = epgen.EPConfig(num_threads=64, n_sms=4, n_experts=4, n_ranks=2,
                         max_tokens_per_rank=4, p2p_world_size=2, use_shmem=False,
                         token_fmt=make_format("BF16", 64, 2))
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 4)
    with sim_world(cfg, seed) as world:
        with pytest.raises(EPInputError, match="topk_weights: the dispatch carries router "
                                               "weights only with ep_rank_dedup=True"):
            world.dispatch(toks, ids, topk_weights=weights(rng, cfg, ids))
        results = world.dispatch(toks, ids)
        with pytest.raises(ValueError, match="partial_reduce: needs ep_rank_dedup=True"):
            world.combine(expert_outputs(rng, cfg, results), partial_reduce=True)


def test_summation_order_is_the_stated_one(seed):
    """Crafted so that the order decides the result (weights 1; ``2^-30`` is below half an
    f32 ulp of 1): token 0 has slots 0, 1, 2 on rank 0 with rows ``1, -1, 2^-30`` (and slot
    3 on rank 1, zero): the destination's fma chain in ``k`` order gives ``2^-30``, any other
    order 0; token 1 has one slot on each of ranks 0, 1, 2 with the same rows: the source's
    sum in ``k`` order gives ``2^-30``. Expected values from this arithmetic, not from the
    reference (which must agree)."""
    cfg = make_cfg("BF16", 64, R=4, K=4, L=4, T=4, path="warp_split")
    H, K = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
    tiny = np.float32(2.0 ** -30)
    value = {0: [1.0, -1.0, tiny, 0.0], 1: [1.0, -1.0, tiny, 0.0]}
    ids = [np.array([[0, 1, 2, 4], [0, 4, 8, -1]], np.int32)] + \
        [np.zeros((0, K), np.int32)] * 3
    toks = [routing.random_tokens(np.random.default_rng(seed), 2, H)] + \
        [np.zeros((0, H), np.uint16)] * 3
    ws = [np.ones((2, K), np.float32)] + [np.zeros((0, K), np.float32)] * 3
    with sim_world(cfg, seed) as world:
        results = world.dispatch(toks, ids, topk_weights=ws)
        ys = []
        for res in results:
            rows = np.zeros((len(res.src_info), H), np.float32)
            for row, (t, k) in enumerate(res.src_info):
                if t >= 0 and row < len(rows) and source_of_rows(res)[row] == 0:
                    rows[row] = value[int(t)][int(k)]
            ys.append((rows.view(np.uint32) >> 16).astype(np.uint16))
        got = world.combine(ys, partial_reduce=True)
        want_bits = np.uint16(np.float32(tiny).view(np.uint32) >> 16)
        assert (got[0] == want_bits).all(), got[0][:, :4]
        ref = reference.combine(cfg, results, ys, ws, partial_reduce=True)
        assert np.array_equal(ref[0], got[0])


def test_rank_mask(seed):
    """``ep_rank_mask`` with rank 1 masked by hand: it is not launched, nobody sends to it
    or waits for it, and the others' partial sums leave its slots out, as the reference
    of the masked inputs (``reference.mask_ranks``) says; then unmasked, every rank again."""
    import epgen
    from backends import sim as sim_backend
    from mask_checks import mask_cfg
    from test_rank_mask_sim import MAX_SPINS
    cfg = mask_cfg(ep_rank_dedup=True)
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed, max_spins=MAX_SPINS))
    for masked in ({1}, set()):
        world.update_mask(1, bool(masked))
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        ws = weights(rng, cfg, ids)
        got_d = world.dispatch(toks, ids, topk_weights=ws)
        mt, mi = reference.mask_ranks(cfg, toks, ids, masked) if masked else (toks, ids)
        ref = reference.dispatch(cfg, mt, mi)
        for q in set(range(cfg.n_ranks)) - masked:
            reference.assert_match(cfg, [ref[q]], [got_d[q]])
        # the world's rows (the order inside a block is the kernels'); a masked rank's none
        res = [ref[q] if q in masked else got_d[q] for q in range(cfg.n_ranks)]
        ys = expert_outputs(rng, cfg, res)
        got = world.combine([None if q in masked else y for q, y in enumerate(ys)],
                            partial_reduce=True)
        want = reference.combine(cfg, res, ys, ws, partial_reduce=True)
        for q in range(cfg.n_ranks):
            if q in masked:
                assert got[q] is None and got_d[q] is None
            else:
                assert np.array_equal(got[q], want[q]), f"rank {q} masked {masked}"
