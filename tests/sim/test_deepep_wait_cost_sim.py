"""The wait-cost statistics of ``epgen.deepep.Buffer`` (``dispatch_wait_recv_cost_stats``,
``combine_wait_recv_cost_stats``: ``[num_ranks]`` int64, nanoseconds of ``%globaltimer`` per
source rank, ``Tuning.wait_times``) on the simulator, and the world-level wait times they
come from.

The simulator's timer advances by one per read, so the values here are ticks, not time: the
tests check where the times go, not how long anything took. Each call adds this rank's
dispatch_wait words (count word ``e * R + src``, summed over its ``L`` local experts, every
one at least one tick) and combine_wait words (one per destination) to the tensors given;
with ``return_recv_hook`` the combine's time is added by the hook, not before; the results
match DeepEP's properties as without statistics; a statistics tensor DeepEP would refuse is
refused by name and the buffer keeps working."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from deepep_checks import LLCase, check_combine, check_dispatch, rank_inputs  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402

CASE = LLCase(n_ranks=2, num_experts=8, tokens=8, hidden=256, top_k=2, masked=1)


def test_statistics_accumulate_each_calls_waits_per_source(seed):
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    inputs = rank_inputs(torch, CASE, seed)
    all_idx = [i for _, i, _ in inputs]
    R, L = CASE.n_ranks, CASE.num_experts // CASE.n_ranks
    T, E = CASE.tokens, CASE.num_experts

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True)
        x, idx, w = inputs[rank]
        ds = torch.zeros(R, dtype=torch.int64)
        cs = torch.zeros(R, dtype=torch.int64)
        for call, hook in enumerate((False, True, False)):
            before_d, before_c = ds.clone(), cs.clone()
            recv_x, count, handle, _, rhook = buf.low_latency_dispatch(
                x, idx, T, E, use_fp8=False, return_recv_hook=hook,
                dispatch_wait_recv_cost_stats=ds)
            if hook:
                assert torch.equal(ds, before_d), "the dispatch's time added before its hook"
                rhook()
            check_dispatch(torch, CASE, rank, all_idx, recv_x, count, handle, None,
                           use_fp8=False, round_scale=False)
            words = _dispatch_words(group, handle, rank)
            assert words.shape == (E,) and (words >= 1).all(), words
            assert torch.equal(ds - before_d, torch.from_numpy(words.reshape(L, R).sum(0)))
            out, _, chook = buf.low_latency_combine(recv_x.clone(), idx, w, handle,
                                                    return_recv_hook=hook,
                                                    combine_wait_recv_cost_stats=cs)
            if hook:
                assert torch.equal(cs, before_c), "the combine's time added before its hook"
                chook()
            cwords = _combine_words(group, handle, rank)
            assert cwords.shape == (R,) and (cwords >= 1).all(), cwords
            assert torch.equal(cs - before_c, torch.from_numpy(cwords))
            check_combine(torch, rank, x, idx, w, out, use_fp8=False, round_scale=False)
        return ds, cs
    group.run(body)


def _dispatch_words(group, handle, rank):
    """Rank ``rank``'s raw dispatch_wait words ``[E]`` of ``handle``'s world, read from the
    world, not through the port's per-source sums."""
    world = handle_world(group, handle)
    return world.ranks[rank].wait_time.to_host().astype(np.int64)


def _combine_words(group, handle, rank):
    """Rank ``rank``'s raw combine_wait words ``[R]`` of ``handle``'s world."""
    world = handle_world(group, handle)
    return world.combiner().bufs[rank].wait_time.to_host().astype(np.int64)


def handle_world(group, handle):
    """The world of ``handle``'s result slot (``EmulatedGroup`` keeps one per shape and
    slot)."""
    (world,) = [w for (shape, slot), w in zip(group.shapes_in_use(), group.worlds())
                if slot == handle.slot]
    return world


def test_a_statistics_tensor_deepep_refuses_is_refused_and_the_buffer_works(seed):
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    inputs = rank_inputs(torch, CASE, seed)
    T, E, R = CASE.tokens, CASE.num_experts, CASE.n_ranks

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True)
        x, idx, w = inputs[rank]
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        for bad, rule in ((torch.zeros(R, dtype=torch.float32), "dtype torch.float32"),
                          (torch.zeros(R + 1, dtype=torch.int64), r"shape \(3,\)")):
            with pytest.raises(EPInputError, match=rf"^combine_wait_recv_cost_stats: {rule}"):
                buf.low_latency_combine(recv_x.clone(), idx, w, handle,
                                        combine_wait_recv_cost_stats=bad)
        out, _, _ = buf.low_latency_combine(recv_x.clone(), idx, w, handle)
        check_combine(torch, rank, x, idx, w, out, use_fp8=False, round_scale=False)
    group.run(body)
