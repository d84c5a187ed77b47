"""``epgen bench --api torch``: the cost of the device-side API (``epgen.torch.EPBuffer``) on
an ``EmulatedWorld``, after the usual figures of the same run.

Per shape (tokens per rank) and kernel form (the staged kernels, ``dispatch_async`` +
``dispatch_wait`` and ``combine_async`` + ``combine_wait``, then the fused single launches
``ep_dispatch`` and ``ep_combine``: one launch fewer per call), with the dispatch outputs fed
back as the expert outputs (no expert work):

- **host time** of one ``ep.dispatch`` and one ``ep.combine`` call, enqueue only, per rank:
  each call timed on its own with ``time.perf_counter`` behind an idle stream (the stream is
  synchronised between iterations, outside the timed span), median over the iterations;
- the same host times with **one handle per rank** (``EPBuffer(world, rank=r)``, each rank
  called on its own stream), as an engine running one process per GPU pays them: no fork
  and join of rank streams;
- **round trip** (dispatch + combine) on the device: CUDA events around the calls on the
  caller's stream, median, as stream launches and as the replay of a ``torch.cuda.graph``
  capture of the same calls, and their ratio.

The first call of each shape is checked against ``epgen.reference`` (dispatch, and the
combine of every source, or of the first and the last above 512 tokens per rank) unless
``--no-post-check``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import numpy as np

from .. import reference
from ..runtime.world import EmulatedWorld
from . import inputs
from .memory import trim_memory_pool
from .combine import PREFILL_CHECK_TOKENS
from .combine import weights as combine_weights
from ..torch import EPBuffer


def _bits_to_torch(torch, bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(
        torch.bfloat16).cuda()


def _check(torch, cfg, ep, toks, ids, x, i, w):
    """One dispatch + combine checked against the reference; the first difference or None."""
    outs = ep.dispatch(x, i, w)
    ep.check()
    got = [o.to_reference(cfg) for o in outs]
    diffs = [d for want, g in zip(reference.dispatch(cfg, toks, ids), got)
             for d in reference.compare(cfg, want, g)]
    if diffs:
        return f"dispatch: {diffs[0]}"
    ys = [o.tokens for o in outs]
    host_y = [o.out_tokens for o in got]
    y = ep.combine(ys, outs)
    ep.check("combine")
    weights = [t.cpu().numpy() for t in w]
    only = [0, len(ids) - 1] if len(ids[0]) > PREFILL_CHECK_TOKENS else None
    want = reference.combine(cfg, got, host_y, weights, n_tokens=[len(a) for a in ids],
                             sources=only)
    for r, (g, e) in enumerate(zip(y, want)):
        if e is None:
            continue
        g = g.view(torch.int16).cpu().numpy().view(np.uint16)
        if not np.array_equal(g, e):
            return f"combine rank {r}: {np.count_nonzero(g != e)} elements differ"
    return None


def _one_rank_handles(torch, world, x, i, w, iters: int) -> tuple[float, float]:
    """Median host us of one dispatch and one combine call of a one-rank handle, every
    rank's handle called on its own stream (a rank's receive kernel waits for the others')."""
    eps = [EPBuffer(world, rank=rk.rank) for rk in world.ranks]
    streams = [torch.cuda.Stream() for _ in eps]
    host_d, host_c = [], []
    for it in range(iters + 5):
        outs, td, tc = [], 0.0, 0.0
        for ep, s, xr, ir, wr in zip(eps, streams, x, i, w):
            t0 = time.perf_counter()
            outs.append(ep.dispatch(xr, ir, wr, stream=s))
            td += time.perf_counter() - t0
        for ep, s, o in zip(eps, streams, outs):
            t0 = time.perf_counter()
            ep.combine(o.tokens, o, stream=s)
            tc += time.perf_counter() - t0
        torch.cuda.synchronize()
        if it >= 5:
            host_d.append(td / len(eps) * 1e6)
            host_c.append(tc / len(eps) * 1e6)
    for ep in eps:
        ep.check("combine")
    return statistics.median(host_d), statistics.median(host_c)


#: the kernel forms timed, by the name a record carries: ``EmulatedWorld``'s ``fused``
KERNEL_FORMS = (("staged", False), ("fused", True))


def run(args, plan, out=None) -> tuple[list[dict], list[str]]:
    """Time every shape of ``plan`` and kernel form (``KERNEL_FORMS``) on the shape's first
    input set, its router weights and its receive-block capacity (the sizing of the figures
    before it); returns (one record per shape and form, failures)."""
    out = sys.stdout if out is None else out
    records, failures = [], []
    for T in plan.tokens:
        for form, fused in KERNEL_FORMS:
            rec = _time_form(args, plan, T, form, fused, failures, out)
            if rec is not None:
                records.append(rec)
    return records, failures


def _time_form(args, plan, T: int, form: str, fused: bool, failures: list, out):
    """One shape's record for one kernel form (module docstring), None when its check
    failed (the failure appended to ``failures``)."""
    import torch
    iters = args.iters or 50
    # a world per shape and form, freed after it (the prefill world is tens of GB)
    gc.collect()
    torch.cuda.empty_cache()
    sets = inputs.make_input_sets(plan.config(T), T, 1, plan.routing, plan.zipf_s,
                                  plan.seed)
    _need, cap = inputs.block_capacity(plan.block_capacity, sets, plan.base.n_experts, T)
    big = plan.config(T, block_capacity=cap)
    world = EmulatedWorld(big, fused=fused)
    ep = EPBuffer(world)
    R = big.n_ranks
    toks, ids = sets[0]
    x = [_bits_to_torch(torch, t) for t in toks]
    i = [torch.from_numpy(a.astype(np.int64)).cuda() for a in ids]
    w = [torch.from_numpy(a).cuda() for a in combine_weights(big, T, plan.seed)]
    if not args.no_post_check:
        bad = _check(torch, big, ep, toks, ids, x, i, w)
        if bad:
            failures.append(f"torch api, {T} tokens, {form}: {bad}")
            return None
    stream = torch.cuda.current_stream()

    def call():
        outs = ep.dispatch(x, i, w)
        return outs, ep.combine([o.tokens for o in outs], outs)
    host_d, host_c, dev = [], [], []
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        outs = ep.dispatch(x, i, w)
        t1 = time.perf_counter()
        ep.combine([o.tokens for o in outs], outs)
        t2 = time.perf_counter()
        end.record(stream)
        torch.cuda.synchronize()
        host_d.append((t1 - t0) / R * 1e6)
        host_c.append((t2 - t1) / R * 1e6)
        dev.append(start.elapsed_time(end) * 1e3)
    ep.check("combine")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replays = []
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        torch.cuda.synchronize()
        replays.append(start.elapsed_time(end) * 1e3)
    ep.check("combine")
    one_d, one_c = _one_rank_handles(torch, world, x, i, w, iters)
    rec = {"tokens_per_rank": T, "kernels": form, "ranks": R, "recv_block_capacity": cap,
           "host_us_dispatch_per_rank": statistics.median(host_d),
           "host_us_combine_per_rank": statistics.median(host_c),
           "host_us_dispatch_one_rank_handle": one_d,
           "host_us_combine_one_rank_handle": one_c,
           "round_trip_us_stream": statistics.median(dev),
           "round_trip_us_graph": statistics.median(replays)}
    rec["stream_over_graph"] = rec["round_trip_us_stream"] / rec["round_trip_us_graph"]
    print(f"torch api, {T} tokens/rank x {R} ranks, {form} kernels: host "
          f"{rec['host_us_dispatch_per_rank']:.1f} us/dispatch/rank, {rec['host_us_combine_per_rank']:.1f} us/combine/rank; "
          f"one handle per rank: {one_d:.1f} us/dispatch, {one_c:.1f} us/combine; "
          f"dispatch+combine {rec['round_trip_us_stream']:.1f} us on the stream, "
          f"{rec['round_trip_us_graph']:.1f} us as a graph replay "
          f"(x{rec['stream_over_graph']:.2f})", file=out)
    device = world.device
    del graph, ep, world
    gc.collect()
    device.sync()
    trim_memory_pool(device, lambda msg: None)
    return rec


__all__ = ["run"]
