"""``epgen bench``: time the dispatch round trip (or ``--op combine|moe``) of a
configuration's variants on a world against a device-to-device copy and the PyTorch baseline
(``epgen.bench``)."""

from __future__ import annotations

import argparse

from .common import PROG, CommandError, add_config, check_output_path, config_from_args

HELP = ("on a GPU: time the dispatch round trip (dispatch_async, dispatch_wait), the combine "
        "(--op combine) or both (--op moe) of one or more variants on an EmulatedWorld "
        "against a device-to-device copy and the PyTorch baseline; on one GPU per rank "
        "(--world p2p) or one process per PE (--world shmem, under epgen launch); table, "
        "JSON, PNG plot")

BENCH_PRESET = "decode"
"""The preset ``epgen bench`` uses without ``--preset``: 8 emulated ranks that fit one H200
(the ``default`` preset's 8 x 132 blocks of 1024 threads do not)."""

P2P_BENCH_PRESET = "default"
"""The preset ``epgen bench --world p2p`` uses without ``--preset``: 8 ranks, one GPU each,
132 blocks of 1024 threads per rank."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from epgen.bench import options

    add_config(p, default=BENCH_PRESET)
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
  {PROG} bench --world p2p --op moe --tokens 128,4096
                                                 dispatch + combine on one GPU per rank
  {PROG} launch -n 4 --mps-share -- {PROG} bench --world shmem --op moe \\
      --preset decode --set n_ranks=4 --set n_experts=28 --set n_sms=8 \\
      --set use_shmem=true --tokens 128 --compare-p2p 1,4
                                                 4 PEs on one GPU: every peer by SHMEM
                                                 puts against every peer by direct stores

Progress goes to stderr, the report and table to stdout. Exit status 1 when there is no
GPU, a phase fails or a check fails; 2 for a bad option (before any GPU work)."""


def default_preset(world: str) -> str:
    """The preset ``epgen bench --world WORLD`` uses without ``--preset``."""
    return P2P_BENCH_PRESET if world == "p2p" else BENCH_PRESET


def run(args: argparse.Namespace) -> int:
    from epgen.bench import driver, options

    check_output_path(args.parser, "--json", args.json)
    check_output_path(args.parser, "--plot", args.plot)
    options.apply_compare_p2p(args)
    cfg, _ = config_from_args(args, default=default_preset(args.world))
    if args.api in ("torch", "deepep") and args.world != "emulated":
        args.parser.error(f"argument --api {args.api}: only with --world emulated")
    if args.world == "shmem":
        plan = options.shmem_plan_from_args(args.parser, args, cfg, arch=args.arch)
        from epgen.bench import shmem

        failures = shmem.run(plan, json_path=args.json)["failures"]
        if failures:
            raise CommandError("bench: " + "; ".join(failures))
        return 0
    plan = options.plan_from_args(args.parser, args, cfg, [cfg.max_tokens_per_rank],
                                  arch=args.arch)
    results = driver.execute(plan, json_path=args.json, plot_path=args.plot)
    failures = list(results["failures"])
    if args.api in ("torch", "deepep"):
        failures += _api_costs(args, plan)
    if failures:
        raise CommandError("bench: " + "; ".join(failures))
    return 0


def _api_costs(args: argparse.Namespace, plan) -> list[str]:
    """``--api torch``: the cost of ``epgen.torch.EPBuffer`` in the same run, added to the
    JSON report under ``torch_api``; ``--api deepep``: ``epgen.deepep.Buffer`` against
    ``EPBuffer``, under ``deepep_api``. Returns the failures."""
    import json

    from epgen.bench import deepep_api, torch_api

    module = torch_api if args.api == "torch" else deepep_api
    records, failures = module.run(args, plan)
    if args.json:
        with open(args.json) as f:
            data = json.load(f)
        data[f"{args.api}_api"] = records
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return failures
