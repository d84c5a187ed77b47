"""``epgen inspect``: a configuration's parameters, layout, roles, barriers, atomics and
ptxas resources (``epgen.inspection``)."""

from __future__ import annotations

import argparse

from .common import DEFAULT_PRESET, add_config, check_output_path, config_from_args, write_output

HELP = ("show a configuration: parameters, layout, roles, barriers, atomics, ptxas "
        "resources")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--op", choices=("dispatch", "combine", "all"), default="dispatch",
                   help="which kernels: dispatch (default), combine (ep_combine_async, "
                        "ep_combine_wait, with the combine buffers) or all of them")


def run(args: argparse.Namespace) -> int:
    import json

    from epgen import inspection

    check_output_path(args.parser, "-o/--output", args.output)
    cfg, overrides = config_from_args(args)
    if args.op != "dispatch":
        from epgen.runtime.combine import check_supported
        try:
            check_supported(cfg)
        except ValueError as e:
            args.parser.error(f"argument --op: {e}")
    report = inspection.inspect_config(cfg, arch=args.arch, preset=args.preset or DEFAULT_PRESET,
                                       overrides=overrides, op=args.op)
    text = (json.dumps(report, indent=2) + "\n" if args.json
            else inspection.format_text(report))
    write_output(text, args.output)
    return 1 if report["ptxas"] and report["ptxas"]["error"] else 0
