"""The ``epgen`` command line (also ``python3 -m epgen``): the parser and the dispatch to the
sub-commands of ``epgen.commands``, one module each (``COMMANDS``).

``ptx``, ``inspect``, ``run`` and ``bench`` work on a configuration: a preset
(``epgen/presets/<name>.toml``, ``default`` unless ``--preset`` names another; ``decode`` for
``bench``) with ``--set key=value`` overrides; ``ptx --variant NAME`` emits a registered golden
variant instead (the demos, ``ep/<preset>``). ``bench`` is ``epgen.bench``'s benchmark.

Exit status: 0 success; 1 the command ran and failed (``epgen: error: ...``), or ``diff``
found differences; 2 a usage error (argparse style, naming the bad option, before any work).
Set ``EPGEN_TRACEBACK=1`` to see the traceback behind an ``epgen: error``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from epgen.commands import bench, check_ordering, diff, inspect, launch, ptx, run, variants
from epgen.commands.common import PROG, CommandError

COMMANDS = {
    "ptx": ptx,
    "inspect": inspect,
    "variants": variants,
    "diff": diff,
    "run": run,
    "bench": bench,
    "check-ordering": check_ordering,
    "launch": launch,
}
"""Each sub-command's module: its ``HELP`` line, ``add_arguments(parser)`` and
``run(args) -> exit status``."""


def build_parser() -> argparse.ArgumentParser:
    """The whole parser, every sub-command's options included (imports no backend)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Generate, inspect and run expert-parallel MoE dispatch GPU kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.HELP, description=command.HELP)
        command.add_arguments(p)
        p.set_defaults(run=command.run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the sub-command, return its exit
    status; a failure the user can act on is one ``epgen: error:`` line, no traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from epgen.config import EPFlagNoEffect
        with warnings.catch_warnings():    # config_from_args has printed each one already
            warnings.simplefilter("ignore", EPFlagNoEffect)
            return args.run(args)
    except BrokenPipeError:
        # `epgen ptx | head`: the reader left; not an error. Point stdout at devnull so the
        # interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from backends.cuda.errors import CudaError
        from epgen.goldens import GoldenError

        if os.environ.get("EPGEN_TRACEBACK") or not isinstance(
                e, (CommandError, GoldenError, ValueError, CudaError, RuntimeError, OSError)):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
