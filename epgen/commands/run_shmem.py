"""``epgen run --world shmem``: this process's rank of a ``ShmemWorld`` (one process per rank,
started by ``epgen launch`` or torchrun). Every rank draws every rank's inputs from the same
seed (rank 0's, shared through the bootstrap when ``--seed`` is not given), computes the whole
reference and compares its own part (``epgen.round_trips``); with ``--combine`` it combines
its own tokens and compares them too."""

from __future__ import annotations

import argparse
import os
import sys

from . import run_options
from .common import PROG, CommandError


def run(args: argparse.Namespace, cfg, tokens: int) -> int:
    """Run the calls on this rank; a failure that left NVSHMEM up (a dead peer) exits the
    process at once rather than risk the library waiting for that peer at exit."""
    if args.graph or args.trace is not None or args.batched or args.backend != "cuda":
        args.parser.error("--world shmem: not with --graph, --trace, --batched or --backend sim")
    if args.drop_rank is not None and not 0 <= args.drop_rank < cfg.n_ranks:
        args.parser.error(f"argument --drop-rank: must be in [0, n_ranks={cfg.n_ranks})")
    if args.combine:
        run_options.check_combine(args, cfg)
    world = run_options.make_world("shmem", cfg, arch=args.arch, input_scale=args.input_scale,
                                   fused=True if args.fused else None)
    try:
        with world:
            _calls(args, cfg, world, tokens)
    except Exception as e:
        if world.finalized or os.environ.get("EPGEN_TRACEBACK"):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return 0


def _calls(args: argparse.Namespace, cfg, world, tokens: int) -> None:
    """The checked calls on this process's ``world``."""
    import numpy as np

    from epgen import round_trips, routing

    r = world.rank
    mine = None if args.seed is not None else os.urandom(4)
    seed = args.seed if args.seed is not None else int.from_bytes(
        world.bootstrap.broadcast_bytes(mine if r == 0 else None, f"seed-{world.index}"),
        "little")
    rng = np.random.default_rng(seed)
    weights = routing.zipf_weights(cfg.n_experts, rng=rng) if args.routing == "zipf" \
        else None
    print(f"rank {r} of {cfg.n_ranks} (ShmemWorld, GPU {world.device_id}, "
          f"p2p_world_size={cfg.p2p_world_size}), {tokens} tokens/rank, seed {seed}"
          + (", the fused single launch" if world.fused else ""), flush=True)

    def inputs():
        """Every rank's inputs of each call; ``--drop-rank``: this rank leaves before its
        first call, without closing."""
        for index, pair in enumerate(
                round_trips.drawn_inputs(rng, cfg, tokens, args.calls, weights)):
            if args.drop_rank == r:
                print(f"rank {r}: --drop-rank: exiting before call {index} without closing",
                      flush=True)
                os._exit(0)
            yield pair

    def combine(checked) -> list[str]:
        """This rank's combine of the call (every rank draws every rank's weights from the
        same seed and combines its own part) against the end-to-end reference."""
        from epgen import combine_run

        scale = world.input_scale
        w = combine_run.router_weights(rng, cfg, checked.topk_ids)
        out = world.combine(combine_run.expert_outputs(cfg, checked.results[0], scale), w[r])
        return combine_run.differences(
            [out], [combine_run.expected(cfg, checked.tokens, checked.topk_ids, w, scale)[r]])

    calls = round_trips.checked_calls(
        world, inputs(), seed=seed, call=lambda toks, ids: [world.dispatch(toks[r], ids[r])],
        ranks=[r], checks={"combine": combine} if args.combine else None)
    try:
        for checked in calls:
            _print_call(r, checked)
    except round_trips.MismatchError as e:
        _print_call(r, e.checked)
        run_options.print_differences(e.checked.differences())
        raise CommandError(f"rank {r}: results differ from the reference (seed {seed})") \
            from None


def _print_call(r: int, checked) -> None:
    """A call's line (rows, host time, the dispatch's verdict) and its combine's."""
    print(f"rank {r} call {checked.index}: {checked.rows} rows received, "
          f"{checked.seconds * 1e3:.1f} ms (host round trip, barrier included), "
          f"{'matches the reference' if not checked.dispatch else 'MISMATCH'}", flush=True)
    if "combine" in checked.checks:
        print(f"rank {r} call {checked.index} combine: "
              f"{'matches the reference' if not checked.checks['combine'] else 'MISMATCH'}",
              flush=True)
