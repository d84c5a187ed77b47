"""The call sequences inference engines make on DeepEP's low-latency API, reproduced against
``epgen.deepep`` without the engines (arguments, dtypes and order as each engine's DeepEP
integration passes them; docs/engines.md):

- ``vllm_buffer`` / ``vllm_prepare`` / ``vllm_finalize``: vLLM's DeepEP low-latency
  prepare/finalize: the buffer built from keywords with the rdma size hint (also by
  keyword), int64 ids, ``async_finish=False`` and ``return_recv_hook=True`` on both calls,
  ``recv_count`` as the experts' token counts, FP8 with 128-blocks (UE8M0 when the experts
  take packed scales), the combine into a preallocated ``out``. With two micro-batches
  (``vllm_two_microbatches``) the two chains interleave and each hook runs on the other
  micro-batch's thread.
- ``sglang_buffer`` / ``sglang_dispatch`` / ``sglang_combine``: SGLang's DeepEP dispatcher:
  the buffer built positionally, ids converted from int32 to int64, ``expected_m``, the
  dispatch split in two halves by the hook, the combine by keywords, no ``out``; an idle
  rank dispatches zero tokens; ``clean_low_latency_buffer`` on a mode switch.
- ``trtllm_round``: TensorRT-LLM's low-latency communication: no hooks, no events
  (``event.event is None`` and ``hook is None`` asserted, as it does), int32 ids as the
  router gives them, BF16.

Each returns what the engine would hand on (tokens per expert, combined tokens) so the test
checks it with ``deepep_checks``.
"""

from __future__ import annotations

import threading


def vllm_buffer(deep_ep, group, T_max: int, H: int, R: int, E: int):
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=T_max, hidden=H, num_ranks=R, num_experts=E)
    return deep_ep.Buffer(group=group, num_nvl_bytes=1024 * 1024 * 1024,
                          num_rdma_bytes=rdma, low_latency_mode=True,
                          num_qps_per_rank=E // R, allow_nvlink_for_low_latency_mode=True,
                          allow_mnnvl=False, explicitly_destroy=True, enable_shrink=False)


def vllm_prepare(buf, a1, topk_ids, T_max: int, E: int, use_fp8: bool, use_ue8m0: bool):
    """Returns ``(hook, (expert_x, expert_num_tokens, handle))``: the engine runs the hook
    (now, or on the other micro-batch's thread) before using the rest."""
    expert_x, expert_num_tokens, handle, _, hook = buf.low_latency_dispatch(
        a1, topk_ids, T_max, E, use_fp8=use_fp8, round_scale=use_ue8m0,
        use_ue8m0=use_ue8m0, async_finish=False, return_recv_hook=True)
    return hook, (expert_x, expert_num_tokens, handle)


def vllm_finalize(torch, buf, fused_expert_output, topk_weights, topk_ids, handle):
    """Returns ``(hook, output)``."""
    output = torch.empty((topk_ids.shape[0], fused_expert_output.shape[-1]),
                         dtype=torch.bfloat16, device=fused_expert_output.device)
    _, _, hook = buf.low_latency_combine(fused_expert_output, topk_ids, topk_weights, handle,
                                         async_finish=False, zero_copy=False,
                                         return_recv_hook=True, out=output)
    return hook, output


def vllm_two_microbatches(torch, buf, batches, T_max, E, experts, stream=None):
    """Two micro-batches ``batches = [(a1, ids, w), (a1, ids, w)]`` as vLLM's dual-batch
    overlap runs them: dispatch 0, dispatch 1 (hook 0 run by micro-batch 1's thread),
    combine 0 (hook 1 run by micro-batch 0's thread), combine 1, each hook on a thread
    other than the one that made the call. ``experts(recv)`` stands in for the expert GEMMs.
    Returns both outputs and dispatch results."""
    def on_other_thread(fn):
        errors = []

        def run():
            try:
                if stream is None:
                    fn()
                else:
                    torch.cuda.set_device(stream.device)
                    with torch.cuda.stream(stream):
                        fn()
            except BaseException as e:
                errors.append(e)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        if errors:
            raise errors[0]
    (a0, i0, w0), (a1, i1, w1) = batches
    hook0, got0 = vllm_prepare(buf, a0, i0, T_max, E, False, False)
    hook1, got1 = vllm_prepare(buf, a1, i1, T_max, E, False, False)
    on_other_thread(hook0)
    on_other_thread(hook1)
    c0, out0 = vllm_finalize(torch, buf, experts(got0[0]), w0, i0, got0[2])
    c1, out1 = vllm_finalize(torch, buf, experts(got1[0]), w1, i1, got1[2])
    on_other_thread(c0)
    on_other_thread(c1)
    return (got0, out0), (got1, out1)


def sglang_buffer(deep_ep, group, T_max: int, H: int, E: int):
    R = group.size()
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T_max, H, R, E)
    return deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // R,
                          allow_mnnvl=True)


def sglang_dispatch(torch, buf, hidden_states, topk_ids_int32, T_max: int, E: int,
                    use_fp8: bool):
    """``dispatch_a`` then ``dispatch_b``: returns ``(recv, masked_m, expected_m, handle)``."""
    topk_ids = topk_ids_int32.to(torch.int64)
    T, K = topk_ids.shape
    expected_m = (T * buf.group_size * K + E) // E
    recv, recv_count, handle, _, hook = buf.low_latency_dispatch(
        hidden_states, topk_ids, T_max, E, use_fp8=use_fp8, async_finish=False,
        return_recv_hook=True)
    hook()                                   # dispatch_b
    return recv, recv_count, expected_m, handle, topk_ids


def sglang_combine(buf, hidden_states, topk_ids, topk_weights, handle):
    combined, _, hook = buf.low_latency_combine(x=hidden_states, topk_idx=topk_ids,
                                                topk_weights=topk_weights, handle=handle,
                                                async_finish=False, return_recv_hook=True)
    hook()                                   # combine_b
    return combined


def trtllm_round(buf, x, token_selected_slots, topk_weights, T_max: int, num_slots: int,
                 experts):
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, token_selected_slots, T_max, num_slots, use_fp8=False)
    assert event.event is None
    assert hook is None
    L = recv_x.shape[0]
    y = experts(recv_x)
    combined, event, hook = buf.low_latency_combine(y.view(L, -1, x.shape[1]),
                                                    token_selected_slots,
                                                    topk_weights.float(), handle)
    assert event.event is None and hook is None
    return recv_x, recv_count, handle, combined
