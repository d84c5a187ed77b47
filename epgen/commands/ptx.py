"""``epgen ptx``: the PTX (or IR text) of a configuration's kernels or of a registered
variant; the main job."""

from __future__ import annotations

import argparse

from .common import (PROG, add_config, check_output_path, check_variant, config_from_args,
                     tuned, variant_text, write_output)

HELP = ("print the PTX (or IR text) of a preset's dispatch kernels (dispatch_async, "
        "dispatch_wait, the fused ep_dispatch); the main job")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p)
    p.add_argument("--variant", metavar="NAME",
                   help=f"emit a registered variant instead of a preset (list them with "
                        f"'{PROG} variants'); not with --preset/--set")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--ir", action="store_true", help="print the IR text instead of PTX")
    p.add_argument("--no-link", action="store_true",
                   help="kernels that call NVSHMEM (use_shmem): print our code only, NVSHMEM's "
                        "functions left .extern .func declarations, instead of the PTX with "
                        "NVSHMEM's device bitcode linked in (the shmem extra); --variant "
                        "always prints the unlinked golden PTX")
    p.add_argument("--batched", action="store_true",
                   help="the rank-batched kernels (one launch for every rank: parameters in "
                        "one by-value table of n_ranks rows, n_sms blocks per rank), as "
                        "'epgen run --batched' launches them")
    p.add_argument("--trace", action="store_true",
                   help="the kernels with trace rings, as 'epgen run --trace' builds them")
    p.add_argument("--op", choices=("dispatch", "combine", "all"), default="dispatch",
                   help="which kernels: dispatch (default), combine (ep_combine_async, "
                        "ep_combine_wait; BF16 over P2P) or all of them in one module")


def run(args: argparse.Namespace) -> int:
    check_output_path(args.parser, "-o/--output", args.output)
    if args.variant is not None:
        if args.preset is not None or args.sets or args.batched or args.trace or args.tunes:
            args.parser.error("argument --variant: not allowed with --preset, --set, "
                              "--tune, --batched or --trace")
        if args.op != "dispatch":
            args.parser.error("argument --op: only dispatch with --variant")
        check_variant(args.parser, "--variant", args.variant)
        text = variant_text(args.variant, args.arch, args.ir)
    else:
        text = _config_text(args)
    write_output(text, args.output)
    return 0


def _config_text(args: argparse.Namespace) -> str:
    """The PTX (or IR text) of ``--op``'s kernels of the configuration the options give."""
    import ir
    from backends.nvptx import emit_linked_ptx, emit_ptx
    from epgen import goldens
    from epgen.kernels import build_combine_module, build_module

    cfg, _ = config_from_args(args)
    if args.trace:
        cfg = tuned(args, cfg, trace=True)
    if args.op != "dispatch" and args.batched:
        args.parser.error(f"argument --op: {args.op} not allowed with --batched")
    try:
        combine = build_combine_module(cfg) if args.op != "dispatch" else None
    except ValueError as e:
        args.parser.error(f"argument --op: {e}")
    if args.op == "combine":
        module = combine
    elif args.op == "all":
        module = ir.Module("ep_dispatch_combine", build_module(cfg).kernels + combine.kernels)
    else:
        module = build_module(cfg)
    if args.batched:
        module = ir.batch_ranks(module, cfg.n_ranks, cfg.n_sms)
    emit = emit_ptx if args.no_link else emit_linked_ptx
    return goldens.print_ir(module) if args.ir else emit(module, arch=args.arch)
