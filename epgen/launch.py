"""``epgen launch -n N [--] CMD ...``: N processes of CMD on this machine, one per rank.

Each process gets the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port) and
``EPGEN_LAUNCH_DIR``, a fresh temporary directory for the file-based bootstrap and host
barriers (``epgen.runtime.bootstrap``), removed at the end. With ``mps_share`` each process
also gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = floor(100 / N)`` (the shares sum to at most
100, which NVSHMEM needs to report full support for several PEs on one GPU under MPS).

Every line a process writes to stdout or stderr is forwarded to the same stream of the
launcher, prefixed ``[rank k] ``. The launcher returns the first non-zero exit status (a
process killed by signal ``s`` counts as ``128 + s``), 0 when every process succeeds. At the
first failure it terminates the others (SIGTERM to each process group, SIGKILL after
``grace_s``) so that nothing waits forever on a dead peer; with ``keep_going`` it lets them
run to their own end instead (the survivors of a rank mask, which go on without the dead
rank). Past ``timeout_s`` it kills them all and returns 124. Each process runs in its own
session, so its children go with it.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from .runtime.bootstrap import LAUNCH_DIR_ENV

TIMEOUT_STATUS = 124
DEFAULT_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, n: int, port: int, launch_dir: str, mps_share: bool = False,
             base: dict | None = None) -> dict:
    """The environment of rank ``rank`` of ``n`` (``base``: default ``os.environ``)."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env[LAUNCH_DIR_ENV] = launch_dir
    if mps_share:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(math.floor(100 / n))
    return env


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(proc, sig) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _forward(stream, out, prefix: str, lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def launch(cmd: list[str], n: int, *, timeout_s: float | None = None, mps_share: bool = False,
           grace_s: float = DEFAULT_GRACE_S, stdout=None, stderr=None, env=None,
           keep_going: bool = False) -> int:
    """Run ``n`` processes of ``cmd`` (module docstring); the exit status. ``stdout`` and
    ``stderr`` (default: ``sys.stdout``, ``sys.stderr``) receive the prefixed lines."""
    if n < 1:
        raise ValueError(f"epgen launch: -n must be >= 1, got {n}")
    if not cmd:
        raise ValueError("epgen launch: no command given (epgen launch -n N -- CMD ...)")
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    previous = _stop_on_signals()
    try:
        return _launch(cmd, n, timeout_s, mps_share, grace_s, stdout, stderr, env,
                       keep_going)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Terminated(BaseException):
    """The launcher itself got SIGTERM or SIGHUP: stop the ranks, exit ``128 + signal``."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.status = 128 + sig


def _stop_on_signals() -> dict:
    """SIGTERM and SIGHUP raise ``_Terminated`` (in the main thread only), so the ranks, in
    sessions of their own, are stopped rather than orphaned; the previous handlers."""
    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous

    def handler(sig, frame):
        raise _Terminated(sig)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _launch(cmd, n, timeout_s, mps_share, grace_s, stdout, stderr, env, keep_going) -> int:
    launch_dir = tempfile.mkdtemp(prefix="epgen-launch-")
    port = free_port()
    lock = threading.Lock()
    procs, threads = [], []
    status = 0
    try:
        for k in range(n):
            p = subprocess.Popen(cmd, env=rank_env(k, n, port, launch_dir, mps_share, env),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
                t = threading.Thread(target=_forward, args=(stream, out, f"[rank {k}] ", lock),
                                     daemon=True)
                t.start()
                threads.append(t)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and not status:
                status = _exit_status(failed[0])
            if status and not keep_going:
                break
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() >= deadline:
                with lock:
                    stderr.write(f"epgen launch: timed out after {timeout_s:g} s; killing "
                                 f"every rank\n")
                status = TIMEOUT_STATUS
                break
            time.sleep(0.02)
        if status == TIMEOUT_STATUS:
            _stop(procs, 0.0)
        elif status:
            _stop(procs, grace_s)
    except _Terminated as e:
        _stop(procs, 0.0)
        status = e.status
    except BaseException:
        _stop(procs, 0.0)
        raise
    finally:
        for p in procs:
            try:
                p.wait(timeout=grace_s + 5)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
        for t in threads:
            t.join(timeout=2)
        shutil.rmtree(launch_dir, ignore_errors=True)
    return status


def _stop(procs, grace_s: float) -> None:
    """SIGTERM every running process group, SIGKILL those left after ``grace_s``."""
    if grace_s > 0:
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
    for p in procs:
        _signal_group(p, signal.SIGKILL)
