"""``epgen.deepep.Buffer`` on the H200 with DeepEP's test properties (``deepep_checks``):

- every rank in one process (``EmulatedGroup``, one thread and one stream per rank), every
  format variant, at DeepEP's decode shape scaled to one GPU;
- the engines' call sequences (``engine_calls``): vLLM (also two overlapped micro-batches,
  hooks on other threads), SGLang (an idle rank), TensorRT-LLM; and vLLM's step captured in
  a CUDA graph and replayed with new inputs;
- one process per rank under ``epgen launch`` (MPS when ``CUDA_MPS_PIPE_DIRECTORY`` is set),
  the buffer built from a gloo process group over NVSHMEM inside one P2P group (every peer
  by puts is refused until the put path takes the final layout): this file is each PE's
  program (``python tests/gpu/test_deepep_gpu.py
  pe ...``).

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_deepep_gpu.py
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402

import engine_calls as ec  # noqa: E402
from deepep_checks import (FAILS, VARIANTS, LLCase, check_combine,  # noqa: E402
                           check_dispatch, gemm_input, rank_inputs, rank_rounds,
                           shrink_rounds)
from pe_programs import PES, die, gloo_group, launch_pe_program, pe_passed  # noqa: E402

#: 4 ranks on one GPU: DeepEP's decode shape with a quarter of the ranks and experts
CASE = LLCase(n_ranks=4, num_experts=64, tokens=128, hidden=7168, top_k=8, masked=10)
DEV = "cuda"


def emulated(n_ranks=CASE.n_ranks):
    return deep_ep.EmulatedGroup(n_ranks, backend="cuda")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_emulated_low_latency_rounds(variant, seed):
    group = emulated()
    inputs = rank_inputs(torch, CASE, seed)
    group.run(lambda rank: rank_rounds(
        torch, deep_ep.Buffer(group.rank(rank), low_latency_mode=True), rank, CASE, inputs,
        variant, rounds=((False, False, 1), (True, True, 2), (True, False, 1)), device=DEV))


def test_emulated_wait_cost_statistics(seed):
    """``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` on the GPU: after
    two calls every source's entry is a number of nanoseconds from 0 (a word already there:
    ``%globaltimer`` may not tick during a short wait) up to the calls' own wall time, some
    wait of the group took time, and the results are DeepEP's as without them."""
    import time
    group = emulated()
    inputs = rank_inputs(torch, CASE, seed)
    all_idx = [i for _, i, _ in inputs]
    T, H, E, R = CASE.tokens, CASE.hidden, CASE.num_experts, CASE.n_ranks

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True)
        x, idx, w = (t.to(DEV) for t in inputs[rank])
        ds, cs = (torch.zeros(R, dtype=torch.int64, device=DEV) for _ in range(2))
        start = time.monotonic()
        for _ in range(2):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(
                x, idx, T, E, use_fp8=False, dispatch_wait_recv_cost_stats=ds)
            buf.check()
            check_dispatch(torch, CASE, rank, all_idx, recv_x, count, handle, None,
                           use_fp8=False, round_scale=False)
            out, _, _ = buf.low_latency_combine(gemm_input(torch, recv_x, False, H), idx, w,
                                                handle, combine_wait_recv_cost_stats=cs)
            buf.check()
            check_combine(torch, rank, inputs[rank][0], inputs[rank][1], inputs[rank][2], out,
                          use_fp8=False, round_scale=False)
        wall_ns = (time.monotonic() - start) * 1e9
        for name, s in (("dispatch", ds.cpu()), ("combine", cs.cpu())):
            assert bool((s >= 0).all()) and bool((s < wall_ns).all()), (rank, name, s, wall_ns)
        return int(ds.sum()) + int(cs.sum())
    assert sum(group.run(body)) > 0


def test_emulated_vllm_two_microbatches_and_sglang_and_trtllm(seed):
    group = emulated()
    first, second = rank_inputs(torch, CASE, seed), rank_inputs(torch, CASE, seed + 1)
    T, H, E = CASE.tokens, CASE.hidden, CASE.num_experts
    ids = [i for _, i, _ in first]

    def body(rank):
        dev = [tuple(t.to(DEV) for t in b[rank]) for b in (first, second)]
        buf = ec.vllm_buffer(deep_ep, group.rank(rank), T, H, CASE.n_ranks, E)
        done = ec.vllm_two_microbatches(torch, buf, dev, T, E, lambda r: r.clone(),
                                        stream=torch.cuda.current_stream())
        for inputs, ((_, _, _), out) in zip((first, second), done):
            x, i, w = inputs[rank]
            check_combine(torch, rank, x, i, w, out, use_fp8=False, round_scale=False)
        x, i, w = dev[0]
        recv, masked_m, _, handle, i64 = ec.sglang_dispatch(torch, buf, x, i.to(torch.int32),
                                                            T, E, True)
        check_dispatch(torch, CASE, rank, ids, recv, masked_m, handle, None, use_fp8=True,
                       round_scale=False)
        combined = ec.sglang_combine(buf, gemm_input(torch, recv, True, H), i64, w, handle)
        check_combine(torch, rank, *first[rank], combined, use_fp8=True, round_scale=False)
        recv_x, count, handle, combined = ec.trtllm_round(buf, x, i.to(torch.int32), w, T, E,
                                                          lambda r: r.clone())
        check_dispatch(torch, CASE, rank, ids, recv_x, count, handle, None, use_fp8=False,
                       round_scale=False)
        check_combine(torch, rank, *first[rank], combined, use_fp8=False, round_scale=False)
    group.run(body)


def test_emulated_vllm_step_in_a_cuda_graph(seed):
    """Warm up both result slots, capture one prepare + finalize (hooks included) per rank,
    replay it with three new inputs copied into the captured tensors."""
    group = emulated()
    rounds = [rank_inputs(torch, CASE, seed + k) for k in range(3)]
    T, H, E = CASE.tokens, CASE.hidden, CASE.num_experts

    def body(rank):
        buf = ec.vllm_buffer(deep_ep, group.rank(rank), T, H, CASE.n_ranks, E)
        x, i, w = (t.to(DEV) for t in rounds[0][rank])
        stream = torch.cuda.current_stream()

        def step():
            hook, (expert_x, _, handle) = ec.vllm_prepare(buf, x, i, T, E, False, False)
            hook()
            c_hook, out = ec.vllm_finalize(torch, buf, expert_x.clone(), w, i, handle)
            c_hook()
            return out
        step()
        step()                          # both slots' worlds made before the capture
        graph = torch.cuda.CUDAGraph()
        out = group.capture(graph, step, stream=stream)
        step()                          # the slot after the captured one, warmed again
        for inputs in rounds:
            nx, ni, nw = inputs[rank]
            x.copy_(nx)
            i.copy_(ni)
            w.copy_(nw)
            graph.replay()
            check_combine(torch, rank, nx, ni, nw, out, use_fp8=False, round_scale=False)
    group.run(body)


# -- one process per rank -------------------------------------------------------------------
PE_CASE = {2: LLCase(2, 8, 64, 2048, 4, masked=6), 4: LLCase(4, 16, 64, 2048, 4, masked=6),
           8: LLCase(8, 16, 32, 2048, 4, masked=6)}


@pytest.mark.parametrize("p2p", ["all_p2p"])
@pytest.mark.parametrize("n", PES)
def test_process_group_buffer_one_process_per_rank(n, p2p, seed, nvshmem_wheel):
    launch_pe_program(__file__, [str(seed), p2p], n, "every DeepEP round passed")


def shrink_fails(n: int) -> dict:
    """DeepEP's shrink test's failing ranks that exist among ``n``: API -> rank."""
    return {api: r for api, r in FAILS.items() if r < n}


@pytest.mark.parametrize("n", PES)
def test_process_group_shrink_survives_killed_ranks(n, seed, nvshmem_wheel):
    """DeepEP's shrink test on a process group (``enable_shrink``): the ranks of
    ``shrink_fails`` die (``pe_programs.die``) when they reach their API; every survivor's
    mask, dispatch and combine are checked after each call (``deepep_checks.shrink_rounds``)."""
    dead = set(shrink_fails(n).values())
    launch_pe_program(__file__, [str(seed), "shrink"], n, "shrink rounds passed",
                      keep_going=True, survivors=[r for r in range(n) if r not in dead])


def pe_buffer(store: str, **kw):
    """A PE program's ``(rank, n, dist, case, Buffer)``: a gloo group through ``store``, a
    low-latency buffer of ``PE_CASE[n]`` over it (8 blocks of 512 threads; ``kw``: more
    arguments)."""
    rank, n, dist = gloo_group(store)
    case = PE_CASE[n]
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.tokens, case.hidden, n,
                                                         case.num_experts)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True,
                         num_qps_per_rank=case.num_experts // n, n_sms=8, num_threads=512,
                         **kw)
    return rank, n, dist, case, buf


def pe_shrink_main(seed: int) -> int:
    """One rank's program of the shrink test (``test_process_group_shrink_...``)."""
    rank, n, _, case, buf = pe_buffer("deepep-shrink-gloo-store", enable_shrink=True,
                                      timeout_ns=2_000_000_000)

    def fail(api):
        die(rank, f"at {api}")
    fails = shrink_fails(n)
    inputs = rank_inputs(torch, case, seed)
    # every rank first makes both result slots' worlds and combine buffers: their symmetric
    # allocations are collective (DeepEP allocates its buffer in the constructor)
    shrink_rounds(torch, buf, rank, case, inputs, {}, fail, rounds=2, device=DEV)
    got = shrink_rounds(torch, buf, rank, case, inputs, fails, fail, device=DEV)
    assert got == set(fails.values()), got
    print(f"rank {rank}: shrink rounds passed", flush=True)
    os._exit(0)           # NVSHMEM stays up (peers are gone): nothing collective at exit


def pe_main(seed: int, p2p: str) -> int:
    """One rank's program: a gloo group from the launcher's directory, a ``Buffer`` over it
    (NVSHMEM), every variant's rounds, then ``destroy``."""
    if p2p == "shrink":
        return pe_shrink_main(seed)
    rank, n, dist, case, buf = pe_buffer(
        "deepep-gloo-store", explicitly_destroy=True,
        allow_nvlink_for_low_latency_mode=p2p == "all_p2p", timeout_ns=5_000_000_000)
    inputs = rank_inputs(torch, case, seed)
    for variant in VARIANTS:
        rank_rounds(torch, buf, rank, case, inputs, variant, device=DEV)
    buf.destroy()
    return pe_passed(dist, rank, "every DeepEP round passed")


if __name__ == "__main__":
    if sys.argv[1:2] != ["pe"]:
        sys.exit("usage: test_deepep_gpu.py pe SEED all_p2p|shrink")
    sys.exit(pe_main(int(sys.argv[2]), sys.argv[3]))
