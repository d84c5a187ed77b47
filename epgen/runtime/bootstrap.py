"""Rank discovery, the NVSHMEM unique-id exchange and host barriers for one process per PE,
without NVSHMEM's host collectives (they abort where NVSHMEM lacks full multi-process-per-GPU
support, e.g. several PEs on one GPU without MPS).

Two ways, picked from the environment (``from_env``):

- **Under ``epgen launch``** (``EPGEN_LAUNCH_DIR`` set): files in that directory. Rank 0
  writes the unique id to ``uid-<name>`` atomically (a temporary file, then ``os.replace``);
  the others wait for it. A barrier ``name`` of generation ``g`` is rank ``k`` creating
  ``barrier-<name>-<g>-<k>`` and waiting until all ``N`` exist. Every wait is bounded and
  fails with ``BootstrapTimeoutError`` naming what it waited for (the file, the ranks
  missing).
- **Under torchrun** (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set, no ``EPGEN_LAUNCH_DIR``):
  ``torch.distributed`` (initialised here with the gloo backend if it is not yet):
  ``broadcast_object_list`` from rank 0 for the id, ``barrier`` for barriers. torch is
  imported only on this path.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

LAUNCH_DIR_ENV = "EPGEN_LAUNCH_DIR"
DEFAULT_TIMEOUT_S = 120.0


class BootstrapTimeoutError(TimeoutError):
    """A bounded host-side wait of the bootstrap expired (a peer died or never started):
    ``waited_for`` says what, ``missing`` the ranks that did not arrive (barriers)."""

    def __init__(self, message: str, waited_for: str = "", missing=()):
        super().__init__(message)
        self.waited_for = waited_for
        self.missing = tuple(missing)


def env_rank() -> tuple[int | None, int | None]:
    """``(RANK, WORLD_SIZE)`` from the environment (None where unset)."""
    def get(name):
        v = os.environ.get(name)
        return None if v in (None, "") else int(v)
    return get("RANK"), get("WORLD_SIZE")


def local_rank() -> int:
    """``LOCAL_RANK`` (default: ``RANK``, else 0)."""
    v = os.environ.get("LOCAL_RANK")
    if v not in (None, ""):
        return int(v)
    return int(os.environ.get("RANK") or 0)


def _poll(done, timeout_s: float, describe):
    """Call ``done()`` until it returns a true value (returned), polling quickly at first
    then every few ms; ``BootstrapTimeoutError`` from ``describe()`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    while True:
        got = done()
        if got:
            return got
        if time.monotonic() >= deadline:
            message, waited_for, missing = describe()
            raise BootstrapTimeoutError(message, waited_for, missing)
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


class FileBootstrap:
    """The file-based exchange of rank ``rank`` of ``world_size`` in ``directory`` (module
    docstring). ``timeout_s`` bounds every wait."""

    kind = "files"

    def __init__(self, directory, rank: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"{LAUNCH_DIR_ENV}={directory}: not a directory (the "
                                    f"launcher creates it; run under 'epgen launch')")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._generations: dict[str, int] = {}

    def _write_atomic(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def broadcast_bytes(self, data: bytes | None, name: str = "nvshmem") -> bytes:
        """Rank 0's ``data`` on every rank: rank 0 writes ``uid-<name>``, the others wait
        for it (bounded) and read it."""
        path = self.dir / f"uid-{name}"
        if self.rank == 0:
            if data is None:
                raise ValueError("rank 0 must give the bytes to broadcast")
            self._write_atomic(path, bytes(data))
            return bytes(data)
        _poll(path.exists, self.timeout_s, lambda: (
            f"rank {self.rank}: rank 0 did not publish {path} within {self.timeout_s:g} s "
            f"(did rank 0 start, or fail before bootstrapping NVSHMEM?)", str(path), (0,)))
        return path.read_bytes()

    def barrier(self, name: str = "sync", timeout_s: float | None = None) -> None:
        """Every rank's ``barrier-<name>-<gen>-<rank>`` exists (this rank's created first);
        the generation counts this process's barriers of that name. ``timeout_s``: this
        wait's bound (default: the bootstrap's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        gen = self._generations.get(name, 0)
        self._generations[name] = gen + 1
        stem = f"barrier-{name}-{gen}-"
        (self.dir / f"{stem}{self.rank}").touch()

        def missing():
            return [k for k in range(self.world_size) if not (self.dir / f"{stem}{k}").exists()]

        _poll(lambda: not missing(), timeout_s, lambda: (
            f"rank {self.rank}: host barrier {name!r} (generation {gen}) timed out after "
            f"{timeout_s:g} s; rank(s) {', '.join(map(str, missing()))} of "
            f"{self.world_size} never arrived (exited or hung?)",
            f"barrier {name!r} generation {gen}", missing()))


class TorchBootstrap:
    """The exchange through ``torch.distributed`` (initialised here with gloo from the
    torchrun environment when it is not yet)."""

    kind = "torch"

    def __init__(self, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        import datetime

        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"torch.distributed has rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, asked for {rank} of {world_size}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    def broadcast_bytes(self, data: bytes | None, name: str = "nvshmem") -> bytes:
        box = [bytes(data) if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self, name: str = "sync", timeout_s: float | None = None) -> None:
        if timeout_s is None:
            self.dist.barrier()
            return
        import datetime
        try:
            self.dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:          # gloo names the ranks that did not arrive
            raise BootstrapTimeoutError(f"rank {self.rank}: host barrier {name!r}: {e}",
                                        f"barrier {name!r}") from e


def torchrun_env() -> bool:
    """RANK, WORLD_SIZE and MASTER_ADDR are set and EPGEN_LAUNCH_DIR is not."""
    return (not os.environ.get(LAUNCH_DIR_ENV)
            and all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")))


def from_env(rank: int | None = None, world_size: int | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S):
    """The bootstrap of this process: ``FileBootstrap`` under ``epgen launch``,
    ``TorchBootstrap`` under torchrun (or an initialised ``torch.distributed``); a
    ``RuntimeError`` saying how to start the processes otherwise. ``rank`` and
    ``world_size`` default to ``RANK`` and ``WORLD_SIZE``."""
    er, ew = env_rank()
    rank = er if rank is None else rank
    world_size = ew if world_size is None else world_size
    if rank is None or world_size is None:
        raise RuntimeError("no rank: run one process per PE under 'epgen launch -n N -- CMD' "
                           "or torchrun (RANK and WORLD_SIZE unset), or pass rank and the "
                           "world size")
    launch_dir = os.environ.get(LAUNCH_DIR_ENV)
    if launch_dir:
        return FileBootstrap(launch_dir, rank, world_size, timeout_s)
    if torchrun_env():
        return TorchBootstrap(rank, world_size, timeout_s)
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return TorchBootstrap(rank, world_size, timeout_s)
    except ImportError:
        pass
    if world_size == 1:
        return SoloBootstrap()
    raise RuntimeError(f"rank {rank} of {world_size}: no way to reach the other processes "
                       f"({LAUNCH_DIR_ENV} unset and not under torchrun): start them with "
                       f"'epgen launch -n {world_size} -- CMD' or torchrun")


class SoloBootstrap:
    """One process alone (world size 1): nothing to exchange."""

    kind = "solo"
    rank, world_size = 0, 1

    def broadcast_bytes(self, data, name: str = "nvshmem") -> bytes:
        return bytes(data)

    def barrier(self, name: str = "sync", timeout_s: float | None = None) -> None:
        pass
