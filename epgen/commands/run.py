"""``epgen run``: a configuration's kernels on a world (emulated ranks on one GPU, one GPU per
rank with ``--world p2p``, the CPU simulator with ``--backend sim``), every call checked
against the reference (``epgen.round_trips``); ``--world shmem`` hands over to
``commands.run_shmem``."""

from __future__ import annotations

import argparse
import os
import sys

from . import run_options, run_shmem
from .common import CommandError, config_from_args, tuned

HELP = ("run the kernels on the GPU (emulated ranks, or one GPU per rank with --world p2p), "
        "or on the CPU with --backend sim, and check them against the reference")

add_arguments = run_options.add_arguments


def run(args: argparse.Namespace) -> int:
    """Run the configuration's kernels on the world the options name and compare each call
    with the numpy reference; exit 1 at the first call that differs."""
    import numpy as np

    from epgen import round_trips, routing
    from epgen.runtime import trace as runtime_trace

    cfg, _ = config_from_args(args)
    devices = run_options.devices_from_args(args, cfg.n_ranks)
    tokens = run_options.checked_run_args(args, cfg)
    if args.world == "shmem":
        return run_shmem.run(args, cfg, tokens)
    if args.drop_rank is not None:
        args.parser.error("argument --drop-rank: only with --world shmem")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    weights = routing.zipf_weights(cfg.n_experts, rng=rng) if args.routing == "zipf" else None
    tracing = args.trace is not None
    if tracing:
        cfg = tuned(args, cfg, trace=True)
    if args.combine:
        run_options.check_combine(args, cfg)
        if args.graph and not hasattr(run_options.world_class(args.world), "capture_moe"):
            args.parser.error(f"argument --graph: with --combine, one graph of dispatch and "
                              f"combine (capture_moe), which --world {args.world} has not")
    world = run_options.make_world(args.world, cfg, arch=args.arch, devices=devices,
                                   input_scale=args.input_scale,
                                   fused=True if args.fused else None, batched=args.batched,
                                   backend=args.backend,
                                   sim_seed=seed if args.backend == "sim" else None)
    where = ("emulated ranks" if args.world == "emulated" else
             f"ranks on GPUs {','.join(map(str, world.devices))} (P2P)")
    print(f"{cfg.n_ranks} {where}, {tokens} tokens/rank, seed {seed}"
          + (", the fused single launch" if world.fused else "")
          + (", every rank in one launch" if world.batched else "")
          + (", each call a CUDA-graph replay" if args.graph else "")
          + (", dispatch + combine" if args.combine else "")
          + (", simulated on the CPU (backends.sim)" if args.backend == "sim" else ""))
    moe = MoeCalls(world, rng, args.graph) if args.combine else None
    calls = round_trips.checked_calls(
        world, round_trips.drawn_inputs(rng, cfg, tokens, args.calls, weights), seed=seed,
        call=moe.call if moe else None, replayed=args.graph and not moe,
        checks={"combine": moe.differences} if moe else None)
    timelines = []
    if tracing:
        runtime_trace.arm(world)
    try:
        for checked in calls:
            _print_call(checked)
            if tracing:
                timelines.append(runtime_trace.read(world))
                runtime_trace.arm(world)
    except round_trips.MismatchError as e:
        _print_call(e.checked)
        run_options.print_differences(e.checked.differences())
        raise CommandError(f"results differ from the reference (seed {seed})") from None
    if timelines:
        _print_timelines(args, cfg, timelines)
    return 0


def _print_call(checked) -> None:
    """A call's line (rows, host time, the dispatch's verdict) and its combine's."""
    print(f"call {checked.index}: {checked.rows} rows received, {checked.seconds * 1e3:.1f} ms "
          f"(host round trip), "
          f"{'matches the reference' if not checked.dispatch else 'MISMATCH'}")
    if "combine" in checked.checks:
        print(f"  combine: "
              f"{'matches the reference' if not checked.checks['combine'] else 'MISMATCH'}")


class MoeCalls:
    """``run --combine``'s calls: each a dispatch, the per-expert transform of every rank's
    rows (``epgen.combine_run``), then the combine with random router weights drawn from
    ``rng``. With ``graph``, one replay of ``world.capture_moe()`` per call (captured on the
    first), the expert outputs loaded before it: the transform of the reference dispatch's
    rows."""

    def __init__(self, world, rng, graph: bool):
        self.world, self.rng, self.graph = world, rng, graph
        self._captured = None
        self._last = None           # (expert outputs, router weights, combine results)

    def call(self, tokens, topk_ids) -> list:
        """One dispatch + combine; returns the dispatch results."""
        from epgen import combine_run, reference

        world, cfg, scale = self.world, self.world.cfg, self.world.input_scale
        w = combine_run.router_weights(self.rng, cfg, topk_ids)
        if not self.graph:
            got = world.dispatch(tokens, topk_ids)
            ys = [combine_run.expert_outputs(cfg, r, scale) for r in got]
            self._last = (ys, w, world.combine(ys, w))
            return got
        ys = [combine_run.expert_outputs(cfg, r, scale)
              for r in reference.dispatch(cfg, tokens, topk_ids, input_scale=scale)]
        world.load_inputs(tokens, topk_ids)
        if self._captured is None:
            self._captured = world.capture_moe()
        self._captured.combiner.load(ys, w)
        self._captured.launch()
        world.check("graph replay")
        self._last = (ys, w, self._captured.combiner.finish())
        return world.results()

    def differences(self, checked) -> list[str]:
        """The last call's combine against the reference: end to end
        (``combine_run.expected``); with ``graph`` (expert outputs computed before the replay)
        ``reference.combine`` of the world's own dispatch results and those outputs."""
        from epgen import combine_run, reference

        cfg = self.world.cfg
        ys, w, out = self._last
        want = reference.combine(cfg, checked.results, ys, w) if self.graph else \
            combine_run.expected(cfg, checked.tokens, checked.topk_ids, w,
                                 self.world.input_scale)
        return combine_run.differences(out, want)


def _print_timelines(args: argparse.Namespace, cfg, timelines: list) -> None:
    """``--trace``: the median timeline of the calls, and with FILE.json every call's events
    as a Chrome trace-event file."""
    from epgen.runtime import trace as runtime_trace

    sim = args.backend == "sim"
    unit = "simulator clock ticks / 1000" if sim else "us"
    print(runtime_trace.format_rows(
        runtime_trace.median_rows(timelines),
        f"trace events, median of {len(timelines)} calls ({unit} after each call's first "
        f"event; blocks: rank x block pairs there)"))
    dropped = sum(sum(tl.dropped.values()) for tl in timelines)
    if dropped:
        print(f"trace: {dropped} events did not fit their rings (raise "
              f"--tune trace_ring_capacity={cfg.tuning.trace_ring_capacity})", file=sys.stderr)
    if args.trace:
        from epgen.runtime import trace_export

        try:
            trace_export.write(args.trace, timelines,
                               clock="sim: one tick per %globaltimer read" if sim else
                               "globaltimer")
        except OSError as e:
            raise CommandError(f"cannot write {args.trace}: {e.strerror or e}") from e
        print(f"trace: {len(timelines)} calls written to {args.trace} (Chrome trace-event "
              f"JSON; open it in ui.perfetto.dev)")
