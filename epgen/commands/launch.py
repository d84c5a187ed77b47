"""``epgen launch -n N -- CMD``: N processes of CMD, one per rank, with the torchrun rank
variables (``epgen.launch``)."""

from __future__ import annotations

import argparse
import shutil

from .common import PROG

HELP = ("start N processes of a command, one per rank, with the torchrun rank variables and "
        "a bootstrap directory (for --world shmem); prefixed output, first failure stops the "
        "rest")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                   help="processes to start, one per rank (RANK 0..N-1)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="kill every process after SECONDS and exit 124 (default: no limit)")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="after the first failure, SIGTERM the others and SIGKILL them after "
                        "SECONDS (default: 5)")
    p.add_argument("--keep-going", action="store_true",
                   help="let the others run to their end after a failure (the survivors of "
                        "a rank mask); the status is still the first failure's")
    p.add_argument("--mps-share", action="store_true",
                   help="set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=floor(100/N) in every process "
                        "(several PEs on one GPU under MPS)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                   help="the command and its arguments (after --)")
    p.epilog = (f"example: {PROG} launch -n 2 -- python -m epgen run --world shmem --preset "
                f"small --set use_shmem=true --set p2p_world_size=1")


def run(args: argparse.Namespace) -> int:
    from epgen.launch import launch

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        args.parser.error("no command given: epgen launch -n N -- CMD ...")
    if shutil.which(cmd[0]) is None:
        args.parser.error(f"argument CMD: {cmd[0]!r} is not an executable file or a command "
                          f"on PATH")
    if args.nproc < 1:
        args.parser.error(f"argument -n: must be >= 1, got {args.nproc}")
    if args.timeout is not None and args.timeout <= 0:
        args.parser.error(f"argument --timeout: must be > 0, got {args.timeout}")
    return launch(cmd, args.nproc, timeout_s=args.timeout, mps_share=args.mps_share,
                  grace_s=args.grace, keep_going=args.keep_going)
