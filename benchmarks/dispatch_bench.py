"""Dispatch round-trip benchmark: ``epgen bench`` (``epgen/bench/``, where the method is
described) with this script's way of giving the configuration.

    PYTHONPATH=. python3 benchmarks/dispatch_bench.py                   # decode and prefill
    PYTHONPATH=. python3 benchmarks/dispatch_bench.py --tokens 128 --routing zipf --json out.json

The configuration is the ``decode`` preset (8 emulated ranks, H=7168, K=8, E=256, BF16, 512
threads and 33 blocks per rank) with ``--ranks``, ``--hidden``, ``--topk``, ``--experts``,
``--threads`` and ``--sms`` overrides; ``--flag NAME`` (repeatable) times the variant with
those flags set (``--flag A --flag B`` is ``--variant A,B``). The default shapes are 128
(decode) and 4096 (prefill) tokens per rank. Every other option is ``epgen bench``'s.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import epgen  # noqa: F401
except ImportError:  # run as a script from anywhere: the repository root holds epgen/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epgen import presets  # noqa: E402
from epgen.bench import driver, options  # noqa: E402
from epgen.bench.plan import parse_variant  # noqa: E402
from epgen.config import BOOL_PARAMS  # noqa: E402

BASE_PRESET = "decode"
DEFAULT_TOKENS = (128, 4096)
SIZE_OPTIONS = (("ranks", ("n_ranks", "p2p_world_size")), ("hidden", ("hid_dim",)),
                ("topk", ("top_k",)), ("experts", ("n_experts",)),
                ("threads", ("num_threads",)), ("sms", ("n_sms",)))
"""This script's option, the preset keys it sets."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dispatch_bench",
        description="Time epgen's dispatch round trip (dispatch_async + dispatch_wait) on an "
                    "EmulatedWorld against a device-to-device copy and the PyTorch baseline "
                    "(the same as 'epgen bench').",
        epilog="The method is described in epgen/bench/__init__.py.")
    base = presets.preset_data(BASE_PRESET)
    for opt, keys in SIZE_OPTIONS:
        ap.add_argument(f"--{opt}", type=int, metavar="N",
                        help=f"{' = '.join(keys)} (default {base[keys[0]]}, the "
                             f"{BASE_PRESET} preset's)")
    ap.add_argument("--flag", action="append", default=[], choices=BOOL_PARAMS, metavar="NAME",
                    help="set an EPConfig bool flag (repeatable), e.g. ep_final_layout; "
                         "default: none (the staged variant)")
    options.add_arguments(ap, tokens_default="128 4096 = decode and prefill")
    return ap


def parse_args(argv=None):
    """(the ``Plan``, the parsed arguments)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    table = presets.preset_data(BASE_PRESET)
    for opt, keys in SIZE_OPTIONS:
        value = getattr(args, opt)
        if value is not None:
            table.update(dict.fromkeys(keys, value))
    try:
        base = presets.config_from_dict(table)
    except ValueError as exc:
        ap.error(str(exc))
    if args.flag:
        if args.variant:
            ap.error("argument --flag: not allowed with --variant")
        args.variant = [parse_variant(",".join(sorted(set(args.flag))))]
    return options.plan_from_args(ap, args, base, DEFAULT_TOKENS), args


def main(argv=None) -> int:
    from backends.cuda.errors import CudaUnavailableError
    plan, args = parse_args(argv)
    try:
        results = driver.execute(plan, json_path=args.json, plot_path=args.plot)
    except CudaUnavailableError as exc:
        raise SystemExit(f"dispatch_bench: error: {exc}") from None
    for line in results["failures"]:
        print(f"dispatch_bench: error: {line}", file=sys.stderr)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
