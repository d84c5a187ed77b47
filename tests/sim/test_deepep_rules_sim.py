"""``epgen.deepep.Buffer``'s own rules on the simulator (docs/deepep.md): at most two
dispatch results outstanding (a handle whose slot a later dispatch reused is refused), one
combine per dispatch, a receive hook must be called before its result is used or its slot
is reused, a handle works only with its own buffer, bad expert ids are refused naming rank,
token and slot; after every refusal the buffer keeps working (a checked round trip).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402

from deepep_checks import LLCase, check_combine, check_dispatch, rank_inputs  # noqa: E402

CASE = LLCase(n_ranks=2, num_experts=4, tokens=4, hidden=256, top_k=2)


def dispatch(buf, x, idx, hook=False):
    return buf.low_latency_dispatch(x, idx, CASE.tokens, CASE.num_experts, use_fp8=False,
                                    return_recv_hook=hook)


def checked_round(buf, rank, inputs):
    """A dispatch and a combine, both checked against DeepEP's properties."""
    x, idx, w = inputs[rank]
    recv_x, count, handle, _, _ = dispatch(buf, x, idx)
    check_dispatch(torch, CASE, rank, [i for _, i, _ in inputs], recv_x, count, handle, None,
                   use_fp8=False, round_scale=False)
    combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    check_combine(torch, rank, x, idx, w, combined, use_fp8=False, round_scale=False)


def test_refused_handles_and_hooks_leave_the_buffer_working(seed):
    inputs = rank_inputs(torch, CASE, seed)
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    buffers = [None] * CASE.n_ranks
    handles = [None] * CASE.n_ranks

    def body(rank):
        buf = buffers[rank] = deep_ep.Buffer(group.rank(rank), low_latency_mode=True)
        x, idx, w = inputs[rank]
        recv1, _, h1, _, _ = dispatch(buf, x, idx)
        handles[rank] = h1
        recv2, _, h2, _, _ = dispatch(buf, x, idx)
        recv3, _, h3, _, _ = dispatch(buf, x, idx)          # reuses h1's slot
        with pytest.raises(EPInputError, match="reused by a later dispatch"):
            buf.low_latency_combine(recv1, idx, w, h1)
        buf.low_latency_combine(recv3, idx, w, h3)
        with pytest.raises(EPInputError, match="already combined"):
            buf.low_latency_combine(recv3, idx, w, h3)
        buf.low_latency_combine(recv2, idx, w, h2)           # two outstanding: both combine
        # a receive hook not called: its result cannot be combined, its slot not reused
        recv4, _, h4, _, hook4 = dispatch(buf, x, idx, hook=True)
        with pytest.raises(EPInputError, match="hook was not called"):
            buf.low_latency_combine(recv4, idx, w, h4)
        recv5, _, h5, _, hook5 = dispatch(buf, x, idx, hook=True)
        with pytest.raises(RuntimeError, match="receive hook that was not called"):
            dispatch(buf, x, idx)
        hook4()
        hook5()
        with pytest.raises(RuntimeError, match="already received"):
            hook5()
        buf.low_latency_combine(recv5, idx, w, h5)
        buf.low_latency_combine(recv4, idx, w, h4)
        checked_round(buf, rank, inputs)
    group.run(body)

    def foreign(rank):
        buf = buffers[rank]
        x, idx, w = inputs[rank]
        other = handles[(rank + 1) % CASE.n_ranks]
        with pytest.raises(EPInputError, match="from another buffer"):
            buf.low_latency_combine(torch.zeros((2, 8, 256), dtype=torch.bfloat16), idx, w,
                                    other)
        checked_round(buf, rank, inputs)
    group.run(foreign)


def test_bad_expert_ids_are_refused_naming_rank_token_and_slot(seed):
    inputs = rank_inputs(torch, CASE, seed)
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True)
        x, idx, _ = inputs[rank]
        for bad in (-2, CASE.num_experts):
            ids = idx.clone()
            ids[2, 1] = bad
            # the simulator checks every rank's ids on the host: rank 0's is named to both
            with pytest.raises(EPInputError, match=rf"^topk_ids\[0\]\[2, 1\] = {bad} is not "
                                                   rf"an expert id in \[0, 4\) nor -1"):
                dispatch(buf, x, ids)
        checked_round(buf, rank, inputs)
    group.run(body)


def test_a_rank_that_fails_ends_the_others_waits_with_its_error(seed):
    inputs = rank_inputs(torch, CASE, seed)
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True)
        if rank == 1:
            raise ValueError("rank 1 stops before its dispatch")
        x, idx, _ = inputs[rank]
        dispatch(buf, x, idx)
    with pytest.raises(ValueError, match="rank 1 stops"):
        group.run(body)
    with pytest.raises(deep_ep.PeerFailedError, match="rank 1 of the group failed"):
        group.run(lambda rank: dispatch(deep_ep.Buffer(group.rank(rank), low_latency_mode=True),
                                        *inputs[rank][:2]))
