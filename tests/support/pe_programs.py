"""A test file run as each PE's program under ``epgen launch`` (one process per rank, MPS
when the session started it): ``launch_pe_program`` starts ``n`` of them and checks that each
printed its verdict line; ``gloo_group`` is what a PE program starts with (the rank, the size
and a gloo process group from the launcher's directory, the GPU set), ``pe_passed`` what it
ends with (the verdict line, the group destroyed), ``die`` how a PE dies on purpose."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: ``EPGEN_SHMEM_PES``: the PE counts of the parametrised tests (default 2 and 4)
PES = [int(x) for x in os.environ.get("EPGEN_SHMEM_PES", "2,4").split(",") if x]
#: ``EPGEN_SHMEM_TIMEOUT``: the bound of one launch in seconds (default 300)
TIMEOUT = float(os.environ.get("EPGEN_SHMEM_TIMEOUT", "300"))


def launch_pe_program(script: str, args: list[str], n: int, verdict: str, *,
                      keep_going: bool = False, survivors=None) -> None:
    """``epgen launch -n n -- python script pe ARGS...``; asserts that every rank ``r`` of
    ``survivors`` (default every rank) printed ``rank r: <verdict>`` and, unless
    ``keep_going`` (``epgen launch --keep-going``: a rank is killed on purpose and the others
    run to their end), that the launch exited 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests",
                                                                           "support")]),
           "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_NVLS": "1"}
    mps = ["--mps-share"] if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else []
    keep = ["--keep-going"] if keep_going else []
    cmd = [sys.executable, "-m", "epgen", "launch", "-n", str(n), "--timeout", str(TIMEOUT),
           "--grace", "10", *keep, *mps, "--", sys.executable, os.path.abspath(script), "pe",
           *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT + 60)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 124 and (keep_going or proc.returncode == 0), text[-6000:]
    for r in (range(n) if survivors is None else survivors):
        assert re.search(rf"^\[rank {r}\] rank {r}: {re.escape(verdict)}$", proc.stdout,
                         re.M), text[-6000:]


def gloo_group(store: str):
    """``(rank, size, dist)`` of this PE program: GPU 0 current, a gloo group initialised
    through the file ``store`` in the launcher's directory."""
    import torch
    import torch.distributed as dist

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    path = os.path.join(os.environ["EPGEN_LAUNCH_DIR"], store)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    return rank, n, dist


def pe_passed(dist, rank: int, verdict: str) -> int:
    """The end of a PE program whose checks passed: prints ``rank <rank>: <verdict>`` (the
    line ``launch_pe_program`` looks for), destroys the process group; returns 0, the exit
    status."""
    print(f"rank {rank}: {verdict}", flush=True)
    dist.destroy_process_group()
    return 0


def die(rank: int, what: str) -> None:
    """PE ``rank`` dies now (SIGKILL), ``what`` says where, as a process alone on its GPU
    would. Under MPS every PE is a client of one server, and a client killed with GPU work
    in flight leaves that server, and so every other client, in an undefined state (NVIDIA's
    MPS guide, "Client Early Termination"); so the MPS control daemon is first asked to
    ``terminate_client`` this process, which ends its work without touching the other
    clients, as a GPU's driver does for a process that dies alone on its GPU."""
    print(f"rank {rank}: killed {what}", flush=True)
    control = shutil.which("nvidia-cuda-mps-control")
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") and control:
        said = _mps_control(control, "get_server_list")
        for server in said.split():
            if server.isdigit():
                answer = _mps_control(control, f"terminate_client {server} {os.getpid()}")
                print(f"rank {rank}: terminate_client {server} {os.getpid()}: "
                      f"{answer.strip() or 'done'}", flush=True)
        from cuda.bindings import driver      # returns once the server has ended our work
        driver.cuCtxSynchronize()
    os.kill(os.getpid(), signal.SIGKILL)


def _mps_control(control: str, command: str) -> str:
    """One command to the MPS control daemon; its answer (stdout and stderr)."""
    done = subprocess.run([control], input=command + "\n", capture_output=True, text=True,
                          timeout=30)
    return done.stdout + done.stderr
