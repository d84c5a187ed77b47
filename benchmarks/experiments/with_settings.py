"""Run an ``epgen`` command with module-level tuning constants changed, for A/B runs of code
generation choices in one command:

    PYTHONPATH=. python3 benchmarks/experiments/with_settings.py \\
        epgen.kernels.dispatch_async.SEND_DSTS_IN_SHARED=True \\
        epgen.formats.blockscaled.QUANT_ITEMS_IN_FLIGHT=2 \\
        -- bench --set format=NVFP4 --tokens 4096 --no-baseline

Each ``MODULE.NAME=VALUE`` (VALUE a Python literal) must name an existing upper-case
constant; the kernels are built after the change, in this process only.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def apply(setting: str) -> None:
    """Set one ``MODULE.NAME=VALUE``; ``ValueError`` naming the setting when it is malformed
    or names no existing upper-case constant."""
    target, sep, text = setting.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name or not name.isupper():
        raise ValueError(f"expected MODULE.NAME=VALUE with an upper-case NAME, got {setting!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"{module_name} has no constant {name}")
    setattr(module, name, ast.literal_eval(text))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: with_settings.py MODULE.NAME=VALUE ... -- EPGEN-ARGS")
    cut = argv.index("--")
    for setting in argv[:cut]:
        apply(setting)
    from epgen import cli
    return cli.main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main())
