"""The engines' call sequences on ``epgen.deepep`` (``engine_calls``: vLLM's low-latency
prepare/finalize with and without two overlapped micro-batches, SGLang's dispatcher with an
idle rank, TensorRT-LLM's hook-less calls), on the simulator, each result checked with
DeepEP's test properties (``deepep_checks``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402

import engine_calls as ec  # noqa: E402
from deepep_checks import (LLCase, check_combine, check_dispatch, gemm_input,  # noqa: E402
                           rank_inputs)

CASE = LLCase(n_ranks=2, num_experts=4, tokens=4, hidden=256, top_k=2)


def all_ids(inputs):
    return [i for _, i, _ in inputs]


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_vllm_prepare_and_finalize(use_fp8, seed):
    inputs = rank_inputs(torch, CASE, seed)
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    T, H, E = CASE.tokens, CASE.hidden, CASE.num_experts

    def body(rank):
        buf = ec.vllm_buffer(deep_ep, group.rank(rank), T, H, CASE.n_ranks, E)
        a1, ids, w = inputs[rank]
        for _ in range(2):
            hook, (expert_x, expert_num_tokens, handle) = ec.vllm_prepare(
                buf, a1, ids, T, E, use_fp8, False)
            hook()
            check_dispatch(torch, CASE, rank, all_ids(inputs), expert_x, expert_num_tokens,
                           handle, None, use_fp8=use_fp8, round_scale=False)
            hook, output = ec.vllm_finalize(torch, buf, gemm_input(torch, expert_x, use_fp8, H),
                                            w, ids, handle)
            hook()
            check_combine(torch, rank, a1, ids, w, output, use_fp8=use_fp8,
                          round_scale=False)
        buf.destroy()
    group.run(body)


def test_vllm_two_overlapped_microbatches_with_hooks_on_the_other_thread(seed):
    first, second = rank_inputs(torch, CASE, seed), rank_inputs(torch, CASE, seed + 1)
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    T, H, E = CASE.tokens, CASE.hidden, CASE.num_experts

    def body(rank):
        buf = ec.vllm_buffer(deep_ep, group.rank(rank), T, H, CASE.n_ranks, E)
        done = ec.vllm_two_microbatches(torch, buf, [first[rank], second[rank]], T, E,
                                        lambda recv: recv.clone())
        for inputs, ((expert_x, counts, handle), out) in zip((first, second), done):
            a1, ids, w = inputs[rank]
            check_combine(torch, rank, a1, ids, w, out, use_fp8=False, round_scale=False)
    group.run(body)


def test_sglang_dispatcher_with_an_idle_rank(seed):
    inputs = rank_inputs(torch, CASE, seed)
    x1, ids1, w1 = inputs[1]
    inputs[1] = (x1[:0], ids1[:0], w1[:0])            # rank 1 has no tokens this step
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    T, H, E = CASE.tokens, CASE.hidden, CASE.num_experts

    def body(rank):
        buf = ec.sglang_buffer(deep_ep, group.rank(rank), T, H, E)
        x, ids, w = inputs[rank]
        for use_fp8 in (True, False):
            buf.clean_low_latency_buffer(T, H, E)
            recv, masked_m, expected_m, handle, ids64 = ec.sglang_dispatch(
                torch, buf, x, ids.to(torch.int32), T, E, use_fp8)
            assert expected_m == (x.shape[0] * CASE.n_ranks * CASE.top_k + E) // E
            check_dispatch(torch, CASE, rank, all_ids(inputs), recv, masked_m, handle, None,
                           use_fp8=use_fp8, round_scale=False)
            combined = ec.sglang_combine(buf, gemm_input(torch, recv, use_fp8, H), ids64, w,
                                         handle)
            assert combined.shape == (x.shape[0], H)
            check_combine(torch, rank, x, ids, w, combined, use_fp8=use_fp8,
                          round_scale=False)
    group.run(body)


def test_trtllm_calls_without_hooks_or_events(seed):
    inputs = rank_inputs(torch, CASE, seed)
    group = deep_ep.EmulatedGroup(CASE.n_ranks, backend="sim")
    T, H, E = CASE.tokens, CASE.hidden, CASE.num_experts

    def body(rank):
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, CASE.n_ranks, E)
        buf = deep_ep.Buffer(group.rank(rank), 0, rdma, low_latency_mode=True,
                             num_qps_per_rank=E // CASE.n_ranks)
        x, ids, w = inputs[rank]
        recv_x, count, handle, combined = ec.trtllm_round(
            buf, x, ids.to(torch.int32), w, T, E, lambda r: r.clone())
        check_dispatch(torch, CASE, rank, all_ids(inputs), recv_x, count, handle, None,
                       use_fp8=False, round_scale=False)
        check_combine(torch, rank, x, ids, w, combined, use_fp8=False, round_scale=False)
    group.run(body)
