"""``epgen run``'s options, their checks (usage errors before anything runs), the world
they name (``make_world``), and how a failed call is reported; shared by the emulated and P2P
run (``commands.run``) and the SHMEM process (``commands.run_shmem``)."""

from __future__ import annotations

import argparse
import math

from .common import add_config, check_output_path

WORLDS = ("emulated", "p2p", "shmem")
BACKENDS = ("cuda", "sim")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``epgen run``."""
    add_config(p)
    p.add_argument("--tokens", type=int, metavar="T",
                   help="tokens per rank (default: max_tokens_per_rank)")
    p.add_argument("--calls", type=int, default=3, metavar="N",
                   help="dispatch round trips, fresh random inputs each (default: 3)")
    p.add_argument("--seed", type=int, help="random seed, >= 0 (default: fresh)")
    p.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--input-scale", type=float, default=1.0, metavar="S",
                   help="global input scale of the formats that take one (NVFP4), finite "
                        "and > 0 (default 1.0)")
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
    add_world(p)
    p.add_argument("--backend", choices=BACKENDS, default="cuda",
                   help="cuda: run on the GPU (the default); sim: interpret the kernels' IR on "
                        "the CPU (backends.sim; no GPU or CUDA driver needed, --seed also "
                        "seeds the simulator's interleaving, --arch is ignored; only small "
                        "configurations, e.g. --preset small)")


def checked_run_args(args: argparse.Namespace, cfg) -> int:
    """``--tokens``, ``--calls``, ``--seed``, ``--input-scale`` and the ``--trace`` file
    checked, a usage error (exit 2) naming a bad one before anything touches a GPU; returns
    the tokens per rank."""
    tokens = cfg.max_tokens_per_rank if args.tokens is None else args.tokens
    if not 0 <= tokens <= cfg.max_tokens_per_rank:
        args.parser.error(f"argument --tokens: must be in [0, max_tokens_per_rank="
                          f"{cfg.max_tokens_per_rank}], got {tokens}")
    if args.calls < 1:
        args.parser.error(f"argument --calls: must be >= 1, got {args.calls}")
    if args.seed is not None and args.seed < 0:
        args.parser.error(f"argument --seed: must be >= 0, got {args.seed}")
    if not (math.isfinite(args.input_scale) and args.input_scale > 0):
        args.parser.error(f"argument --input-scale: must be finite and > 0, got "
                          f"{args.input_scale}")
    if getattr(cfg.token_fmt, "uses_input_scale", False):
        try:
            cfg.token_fmt.check_input_scale(args.input_scale)
        except ValueError as e:
            args.parser.error(f"argument --input-scale: {e}")
    check_output_path(args.parser, "--trace", args.trace or None)
    if args.batched and args.world == "p2p":
        args.parser.error("argument --batched: one launch for every rank needs the ranks on "
                          "one GPU (--world emulated)")
    return tokens


def check_combine(args: argparse.Namespace, cfg) -> None:
    """``--combine`` on a configuration the combine kernels do not take: a usage error
    naming why (``runtime.combine.check_supported``)."""
    from epgen.runtime.combine import check_supported

    try:
        check_supported(cfg)
    except ValueError as e:
        args.parser.error(f"argument --combine: {e}")


def print_differences(differences: list[str], limit: int = 10) -> None:
    """The first ``limit`` differences of a failed call, indented under its line."""
    print("\n".join("  " + d for d in differences[:limit]), flush=True)


def add_world(p: argparse.ArgumentParser) -> None:
    """``--world``, ``--drop-rank`` and ``--devices``."""
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


def devices_from_args(args: argparse.Namespace, n_ranks: int):
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
    """The world ``--world`` names: ``EmulatedWorld``, ``P2PWorld`` (``devices``) or this
    process's rank of a ``ShmemWorld`` (on the GPU); ``fused`` as the worlds take it (None:
    their default); ``batched`` (one launch for every rank) is the emulated world's only;
    ``backend`` and ``sim_seed`` as the worlds take them (``--backend sim``: the CPU
    simulator). ``checked_run_args`` and ``run_shmem`` have refused the other combinations."""
    sim = {} if backend == "cuda" else {"backend": backend, "sim_seed": sim_seed}
    world = world_class(kind)
    if kind == "shmem":
        return world(cfg, arch=arch, input_scale=input_scale, fused=fused)
    if kind == "p2p":
        return world(cfg, arch=arch, devices=devices, input_scale=input_scale, fused=fused,
                     **sim)
    return world(cfg, arch=arch, input_scale=input_scale, fused=fused, batched=batched, **sim)


def world_class(kind: str) -> type:
    """The class of the world ``--world`` names (its module imported when asked)."""
    if kind == "shmem":
        from epgen.runtime.shmem_world import ShmemWorld
        return ShmemWorld
    if kind == "p2p":
        from epgen.runtime.p2p_world import P2PWorld
        return P2PWorld
    from epgen.runtime.world import EmulatedWorld
    return EmulatedWorld
