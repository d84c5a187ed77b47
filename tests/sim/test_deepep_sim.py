"""``epgen.deepep.Buffer`` (DeepEP's low-latency API) on the CPU simulator, checked with the
properties of DeepEP's own low-latency test (``deepep_checks``): every rank in one process,
one thread per rank (``EmulatedGroup.run``), as one process per rank would call it.

Each format variant DeepEP offers (BF16; FP8; FP8 with power-of-two scales; with packed
UE8M0 scales) runs two rounds per rank (``deepep_checks.ROUNDS``): a dispatch with
``async_finish`` and a plain combine into ``out``; then two dispatches in a row (the first
one's result dropped, so the slots alternate), receive hooks, and a zero-copy combine.
Masked ``-1`` slots at random positions throughout.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402

from deepep_checks import VARIANTS, LLCase, rank_inputs, rank_rounds  # noqa: E402


def run_rounds(group, case, inputs, variant, **kw):
    group.run(lambda rank: rank_rounds(
        torch, deep_ep.Buffer(group.rank(rank), low_latency_mode=True,
                              num_qps_per_rank=case.num_experts // case.n_ranks),
        rank, case, inputs, variant, **kw))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_low_latency_dispatch_and_combine_have_deepeps_properties(variant, seed):
    case = LLCase(n_ranks=3, num_experts=6, tokens=5,
                  hidden=512 if variant == "fp8_ue8m0" else 256, top_k=3)
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
    run_rounds(group, case, rank_inputs(torch, case, seed), variant)


def test_a_token_with_every_slot_masked_is_sent_nowhere_and_combines_to_zero(seed):
    case = LLCase(n_ranks=2, num_experts=4, tokens=4, hidden=256, top_k=2, masked=0)
    inputs = rank_inputs(torch, case, seed)
    for _, idx, _ in inputs:
        idx[1, :] = -1
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim")
    run_rounds(group, case, inputs, "bf16", rounds=((False, False, 1),))
