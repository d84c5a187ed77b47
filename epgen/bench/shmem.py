"""``epgen bench --world shmem``: each process of ``epgen launch`` (or torchrun) times its
own rank's round trip on a ``ShmemWorld``.

Every rank draws the same inputs (``--seed``), checks its first call against its part of
``epgen.reference.dispatch`` (unless ``--no-post-check``), then times ``--iters`` round trips
after ``--warmup``: device time from an event before its dispatch_async to one after its
dispatch_wait, on its own stream; between calls the host barrier that the world needs
(outside the timed span). It prints one line per shape: its rank, the median and minimum
round trip, and the bytes it sent per second (its messages to other ranks, payload and
metadata as the layout sizes them). No NCCL baseline and no gate here.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np

from backends import cuda

from .. import reference, routing
from ..runtime.shmem_world import ShmemWorld


def sent_bytes(cfg, topk_ids, rank: int) -> int:
    """Bytes rank ``rank`` sends to other ranks: one message per (token, distinct
    destination rank other than its own)."""
    L = cfg.layout.n_local_experts
    ids = np.asarray(topk_ids)
    if ids.size == 0:
        return 0
    dest = ids // L
    n = sum(len(set(row.tolist()) - {rank}) for row in dest)
    return n * cfg.layout.msg_bytes


def run(args, cfg, tokens: list[int], out=None) -> list[str]:
    """Time every shape in ``tokens`` (tokens per rank); the failures (empty: all fine)."""
    out = sys.stdout if out is None else out
    iters = args.iters or 50
    warmup = 5 if args.warmup is None else args.warmup
    failures = []
    # one world for every shape: NVSHMEM is initialised once per process
    big = cfg.replace(max_tokens_per_rank=max([*tokens, cfg.max_tokens_per_rank]))
    with ShmemWorld(big) as world:
        r = world.rank
        rk = world.ranks[0]
        for T in tokens:
            rng = np.random.default_rng(args.seed)
            toks, ids = routing.routing(rng, big, T)
            got = world.dispatch(toks[r], ids[r])
            if not args.no_post_check:
                diffs = reference.compare(big, reference.dispatch(big, toks, ids)[r], got)
                if diffs:       # the others cannot go on without this rank: stop here
                    world.mark_failed()
                    failures.append(f"rank {r}, {T} tokens: results differ from the "
                                    f"reference: {diffs[0]}")
                    break
            times = []
            for i in range(warmup + iters):
                world.load_inputs(toks[r], ids[r])
                start = cuda.record(rk.stream)
                world.enqueue_round_trip()
                end = cuda.record(rk.stream)
                world.check()
                world.barrier("bench")
                if i >= warmup:
                    times.append(cuda.elapsed_ms(start, end))
            med = statistics.median(times)
            gbs = sent_bytes(big, ids[r], r) / (med * 1e-3) / 1e9
            print(f"rank {r}: {T} tokens/rank, {big.n_ranks} PEs (p2p_world_size="
                  f"{big.p2p_world_size}): round trip median {med * 1e3:.1f} us, min "
                  f"{min(times) * 1e3:.1f} us over {iters} calls, {gbs:.2f} GB/s sent",
                  file=out, flush=True)
    return failures
