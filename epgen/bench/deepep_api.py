"""``epgen bench --api deepep``: the cost of the DeepEP-compatible API (``epgen.deepep``)
against epgen's own ``EPBuffer`` on the same kernels, in the same run.

Per shape (tokens per rank, which is also ``num_max_dispatch_tokens_per_rank``) and token
format (BF16, and FP8 as DeepEP's ``use_fp8``), every rank of an ``EmulatedGroup`` on one
GPU, each rank called from the main thread on its own stream (as one process per rank
would, without the threads' noise), every rank's sending half enqueued before any rank's
receiving half (``return_recv_hook``; ``receive=False`` and ``receive()`` on ``EPBuffer``):

- **host time** per rank of one ``low_latency_dispatch`` and its hook, and one
  ``low_latency_combine`` (into ``out``) and its hook, against one ``EPBuffer.dispatch``
  and ``receive`` and one ``EPBuffer.combine`` and ``combine_receive`` of the same world
  (the port the DeepEP buffer uses: same kernels, same buffers): ``time.perf_counter``
  around each call, a call and its receive summed, median over the iterations;
- **device time** of a dispatch + combine round trip of every rank: a start event on the
  current stream that every rank stream waits for, an end event after every rank's
  combine, median; both APIs timed this way. One thread enqueues every rank, so this
  figure holds the host's launch time too; the same round trip is timed again with each
  rank's round captured into a CUDA graph of its own (``torch.cuda.graph`` on the rank's
  stream, the ranks' graphs replayed on their streams), which leaves the kernels' time.

The compat layer's goal: no device time added (its outputs are views) and at most 3 us of
host time per call. The first call of each shape is checked with DeepEP's properties
(recv counts against the routing, each row's source, combine's ``calc_diff``) unless
``--no-post-check``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import numpy as np

from . import inputs
from .combine import weights as combine_weights
from .memory import fmt_gb, mem_info, world_memory

#: the formats timed: name -> DeepEP's use_fp8
FORMATS = (("BF16", False), ("FP8", True))
#: DeepEP's combine threshold for BF16 (its test's)
BF16_DIFF = 1e-5


def run(args, plan, out=None) -> tuple[list[dict], list[str]]:
    """One record per shape of ``plan`` and format (module docstring); (records, failures)."""
    out = sys.stdout if out is None else out
    records, failures = [], []
    for T in plan.tokens:
        for name, use_fp8 in FORMATS:
            rec = _time_shape(args, plan, T, name, use_fp8, failures, out)
            if rec is not None:
                records.append(rec)
    return records, failures


def _calc_diff(torch, x, y) -> float:
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _time_shape(args, plan, T: int, name: str, use_fp8: bool, failures: list, out):
    import torch

    import epgen.deepep as deep_ep
    iters = args.iters or 50
    gc.collect()                    # the previous shape's worlds (tens of GB at prefill)
    torch.cuda.empty_cache()
    cfg = plan.config(T)
    R, E, H = cfg.n_ranks, cfg.n_experts, cfg.token_fmt.hid_dim
    toks, ids = inputs.make_input_sets(cfg, T, 1, plan.routing, plan.zipf_s, plan.seed)[0]
    x = [torch.from_numpy(np.ascontiguousarray(t).view(np.int16)).view(torch.bfloat16).cuda()
         for t in toks]
    i = [torch.from_numpy(a.astype(np.int64)).cuda() for a in ids]
    w = [torch.from_numpy(a).cuda() for a in combine_weights(cfg, T, plan.seed)]
    need = _bytes_needed(cfg, T)
    free, _total = mem_info(0)
    if need > 0.9 * free:
        print(f"deepep api, {T} tokens/rank, {name}: skipped (its two worlds need "
              f"{fmt_gb(need)}, {fmt_gb(free)} free: DeepEP's layout reserves "
              f"R * T rows per local expert)", file=out)
        return None
    group = deep_ep.EmulatedGroup(R, n_sms=cfg.n_sms, num_threads=cfg.num_threads)
    bufs = [deep_ep.Buffer(group.rank(r), low_latency_mode=True) for r in range(R)]
    streams = [group.stream(torch, r) for r in range(R)]
    outs = [torch.empty((T, H), dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    main = torch.cuda.current_stream()

    L = cfg.layout.n_local_experts
    # the experts' stand-in outputs: any BF16 rows in the dispatch layout time the same
    ys = [torch.zeros((L, R * T, H), dtype=torch.bfloat16, device="cuda") for _ in range(R)]

    # Every rank's sends are enqueued before any rank's receive, in both APIs: a receive
    # kernel then only waits for kernels already enqueued. The ranks share one GPU, so a
    # host call that synchronises it (a free, say) between one rank's receive and the next
    # rank's send would wait for a receive whose peer's send this thread has not launched.
    def both_halves(send, receive, host):
        """``send(r)`` for every rank, then ``receive(r, sent)`` for every rank, each on the
        rank's stream; a rank's two host times summed into ``host`` (a list, or None)."""
        took, sent = [], []
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                t0 = time.perf_counter()
                sent.append(send(r))
                took.append(time.perf_counter() - t0)
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                t0 = time.perf_counter()
                receive(r, sent[r])
                took[r] += time.perf_counter() - t0
        if host is not None:
            host += took
        return sent

    def deepep_round(host_d=None, host_c=None, received_rows=False):
        got = both_halves(
            lambda r: bufs[r].low_latency_dispatch(x[r], i[r], T, E, use_fp8=use_fp8,
                                                   return_recv_hook=True),
            lambda r, res: res[4](), host_d)
        both_halves(
            lambda r: bufs[r].low_latency_combine(
                got[r][0] if received_rows and not use_fp8 else ys[r], i[r], w[r], got[r][2],
                out=outs[r], return_recv_hook=True),
            lambda r, res: res[2](), host_c)
        return [(recv_x, count, handle) for recv_x, count, handle, _, _ in got]

    deepep_round()                           # makes both result slots' worlds
    got = deepep_round(received_rows=True)
    eps = [bufs[r].epbuffer_of(got[r][2]) for r in range(R)]
    if not args.no_post_check:
        bad = _check(torch, cfg, x, ids, w, got, outs, use_fp8, bufs, streams)
        if bad:
            failures.append(f"deepep api, {T} tokens, {name}: {bad}")
            return None

    def epgen_round(host_d=None, host_c=None):
        disp = both_halves(lambda r: eps[r].dispatch(x[r], i[r], receive=False),
                           lambda r, _: eps[r].receive(), host_d)
        both_halves(lambda r: eps[r].combine(ys[r].view(L * R * T, H), disp[r], w[r],
                                             into=outs[r], receive=False),
                    lambda r, _: eps[r].combine_receive(), host_c)

    def timed(round_fn):
        host_d, host_c, dev = [], [], []
        for it in range(iters + 5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record(main)
            for s in streams:
                s.wait_event(start)
            hd, hc = ([], []) if it >= 5 else (None, None)
            round_fn(hd, hc)
            for s in streams:
                main.wait_stream(s)
            end.record(main)
            torch.cuda.synchronize()
            if it >= 5:
                host_d += hd
                host_c += hc
                dev.append(start.elapsed_time(end) * 1e3)
        us = lambda v: statistics.median(v) * 1e6  # noqa: E731
        return us(host_d), us(host_c), statistics.median(dev)
    d_host, c_host, d_dev = timed(deepep_round)
    e_host, ec_host, e_dev = timed(epgen_round)
    for b in bufs:
        b.check()

    # Device time without the host's launches in it: each rank's round (dispatch, its
    # receive, combine, its receive) captured into a CUDA graph of its own, as the engines'
    # decode loops capture their step; the ranks' graphs replayed on their streams.
    def deepep_rank_round(r):
        _, _, handle, _, hook = bufs[r].low_latency_dispatch(
            x[r], i[r], T, E, use_fp8=use_fp8, return_recv_hook=True)
        hook()
        bufs[r].low_latency_combine(ys[r], i[r], w[r], handle, out=outs[r],
                                    return_recv_hook=True)[2]()

    def epgen_rank_round(r):
        disp = eps[r].dispatch(x[r], i[r], receive=False)
        eps[r].receive()
        eps[r].combine(ys[r].view(L * R * T, H), disp, w[r], into=outs[r], receive=False)
        eps[r].combine_receive()

    def graph_timed(rank_round):
        graphs = []
        for r in range(R):      # nothing runs while capturing: every rank's graph first
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=streams[r]):
                rank_round(r)
            graphs.append(g)
        dev = []
        for it in range(iters + 5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record(main)
            for r, g in enumerate(graphs):
                streams[r].wait_event(start)
                with torch.cuda.stream(streams[r]):
                    g.replay()
            for st in streams:
                main.wait_stream(st)
            end.record(main)
            torch.cuda.synchronize()
            if it >= 5:
                dev.append(start.elapsed_time(end) * 1e3)
        for b in bufs:
            b.check()
        return statistics.median(dev)
    d_graph = graph_timed(deepep_rank_round)
    e_graph = graph_timed(epgen_rank_round)
    rec = {"tokens_per_rank": T, "format": name, "ranks": R,
           "host_us_dispatch_deepep": d_host, "host_us_dispatch_epgen": e_host,
           "host_us_combine_deepep": c_host, "host_us_combine_epgen": ec_host,
           "round_trip_us_deepep": d_dev, "round_trip_us_epgen": e_dev,
           "graph_round_trip_us_deepep": d_graph, "graph_round_trip_us_epgen": e_graph}
    rec["host_us_added_dispatch"] = d_host - e_host
    rec["host_us_added_combine"] = c_host - ec_host
    rec["device_ratio"] = d_dev / e_dev
    rec["graph_device_ratio"] = d_graph / e_graph
    print(f"deepep api, {T} tokens/rank x {R} ranks, {name}: host "
          f"{d_host:.1f} / {e_host:.1f} us per dispatch (deepep / EPBuffer), "
          f"{c_host:.1f} / {ec_host:.1f} us per combine; round trip {d_dev:.1f} / "
          f"{e_dev:.1f} us (x{rec['device_ratio']:.3f}); in CUDA graphs {d_graph:.1f} / "
          f"{e_graph:.1f} us (x{rec['graph_device_ratio']:.3f})", file=out)
    return rec


def _bytes_needed(cfg, T: int) -> int:
    """Device bytes of the two worlds (result slots) of this shape: ``world_memory`` of its
    capacity-strided configuration, twice."""
    from ..deepep.shapes import LowLatencyShape   # epgen.deepep needs torch
    shape = LowLatencyShape(cfg.n_ranks, cfg.n_experts, T, cfg.token_fmt.hid_dim,
                            cfg.token_fmt.top_k, "BF16")
    return 2 * world_memory(shape.config(n_sms=cfg.n_sms, num_threads=cfg.num_threads,
                                         p2p_world_size=cfg.n_ranks,
                                         use_shmem=False))["total"]


def _check(torch, cfg, x, ids, w, got, outs, use_fp8: bool, bufs, streams):
    """DeepEP's properties of the last round (the receive counts against the routing; with
    BF16, whose received rows went back as the experts' outputs, combine's ``calc_diff``
    against ``x * sum of unmasked weights``); the first failure or None."""
    torch.cuda.synchronize()
    for b in bufs:
        b.check()
    R, L = cfg.n_ranks, cfg.layout.n_local_experts
    for r in range(R):
        counts = got[r][1].cpu()
        for e in range(L):
            want = sum(int((a == r * L + e).sum()) for a in ids)
            if int(counts[e]) != want:
                return f"rank {r} expert {r * L + e}: recv_count {int(counts[e])}, routed {want}"
    for r in range(R):
        idx = torch.from_numpy(ids[r].astype(np.int64))
        want = x[r].float().cpu() * w[r].cpu().masked_fill(idx == -1, 0).sum(1, keepdim=True)
        if use_fp8:
            continue
        diff = _calc_diff(torch, want, outs[r].float().cpu())
        if not use_fp8 and diff >= BF16_DIFF:
            return f"rank {r}: combine calc_diff {diff:.3g}"
    return None


__all__ = ["run"]
