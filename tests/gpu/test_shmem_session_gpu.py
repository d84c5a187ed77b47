"""Two ``ShmemWorld``\\ s alive at once on one ``ShmemSession`` on the GPU: one process per PE
under ``epgen launch`` (as tests/gpu/test_shmem_gpu.py runs them; several PEs on one GPU:
best under MPS), NVSHMEM initialised once per process and shared by a BF16 world and a
BlockwiseFP8 world whose calls interleave, each call (dispatch, then combine) checked against
the numpy reference (``test_shmem_gpu.combine_rounds``). Then the BF16 world closes on its
own (its symmetric memory freed, NVSHMEM left up), the FP8 world runs once more, and leaving
the session closes the FP8 world and finalises NVSHMEM.

The test launches this file itself as each PE's program (``python
tests/gpu/test_shmem_session_gpu.py pe ...``, ``session_pe``). Skipped without a GPU (the
``gpu`` marker) or without the NVSHMEM wheel; ``EPGEN_SHMEM_PES`` and
``EPGEN_SHMEM_TIMEOUT`` as in tests/gpu/test_shmem_gpu.py.

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_shmem_session_gpu.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import test_shmem_gpu as shmem_gpu

pytestmark = pytest.mark.gpu

#: the worlds of every PE's session, in creation order
FORMATS = ("BF16", "BlockwiseFP8")


@pytest.fixture(autouse=True, scope="module")
def _nvshmem_wheel(nvshmem_wheel):
    """Every test here needs the NVSHMEM wheel (``nvshmem_wheel``, tests/conftest.py)."""


def launch_session(n: int, args: list[str], timeout: float = shmem_gpu.TIMEOUT):
    """``epgen launch -n n -- python tests/gpu/test_shmem_session_gpu.py pe ARGS``."""
    env = {**os.environ, "PYTHONPATH": shmem_gpu.PE_PYTHONPATH,
           "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_NVLS": "1"}
    mps = ["--mps-share"] if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else []
    cmd = [sys.executable, "-m", "epgen", "launch", "-n", str(n), "--timeout", str(timeout),
           "--grace", "10", *mps, "--", sys.executable, os.path.abspath(__file__), "pe", *args]
    return subprocess.run(cmd, cwd=shmem_gpu.REPO, env=env, capture_output=True, text=True,
                          timeout=timeout + 60)


@pytest.mark.parametrize("n", shmem_gpu.PES)
def test_two_formats_on_one_session(n):
    """p2p_world_size 1 on 2 PEs (every peer by put and signal), 2 on more (nvshmem_ptr
    stores inside a pair, SHMEM between pairs)."""
    p2p = 1 if n <= 2 else 2
    calls = 3
    proc = launch_session(n, ["--n-ranks", str(n), "--p2p", str(p2p), "--calls", str(calls),
                              "--seed", "11"])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    for r in range(n):
        for fmt, want in (("BF16", calls), ("BlockwiseFP8", calls + 1)):
            got = re.findall(rf"^\[rank {r}\] {fmt} rank {r} call 0: combine matches the "
                             rf"reference$", proc.stdout, re.M)
            assert len(got) == want, f"rank {r} {fmt}: {len(got)} of {want}\n{text[-6000:]}"
        assert re.search(rf"^\[rank {r}\] rank {r}: BF16 closed, NVSHMEM up$", proc.stdout,
                         re.M), text[-6000:]
        assert re.search(rf"^\[rank {r}\] rank {r}: session closed, every world closed, "
                         rf"NVSHMEM finalised$", proc.stdout, re.M), text[-6000:]


def session_config(fmt: str, n: int, p2p: int):
    """``test_shmem_gpu.combine_config`` in token format ``fmt``."""
    from epgen import presets

    table = {**presets.preset_data("small"), "n_ranks": n, "p2p_world_size": p2p,
             "use_shmem": True, "format": fmt}
    if n >= 8:
        table["n_sms"] = shmem_gpu.N_SMS_8_PES
    return presets.config_from_dict(table)


def session_pe(argv: list[str]) -> int:
    """One PE's program (module docstring): exit status 0 when every call matched; at the
    first mismatch it exits 1 at once, so the launcher stops the others."""
    import argparse

    from epgen.runtime.shmem_session import ShmemSession
    from epgen.runtime.shmem_world import ShmemWorld

    ap = argparse.ArgumentParser(prog="test_shmem_session_gpu.py pe")
    ap.add_argument("--n-ranks", type=int, required=True)
    ap.add_argument("--p2p", type=int, required=True)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    def one_call(fmt, world, call):
        ok = shmem_gpu.combine_rounds(world, 1, args.seed * 1000 + call,
                                      say=lambda line: print(f"{fmt} {line}", flush=True))
        if not ok:
            sys.stdout.flush()
            os._exit(1)

    with ShmemSession() as session:
        me = session.rank
        worlds = {fmt: ShmemWorld(session_config(fmt, args.n_ranks, args.p2p), session=session)
                  for fmt in FORMATS}
        assert session.worlds == tuple(worlds.values())
        for call in range(args.calls):
            for fmt, world in worlds.items():
                one_call(fmt, world, call)
        worlds["BF16"].close()
        if session.worlds == (worlds["BlockwiseFP8"],) and not session.finalized:
            print(f"rank {me}: BF16 closed, NVSHMEM up", flush=True)
        one_call("BlockwiseFP8", worlds["BlockwiseFP8"], args.calls)
    if session.finalized and session.worlds == () and all(w.finalized for w in worlds.values()):
        print(f"rank {me}: session closed, every world closed, NVSHMEM finalised", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["pe"]:
        sys.exit("usage: test_shmem_session_gpu.py pe --n-ranks N --p2p P [--calls C] "
                 "[--seed S]")
    sys.exit(session_pe(sys.argv[2:]))
