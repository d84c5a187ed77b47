"""Where the host time of ``epgen.torch.EPBuffer`` calls goes: ``--calls`` dispatch +
combine calls of one handle holding every rank of an ``EmulatedWorld`` (or, with
``--per-rank``, of one handle per rank, each called on its own stream) under ``cProfile``, the functions printed by their own time; then, without the profiler,
the median host time of the parts of one dispatch of the first handle: the whole call, its
enqueue alone (the prepared launches, with the fork and join of a multi-rank handle), the
fork and join alone, one prepared launch. Needs a GPU and torch.

    PYTHONPATH=. python3 benchmarks/torch_api_profile.py --preset decode --calls 500
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="decode")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--per-rank", action="store_true", help="one handle per rank")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()

    import torch

    from epgen import presets, routing
    from epgen.runtime.world import EmulatedWorld
    from epgen.torch import EPBuffer

    cfg = presets.load_preset(args.preset)
    world = EmulatedWorld(cfg)
    rng = np.random.default_rng(0)
    T, H, K = cfg.max_tokens_per_rank, cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
    R = cfg.n_ranks
    x = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(R)]
    ids = [torch.from_numpy(routing.random_topk(rng, T, cfg.n_experts, K).astype(np.int64))
           .cuda() for _ in range(R)]
    w = [torch.rand(T, K, device="cuda") for _ in range(R)]
    if args.per_rank:
        eps = [EPBuffer(world, rank=r) for r in range(R)]
        streams = [torch.cuda.Stream() for _ in range(R)]

        def call() -> None:
            outs = [ep.dispatch(x[r], ids[r], w[r], stream=streams[r])
                    for r, ep in enumerate(eps)]
            for r, (ep, o) in enumerate(zip(eps, outs)):
                ep.combine(o.tokens, o, stream=streams[r])
    else:
        eps = [EPBuffer(world)]

        def call() -> None:
            outs = eps[0].dispatch(x, ids, w)
            eps[0].combine([o.tokens for o in outs], outs)

    def calls(n: int) -> None:
        for _ in range(n):
            call()
            torch.cuda.synchronize()

    def check() -> None:
        for ep in eps:
            ep.check("combine")

    calls(5)
    check()
    prof = cProfile.Profile()
    prof.enable()
    calls(args.calls)
    prof.disable()
    check()
    print(f"{args.calls} dispatch + combine calls of {R} ranks, "
          f"{'one handle per rank' if args.per_rank else 'one handle'} "
          f"(torch.cuda.synchronize after each call included)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    if not args.per_rank:      # a lone one-rank handle's kernels would wait for the others
        _sections(torch, eps[0], x, ids, w)


def _median_us(fn, n: int = 300) -> float:
    import torch
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _sections(torch, ep, x, ids, w) -> None:
    """Host-time medians of the parts of a dispatch call of ``ep``, a handle of every rank
    (module docstring)."""
    n = len(ep.ranks)
    s = torch.cuda.current_stream().cuda_stream
    full = _median_us(lambda: ep.dispatch(x, ids, w))
    enq = _median_us(lambda: ep._enqueue(ep._dispatch, s, ep._check_all))
    lanes = _median_us(lambda: (ep.lanes.fork(s), ep.lanes.join(s)))
    check = ep._check_all or ep._dispatch[0][1][0]
    one = _median_us(lambda: check.launch(s))
    print(f"per dispatch call of {n} ranks, host us (per rank): whole {full:.1f} "
          f"({full / n:.1f}); enqueue {enq:.1f} ({enq / n:.1f}); fork + join {lanes:.1f} "
          f"({lanes / n:.1f}); one id-check launch ({check.kernel.name}) {one:.1f}; "
          f"launches per rank {len(ep._dispatch)}"
          f"{' + one id check of every rank' if ep._check_all else ''}")

if __name__ == "__main__":
    main()
