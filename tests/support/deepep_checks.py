"""The properties DeepEP's low-latency test checks, written for ``epgen.deepep.Buffer`` and
run per rank (on the simulator through ``EmulatedGroup(backend="sim").run``, on a GPU in an
``EmulatedGroup`` or one process per rank).

Inputs (``rank_inputs``), as DeepEP's test makes them: rank ``r``'s tokens are ``r - 128``
in every column but the last 128, which hold the token index (both exact in BF16 and e4m3);
top-k ids from ``topk`` of random scores, int64, with random slots masked to ``-1``; weights
``|randn|``. All ranks' inputs come from one seed, so every rank knows every rank's ids (the
test's all-gather).

Checked after a dispatch, per local expert ``e`` (``check_dispatch``): ``recv_count[e]``
equals the ``(token, slot)`` pairs of every rank routed to it, equals the sum of the counts
in ``layout_range[e]`` and the accumulated statistics; each valid row is constant but for
its last 128 columns, which equal its ``src_info`` (exactly, or by ``calc_diff`` with
power-of-two scales, as DeepEP's test); each source rank's block ``[begin, begin + count)``
of ``layout_range`` holds exactly that rank's rows, as many as it routed there. After a
combine (``check_combine``): no NaN, and ``calc_diff`` against ``x * sum of unmasked
weights`` below DeepEP's thresholds (``1e-5`` BF16, ``9e-4`` FP8; not checked with
``round_scale``, as in DeepEP's test).

``calc_diff`` and ``cast_back`` are ours, written from DeepEP's stated formulas: ``1 -
2 sum(xy) / sum(x^2 + y^2)`` of ``x + 1`` and ``y + 1`` in float64; e4m3 values times their
group's scale (float32, or UE8M0 bytes as ``2^(b - 127)``).
"""

from __future__ import annotations

import attrs
import numpy as np

RANK_OFFSET = 128
#: the format variants DeepEP offers: name -> (use_fp8, round_scale, use_ue8m0)
VARIANTS = {"bf16": (False, False, False), "fp8": (True, False, False),
            "fp8_round_scale": (True, True, False), "fp8_ue8m0": (True, True, True)}
#: (return_recv_hook, zero_copy, dispatches before the combine)
ROUNDS = ((False, False, 1), (True, True, 2))
#: DeepEP's combine thresholds
BF16_DIFF, FP8_DIFF = 1e-5, 9e-4


def calc_diff(torch, x, y) -> float:
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def cast_back(torch, x_fp8, scales):
    """``[n, H]`` e4m3 rows and their per-128 scales ``[n, H/128]`` float32 (or packed
    UE8M0 ``[n, H/512]`` int32) as BF16."""
    n, H = x_fp8.shape
    # a fresh row-major copy: with one pack per row ([n, 1]) ``contiguous()`` keeps the
    # column-major stride, which ``view(uint8)`` refuses
    s = torch.empty(scales.shape, dtype=scales.dtype, device=scales.device).copy_(scales)
    if s.dtype == torch.int32:
        exps = s.view(torch.uint8).to(torch.int32)
        s = (exps << 23).view(torch.float32)
    vals = x_fp8.to(torch.float32).view(n, H // 128, 128) * s.view(n, H // 128, 1)
    return vals.view(n, H).to(torch.bfloat16)


@attrs.define
class LLCase:
    """One low-latency test configuration (every rank's)."""

    n_ranks: int
    num_experts: int
    tokens: int
    hidden: int
    top_k: int
    masked: int = 3


def rank_inputs(torch, case: LLCase, seed: int) -> list:
    """Every rank's ``(x, topk_idx, topk_weights)`` as CPU tensors (module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    T, H, E, K = case.tokens, case.hidden, case.num_experts, case.top_k
    for r in range(case.n_ranks):
        x = torch.full((T, H), float(r - RANK_OFFSET), dtype=torch.bfloat16)
        x[:, -128:] = torch.arange(T, dtype=torch.float32).view(-1, 1).to(torch.bfloat16)
        scores = np.abs(rng.standard_normal((T, E))) + 1
        idx = torch.from_numpy(np.argsort(-scores, axis=1)[:, :K].copy()).to(torch.int64)
        for _ in range(case.masked):
            idx[int(rng.integers(0, T)), int(rng.integers(0, K))] = -1
        w = torch.from_numpy(np.abs(rng.standard_normal((T, K))).astype(np.float32))
        out.append((x, idx, w))
    return out


def check_dispatch(torch, case: LLCase, rank: int, all_idx, recv_x, recv_count, handle,
                   stats, *, use_fp8: bool, round_scale: bool) -> None:
    """DeepEP's per-expert dispatch properties (module docstring) for rank ``rank``;
    ``all_idx``: every rank's ids (CPU)."""
    L = case.num_experts // case.n_ranks
    T = case.tokens
    if use_fp8:
        x8, scales = recv_x
        recv = [cast_back(torch, x8[i].cpu(), scales[i].cpu()) for i in range(L)]
    else:
        recv = [recv_x[i].cpu() for i in range(L)]
    counts = recv_count.cpu()
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    for i in range(L):
        e = rank * L + i
        n = int(counts[i])
        routed = [int((ids == e).sum()) for ids in all_idx]
        where = f"rank {rank} expert {e}"
        assert n == sum(routed), f"{where}: recv_count {n}, routed {sum(routed)}"
        assert n == int((layout_range[i] & 0xFFFFFFFF).sum()), f"{where}: layout_range"
        if stats is not None:
            assert int(stats.cpu()[i]) == n, f"{where}: statistics {int(stats.cpu()[i])}"
        if n == 0:
            continue
        rows, info = recv[i][:n].float(), src_info[i][:n]
        amin, amax = rows[:, :-128].amin(dim=-1), rows[:, :-128].amax(dim=-1)
        assert torch.equal(amin, amax), f"{where}: a row is not constant"
        if round_scale:
            assert calc_diff(torch, rows[:, -1], info.float()) < 0.007, f"{where}: src_info"
        else:
            assert torch.equal(rows[:, -128:], info.float().view(-1, 1).expand(-1, 128)), \
                f"{where}: the payload's token index differs from src_info"
        assert bool(((info >= 0) & (info < T)).all()), f"{where}: src_info out of range"
        for j in range(case.n_ranks):
            begin = int(layout_range[i, j] >> 32)
            count = int(layout_range[i, j] & 0xFFFFFFFF)
            assert count == routed[j], f"{where} source {j}: count {count}, routed {routed[j]}"
            if not round_scale:
                assert int((amin == j - RANK_OFFSET).sum()) == routed[j], \
                    f"{where}: rows of source {j}"
                block = rows[begin:begin + count, :-128]
                assert bool((block == j - RANK_OFFSET).all()), \
                    f"{where}: block [{begin}, {begin + count}) is not source {j}'s"


def gemm_input(torch, recv_x, use_fp8: bool, hidden: int):
    """The experts' stand-in outputs: the received rows as BF16 (dequantised with FP8), in
    the dispatch layout, as DeepEP's test feeds its combine."""
    if not use_fp8:
        return recv_x.clone()
    x8, scales = recv_x
    L, RT, H = x8.shape
    s = torch.empty(scales.shape, dtype=scales.dtype, device=scales.device).copy_(scales)
    return cast_back(torch, x8.reshape(L * RT, H), s.reshape(L * RT, -1)).view(L, RT, H)


def check_combine(torch, rank: int, x, idx, w, combined, *, use_fp8: bool,
                  round_scale: bool) -> None:
    """No NaN; ``calc_diff`` against ``x * sum of unmasked weights`` (module docstring)."""
    got = combined.cpu()
    assert tuple(got.shape) == tuple(x.shape), f"rank {rank}: combined shape {got.shape}"
    if got.numel() == 0:
        return
    assert not bool(torch.isnan(got.float()).any()), f"rank {rank}: NaN in the combine"
    want = x.float() * w.masked_fill(idx == -1, 0).sum(dim=1).view(-1, 1)
    diff = calc_diff(torch, want, got.float())
    if not round_scale:
        bound = FP8_DIFF if use_fp8 else BF16_DIFF
        assert diff < bound, f"rank {rank}: calc_diff {diff:.3g} >= {bound}"


def rank_rounds(torch, buf, rank: int, case: LLCase, inputs, variant: str, rounds=ROUNDS,
                device=None, combine_fp8: bool = False) -> None:
    """Rank ``rank``'s ``rounds`` on ``buf`` (``inputs``: every rank's, on the CPU; moved to
    ``device`` for the calls): dispatch(es) with the statistics, the hook or
    ``async_finish``, then a combine into ``out`` (zero-copy when the round says), each
    result checked (module docstring). ``combine_fp8``: every combine is epgen's FP8 combine
    (``use_fp8=True`` on ``low_latency_combine``), checked with the FP8 bound."""
    use_fp8, round_scale, use_ue8m0 = VARIANTS[variant]
    all_idx = [i for _, i, _ in inputs]
    T, H, E, L = case.tokens, case.hidden, case.num_experts, case.num_experts // case.n_ranks
    x, idx, w = (t.to(device) if device is not None else t for t in inputs[rank])
    for hook, zero_copy, dispatches in rounds:
        for _ in range(dispatches):
            stats = torch.zeros(L, dtype=torch.int32, device=device)
            recv_x, count, handle, event, recv_hook = buf.low_latency_dispatch(
                x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook,
                return_recv_hook=hook)
            assert (recv_hook is not None) == hook
            recv_hook() if hook else event.current_stream_wait()
        buf.check()         # an expired wait or a bad id named as such, not as wrong rows
        check_dispatch(torch, case, rank, all_idx, recv_x, count, handle, stats,
                       use_fp8=use_fp8, round_scale=round_scale)
        y = gemm_input(torch, recv_x, use_fp8, H)
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
        out = torch.empty((T, H), dtype=torch.bfloat16, device=device)
        combined, event, recv_hook = buf.low_latency_combine(
            y, idx, w, handle, zero_copy=zero_copy, async_finish=not hook,
            return_recv_hook=hook, out=out, use_fp8=combine_fp8)
        recv_hook() if hook else event.current_stream_wait()
        buf.check()
        assert combined is out
        check_combine(torch, rank, inputs[rank][0], inputs[rank][1], inputs[rank][2],
                      combined, use_fp8=use_fp8 or combine_fp8, round_scale=round_scale)


#: API -> the rank that fails when it first calls it (DeepEP's test: 1, 3, 5 of 8+ ranks)
FAILS = {"dispatch": 1, "combine": 3, "clean": 4}


def query(torch, buf, n: int) -> set:
    """The ranks ``buf``'s rank masks (``low_latency_query_mask_buffer``)."""
    status = torch.zeros(n, dtype=torch.int32, device="cuda" if buf.on_cuda else "cpu")
    buf.low_latency_query_mask_buffer(status)
    return set(status.cpu().nonzero().view(-1).tolist())


def check_dispatch_masked(case, rank, all_idx, recv_x, count, handle, masked):
    """DeepEP's dispatch checks with its shrink rule: counts from the unmasked sources only;
    each unmasked source's block holds its rows."""
    L = case.num_experts // case.n_ranks
    layout = handle[1].cpu()
    for i in range(L):
        e = rank * L + i
        routed = [0 if j in masked else int((ids == e).sum()) for j, ids in enumerate(all_idx)]
        n = int(count[i])
        assert n == sum(routed), f"rank {rank} expert {e}: {n} rows, {sum(routed)} routed"
        rows = recv_x[i][:n].float().cpu()
        for j in range(case.n_ranks):
            begin, cnt = int(layout[i, j] >> 32), int(layout[i, j] & 0xFFFFFFFF)
            if j in masked:
                assert cnt == 0, f"rank {rank} expert {e}: {cnt} rows of masked rank {j}"
                continue
            assert cnt == routed[j]
            assert bool((rows[begin:begin + cnt, :-128] == j - RANK_OFFSET).all())


def shrink_rounds(torch, buf, rank: int, case, inputs, fails: dict, fail, rounds: int = 3,
                  device=None):
    """DeepEP's shrink test for rank ``rank`` on ``buf`` (``enable_shrink``): ``rounds`` of
    dispatch, combine and clean-up; the rank of ``fails[api]`` fails when it first reaches
    ``api`` (``fail(api)``: on the simulator it stops calling, on a GPU the process dies;
    returns None then). After each call the rank's mask is exactly the ranks failed so far,
    its dispatch counts only unmasked sources and its combine weighs nothing on masked
    ranks' experts. Returns the final mask."""
    T, E, H, n = case.tokens, case.num_experts, case.hidden, case.n_ranks
    L = E // n
    all_idx = [i for _, i, _ in inputs]
    x, idx, w = (t if device is None else t.to(device) for t in inputs[rank])
    expected: set = set()

    def failing(api):
        if rank in expected or rank == fails.get(api):
            fail(api)
            return True
        if api in fails:
            expected.add(fails[api])
        return False
    for _ in range(rounds):
        if failing("dispatch"):
            return None
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        masked = query(torch, buf, n)
        assert masked == expected, f"rank {rank} after dispatch: {masked}"
        check_dispatch_masked(case, rank, all_idx, recv_x, count.cpu(), handle, masked)
        if failing("combine"):
            return None
        combined, _, _ = buf.low_latency_combine(gemm_input(torch, recv_x, False, H), idx, w,
                                                 handle)
        masked = query(torch, buf, n)
        assert masked == expected, f"rank {rank} after combine: {masked}"
        owner = idx.cpu().clamp(min=0) // L
        dead = torch.tensor([q in masked for q in range(n)])[owner]
        cidx = idx.cpu()
        check_combine(torch, rank, inputs[rank][0], cidx.masked_fill(dead & (cidx >= 0), -1),
                      inputs[rank][2], combined, use_fp8=False, round_scale=False)
        if failing("clean"):
            return None
        buf.clean_low_latency_buffer(T, H, E)
        assert query(torch, buf, n) == expected
    return query(torch, buf, n)
