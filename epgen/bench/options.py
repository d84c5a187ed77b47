"""The command-line options of a benchmark run, shared by ``epgen bench`` and
``benchmarks/dispatch_bench.py`` (each adds its own way to give the configuration), and their
validation into a ``Plan``: every bad value is a usage error (exit 2) naming the option, found
before any device work."""

from __future__ import annotations

import argparse
import importlib.util
import os

from .choices import OPS, ROUTINGS, WORLDS

VARIANT_HELP = (
    "a variant to time, repeatable (default: one, 'default': the configuration as given). "
    "SPEC is 'default' or comma-separated items: a bool parameter's name sets it to true "
    "(ep_final_layout), KEY:VALUE sets num_threads, n_sms, timeout_ns or a bool "
    "(num_threads:1024, ep_ord_r:false); 'fused' runs the single-launch kernel, 'batched' "
    "launches every rank's grid at once (one launch, EmulatedWorld only), 'graph' "
    "replays the round trip as a captured CUDA graph (round trip timed only); LABEL names "
    "it in the table, JSON and plot (default: SPEC). E.g. --variant default --variant "
    "final=ep_final_layout,ep_prod_reserve --variant g=graph")


def _arg_type(parse, name):
    """An argparse ``type`` whose ``ValueError`` message reaches the usage error. ``parse`` is a
    function, or the name of one of ``plan``'s, imported when an option is parsed: building
    the parser (every ``epgen`` start) needs neither ``plan`` nor the configuration it
    imports (the token formats and ml_dtypes)."""
    def convert(text):
        if isinstance(parse, str):
            from . import plan
            fn = getattr(plan, parse)
        else:
            fn = parse
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = name
    return convert


def _positive(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise ValueError(f"must be a positive integer, got {n}")
    return n


def _capacity(text: str):
    if text in ("fit", "full"):
        return text
    try:
        return _positive(text)
    except ValueError:
        raise ValueError(f"must be 'fit', 'full' or a positive integer, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser, tokens_default: str) -> None:
    """Add the options of a run (shapes, variants, measurement, output) to ``p``;
    ``tokens_default`` describes the default shapes in the help."""
    positive = _arg_type(_positive, "positive integer")
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--tokens", nargs="+", type=_arg_type("parse_tokens", "token list"),
                        metavar="T", help=f"tokens per rank, one shape each: '128,4096' or "
                                          f"'128 4096' (default: {tokens_default})")
    shapes.add_argument("--sweep-tokens", type=_arg_type("parse_sweep", "sweep"),
                        metavar="LO,[NEXT,]...,HI",
                        help="a geometric sweep of tokens per rank: '32,...,4096' or "
                             "'32,64,...,4096' doubles from 32 to 4096; '128,512,...,8192' "
                             "multiplies by 4")
    p.add_argument("--variant", action="append", type=_arg_type("parse_variant", "variant"),
                   metavar="[LABEL=]SPEC", help=VARIANT_HELP)
    p.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="top-k routing: uniform, or Zipf-like expert popularity (a few hot "
                        "experts; default uniform)")
    p.add_argument("--zipf-s", type=float, default=0.8, metavar="S",
                   help="Zipf exponent of --routing zipf (default 0.8; popularity 1/rank^s over "
                        "shuffled experts). The hottest (expert, source) block sets the receive "
                        "buffers' size: at the prefill shape ~101 GB at s=0.8, ~129 GB at 1.0")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--sets", type=positive, default=3, dest="input_sets", metavar="N",
                   help="input sets rotated through the iterations (default 3)")
    p.add_argument("--iters", type=positive, default=None, metavar="N",
                   help="timed iterations per figure (default: 100 at <= 512 tokens per rank, "
                        "else 20; --world shmem: 50)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed iterations first (default: 10 at <= 512 tokens, else 3; "
                        "--world shmem: 5)")
    p.add_argument("--block-capacity", type=_arg_type(_capacity, "capacity"), default="fit",
                   metavar="fit|full|N",
                   help="recv_block_capacity: 'fit' (default: the inputs' largest (expert, "
                        "source) block, rounded up to 64), 'full' (max_tokens_per_rank, the "
                        "reference sizing; ~152 GB at prefill) or a number")
    p.add_argument("--copy-mib", type=positive, default=1024, metavar="MIB",
                   help="device-to-device copy size in MiB (default 1024)")
    p.add_argument("--copy-iters", type=positive, default=20, metavar="N",
                   help="timed copies (default 20)")
    p.add_argument("--mem-fraction", type=float, default=0.9, metavar="F",
                   help="skip a phase needing more than this fraction of the free device "
                        "memory (default 0.9)")
    p.add_argument("--device", type=int, default=0, metavar="N",
                   help="CUDA device ordinal (default 0)")
    p.add_argument("--check-rank", type=int, default=0, metavar="R",
                   help="rank whose baseline output is checked (default 0)")
    p.add_argument("--no-gate", action="store_true",
                   help="no spin kernel ahead of the start event: times include host enqueue "
                        "(--world p2p times epgen as its NCCL baseline, host enqueue included, "
                        "always; there the gate is the peer copies' only)")
    p.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--no-post-check", action="store_true",
                   help="skip the check of each world's output after the timing (--world "
                        "shmem: every check, before the timing too)")
    p.add_argument("--world", choices=WORLDS, default="emulated",
                   help="emulated (default): every rank on one GPU, against a device copy and "
                        "the PyTorch baseline; p2p: one GPU per rank (P2PWorld), against the "
                        "peer-copy (NVLink) bandwidth and torch.distributed NCCL all-to-all "
                        "plus a permute (needs >= 2 GPUs; default preset 'default'); shmem: "
                        "one process per PE under 'epgen launch -n N' (ShmemWorld), each PE "
                        "timing its own rank on its stream (--iters default 50, --warmup 5), "
                        "rank 0 adding the slowest PE per call; no baseline, no gate")
    p.add_argument("--devices", metavar="LIST",
                   help="with --world p2p: the GPU of each rank, comma-separated (default: "
                        "rank r on GPU r)")
    p.add_argument("--op", choices=OPS, default="dispatch",
                   help="what to time: dispatch (the round trip, the default), combine (the "
                        "combine alone, each sample after an untimed dispatch; on the "
                        "emulated world vs a torch index_copy + weighted sum) or moe "
                        "(dispatch + combine back to back; emulated: vs the dispatch "
                        "baseline then the combine's); every world, timed as its dispatch "
                        "is; transform-free (each received row goes back as it came; the "
                        "quantising formats send fixed BF16 rows); --world p2p has no NCCL "
                        "baseline for combine and moe")
    p.add_argument("--combine-fp8", action="store_true",
                   help="with --op combine (--world emulated or shmem): time the FP8 combine "
                        "(combine(fp8=True): rows sent as E4M3 with a float32 scale per 128 "
                        "elements) after the BF16 one in the same run, the same way, and "
                        "report both and their ratio; hid_dim a multiple of 128")
    p.add_argument("--combine-partial", action="store_true",
                   help="with --op combine (--world emulated or shmem): time the "
                        "partial-reduce "
                        "combine (combine(partial_reduce=True): each destination sums its "
                        "experts' weighted rows of a token and sends one row back) after the "
                        "plain one of the same dispatches, the same way, and report both and "
                        "their ratio; on each variant with ep_rank_dedup (e.g. --variant "
                        "dedup=ep_rank_dedup), the others say why not (--world shmem: the "
                        "configuration needs it); not with "
                        "--combine-fp8 (the kernels do not build an FP8 partial reduce)")
    p.add_argument("--compare-p2p", type=_arg_type("parse_p2p_sizes", "p2p_world_size list"),
                   metavar="P,Q[,...]",
                   help="with --world shmem: time every p2p_world_size of the list in the "
                        "same run, one world after the other on one NVSHMEM session, and "
                        "report each one's median against the largest's as 'x of direct "
                        "stores' (its median / this one's: 1.0 is as fast); e.g. 1,4 on 4 "
                        "PEs: every peer by SHMEM puts against every peer by nvshmem_ptr "
                        "stores. Replaces --set p2p_world_size; below n_ranks needs --set "
                        "use_shmem=true")
    p.add_argument("--copy-rate", action="store_true",
                   help="with --world shmem: after each shape on the world of the smallest "
                        "p2p_world_size, copy the bytes that shape's dispatch sends from its "
                        "busiest PE to the other PEs by each way a dispatch can (warp stores "
                        "through nvshmem_ptr, NVSHMEM warp puts, warp puts with a signal "
                        "each) on the world's grid, and report each one's GB/s per PE and "
                        "its ratio to the stores (every PE must be reachable by "
                        "nvshmem_ptr: one node; two message-sized symmetric buffers more per "
                        "PE)")
    p.add_argument("--api", choices=("numpy", "torch", "deepep"), default="numpy",
                   help="torch: after the figures above, the cost of the device-side API "
                        "(epgen.torch.EPBuffer) in the same run: host time per dispatch and "
                        "combine call per rank, and the dispatch + combine round trip on the "
                        "stream against its CUDA-graph replay (emulated world; needs torch). "
                        "deepep: the DeepEP-compatible API (epgen.deepep.Buffer, BF16 and "
                        "FP8) against EPBuffer on the same kernels in the same run: host time "
                        "per call and the round trip on the device")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw a PNG: round-trip GB/s against tokens per rank for each variant "
                        "and the baseline, the copy bandwidth as a line (with --world p2p: "
                        "GB/s per GPU over the links, NCCL, the peer copy; needs matplotlib)")


PARTIAL_WITH_FP8 = ("argument --combine-partial: not with --combine-fp8 (the partial-reduce "
                    "combine is not built with fp8=True: the kernels refuse the pair)")


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _check_output(parser, option: str, path: str | None) -> None:
    if path and not os.path.isdir(os.path.dirname(path) or "."):
        parser.error(f"argument {option}: no such directory: {os.path.dirname(path)}")


def parse_devices(parser, text: str | None, world: str, n_ranks: int):
    """``--devices`` as a tuple of GPU ordinals, one per rank (None when not given); a usage
    error when malformed or given without ``--world p2p``."""
    if text is None:
        return None
    if world != "p2p":
        parser.error("argument --devices: only with --world p2p")
    try:
        devices = tuple(int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"argument --devices: expected GPU ordinals like 0,1,2,3, got {text!r}")
    if len(devices) != n_ranks or min(devices) < 0:
        parser.error(f"argument --devices: expected {n_ranks} GPU ordinals >= 0 (one per "
                     f"rank), got {text!r}")
    return devices


def plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, base,
                   default_tokens, arch: str | None = None):
    """The ``plan.Plan`` of parsed ``args`` on the base configuration ``base``; ``parser.error``
    (exit 2, naming the option) for any value that cannot run."""
    if args.tokens:
        tokens = [t for group in args.tokens for t in group]
    else:
        tokens = args.sweep_tokens or list(default_tokens)
    tokens = list(dict.fromkeys(tokens))
    if args.warmup is not None and args.warmup < 0:
        parser.error("argument --warmup: must be >= 0")
    if not 0 < args.mem_fraction <= 1:
        parser.error("argument --mem-fraction: must be in (0, 1]")
    if args.zipf_s <= 0:
        parser.error("argument --zipf-s: must be > 0")
    if base.recv_block_capacity is not None:
        parser.error("recv_block_capacity is set per shape here: use --block-capacity, not "
                     "--set or the preset")
    if not 0 <= args.check_rank < base.n_ranks:
        parser.error(f"argument --check-rank: must be in [0, {base.n_ranks})")
    labels = [v.label for v in args.variant or ()]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        parser.error(f"argument --variant: label {dup[0]!r} used twice; name them LABEL=SPEC")
    _check_output(parser, "--json", args.json)
    _check_output(parser, "--plot", args.plot)
    if args.plot and not have_matplotlib():
        parser.error("argument --plot: needs matplotlib (python3 -m pip install matplotlib)")
    world = getattr(args, "world", "emulated")
    devices = parse_devices(parser, getattr(args, "devices", None), world, base.n_ranks)
    op = getattr(args, "op", "dispatch")
    if world == "shmem":
        parser.error("argument --world shmem: one process per PE: run 'epgen launch -n N -- "
                     "epgen bench --world shmem ...' (shmem_plan_from_args)")
    if getattr(args, "compare_p2p", None):
        parser.error("argument --compare-p2p: only with --world shmem (a P2P or emulated "
                     "world reaches every rank by direct stores)")
    if getattr(args, "copy_rate", False):
        parser.error("argument --copy-rate: only with --world shmem (it times NVSHMEM puts "
                     "against stores between PEs)")
    graph = any(dict(v.overrides).get("graph") for v in args.variant or ())
    if op == "combine" and graph:
        parser.error("argument --variant: graph times a whole replay: with --op moe or "
                     "dispatch, not --op combine")
    if op == "moe" and graph and world != "emulated":
        parser.error(f"argument --variant: graph with --op moe replays a captured dispatch + "
                     f"combine (EmulatedWorld.capture_moe): --world emulated only, not "
                     f"{world}")
    combine_fp8 = bool(getattr(args, "combine_fp8", False))
    if combine_fp8 and (op != "combine" or world == "p2p"):
        parser.error(f"argument --combine-fp8: times the FP8 combine next to the BF16 one: "
                     f"with --op combine on --world emulated or shmem, not --op {op} --world "
                     f"{world}")
    combine_partial = bool(getattr(args, "combine_partial", False))
    if combine_partial and (op != "combine" or world == "p2p"):
        parser.error(f"argument --combine-partial: times the partial-reduce combine next to "
                     f"the plain one: with --op combine on --world emulated or shmem, not --op "
                     f"{op} --world {world}")
    if combine_partial and combine_fp8:
        parser.error(PARTIAL_WITH_FP8)
    kw = {"variants": tuple(args.variant)} if args.variant else {}
    kw.update(world=world, devices=devices, op=op, combine_fp8=combine_fp8,
              combine_partial=combine_partial)
    from .plan import Plan
    plan = Plan(base=base, tokens=tuple(tokens), routing=args.routing, zipf_s=args.zipf_s,
                seed=args.seed, sets=args.input_sets, iters=args.iters, warmup=args.warmup,
                block_capacity=args.block_capacity, copy_mib=args.copy_mib,
                copy_iters=args.copy_iters, mem_fraction=args.mem_fraction, device=args.device,
                check_rank=args.check_rank, gate=not args.no_gate,
                baseline=not args.no_baseline, post_check=not args.no_post_check, arch=arch,
                **kw)
    for T in plan.tokens:           # every configuration error now, before any GPU work
        try:
            plan.config(T)
        except ValueError as exc:
            parser.error(f"argument --tokens: {T} tokens per rank: {exc}")
        for v in plan.variants:
            try:
                plan.config(T, v)
            except ValueError as exc:
                parser.error(f"argument --variant {v.label} (at {T} tokens per rank): {exc}")
            if op != "dispatch":
                try:
                    plan.check_op(T, v)
                except ValueError as exc:
                    parser.error(f"argument --op {op}: variant {v.label}: {exc}")
                if combine_fp8:
                    try:
                        plan.check_combine_fp8(T, v)
                    except ValueError as exc:
                        parser.error(f"argument --combine-fp8: variant {v.label}: {exc}")
    return plan


def apply_compare_p2p(args: argparse.Namespace) -> None:
    """With ``--world shmem --compare-p2p P,Q``: the configuration is built at the smallest
    ``p2p_world_size`` of the list (appended to ``--set``), so a preset's own value need not
    suit the PE count and the configuration is the one that reaches peers by SHMEM; each
    world then takes its own size (``ShmemPlan.config``, each checked by
    ``shmem_plan_from_args``). Call before ``config_from_args``."""
    if getattr(args, "world", None) == "shmem" and getattr(args, "compare_p2p", None):
        args.sets = [*args.sets, f"p2p_world_size={min(args.compare_p2p)}"]


SHMEM_REFUSED = (
    ("--variant", "variant", "the SHMEM benchmark times the configuration as given (--set)"),
    ("--routing", "routing", "the SHMEM benchmark routes uniformly"),
    ("--sets", "input_sets", "the SHMEM benchmark loads one input set per shape"),
    ("--block-capacity", "block_capacity",
     "ShmemWorld sizes its receive blocks at full capacity"),
    ("--devices", "devices", "each PE takes its GPU from LOCAL_RANK"),
    ("--device", "device", "each PE takes its GPU from LOCAL_RANK"),
    ("--check-rank", "check_rank", "each PE checks its own rank"),
    ("--plot", "plot", "the SHMEM benchmark draws no plot"),
    ("--copy-mib", "copy_mib", "the SHMEM benchmark measures no device copy"),
    ("--copy-iters", "copy_iters", "the SHMEM benchmark measures no device copy"),
    ("--mem-fraction", "mem_fraction", "the SHMEM benchmark skips no phase for memory"),
)
"""Options ``--world shmem`` refuses when given (option, ``dest``, why): it would ignore
them."""


def shmem_plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, base,
                         arch: str | None = None):
    """The ``plan.ShmemPlan`` of parsed ``args`` (``--world shmem``) on ``base``;
    ``parser.error`` (exit 2, naming the option and the rule) for an option the SHMEM
    benchmark would ignore (``SHMEM_REFUSED``) and for any configuration that cannot run:
    every ``--compare-p2p`` size and shape is built and checked here, before NVSHMEM
    starts."""
    from ..runtime.shmem_world import check_transport
    from .plan import ShmemPlan

    for option, dest, why in SHMEM_REFUSED:
        if getattr(args, dest, None) != parser.get_default(dest):
            parser.error(f"argument {option}: not with --world shmem ({why})")
    if args.warmup is not None and args.warmup < 0:
        parser.error("argument --warmup: must be >= 0")
    _check_output(parser, "--json", args.json)
    if args.tokens:
        tokens = [t for group in args.tokens for t in group]
    else:
        tokens = args.sweep_tokens or [base.max_tokens_per_rank]
    kw = {k: v for k, v in (("iters", args.iters), ("warmup", args.warmup)) if v is not None}
    for option, dest in (("--combine-fp8", "combine_fp8"),
                         ("--combine-partial", "combine_partial")):
        if getattr(args, dest, False) and args.op != "combine":
            parser.error(f"argument {option}: times an extra combine next to the plain one: "
                         f"with --op combine, not --op {args.op}")
    if getattr(args, "combine_partial", False) and getattr(args, "combine_fp8", False):
        parser.error(PARTIAL_WITH_FP8)
    plan = ShmemPlan(base=base, tokens=tuple(dict.fromkeys(tokens)), op=args.op,
                     p2p_sizes=args.compare_p2p, seed=args.seed,
                     check=not args.no_post_check, arch=arch,
                     combine_fp8=bool(getattr(args, "combine_fp8", False)),
                     combine_partial=bool(getattr(args, "combine_partial", False)),
                     copy_rate=bool(getattr(args, "copy_rate", False)), **kw)
    option = "--compare-p2p" if args.compare_p2p else "--set"
    for p in plan.sizes:
        try:
            check_transport(plan.config(p))
            plan.check_op(p)
        except ValueError as exc:
            parser.error(f"argument {option}: p2p_world_size={p}: {exc}")
    return plan
