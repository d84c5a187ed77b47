"""``epgen check-ordering VARIANT``: a variant's protocol under the CPU simulator's
weak-memory mode, and with ``--mutate`` each ordered operation weakened in turn
(``epgen.ordering``)."""

from __future__ import annotations

import argparse

from .common import CommandError, check_output_path, check_preset, parse_sets

HELP = ("run a variant's dispatch (and combine) on the CPU simulator's weak-memory mode "
        "against the reference; --mutate weakens each ordered operation in turn and reports "
        "which ones the protocol needs")

CHECKED_VARIANTS = ("ep/small", "ep/ord_r", "ep/final_layout_prod_reserve", "ep/fused",
                    "ep/shmem_p2p1", "ep/shmem_mixed", "ep/shmem_mixed_ord_r",
                    "ep/shmem_fused", "ep/shmem_mixed_rank_dedup", "ep/rank_mask",
                    "ep/rank_dedup", "ep/rank_dedup_tokens", "ep/rank_dedup_combine_tokens",
                    "combine/small", "combine/fused", "combine/shmem",
                    "combine/shmem_fused", "combine/rank_mask", "combine/rank_dedup_partial",
                    "combine/rank_dedup_partial_fused", "combine/shmem_rank_dedup_partial",
                    "combine/shmem_rank_dedup_partial_fused")
"""The variants ``check-ordering`` takes (``epgen.ordering.runs.checked``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("variant", metavar="VARIANT", choices=CHECKED_VARIANTS,
                   help=f"the variant whose kernels are checked: {', '.join(CHECKED_VARIANTS)}")
    p.add_argument("--preset", metavar="NAME",
                   help="run on this preset (with the variant's flags) instead of the "
                        "variant's small check configuration")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", dest="sets", default=[],
                   help="override one parameter (repeatable)")
    p.add_argument("--seeds", type=int, default=3, metavar="N",
                   help="seeds per run: 0 .. N-1 after --first-seed (default: 3)")
    p.add_argument("--first-seed", type=int, default=0, metavar="S",
                   help="the first seed (default: 0)")
    p.add_argument("--mutate", nargs="+", metavar="OP",
                   help="weaken ordered operations in turn: 'all', or operation ids "
                        "(kernel:role:index:op, or a part of one, as --list prints)")
    p.add_argument("--list", action="store_true",
                   help="list the ordered operations and their mutations, run nothing")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the variant's protocol under the simulator's weak-memory mode for each seed, and
    with ``--mutate`` each weakened ordered operation; table, JSON, exit 1 on a miss."""
    from epgen.ordering import runs, sweep

    spec = runs.checked()[args.variant]
    if args.seeds < 1:
        args.parser.error(f"argument --seeds: must be >= 1, got {args.seeds}")
    if args.preset is not None:
        check_preset(args.parser, args.preset)
    overrides = parse_sets(args.parser, args.sets)
    check_output_path(args.parser, "--json", args.json)
    try:
        cfg = runs.config(spec, args.preset, overrides)
    except ValueError as e:
        args.parser.error(f"{args.variant}: {e}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.list:
        kernels, _ = runs.targets(cfg, spec, args.variant, seeds[0])
        for m in sweep.all_mutations(kernels):
            print(m.name + ("" if m.modelled else "   (not modelled)"))
        return 0
    print(f"check-ordering {args.variant}: weak-memory runs, seeds {seeds[0]}..{seeds[-1]}",
          flush=True)
    try:
        report = sweep.check(args.variant, seeds, args.mutate, cfg,
                             progress=lambda line: print(line, flush=True))
    except ValueError as e:
        if str(e).startswith("--mutate"):
            args.parser.error(f"argument {e}")
        raise
    print()
    print(sweep.table(report))
    if args.json:
        sweep.write_json([report], args.json)
    if not report.baseline_ok:
        raise CommandError(f"{args.variant}: the unmutated kernels fail under the weak "
                           f"model (seeds {seeds})")
    if report.missed:
        raise CommandError(f"{args.variant}: not detected in any of seeds {seeds}: "
                           + ", ".join(r.mutation.name for r in report.missed))
    return 0
