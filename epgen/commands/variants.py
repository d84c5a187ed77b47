"""``epgen variants``: the registered variants (the goldens) with what each sets and whether
the combine kernels build for it; ``--matrix``: every combination of the boolean flags."""

from __future__ import annotations

import argparse
import re

HELP = ("list the named variants (the registered goldens) with what each sets; --matrix: "
        "every flag combination, legal or not")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", action="store_true",
                   help="list every combination of the boolean flags (use_shmem=false) instead: "
                        "legal ones with the --preset/--set arguments that build them, illegal "
                        "ones with the rules they break")


def run(args: argparse.Namespace) -> int:
    if args.matrix:
        return _print_matrix()
    from epgen import goldens, variants

    names = goldens.names()
    width = max((len(n) for n in names), default=0)
    for name in names:
        cfg = variants.variant_config(name)
        combine = "" if cfg is None else combine_note(variants.combine_error(cfg))
        print(f"{name:<{width}}  {goldens.describe(name)}{combine}".rstrip())
    return 0


def combine_note(error: str | None) -> str:
    """`` [combine: yes]`` or `` [combine: no: <why>]`` after a variant's description."""
    return " [combine: yes]" if error is None else f" [combine: no: {error}]"


def _print_matrix() -> int:
    from epgen import variants

    combos = variants.combinations()
    legal = [c for c in combos if c.legal]
    combine = [c for c in legal if c.combine_error is None]
    print(f"# {len(variants.MATRIX_FLAGS)} flags on preset {variants.BASE_PRESET}, "
          f"use_shmem=false: {len(legal)} legal, {len(combos) - len(legal)} illegal of "
          f"{len(combos)} combinations (epgen/variants.py); the combine kernels build for "
          f"{len(combine)} (combine=yes; why not: 'epgen inspect --op combine')")
    for c in sorted(combos, key=lambda c: not c.legal):
        if c.legal:
            detail = " ".join(c.cli_args())
        else:
            # each violated rule's parameters and its first clause (the full text: run
            # 'epgen inspect' with the combination's flags)
            detail = "; ".join(f"{', '.join(p)}: {re.split(r' [(]|, got ', rule)[0]}"
                               for p, rule in c.error.violations)
        comb = "-" if not c.legal else \
            "combine=yes" if c.combine_error is None else "combine=no"
        print(f"{'legal' if c.legal else 'illegal':<7}  {comb:<11}  {c.name}: {detail}")
    return 0
