"""What several ``epgen`` sub-commands share: the configuration options (``--preset``,
``--set``, ``--tune``, ``--arch``) and the ``EPConfig`` they give, variant names, output
files checked before any work, and ``CommandError``.

Bad input is a usage error (argparse style, exit 2) that names the option; ``CommandError``
is a failure the user can act on, printed without a traceback (exit 1).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

PROG = "epgen"
ARCHS = ("sm_80", "sm_90", "sm_100")
DEFAULT_ARCH = "sm_90"
DEFAULT_PRESET = "default"
"""The preset ``epgen ptx``, ``inspect`` and ``run`` use without ``--preset`` (or
``--variant``)."""


class CommandError(Exception):
    """A command failed for a reason the user can act on; printed without a traceback."""


def add_arch(p: argparse.ArgumentParser) -> None:
    """``--arch``: the target GPU architecture."""
    p.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH,
                   help=f"target GPU architecture (default: {DEFAULT_ARCH})")


def add_config(p: argparse.ArgumentParser, default: str = DEFAULT_PRESET) -> None:
    """``--preset``, ``--set``, ``--tune`` and ``--arch``: the options ``config_from_args``
    reads."""
    p.add_argument("--preset", metavar="NAME",
                   help=f"configuration preset (default: {default}; one of "
                        f"epgen/presets/*.toml)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", dest="sets", default=[],
                   help="override one parameter of the preset (repeatable): any EPConfig "
                        "parameter, or format, hid_dim, top_k, alignment")
    p.add_argument("--tune", metavar="KEY=VALUE", action="append", dest="tunes", default=[],
                   help="set one code-generation choice (repeatable): a field of "
                        "epgen.tuning.Tuning, e.g. send_warps_per_token_max=1")
    add_arch(p)


def check_preset(parser: argparse.ArgumentParser, name: str) -> None:
    """An unknown preset name is a usage error naming ``--preset`` (with the closest name)."""
    from epgen import presets

    known = presets.preset_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.error(f"argument --preset: unknown preset {name!r}{hint} "
                     f"(known: {', '.join(known)})")


def parse_sets(parser: argparse.ArgumentParser, items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as ``{key: value}`` (``presets.parse_value``); a malformed
    item or a bad value is a usage error naming it."""
    from epgen import presets

    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            parser.error(f"argument --set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key] = presets.parse_value(key, text)
        except ValueError as e:
            parser.error(f"argument --set {item}: {e}")
    return overrides


def config_from_args(args: argparse.Namespace, default: str = DEFAULT_PRESET):
    """The ``EPConfig`` of ``--preset`` (``default`` when not given), ``--set`` and
    ``--tune``, and the ``--set`` overrides; a bad name or value is a usage error (exit 2)
    that names the parameter. Prints the configuration's notes and inert flags on stderr."""
    from epgen import presets
    from epgen.config import SHMEM_ALL_P2P_NOTE

    parser, name = args.parser, args.preset or default
    check_preset(parser, name)
    overrides = parse_sets(parser, args.sets)
    try:
        cfg = presets.config_from_dict(presets.with_overrides(presets.preset_data(name), overrides))
    except ValueError as e:
        sets = "".join(f" --set {item}" for item in args.sets)
        parser.error(f"preset {name}{sets}: {e}")
    if cfg.shmem_all_p2p:
        print(f"note: {SHMEM_ALL_P2P_NOTE}", file=sys.stderr)
    for flag, why in cfg.inert_flags().items():
        print(f"warning: {flag}: {why}", file=sys.stderr)
    world = getattr(args, "world", None)
    if (cfg.needs_shmem and world not in (None, "shmem")
            and getattr(args, "backend", "cuda") != "sim"):
        parser.error(f"argument --world {world}: p2p_world_size={cfg.p2p_world_size} < "
                     f"n_ranks={cfg.n_ranks} reaches ranks outside the P2P group through "
                     f"NVSHMEM, one process per PE: use --world shmem under epgen launch "
                     f"(or --backend sim)")
    return tuned(args, cfg), overrides


def tuned(args: argparse.Namespace, cfg, **changes):
    """``cfg`` with ``--tune`` (and ``changes``, e.g. ``trace=True``) applied to its tuning;
    a bad key or value is a usage error (exit 2) that names the field."""
    from epgen.tuning import TuningError, parse_tune

    try:
        tuning = parse_tune(getattr(args, "tunes", []), base=cfg.tuning)
        return cfg.replace(tuning=tuning.replace(**changes)) if (args.tunes or changes) \
            else cfg
    except TuningError as e:
        args.parser.error(f"argument --tune: {e}")


def check_variant(parser: argparse.ArgumentParser, option: str, name: str) -> None:
    """Reject an unknown variant name the way argparse rejects a bad option (exit 2)."""
    from epgen import goldens

    known = goldens.names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.error(f"argument {option}: unknown variant {name!r}{hint} "
                     f"(see '{PROG} variants')")


def variant_text(name: str, arch: str, want_ir: bool) -> str:
    """The PTX (or with ``want_ir`` the IR text) of the registered variant ``name``."""
    from epgen import goldens

    module = goldens.build_module(name)
    return goldens.print_ir(module) if want_ir else goldens.emit_ptx(module, arch=arch)


def check_output_path(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """A usage error (exit 2) naming ``option`` unless ``path`` can be written: its directory
    exists and is writable, and it is not a directory itself. None and ``-`` (stdout) pass.
    Commands call it before any work, so a bad path costs nothing."""
    if path is None or path == "-":
        return
    if os.path.isdir(path):
        parser.error(f"argument {option}: cannot write {path}: it is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"argument {option}: cannot write {path}: no directory {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path)
                                          and not os.access(path, os.W_OK)):
        parser.error(f"argument {option}: cannot write {path}: permission denied")


def write_output(text: str, path: str | None) -> None:
    """``text`` to ``path`` (None or ``-``: stdout); a failed write is a ``CommandError``."""
    if path is None or path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    except OSError as e:
        raise CommandError(f"cannot write {path}: {e.strerror or e}") from e
