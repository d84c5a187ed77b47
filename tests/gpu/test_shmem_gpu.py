"""``ShmemWorld`` on the GPU: one process per PE under ``epgen launch``, NVSHMEM between
them, every PE on the GPUs this machine has (several PEs share a GPU: best under MPS, see
benchmarks/shmem_session.sh). Each test runs ``epgen launch -n N -- python -m epgen run
--world shmem ...`` with ``NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1`` and a
timeout, and reads every rank's verdict from the prefixed output.

Skipped without a GPU (the ``gpu`` marker) or without the NVSHMEM wheel
(``pip install 'epgen[shmem]'``). ``EPGEN_SHMEM_PES`` (default ``2,4``) lists the PE counts
of the parametrised tests; ``EPGEN_SHMEM_TIMEOUT`` (default 300) bounds each launch in
seconds.

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_shmem_gpu.py

The combine tests launch this file itself as each PE's program (``python
tests/gpu/test_shmem_gpu.py combine ...``, ``combine_pe``): every PE dispatches and combines its
own part with ``ShmemWorld`` and checks it against the numpy reference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import format_cases

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PES = [int(x) for x in os.environ.get("EPGEN_SHMEM_PES", "2,4").split(",") if x]
TIMEOUT = float(os.environ.get("EPGEN_SHMEM_TIMEOUT", "300"))
FORMATS = format_cases.ALL
#: the PE program (this file run as a script) imports the support modules by their bare names
PE_PYTHONPATH = os.pathsep.join([REPO, os.path.join(REPO, "tests", "support")])


@pytest.fixture(autouse=True, scope="module")
def _nvshmem_wheel(nvshmem_wheel):
    """Every test here needs the NVSHMEM wheel (``nvshmem_wheel``, tests/conftest.py)."""


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


def small_group() -> int:
    """The PE count of the format and flag cases: the largest of ``PES`` up to 4 (they are
    not sized for 8); a run with none (``EPGEN_SHMEM_PES=8``) skips them."""
    small = [p for p in PES if p <= 4]
    if not small:
        pytest.skip(f"EPGEN_SHMEM_PES={','.join(map(str, PES))}: the format and flag cases "
                    f"run at 2 or 4 PEs")
    return max(small)


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats(fmt):
    n = small_group()
    proc = launch(n, group(n, 2 if n >= 4 else 1) + ["--set", f"format={fmt}", "--calls", "2",
                                                     "--seed", "3"])
    assert_all_match(proc, n, 2)


def test_ord_r():
    n = small_group()
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


# ---- combine -------------------------------------------------------------------------------------

def launch_combine(n: int, args: list[str], timeout: float = TIMEOUT):
    """``epgen launch -n n -- python tests/gpu/test_shmem_gpu.py combine ARGS``."""
    env = {**os.environ, "PYTHONPATH": PE_PYTHONPATH, "NVSHMEM_REMOTE_TRANSPORT": "none",
           "NVSHMEM_DISABLE_NVLS": "1"}
    mps = ["--mps-share"] if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else []
    cmd = [sys.executable, "-m", "epgen", "launch", "-n", str(n), "--timeout", str(timeout),
           "--grace", "10", *mps, "--", sys.executable, os.path.abspath(__file__), "combine",
           *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout + 60)


def assert_all_combined(proc, n: int, calls: int):
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    for r in range(n):
        got = re.findall(rf"^\[rank {r}\] rank {r} call \d+: combine matches the reference$",
                         proc.stdout, re.M)
        assert len(got) == calls, f"rank {r}: {len(got)} of {calls} calls matched\n{text[-6000:]}"


@pytest.mark.parametrize("n", PES)
def test_combine_every_peer_by_shmem(n):
    """p2p_world_size=1: every row to another PE by put, its arrival word by signal."""
    proc = launch_combine(n, ["--n-ranks", str(n), "--p2p", "1", "--calls", "6", "--seed", "5"])
    assert_all_combined(proc, n, 6)


@pytest.mark.parametrize("n", [n for n in PES if n >= 4])
def test_combine_p2p_groups_and_shmem_between_them(n):
    """p2p_world_size=2: the group's peer by nvshmem_ptr stores, the others by SHMEM."""
    proc = launch_combine(n, ["--n-ranks", str(n), "--p2p", "2", "--calls", "6", "--seed", "6"])
    assert_all_combined(proc, n, 6)


def test_combine_all_in_one_p2p_group():
    """p2p_world_size=n_ranks: ShmemWorld's combine with no NVSHMEM call (nvshmem_ptr
    stores only)."""
    proc = launch_combine(2, ["--n-ranks", "2", "--p2p", "2", "--calls", "4", "--seed", "7"])
    assert_all_combined(proc, 2, 4)


def test_combine_200_calls():
    proc = launch_combine(2, ["--n-ranks", "2", "--p2p", "1", "--calls", "200", "--seed", "8"])
    assert_all_combined(proc, 2, 200)


@pytest.mark.parametrize("p2p", [1, 2])
def test_torch_api_on_shmem_world(p2p):
    """``epgen.torch.EPBuffer`` of each PE's ``ShmemWorld``: torch tensors in and out on the
    PE's current stream (by SHMEM, or nvshmem_ptr stores inside one group), dispatch and
    combine checked against the reference."""
    pytest.importorskip("torch")
    proc = launch_combine(2, ["--n-ranks", "2", "--p2p", str(p2p), "--calls", "5",
                              "--seed", "9", "--api", "torch"])
    assert_all_combined(proc, 2, 5)


def combine_rounds(world, calls: int, seed: int, say=print, api: str = "numpy") -> bool:
    """``calls`` dispatch + combine rounds of this PE's ``world`` (``use_shmem``; the weights
    on even calls, None on odd ones, a residual every fourth call), through the numpy API or
    (``api="torch"``) an ``epgen.torch.EPBuffer`` on torch CUDA tensors. Every PE draws every
    rank's inputs from the same seed; the expert output of slot ``(t, k)`` of source ``s`` is
    a fixed random row ``Y[s][t, k]``, so each destination builds its rows from its own
    ``src_info`` and each source's expectation is ``reference.combine`` over the reference
    dispatch. Says ``rank R call C: combine matches the reference`` per call; False at the
    first mismatch."""
    import numpy as np

    from epgen import reference, routing
    from epgen.reference_combine import source_of_rows

    cfg, me = world.cfg, world.rank
    ep = torch = None
    if api == "torch":
        import torch

        import epgen.torch
        ep = epgen.torch.EPBuffer(world)

    def on_gpu(bits):
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(
            torch.bfloat16).cuda()
    n, K, H, T = cfg.n_ranks, cfg.token_fmt.top_k, cfg.token_fmt.hid_dim, cfg.max_tokens_per_rank
    rng = np.random.default_rng(seed)

    def rows_of(res, Y):
        src = source_of_rows(res)
        if not len(src):
            return np.zeros((0, H), np.uint16)
        return np.stack([Y[s][t, k] for s, (t, k) in zip(src, res.src_info)])

    for call in range(calls):
        counts = [T] * n if call < 2 else [int(rng.integers(0, T + 1)) for _ in range(n)]
        toks, ids = routing.routing(rng, cfg, counts)
        Y = [rng.integers(0, 1 << 16, size=(T, K, H), dtype=np.uint16) & np.uint16(0xBFFF)
             for _ in range(n)]
        w = [rng.standard_normal((c, K)).astype(np.float32) for c in counts] \
            if call % 2 == 0 else None
        res = [rng.integers(0, 1 << 16, size=(c, H), dtype=np.uint16) & np.uint16(0xBFFF)
               for c in counts] if call % 4 == 0 else None
        ref = reference.dispatch(cfg, toks, ids)
        if ep is None:
            got_d = world.dispatch(toks[me], ids[me])
        else:
            out = ep.dispatch(on_gpu(toks[me]), torch.from_numpy(ids[me]).cuda(),
                              None if w is None else torch.from_numpy(w[me]).cuda())
            ep.check()
            got_d = out.to_reference(cfg)
        problems = reference.compare(cfg, ref[me], got_d)
        if problems:
            say(f"rank {me} call {call}: dispatch differs: {problems[:3]}")
            return False
        if ep is None:
            got = world.combine(rows_of(got_d, Y), None if w is None else w[me],
                                None if res is None else res[me])
        else:
            rows = rows_of(got_d, Y)      # the torch API takes max_out_rows rows
            full = np.zeros((cfg.layout.max_out_rows, H), np.uint16)
            full[:len(rows)] = rows
            y = ep.combine(on_gpu(full), out,
                           residual=None if res is None else on_gpu(res[me]))
            ep.check("combine")
            got = y.view(torch.int16).cpu().numpy().view(np.uint16)
        want = reference.combine(cfg, ref, [rows_of(r, Y) for r in ref], w, residual=res,
                                 n_tokens=counts)[me]
        if got.shape != want.shape or not np.array_equal(got, want):
            bad = np.count_nonzero(got != want) if got.shape == want.shape else got.shape
            say(f"rank {me} call {call}: combine differs ({bad})")
            return False
        say(f"rank {me} call {call}: combine matches the reference")
    return True


def combine_config(n: int, p2p: int):
    """The small preset with ``use_shmem``, ``n`` ranks in P2P groups of ``p2p``."""
    from epgen import presets

    table = {**presets.preset_data("small"), "n_ranks": n, "p2p_world_size": p2p,
             "use_shmem": True}
    if n >= 8:
        table["n_sms"] = N_SMS_8_PES
    return presets.config_from_dict(table)


def combine_pe(argv: list[str]) -> int:
    """One PE's program (``combine_rounds`` in a ``ShmemWorld``): exit status 0 when every
    call matched."""
    import argparse

    import epgen

    ap = argparse.ArgumentParser(prog="test_shmem_gpu.py combine")
    ap.add_argument("--n-ranks", type=int, required=True)
    ap.add_argument("--p2p", type=int, required=True)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api", choices=["numpy", "torch"], default="numpy")
    args = ap.parse_args(argv)
    with epgen.ShmemWorld(combine_config(args.n_ranks, args.p2p)) as world:
        ok = combine_rounds(world, args.calls, args.seed,
                            say=lambda line: print(line, flush=True), api=args.api)
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] != ["combine"]:
        sys.exit("usage: test_shmem_gpu.py combine --n-ranks N --p2p P [--calls C] [--seed S]")
    sys.exit(combine_pe(sys.argv[2:]))
