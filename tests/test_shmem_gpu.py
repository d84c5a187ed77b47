"""``ShmemWorld`` on the GPU: one process per PE under ``epgen launch``, NVSHMEM between
them, every PE on the GPUs this machine has (several PEs share a GPU: best under MPS, see
benchmarks/shmem_session.sh). Each test runs ``epgen launch -n N -- python -m epgen run
--world shmem ...`` with ``NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1`` and a
timeout, and reads every rank's verdict from the prefixed output.

Skipped without a GPU (the ``gpu`` marker) or without the NVSHMEM wheel
(``pip install 'epgen[shmem]'``). ``EPGEN_SHMEM_PES`` (default ``2,4``) lists the PE counts
of the parametrised tests; ``EPGEN_SHMEM_TIMEOUT`` (default 300) bounds each launch in
seconds.

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_shmem_gpu.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from backends.cuda import nvshmem_host

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PES = [int(x) for x in os.environ.get("EPGEN_SHMEM_PES", "2,4").split(",") if x]
TIMEOUT = float(os.environ.get("EPGEN_SHMEM_TIMEOUT", "300"))
FORMATS = ("BF16", "BlockwiseFP8", "NVFP4", "MXFP8")


@pytest.fixture(autouse=True, scope="module")
def _nvshmem_wheel():
    try:
        nvshmem_host.find_host_library()
    except nvshmem_host.NvshmemUnavailableError as e:
        pytest.skip(str(e))


def launch(n: int, run_args: list[str], timeout: float = TIMEOUT, mps_share: bool = False):
    """``epgen launch -n n -- python -m epgen run --world shmem --preset small ...``: the
    completed process (stdout and stderr as text)."""
    env = {**os.environ, "PYTHONPATH": REPO, "NVSHMEM_REMOTE_TRANSPORT": "none",
           "NVSHMEM_DISABLE_NVLS": "1"}
    mps = ["--mps-share"] if mps_share or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else []
    cmd = [sys.executable, "-m", "epgen", "launch", "-n", str(n), "--timeout", str(timeout),
           "--grace", "10", *mps, "--", sys.executable, "-m", "epgen", "run", "--world",
           "shmem", "--preset", "small", "--set", "use_shmem=true", *run_args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout + 60)


#: blocks per PE when 8 PEs share one GPU: under MPS each PE gets 12% of the SMs (14 of 132,
#: 56 co-resident blocks of 256 threads), and all of a call's grids must be resident at once
N_SMS_8_PES = 6


def group(n: int, p2p: int) -> list[str]:
    sms = ["--set", f"n_sms={N_SMS_8_PES}"] if n >= 8 else []
    return ["--set", f"n_ranks={n}", "--set", f"p2p_world_size={p2p}", *sms]


def assert_all_match(proc, n: int, calls: int):
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    for r in range(n):
        got = re.findall(rf"^\[rank {r}\] rank {r} call \d+: .* matches the reference$",
                         proc.stdout, re.M)
        assert len(got) == calls, f"rank {r}: {len(got)} of {calls} calls matched\n{text[-6000:]}"


@pytest.mark.parametrize("n", PES)
def test_every_peer_by_shmem(n):
    """p2p_world_size=1: every destination but itself by put + signal."""
    proc = launch(n, group(n, 1) + ["--calls", "3", "--seed", "1"])
    assert_all_match(proc, n, 3)


@pytest.mark.parametrize("n", [n for n in PES if n >= 4])
def test_p2p_groups_and_shmem_between_them(n):
    """p2p_world_size=2: the group's peer by nvshmem_ptr stores, the others by SHMEM."""
    proc = launch(n, group(n, 2) + ["--calls", "3", "--seed", "2"])
    assert_all_match(proc, n, 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats(fmt):
    n = max(p for p in PES if p <= 4)
    proc = launch(n, group(n, 2 if n >= 4 else 1) + ["--set", f"format={fmt}", "--calls", "2",
                                                     "--seed", "3"])
    assert_all_match(proc, n, 2)


def test_ord_r():
    n = max(p for p in PES if p <= 4)
    proc = launch(n, group(n, 2 if n >= 4 else 1) + ["--set", "ep_ord_r=true", "--set",
                                                     "has_rank_flag=true", "--calls", "2"])
    assert_all_match(proc, n, 2)


def test_fused():
    proc = launch(2, group(2, 1) + ["--fused", "--calls", "2"])
    assert_all_match(proc, 2, 2)


def test_dead_peer_times_out():
    """Rank 1 exits right before its first call without closing: rank 0's bounded waits
    expire (EPTimeoutError), it exits non-zero within the deadline and the launch ends."""
    timeout_ns = 500_000_000
    t0 = time.monotonic()
    proc = launch(2, group(2, 1) + ["--set", f"timeout_ns={timeout_ns}", "--drop-rank", "1",
                                    "--calls", "2"], timeout=180)
    took = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), text[-6000:]
    assert "[rank 1] rank 1: --drop-rank: exiting before call 0" in proc.stdout
    assert re.search(r"^\[rank 0\] epgen: error: \d+ bounded wait\(s\) expired", proc.stderr,
                     re.M), text[-6000:]
    # two kernels' deadlines, the shortened close barrier, process start and NVSHMEM init
    assert took < 120, f"took {took:.0f} s\n{text[-3000:]}"


def test_1000_calls():
    proc = launch(2, group(2, 1) + ["--calls", "1000", "--tokens", "8", "--seed", "4"],
                  timeout=TIMEOUT)
    assert_all_match(proc, 2, 1000)
