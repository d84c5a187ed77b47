"""The ``epgen`` command line (also ``python3 -m epgen``).

Each subcommand is one small function ``cmd_<name>(args) -> exit status`` plus a function
adding its arguments, listed in ``COMMANDS``. Heavy imports (the kernels, llvmlite, cuda) happen
inside the commands, so ``epgen --help`` stays fast and works even where a backend is broken.

``ptx``, ``inspect``, ``run`` and ``bench`` work on a configuration: a preset
(``epgen/presets/<name>.toml``, ``default`` unless ``--preset`` names another; ``decode`` for
``bench``) with ``--set key=value`` overrides; ``ptx --variant NAME`` emits a registered golden
variant instead (the demos, ``ep/<preset>``). ``bench`` is ``epgen.bench``'s benchmark.

Exit status: 0 success; 1 the command ran and failed (``epgen: error: ...``), or ``diff``
found differences; 2 a usage error (argparse style, naming the bad option). Set
``EPGEN_TRACEBACK=1`` to see the traceback behind an ``epgen: error``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings
from typing import Callable, NamedTuple

PROG = "epgen"
ARCHS = ("sm_80", "sm_90", "sm_100")
DEFAULT_ARCH = "sm_90"
DEFAULT_PRESET = "default"
"""The preset ``epgen ptx`` and ``epgen inspect`` use without ``--preset`` (or ``--variant``)."""


class CommandError(Exception):
    """A command failed for a reason the user can act on; printed without a traceback."""


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _add_arch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH,
                   help=f"target GPU architecture (default: {DEFAULT_ARCH})")


def _add_config(p: argparse.ArgumentParser, default: str = DEFAULT_PRESET) -> None:
    p.add_argument("--preset", metavar="NAME",
                   help=f"configuration preset (default: {default}; one of "
                        f"epgen/presets/*.toml)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", dest="sets", default=[],
                   help="override one parameter of the preset (repeatable): any EPConfig "
                        "parameter, or format, hid_dim, top_k, alignment")
    p.add_argument("--tune", metavar="KEY=VALUE", action="append", dest="tunes", default=[],
                   help="set one code-generation choice (repeatable): a field of "
                        "epgen.tuning.Tuning, e.g. send_warps_per_token_max=1")
    _add_arch(p)


def _config(args: argparse.Namespace, default: str = DEFAULT_PRESET):
    """The ``EPConfig`` of ``--preset`` (``default`` when not given) and ``--set``, and the
    overrides; a bad name or value is a usage error (exit 2) that names the parameter."""
    from epgen import presets
    from epgen.config import SHMEM_ALL_P2P_NOTE

    parser, name = args.parser, args.preset or default
    known = presets.preset_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.error(f"argument --preset: unknown preset {name!r}{hint} "
                     f"(known: {', '.join(known)})")
    overrides = {}
    for item in args.sets:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            parser.error(f"argument --set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key] = presets.parse_value(key, text)
        except ValueError as e:
            parser.error(f"argument --set {item}: {e}")
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
    return _tuned(args, cfg), overrides


def _tuned(args: argparse.Namespace, cfg, **changes):
    """``cfg`` with ``--tune`` (and ``changes``, e.g. ``trace=True``) applied to its tuning;
    a bad key or value is a usage error (exit 2) that names the field."""
    from epgen.tuning import TuningError, parse_tune

    try:
        tuning = parse_tune(getattr(args, "tunes", []), base=cfg.tuning)
        return cfg.replace(tuning=tuning.replace(**changes)) if (args.tunes or changes) \
            else cfg
    except TuningError as e:
        args.parser.error(f"argument --tune: {e}")


def _check_variant(parser: argparse.ArgumentParser, option: str, name: str) -> None:
    """Reject an unknown variant name the way argparse rejects a bad option (exit 2)."""
    from epgen import goldens

    known = goldens.names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parser.error(f"argument {option}: unknown variant {name!r}{hint} "
                     f"(see '{PROG} variants')")


def _variant_text(name: str, arch: str, want_ir: bool) -> str:
    from epgen import goldens

    module = goldens.build_module(name)
    return goldens.print_ir(module) if want_ir else goldens.emit_ptx(module, arch=arch)


def _write(text: str, path: str | None) -> None:
    if path is None or path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    except OSError as e:
        raise CommandError(f"cannot write {path}: {e.strerror or e}") from e


# ---------------------------------------------------------------------------------------------
# Commands


def args_ptx(p: argparse.ArgumentParser) -> None:
    _add_config(p)
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


def cmd_ptx(args: argparse.Namespace) -> int:
    if args.variant is not None:
        if args.preset is not None or args.sets or args.batched or args.trace or args.tunes:
            args.parser.error("argument --variant: not allowed with --preset, --set, "
                              "--tune, --batched or --trace")
        if args.op != "dispatch":
            args.parser.error("argument --op: only dispatch with --variant")
        _check_variant(args.parser, "--variant", args.variant)
        text = _variant_text(args.variant, args.arch, args.ir)
    else:
        import ir
        from backends.nvptx import emit_linked_ptx, emit_ptx
        from epgen import goldens
        from epgen.kernels import build_combine_module, build_module

        cfg, _ = _config(args)
        if args.trace:
            cfg = _tuned(args, cfg, trace=True)
        if args.op != "dispatch" and args.batched:
            args.parser.error(f"argument --op: {args.op} not allowed with --batched")
        try:
            combine = build_combine_module(cfg) if args.op != "dispatch" else None
        except ValueError as e:
            args.parser.error(f"argument --op: {e}")
        if args.op == "combine":
            module = combine
        elif args.op == "all":
            module = ir.Module("ep_dispatch_combine",
                               build_module(cfg).kernels + combine.kernels)
        else:
            module = build_module(cfg)
        if args.batched:
            module = ir.batch_ranks(module, cfg.n_ranks, cfg.n_sms)
        emit = emit_ptx if args.no_link else emit_linked_ptx
        text = goldens.print_ir(module) if args.ir else emit(module, arch=args.arch)
    _write(text, args.output)
    return 0


def args_inspect(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--op", choices=("dispatch", "combine", "all"), default="dispatch",
                   help="which kernels: dispatch (default), combine (ep_combine_async, "
                        "ep_combine_wait, with the combine buffers) or all of them")


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from epgen import inspection

    cfg, overrides = _config(args)
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
    _write(text, args.output)
    return 1 if report["ptxas"] and report["ptxas"]["error"] else 0


def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


def args_variants(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", action="store_true",
                   help="list every combination of the boolean flags (use_shmem=false) instead: "
                        "legal ones with the --preset/--set arguments that build them, illegal "
                        "ones with the rules they break")


def cmd_variants(args: argparse.Namespace) -> int:
    if args.matrix:
        return _print_matrix()
    from epgen import goldens

    from epgen import variants

    names = goldens.names()
    width = max((len(n) for n in names), default=0)
    for name in names:
        cfg = variants.variant_config(name)
        combine = "" if cfg is None else _combine_note(variants.combine_error(cfg))
        print(f"{name:<{width}}  {goldens.describe(name)}{combine}".rstrip())
    return 0


def _combine_note(error: str | None) -> str:
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


def args_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="first variant")
    p.add_argument("b", metavar="B", help="second variant")
    _add_arch(p)
    p.add_argument("--ir", action="store_true", help="compare the IR text instead of PTX")
    p.add_argument("-U", "--context", type=int, default=3, metavar="N",
                   help="lines of context (default: 3)")
    p.add_argument("--normalize", action="store_true",
                   help="renumber PTX registers and block labels per function in order of "
                        "first appearance and compare lines regardless of those numbers "
                        "(backends.nvptx.normalize), so the diff shows what changed rather "
                        "than renamed registers")


def cmd_diff(args: argparse.Namespace) -> int:
    _check_variant(args.parser, "A", args.a)
    _check_variant(args.parser, "B", args.b)
    if args.context < 0:
        args.parser.error("argument -U/--context: must be >= 0")
    ext = "ir" if args.ir else "ptx"
    a, b = (_variant_text(v, args.arch, args.ir) for v in (args.a, args.b))
    if args.normalize and not args.ir:
        from backends.nvptx.normalize import comparable_lines

        a, b = comparable_lines(a), comparable_lines(b)
    else:
        a, b = a.splitlines(keepends=True), b.splitlines(keepends=True)
    diff = list(difflib.unified_diff(a, b, f"{args.a}.{ext}", f"{args.b}.{ext}", n=args.context))
    for line in diff:
        sys.stdout.write(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return 1 if diff else 0


def args_run(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--tokens", type=int, metavar="T",
                   help="tokens per rank (default: max_tokens_per_rank)")
    p.add_argument("--calls", type=int, default=3, metavar="N",
                   help="dispatch round trips, fresh random inputs each (default: 3)")
    p.add_argument("--seed", type=int, help="random seed (default: fresh)")
    p.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--input-scale", type=float, default=1.0, metavar="S",
                   help="global input scale of the formats that take one (NVFP4; default 1.0)")
    p.add_argument("--graph", action="store_true",
                   help="capture the round trip once as a CUDA graph (RoundTripGraph) and "
                        "replay it for every call, new inputs loaded into the same buffers")
    p.add_argument("--fused", action="store_true",
                   help="run the fused single launch (ep_dispatch) instead of dispatch_async "
                        "then dispatch_wait")
    p.add_argument("--combine", action="store_true",
                   help="after each dispatch, a per-expert transform of every rank's grouped "
                        "rows on the host (epgen.combine_run), then the combine with random "
                        "router weights, checked bit for bit against epgen.reference.combine; "
                        "with --graph, dispatch and combine are one graph (world.capture_moe) "
                        "and the transform is of the reference dispatch's rows")
    p.add_argument("--batched", action="store_true",
                   help="launch every rank's grid of a kernel as one grid (emulated ranks "
                        "only): the ranks start together, as on their own GPUs")
    p.add_argument("--trace", nargs="?", const="", default=None, metavar="FILE.json",
                   help="build the kernels with trace rings (tuning.trace, "
                        "epgen.kernels.trace) and print "
                        "where each call's time went: per role and hand-off, the first and "
                        "last block there (us after the call's first event), the median over "
                        "the calls; with FILE.json, also write every call's events as a "
                        "Chrome trace-event file (one track per rank, role and block) that "
                        "ui.perfetto.dev opens")
    _add_world(p)
    p.add_argument("--backend", choices=RUN_BACKENDS, default="cuda",
                   help="cuda: run on the GPU (the default); sim: interpret the kernels' IR on "
                        "the CPU (backends.sim; no GPU or CUDA driver needed, --seed also "
                        "seeds the simulator's interleaving, --arch is ignored; only small "
                        "configurations, e.g. --preset small)")


WORLDS = ("emulated", "p2p", "shmem")
RUN_BACKENDS = ("cuda", "sim")


def _add_world(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", choices=WORLDS, default="emulated",
                   help="emulated: every rank on one GPU (EmulatedWorld, the default); p2p: "
                        "one GPU per rank in this process, peer access between them "
                        "(P2PWorld); shmem: this process is one rank of a group started by "
                        "'epgen launch -n N --' or torchrun (ShmemWorld, NVSHMEM)")
    p.add_argument("--drop-rank", type=int, metavar="K",
                   help="testing, with --world shmem: rank K exits right before its first "
                        "call without closing (a dead peer); the others must time out")
    p.add_argument("--devices", metavar="LIST",
                   help="with --world p2p: the GPU of each rank, comma-separated (default: "
                        "rank r on GPU r); ranks may share a GPU, e.g. 0,0")


def _devices(args: argparse.Namespace, n_ranks: int):
    """``--devices`` as a tuple of ordinals (None when not given); a usage error (exit 2)
    when malformed, with one entry per rank, or given without ``--world p2p``."""
    if args.devices is None:
        return None
    if args.world != "p2p":
        args.parser.error("argument --devices: only with --world p2p")
    try:
        devices = tuple(int(x) for x in args.devices.split(","))
    except ValueError:
        args.parser.error(f"argument --devices: expected GPU ordinals like 0,1,2,3, got "
                          f"{args.devices!r}")
    if len(devices) != n_ranks or min(devices) < 0:
        args.parser.error(f"argument --devices: expected {n_ranks} GPU ordinals >= 0 (one per "
                          f"rank), got {args.devices!r}")
    return devices


def make_world(kind: str, cfg, *, arch=None, devices=None, input_scale: float = 1.0,
               fused: bool | None = None, batched: bool = False, backend: str = "cuda",
               sim_seed: int | None = None):
    """The world ``--world`` names: ``EmulatedWorld`` or ``P2PWorld`` (``devices``);
    ``fused`` as the worlds take it (None: their default); ``batched`` (one launch for
    every rank) is the emulated world's only; ``backend`` and ``sim_seed`` as the worlds
    take them (``--backend sim``: the CPU simulator)."""
    sim = {} if backend == "cuda" else {"backend": backend, "sim_seed": sim_seed}
    if kind == "shmem":
        if batched or backend != "cuda":
            raise CommandError("--world shmem: one process per rank on the GPU (not with "
                               "--batched or --backend sim)")
        from epgen.runtime.shmem_world import ShmemWorld
        return ShmemWorld(cfg, arch=arch, input_scale=input_scale, fused=fused)
    if kind == "p2p":
        if batched:
            raise CommandError("--batched: one launch for every rank needs the ranks on one "
                               "GPU (--world emulated)")
        from epgen.runtime.p2p_world import P2PWorld
        return P2PWorld(cfg, arch=arch, devices=devices, input_scale=input_scale, fused=fused,
                        **sim)
    from epgen.runtime.world import EmulatedWorld
    return EmulatedWorld(cfg, arch=arch, input_scale=input_scale, fused=fused,
                         batched=batched, **sim)


def cmd_run(args: argparse.Namespace) -> int:
    """Run ``cfg``'s kernels on an ``EmulatedWorld`` (or, with ``--world p2p``, a
    ``P2PWorld``) and compare with the numpy reference."""
    import os
    import time

    import numpy as np

    from epgen import reference, routing

    cfg, _ = _config(args)
    devices = _devices(args, cfg.n_ranks)
    tokens = _checked_run_args(args, cfg)
    if args.world == "shmem":
        return _run_shmem(args, cfg, tokens)
    if args.drop_rank is not None:
        args.parser.error("argument --drop-rank: only with --world shmem")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    weights = routing.zipf_weights(cfg.n_experts, rng=rng) if args.routing == "zipf" else None
    from epgen.runtime import trace as runtime_trace

    tracing = args.trace is not None
    if tracing:
        cfg = _tuned(args, cfg, trace=True)
    if args.combine:
        _check_combine(args, cfg)
    world = make_world(args.world, cfg, arch=args.arch, devices=devices,
                       input_scale=args.input_scale, fused=True if args.fused else None,
                       batched=args.batched, backend=args.backend,
                       sim_seed=seed if args.backend == "sim" else None)
    where = ("emulated ranks" if args.world == "emulated" else
             f"ranks on GPUs {','.join(map(str, world.devices))} (P2P)")
    print(f"{cfg.n_ranks} {where}, {tokens} tokens/rank, seed {seed}"
          + (", the fused single launch" if world.fused else "")
          + (", every rank in one launch" if world.batched else "")
          + (", each call a CUDA-graph replay" if args.graph else "")
          + (", dispatch + combine" if args.combine else "")
          + (", simulated on the CPU (backends.sim)" if args.backend == "sim" else ""))
    if args.combine and (not hasattr(world, "combine")
                         or args.graph and not hasattr(world, "capture_moe")):
        raise CommandError(f"--combine{' --graph' if args.graph else ''}: "
                           f"{type(world).__name__} has no "
                           f"{'capture_moe' if args.graph else 'combine'} yet")
    graph = None
    timelines = []
    for call in range(args.calls):
        toks, ids = routing.routing(rng, cfg, tokens, weights)
        if tracing:
            runtime_trace.arm(world)
        t0 = time.perf_counter()
        combined = None
        if args.combine:
            graph, got, combined = _moe_call(world, cfg, rng, toks, ids, graph, args.graph,
                                             args.input_scale)
        elif args.graph:
            graph, got = world.dispatch_replayed(toks, ids, graph)
        else:
            got = world.dispatch(toks, ids)
        dt = time.perf_counter() - t0
        if tracing:
            timelines.append(runtime_trace.read(world))
        want = reference.dispatch(cfg, toks, ids, input_scale=args.input_scale)
        diffs = [d for x, a in zip(want, got)
                 for d in reference.compare(cfg, x, a)]
        rows = sum(int(r.row_offsets[-1]) for r in got)
        print(f"call {call}: {rows} rows received, {dt * 1e3:.1f} ms (host round trip), "
              f"{'matches the reference' if not diffs else 'MISMATCH'}")
        if combined is not None and not diffs:
            diffs = _combine_diffs(cfg, toks, ids, got, *combined, graph=args.graph,
                                   input_scale=args.input_scale)
            print(f"  combine: {'matches the reference' if not diffs else 'MISMATCH'}")
        if diffs:
            print("\n".join("  " + d for d in diffs[:10]))
            raise CommandError(f"results differ from the reference (seed {seed})")
    if timelines:
        sim = args.backend == "sim"
        unit = "simulator clock ticks / 1000" if sim else "us"
        print(runtime_trace.format_rows(
            runtime_trace.median_rows(timelines),
            f"trace events, median of {len(timelines)} calls ({unit} after each call's first "
            f"event; blocks: rank x block pairs there)"))
        dropped = sum(sum(tl.dropped.values()) for tl in timelines)
        if dropped:
            print(f"trace: {dropped} events did not fit their rings (raise "
                  f"--tune trace_ring_capacity={cfg.tuning.trace_ring_capacity})",
                  file=sys.stderr)
        if args.trace:
            from epgen.runtime import trace_export

            trace_export.write(args.trace, timelines,
                               clock="sim: one tick per %globaltimer read" if sim else
                               "globaltimer")
            print(f"trace: {len(timelines)} calls written to {args.trace} (Chrome trace-event "
                  f"JSON; open it in ui.perfetto.dev)")
    return 0


def _checked_run_args(args: argparse.Namespace, cfg) -> int:
    """``epgen run``'s ``--tokens``, ``--calls``, ``--seed`` and ``--input-scale`` checked,
    a usage error (exit 2) naming a bad one before anything touches a GPU; returns the
    tokens per rank."""
    tokens = cfg.max_tokens_per_rank if args.tokens is None else args.tokens
    if not 0 <= tokens <= cfg.max_tokens_per_rank:
        args.parser.error(f"argument --tokens: must be in [0, max_tokens_per_rank="
                          f"{cfg.max_tokens_per_rank}], got {tokens}")
    if args.calls < 1:
        args.parser.error(f"argument --calls: must be >= 1, got {args.calls}")
    if args.seed is not None and args.seed < 0:
        args.parser.error(f"argument --seed: must be >= 0, got {args.seed}")
    if getattr(cfg.token_fmt, "uses_input_scale", False):
        try:
            cfg.token_fmt.check_input_scale(args.input_scale)
        except ValueError as e:
            args.parser.error(f"argument --input-scale: {e}")
    return tokens


def _check_combine(args: argparse.Namespace, cfg) -> None:
    """``--combine`` on a configuration the combine kernels do not take: a usage error
    naming why (``runtime.combine.check_supported``)."""
    from epgen.runtime.combine import check_supported

    try:
        check_supported(cfg)
    except ValueError as e:
        args.parser.error(f"argument --combine: {e}")


def _moe_call(world, cfg, rng, toks, ids, graph, use_graph: bool, scale: float):
    """One ``run --combine`` call: dispatch, the per-expert transform of each rank's rows,
    combine with random weights. Returns ``(graph, dispatch results, (expert outputs,
    weights, combine results))``. With ``use_graph`` one replay of ``world.capture_moe()``
    (captured on the first call), the expert outputs loaded before it: the transform of the
    reference dispatch's rows."""
    from epgen import combine_run, reference

    w = combine_run.router_weights(rng, cfg, ids)
    if not use_graph:
        got = world.dispatch(toks, ids)
        ys = [combine_run.expert_outputs(cfg, r, scale) for r in got]
        return None, got, (ys, w, world.combine(ys, w))
    ys = [combine_run.expert_outputs(cfg, r, scale)
          for r in reference.dispatch(cfg, toks, ids, input_scale=scale)]
    world.load_inputs(toks, ids)
    if graph is None:
        graph = world.capture_moe()
    graph.combiner.load(ys, w)
    graph.launch()
    world.check("graph replay")
    out = graph.combiner.finish()
    return graph, world.results(), (ys, w, out)


def _combine_diffs(cfg, toks, ids, got, ys, w, out, *, graph: bool,
                   input_scale: float) -> list[str]:
    """The combine's differences from the reference: end to end
    (``combine_run.expected``); with ``graph`` (expert outputs computed before the replay)
    ``reference.combine`` of the world's own dispatch results and those outputs."""
    from epgen import combine_run, reference

    want = reference.combine(cfg, got, ys, w) if graph else \
        combine_run.expected(cfg, toks, ids, w, input_scale)
    return combine_run.differences(out, want)


def _run_shmem(args: argparse.Namespace, cfg, tokens: int) -> int:
    """``epgen run --world shmem``: this process's rank of a ``ShmemWorld`` (one process per
    rank); every rank draws every rank's inputs from the same seed (rank 0's, shared through
    the bootstrap when ``--seed`` is not given), computes the whole reference and compares
    its own part."""
    if args.graph or args.trace is not None or args.batched or args.backend != "cuda":
        args.parser.error("--world shmem: not with --graph, --trace, --batched or --backend sim")
    if args.drop_rank is not None and not 0 <= args.drop_rank < cfg.n_ranks:
        args.parser.error(f"argument --drop-rank: must be in [0, n_ranks={cfg.n_ranks})")
    if args.combine:
        _check_combine(args, cfg)
    world = make_world("shmem", cfg, arch=args.arch, input_scale=args.input_scale,
                       fused=True if args.fused else None)
    if args.combine and not hasattr(world, "combine"):
        raise CommandError("--combine: ShmemWorld has no combine yet")
    try:
        with world:
            _shmem_calls(args, cfg, world, tokens)
    except Exception as e:
        if world.finalized or os.environ.get("EPGEN_TRACEBACK"):
            raise
        # a peer is gone and NVSHMEM could not be shut down: leave now rather than risk
        # the library waiting for that peer at exit
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return 0


def _shmem_calls(args: argparse.Namespace, cfg, world, tokens: int) -> None:
    """The calls of ``epgen run --world shmem`` on this process's ``world``."""
    import time

    import numpy as np

    from epgen import reference, routing

    r = world.rank
    mine = None if args.seed is not None else os.urandom(4)
    seed = args.seed if args.seed is not None else int.from_bytes(
        world.bootstrap.broadcast_bytes(mine if r == 0 else None, f"seed-{world.index}"),
        "little")
    rng = np.random.default_rng(seed)
    weights = routing.zipf_weights(cfg.n_experts, rng=rng) if args.routing == "zipf" \
        else None
    print(f"rank {r} of {cfg.n_ranks} (ShmemWorld, GPU {world.device_id}, "
          f"p2p_world_size={cfg.p2p_world_size}), {tokens} tokens/rank, seed {seed}"
          + (", the fused single launch" if world.fused else ""), flush=True)
    for call in range(args.calls):
        toks, ids = routing.routing(rng, cfg, tokens, weights)
        if args.drop_rank == r:
            print(f"rank {r}: --drop-rank: exiting before call {call} without closing",
                  flush=True)
            os._exit(0)
        t0 = time.perf_counter()
        got = world.dispatch(toks[r], ids[r])
        dt = time.perf_counter() - t0
        want = reference.dispatch(cfg, toks, ids, input_scale=args.input_scale)[r]
        diffs = reference.compare(cfg, want, got)
        print(f"rank {r} call {call}: {int(got.row_offsets[-1])} rows received, "
              f"{dt * 1e3:.1f} ms (host round trip, barrier included), "
              f"{'matches the reference' if not diffs else 'MISMATCH'}", flush=True)
        if args.combine:
            from epgen import combine_run

            # every rank draws every rank's weights (same seed), combines its own part
            w = combine_run.router_weights(rng, cfg, ids)
            out = world.combine(combine_run.expert_outputs(cfg, got, args.input_scale), w[r])
            cdiffs = combine_run.differences(
                [out], [combine_run.expected(cfg, toks, ids, w, args.input_scale)[r]])
            print(f"rank {r} call {call} combine: "
                  f"{'matches the reference' if not cdiffs else 'MISMATCH'}", flush=True)
            diffs += cdiffs
        if diffs:
            print("\n".join("  " + d for d in diffs[:10]))
            raise CommandError(f"rank {r}: results differ from the reference (seed {seed})")


BENCH_PRESET = "decode"
"""The preset ``epgen bench`` uses without ``--preset``: 8 emulated ranks that fit one H200
(the ``default`` preset's 8 x 132 blocks of 1024 threads do not)."""


P2P_BENCH_PRESET = "default"
"""The preset ``epgen bench --world p2p`` uses without ``--preset``: 8 ranks, one GPU each,
132 blocks of 1024 threads per rank."""


def args_bench(p: argparse.ArgumentParser) -> None:
    from epgen.bench import options

    _add_config(p, default=BENCH_PRESET)
    options.add_arguments(p, tokens_default="the configuration's max_tokens_per_rank")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = f"""\
examples (on a GPU):
  {PROG} bench                                    the decode preset, 128 tokens per rank
  {PROG} bench --tokens 128,4096 --json out.json  decode and prefill shapes
  {PROG} bench --sweep-tokens 32,...,4096 --plot bw.png
  {PROG} bench --tokens 128,4096 --variant default \\
      --variant final=ep_final_layout,ep_prod_reserve
  {PROG} bench --tokens 4096 --routing zipf
  {PROG} bench --world p2p --tokens 128,4096 --json p2p.json
                                                 8 GPUs: vs NVLink and NCCL
  {PROG} bench --op combine --tokens 128,4096      the combine alone, vs torch
  {PROG} bench --op moe --variant default --variant g=graph
                                                 dispatch + combine, streams and a graph

Progress goes to stderr, the report and table to stdout. Exit status 1 when there is no
GPU, a phase fails or a check fails; 2 for a bad option (before any GPU work)."""


def cmd_bench(args: argparse.Namespace) -> int:
    """Time the dispatch round trip (or ``--op combine|moe``) of a configuration's variants
    on an ``EmulatedWorld`` against a device-to-device copy and the PyTorch baseline
    (``epgen.bench``)."""
    from epgen.bench import driver, options

    cfg, _ = _config(args, default=P2P_BENCH_PRESET if args.world == "p2p" else BENCH_PRESET)
    if args.world == "shmem" and args.op != "dispatch":
        args.parser.error(f"argument --op {args.op}: only with --world emulated (the combine "
                          f"of the other worlds is not benchmarked yet)")
    if args.world == "shmem":
        from epgen.bench import shmem

        tokens = ([t for group in args.tokens for t in group] if args.tokens
                  else args.sweep_tokens or [cfg.max_tokens_per_rank])
        failures = shmem.run(args, cfg, list(dict.fromkeys(tokens)))
        if failures:
            raise CommandError("bench: " + "; ".join(failures))
        return 0
    if args.api == "torch" and args.world != "emulated":
        args.parser.error("argument --api torch: only with --world emulated")
    plan = options.plan_from_args(args.parser, args, cfg, [cfg.max_tokens_per_rank],
                                  arch=args.arch)
    results = driver.execute(plan, json_path=args.json, plot_path=args.plot)
    failures = list(results["failures"])
    if args.api == "torch":
        import json

        from epgen.bench import torch_api
        records, bad = torch_api.run(args, plan)
        failures += bad
        if args.json:
            with open(args.json) as f:
                data = json.load(f)
            data["torch_api"] = records
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
    if failures:
        raise CommandError("bench: " + "; ".join(failures))
    return 0


def args_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                   help="processes to start, one per rank (RANK 0..N-1)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="kill every process after SECONDS and exit 124 (default: no limit)")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="after the first failure, SIGTERM the others and SIGKILL them after "
                        "SECONDS (default: 5)")
    p.add_argument("--mps-share", action="store_true",
                   help="set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=floor(100/N) in every process "
                        "(several PEs on one GPU under MPS)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                   help="the command and its arguments (after --)")
    p.epilog = (f"example: {PROG} launch -n 2 -- python -m epgen run --world shmem --preset "
                f"small --set use_shmem=true --set p2p_world_size=1")


def cmd_launch(args: argparse.Namespace) -> int:
    """Start N processes of CMD with the torchrun rank variables (``epgen.launch``)."""
    from epgen.launch import launch

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        args.parser.error("no command given: epgen launch -n N -- CMD ...")
    if args.nproc < 1:
        args.parser.error(f"argument -n: must be >= 1, got {args.nproc}")
    if args.timeout is not None and args.timeout <= 0:
        args.parser.error(f"argument --timeout: must be > 0, got {args.timeout}")
    return launch(cmd, args.nproc, timeout_s=args.timeout, mps_share=args.mps_share,
                  grace_s=args.grace)


CHECKED_VARIANTS = ("ep/small", "ep/ord_r", "ep/final_layout_prod_reserve", "ep/fused",
                    "ep/shmem_p2p1", "combine/small", "combine/fused")
"""The variants ``check-ordering`` takes (``epgen.ordering.runs.checked``)."""


def args_check_ordering(p: argparse.ArgumentParser) -> None:
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


def cmd_check_ordering(args: argparse.Namespace) -> int:
    """Run the variant's protocol under the simulator's weak-memory mode for each seed, and
    with ``--mutate`` each weakened ordered operation; table, JSON, exit 1 on a miss."""
    from epgen import presets
    from epgen.ordering import runs, sweep

    spec = runs.checked()[args.variant]
    if args.seeds < 1:
        args.parser.error(f"argument --seeds: must be >= 1, got {args.seeds}")
    if args.preset is not None and args.preset not in presets.preset_names():
        args.parser.error(f"argument --preset: unknown preset {args.preset!r} (known: "
                          f"{', '.join(presets.preset_names())})")
    overrides = {}
    for item in args.sets:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            args.parser.error(f"argument --set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key.strip()] = presets.parse_value(key.strip(), text)
        except ValueError as e:
            args.parser.error(f"argument --set {item}: {e}")
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


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "ptx": Command("print the PTX (or IR text) of a preset's dispatch kernels (dispatch_async, "
                   "dispatch_wait, the fused ep_dispatch); the main job", args_ptx, cmd_ptx),
    "inspect": Command("show a configuration: parameters, layout, roles, barriers, atomics, "
                       "ptxas resources", args_inspect, cmd_inspect),
    "variants": Command("list the named variants (the registered goldens) with what each sets; "
                        "--matrix: every flag combination, legal or not", args_variants,
                        cmd_variants),
    "diff": Command("unified diff of two variants' PTX (exit 1 when they differ)",
                    args_diff, cmd_diff),
    "run": Command("run the kernels on the GPU (emulated ranks, or one GPU per rank with "
                   "--world p2p), or on the CPU with --backend sim, and check them against "
                   "the reference", args_run, cmd_run),
    "bench": Command("on a GPU: time the dispatch round trip (dispatch_async, dispatch_wait), "
                     "the combine (--op combine) or both (--op moe) of one or more variants "
                     "on an EmulatedWorld against a device-to-device copy and the PyTorch "
                     "baseline; table, JSON, PNG plot",
                     args_bench, cmd_bench),
    "check-ordering": Command("run a variant's dispatch (and combine) on the CPU simulator's "
                              "weak-memory mode against the reference; --mutate weakens each "
                              "ordered operation in turn and reports which ones the protocol "
                              "needs", args_check_ordering, cmd_check_ordering),
    "launch": Command("start N processes of a command, one per rank, with the torchrun rank "
                      "variables and a bootstrap directory (for --world shmem); prefixed "
                      "output, first failure stops the rest", args_launch, cmd_launch),
}


# ---------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Generate, inspect and run expert-parallel MoE dispatch GPU kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from epgen.config import EPFlagNoEffect
        with warnings.catch_warnings():    # _config has printed each one already
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
                e, (CommandError, GoldenError, ValueError, CudaError, RuntimeError)):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
