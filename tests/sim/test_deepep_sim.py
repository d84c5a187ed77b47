"""``epgen.deepep.Buffer`` (DeepEP's low-latency API) on the CPU simulator, checked with the
properties of DeepEP's own low-latency test (``deepep_checks``): every rank in one process,
one thread per rank (``EmulatedGroup.run``), as one process per rank would call it.

Each format variant DeepEP offers (BF16; FP8; FP8 with power-of-two scales; with packed
UE8M0 scales) runs two rounds per rank: a dispatch with ``async_finish`` and a plain
combine into ``out``; then two dispatches in a row (the first one's result dropped, so the
slots alternate), receive hooks, and a zero-copy combine. Masked ``-1`` slots at random
positions throughout.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402

from deepep_checks import (LLCase, check_combine, check_dispatch, gemm_input,  # noqa: E402
                           rank_inputs)

#: name -> (use_fp8, round_scale, use_ue8m0)
VARIANTS = {"bf16": (False, False, False), "fp8": (True, False, False),
            "fp8_round_scale": (True, True, False), "fp8_ue8m0": (True, True, True)}
#: (return_recv_hook, zero_copy, dispatches before the combine)
ROUNDS = ((False, False, 1), (True, True, 2))


def low_latency_rounds(group, case, inputs, variant, rounds=ROUNDS):
    """The per-rank body: ``rounds`` of dispatch(es) and a combine, every result checked."""
    use_fp8, round_scale, use_ue8m0 = VARIANTS[variant]
    all_idx = [i for _, i, _ in inputs]
    T, H, E = case.tokens, case.hidden, case.num_experts

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True,
                             num_qps_per_rank=E // case.n_ranks)
        x, idx, w = inputs[rank]
        for hook, zero_copy, dispatches in rounds:
            for _ in range(dispatches):
                stats = torch.zeros(E // case.n_ranks, dtype=torch.int32)
                recv_x, count, handle, event, recv_hook = buf.low_latency_dispatch(
                    x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                    round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook,
                    return_recv_hook=hook)
                assert (recv_hook is not None) == hook
                recv_hook() if hook else event.current_stream_wait()
            check_dispatch(torch, case, rank, all_idx, recv_x, count, handle, stats,
                           use_fp8=use_fp8, round_scale=round_scale)
            y = gemm_input(torch, recv_x, use_fp8, H)
            if zero_copy:
                buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
            out = torch.empty((T, H), dtype=torch.bfloat16)
            combined, event, recv_hook = buf.low_latency_combine(
                y, idx, w, handle, zero_copy=zero_copy, async_finish=not hook,
                return_recv_hook=hook, out=out)
            recv_hook() if hook else event.current_stream_wait()
            assert combined is out
            check_combine(torch, rank, x, idx, w, combined, use_fp8=use_fp8,
                          round_scale=round_scale)
        return buf
    return group.run(body)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_low_latency_dispatch_and_combine_have_deepeps_properties(variant, seed):
    case = LLCase(n_ranks=3, num_experts=6, tokens=5,
                  hidden=512 if variant == "fp8_ue8m0" else 256, top_k=3)
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
    low_latency_rounds(group, case, rank_inputs(torch, case, seed), variant)


def test_a_token_with_every_slot_masked_is_sent_nowhere_and_combines_to_zero(seed):
    case = LLCase(n_ranks=2, num_experts=4, tokens=4, hidden=256, top_k=2, masked=0)
    inputs = rank_inputs(torch, case, seed)
    for _, idx, _ in inputs:
        idx[1, :] = -1
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim")
    low_latency_rounds(group, case, inputs, "bf16", rounds=((False, False, 1),))
