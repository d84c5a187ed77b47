"""``epgen diff A B``: a unified diff of two registered variants' PTX (or IR text)."""

from __future__ import annotations

import argparse
import difflib
import sys

from .common import add_arch, check_variant, variant_text

HELP = "unified diff of two variants' PTX (exit 1 when they differ)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="first variant")
    p.add_argument("b", metavar="B", help="second variant")
    add_arch(p)
    p.add_argument("--ir", action="store_true", help="compare the IR text instead of PTX")
    p.add_argument("-U", "--context", type=int, default=3, metavar="N",
                   help="lines of context (default: 3)")
    p.add_argument("--normalize", action="store_true",
                   help="renumber PTX registers and block labels per function in order of "
                        "first appearance and compare lines regardless of those numbers "
                        "(backends.nvptx.normalize), so the diff shows what changed rather "
                        "than renamed registers")


def run(args: argparse.Namespace) -> int:
    check_variant(args.parser, "A", args.a)
    check_variant(args.parser, "B", args.b)
    if args.context < 0:
        args.parser.error("argument -U/--context: must be >= 0")
    ext = "ir" if args.ir else "ptx"
    a, b = (variant_text(v, args.arch, args.ir) for v in (args.a, args.b))
    if args.normalize and not args.ir:
        from backends.nvptx.normalize import comparable_lines

        a, b = comparable_lines(a), comparable_lines(b)
    else:
        a, b = a.splitlines(keepends=True), b.splitlines(keepends=True)
    diff = list(difflib.unified_diff(a, b, f"{args.a}.{ext}", f"{args.b}.{ext}", n=args.context))
    for line in diff:
        sys.stdout.write(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return 1 if diff else 0
