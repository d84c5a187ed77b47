"""``epgen.deepep.Buffer.dispatch`` (DeepEP's normal mode on the deduplicated transport) on
the H200, every rank in one process (``EmulatedGroup``, one thread and one stream per rank),
with the properties of DeepEP's tests/legacy/test_intranode.py dispatch and combine checks
(``normal_checks``: ``recv_topk_weights``, the combine's ``calc_diff`` thresholds, bit-exact
against the reference) at realistic sizes; ``num_worst_tokens`` dispatches captured in a
CUDA graph (both result slots: an even number of dispatches per graph) and replayed with new
tokens; and dispatch + combine pairs (weights and a bias) captured and replayed likewise.

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_deepep_normal_gpu.py
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.reference_tokens import normal_combine, normal_dispatch  # noqa: E402

from normal_checks import NormalCase, draw_inputs, draw_weights, rank_checks  # noqa: E402
from pe_programs import PES, gloo_group, launch_pe_program, pe_passed  # noqa: E402

DEV = "cuda"
CASES = {
    # DeepEP's intranode test shape with 8 ranks on one GPU (4096 tokens per rank scaled down)
    "R8-E256-K8": NormalCase(n_ranks=8, num_experts=256, tokens=512, hidden=7168, top_k=8,
                             masked=0.05),
    "R4-E64-K6": NormalCase(n_ranks=4, num_experts=64, tokens=1024, hidden=4096, top_k=6),
}


def emulated(n_ranks):
    return deep_ep.EmulatedGroup(n_ranks, backend="cuda")


@pytest.mark.parametrize("name", list(CASES))
def test_normal_dispatch_has_deepeps_properties(name, seed):
    case = CASES[name]
    inputs = draw_inputs(torch, case, seed)
    weights = draw_weights(torch, case, inputs, seed)
    group = emulated(case.n_ranks)

    def body(rank):
        dev = [(x.to(DEV), i.to(DEV)) for x, i in inputs]
        buf = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=case.tokens)
        for alignment, ws in ((1, [w.to(DEV) for w in weights]), (128, None)):
            rank_checks(torch, buf, rank, case, dev, alignment=alignment, weights=ws)
        torch.cuda.current_stream().synchronize()
        return True
    assert all(group.run(body))


def test_num_worst_tokens_dispatch_in_a_cuda_graph(seed):
    """Warm up both result slots, capture two dispatches per rank (one per slot), replay
    with three new token sets copied into the captured input and compare with the
    reference."""
    case = CASES["R4-E64-K6"]
    rounds = [draw_inputs(torch, case, seed + k) for k in range(3)]
    group = emulated(case.n_ranks)
    E, worst = case.num_experts, case.n_ranks * case.tokens

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=case.tokens)
        x, idx = (t.to(DEV) for t in rounds[0][rank])
        ntpr, _, ntpe, itir, _ = buf.get_dispatch_layout(idx, E)
        args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                    num_tokens_per_expert=ntpe, topk_idx=idx, num_worst_tokens=worst)
        stream = torch.cuda.current_stream()
        buf.dispatch(x, **args)
        buf.dispatch(x, **args)             # both slots' worlds made before the capture
        buf.check()
        graph = torch.cuda.CUDAGraph()
        first, second = group.capture(
            graph, lambda: (buf.dispatch(x, **args), buf.dispatch(x, **args)), stream=stream)
        for inputs in rounds:
            x.copy_(inputs[rank][0].to(DEV))
            graph.replay()
            buf.check()
            ref = normal_dispatch(E, [xs.view(torch.int16).numpy().view(np.uint16)
                                      for xs, _ in inputs],
                                  [i.numpy() for _, i in rounds[0]], rank)
            for recv_x, recv_idx, _, counts, _, _ in (first, second):
                assert recv_x.size(0) == worst and counts == []
                n = ref.n_rows
                got = recv_x[:n].cpu().view(torch.int16).numpy().view(np.uint16)
                np.testing.assert_array_equal(got, ref.x)
                np.testing.assert_array_equal(recv_idx[:n].cpu().numpy(), ref.topk_idx)
                assert torch.all(recv_idx[n:] == -1).item()
        return True
    assert all(group.run(body))


def test_dispatch_and_combine_pairs_in_a_cuda_graph(seed):
    """Two ``num_worst_tokens`` dispatch + combine pairs per rank (both result slots; the
    rows returned are the received ones, weights and a bias given) captured after a warm-up
    and replayed with three new token sets; each result bit-exact against
    ``normal_combine``."""
    case = CASES["R4-E64-K6"]
    rounds = [draw_inputs(torch, case, seed + k) for k in range(3)]
    weights = draw_weights(torch, case, rounds[0], seed)
    g = torch.Generator().manual_seed(seed % 1000)
    bias = [torch.randn((len(i), case.hidden), generator=g).to(torch.bfloat16)
            for _, i in rounds[0]]
    group = emulated(case.n_ranks)
    R, E, worst = case.n_ranks, case.num_experts, case.n_ranks * case.tokens

    def bits(t):
        return t.cpu().view(torch.int16).numpy().view(np.uint16)

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), num_max_dispatch_tokens_per_rank=case.tokens)
        x, idx = (t.to(DEV) for t in rounds[0][rank])
        w, b = weights[rank].to(DEV), bias[rank].to(DEV)
        ntpr, _, ntpe, itir, _ = buf.get_dispatch_layout(idx, E)
        args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                    num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                    num_worst_tokens=worst)

        def pair():
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **args)
            return buf.combine(recv_x, handle, topk_weights=recv_w, bias=b)
        stream = torch.cuda.current_stream()
        pair()
        pair()                              # both slots' worlds made before the capture
        buf.check()
        graph = torch.cuda.CUDAGraph()
        first, second = group.capture(graph, lambda: (pair(), pair()), stream=stream)
        ids = [i.numpy() for _, i in rounds[0]]
        ws = [q.numpy() for q in weights]
        for inputs in rounds:
            x.copy_(inputs[rank][0].to(DEV))
            graph.replay()
            buf.check()
            toks = [bits(xs) for xs, _ in inputs]
            refs = [normal_dispatch(E, toks, ids, d, ws) for d in range(R)]
            exp_x, exp_w = normal_combine(E, ids, [r.src for r in refs], [r.x for r in refs],
                                          [r.topk_weights for r in refs],
                                          [(bits(q),) for q in bias])[rank]
            for combined_x, combined_w, _ in (first, second):
                np.testing.assert_array_equal(bits(combined_x), exp_x)
                np.testing.assert_array_equal(combined_w.cpu().numpy(), exp_w)
        return True
    assert all(group.run(body))


# -- one process per rank (a process group: ShmemSource.normal_port, ShmemWorld) -----------------
def pe_case(n: int) -> NormalCase:
    """The shape of ``n`` PEs sharing one GPU (8 blocks of 512 threads each, under MPS)."""
    return NormalCase(n_ranks=n, num_experts=8 * n, tokens=128, hidden=2048, top_k=4)


@pytest.mark.parametrize("n", PES)
def test_process_group_normal_mode_one_process_per_rank(n, seed, nvshmem_wheel):
    """``Buffer`` over a gloo process group, one process per rank under ``epgen launch``:
    every rank's ``rank_checks`` (DeepEP's test_intranode properties, with and without
    weights, the combine checks) on its ``ShmemWorld``s."""
    launch_pe_program(__file__, [str(seed)], n, "every normal-mode check passed")


def pe_main(seed: int) -> int:
    """One rank's program: a gloo group from the launcher's directory, a ``Buffer`` over it,
    ``rank_checks`` with weights and with alignment 128, then ``destroy``."""
    rank, n, dist = gloo_group("deepep-normal-gloo-store")
    case = pe_case(n)
    buf = deep_ep.Buffer(dist.group.WORLD, explicitly_destroy=True, n_sms=8, num_threads=512,
                         timeout_ns=5_000_000_000,
                         num_max_dispatch_tokens_per_rank=case.tokens)
    inputs = draw_inputs(torch, case, seed)
    weights = draw_weights(torch, case, inputs, seed)
    dev = [(x.to(DEV), i.to(DEV)) for x, i in inputs]
    for alignment, ws in ((1, [w.to(DEV) for w in weights]), (128, None)):
        rank_checks(torch, buf, rank, case, dev, alignment=alignment, weights=ws)
    buf.check()
    torch.cuda.current_stream().synchronize()
    buf.destroy()
    return pe_passed(dist, rank, "every normal-mode check passed")


if __name__ == "__main__":
    if sys.argv[1:2] != ["pe"]:
        sys.exit("usage: test_deepep_normal_gpu.py pe SEED")
    sys.exit(pe_main(int(sys.argv[2])))
