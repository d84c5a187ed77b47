"""Rank discovery, the NVSHMEM unique-id exchange and host barriers for one process per PE,
without NVSHMEM's host collectives (they abort where NVSHMEM lacks full multi-process-per-GPU
support, e.g. several PEs on one GPU without MPS).

Two ways, picked from the environment (``from_env``):

- **Under ``epgen launch``** (``EPGEN_LAUNCH_DIR`` set): files in that directory. Rank 0
  writes the unique id to ``uid-<name>`` atomically (a temporary file, then ``os.replace``);
  the others wait for it. A barrier ``name`` of generation ``g`` is rank ``k`` creating
  ``barrier-<name>-<g>-<k>`` and waiting until all ``N`` exist; a gather
  (``all_gather_bytes``, e.g. the SHMEM benchmark's per-PE timings) is rank ``k`` writing
  ``gather-<name>-<g>-<k>`` atomically and reading all ``N``. Every wait is bounded and
  fails with ``BootstrapTimeoutError`` naming what it waited for (the file, the ranks
  missing).
- **Under torchrun** (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set, no ``EPGEN_LAUNCH_DIR``):
  ``torch.distributed`` (initialised here with the gloo backend if it is not yet):
  ``broadcast_object_list`` from rank 0 for the id, point-to-point messages to and from rank
  0 for bounded barriers, ``all_gather_object`` for gathers (``TorchBootstrap``). torch is
  imported only on this path.

``from_group(group)`` is the third way, never picked from the environment: a
``TorchBootstrap`` over a given ``torch.distributed`` process group (a sub-group too), whose
rank and size are the group's.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

LAUNCH_DIR_ENV = "EPGEN_LAUNCH_DIR"
DEFAULT_TIMEOUT_S = 120.0
#: the point-to-point tag of ``TorchBootstrap``'s bounded barriers
BARRIER_TAG = 0x45504742


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


def member_ranks(boot, ranks) -> list[int]:
    """The ranks of a barrier over ``ranks`` (None: every rank of ``boot``), sorted;
    ``ValueError`` unless they are ranks of ``boot`` and include its own."""
    members = list(range(boot.world_size)) if ranks is None else sorted({int(r) for r in ranks})
    if boot.rank not in members or any(not 0 <= r < boot.world_size for r in members):
        raise ValueError(f"barrier ranks={ranks!r}: must be ranks of [0, {boot.world_size}) "
                         f"including this one ({boot.rank})")
    return members


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

    def barrier(self, name: str = "sync", timeout_s: float | None = None,
                ranks=None) -> None:
        """Every rank's ``barrier-<name>-<gen>-<rank>`` exists (this rank's created first);
        the generation counts this process's barriers of that name. ``timeout_s``: this
        wait's bound (default: the bootstrap's). ``ranks``: the ranks that meet (default
        every one; ``member_ranks``), e.g. the ones a rank mask left alive."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        members = member_ranks(self, ranks)
        gen = self._generations.get(name, 0)
        self._generations[name] = gen + 1
        stem = f"barrier-{name}-{gen}-"
        (self.dir / f"{stem}{self.rank}").touch()

        def missing():
            return [k for k in members if not (self.dir / f"{stem}{k}").exists()]

        _poll(lambda: not missing(), timeout_s, lambda: (
            f"rank {self.rank}: host barrier {name!r} (generation {gen}) timed out after "
            f"{timeout_s:g} s; rank(s) {', '.join(map(str, missing()))} of "
            f"{self.world_size} never arrived (exited or hung?)",
            f"barrier {name!r} generation {gen}", missing()))

    def all_gather_bytes(self, data: bytes, name: str = "gather",
                         timeout_s: float | None = None) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank: rank ``k`` writes
        ``gather-<name>-<gen>-<k>`` atomically and reads the others' once all exist (the
        generation counts this process's gathers of that name, as for barriers); bounded by
        ``timeout_s`` (default: the bootstrap's), ``BootstrapTimeoutError`` naming the
        ranks missing."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        key = f"gather-{name}"
        gen = self._generations.get(key, 0)
        self._generations[key] = gen + 1
        paths = [self.dir / f"gather-{name}-{gen}-{k}" for k in range(self.world_size)]
        self._write_atomic(paths[self.rank], bytes(data))

        def missing():
            return [k for k, path in enumerate(paths) if not path.exists()]

        _poll(lambda: not missing(), timeout_s, lambda: (
            f"rank {self.rank}: gather {name!r} (generation {gen}) timed out after "
            f"{timeout_s:g} s; rank(s) {', '.join(map(str, missing()))} of "
            f"{self.world_size} never sent theirs (exited or hung?)",
            f"gather {name!r} generation {gen}", missing()))
        return [path.read_bytes() for path in paths]


class TorchBootstrap:
    """The exchange through ``torch.distributed``: over ``group`` (a ``ProcessGroup`` this
    process is a member of, e.g. a sub-group; ``rank`` and ``world_size`` are then the
    group's), or over the default group (initialised here with gloo from the torchrun
    environment when it is not yet).

    ``broadcast_bytes`` broadcasts from the group's rank 0 (``dist.get_global_rank(group,
    0)``). ``barrier(name, timeout_s)`` with a ``timeout_s`` on a gloo group is bounded on
    every rank: each rank sends a token to the group's rank 0, which waits (``irecv`` with
    ``Work.wait(timeout)``) for all of them and then sends each a release, awaited the same
    way; ``BootstrapTimeoutError`` after ``timeout_s`` (rank 0 names the ranks that never
    arrived; the others only know rank 0 did not release them). ``monitored_barrier`` is not
    used: its non-zero ranks wait with the group's timeout, not the one given. Without a
    ``timeout_s``, or on a group of another backend (NCCL, ...), it is a plain
    ``dist.barrier``, bounded only by the group's own timeout (how that expiry surfaces is
    the backend's: NCCL's watchdog may abort the process). After a barrier timed out the
    bootstrap is not used again for barriers (the peer is taken as gone). The barrier names
    play no part: every rank calls the same barriers in the same order."""

    kind = "torch"

    def __init__(self, rank: int | None = None, world_size: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, group=None):
        import datetime

        import torch.distributed as dist

        self.dist, self.group = dist, group
        if group is None:
            if rank is None or world_size is None:
                raise ValueError("TorchBootstrap: rank and world_size are needed without "
                                 "group= (the default group's, or to initialise it)")
            if not dist.is_initialized():
                dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            have = (dist.get_rank(), dist.get_world_size())
            where = "torch.distributed"
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("TorchBootstrap: group= needs an initialised "
                                 "torch.distributed (init_process_group first)")
            have = (dist.get_rank(group), dist.get_world_size(group))
            if have[0] < 0:
                raise ValueError(f"TorchBootstrap: group=: this process (global rank "
                                 f"{dist.get_rank()}) is not a member of the group")
            where = "group="
        rank = have[0] if rank is None else rank
        world_size = have[1] if world_size is None else world_size
        if have != (rank, world_size):
            raise ValueError(f"{where} has rank {have[0]} of {have[1]}, asked for {rank} of "
                             f"{world_size}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.src = 0 if group is None else dist.get_global_rank(group, 0)
        self.bounded = str(dist.get_backend(group)) == "gloo"

    def broadcast_bytes(self, data: bytes | None, name: str = "nvshmem") -> bytes:
        """Rank 0's ``data`` (of the group) on every rank."""
        if self.rank == 0 and data is None:
            raise ValueError("rank 0 must give the bytes to broadcast")
        box = [bytes(data) if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def all_gather_bytes(self, data: bytes, name: str = "gather",
                         timeout_s: float | None = None) -> list[bytes]:
        """Every rank's ``data`` (of the group), in rank order, on every rank
        (``all_gather_object``: bounded by the group's own timeout, not ``timeout_s``; the
        names play no part, as for barriers)."""
        out = [None] * self.world_size
        self.dist.all_gather_object(out, bytes(data), group=self.group)
        return [bytes(x) for x in out]

    def barrier(self, name: str = "sync", timeout_s: float | None = None,
                ranks=None) -> None:
        """Every rank of the group arrived. ``timeout_s`` bounds the wait on a gloo group
        (class docstring); None: a plain ``dist.barrier``, bounded by the group's timeout.
        ``ranks``: only these ranks meet (``member_ranks``; the lowest of them coordinates),
        on a gloo group only (another backend's barrier takes every rank)."""
        members = member_ranks(self, ranks)
        if len(members) < self.world_size and not self.bounded:
            raise ValueError(f"barrier ranks={ranks!r}: a barrier over some of the ranks needs "
                             f"a gloo group (this one is {self.dist.get_backend(self.group)})")
        if len(members) < self.world_size and timeout_s is None:
            timeout_s = self.timeout_s
        if timeout_s is None or not self.bounded:
            self.dist.barrier(group=self.group)
            return
        import datetime

        import torch

        dist, group, n = self.dist, self.group, self.world_size
        deadline = time.monotonic() + timeout_s

        def left():
            return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))

        def peer(r):
            return r if group is None else dist.get_global_rank(group, r)

        def token():
            return torch.zeros(1, dtype=torch.uint8)
        lead = members[0]
        if self.rank == lead:
            arrivals = {r: dist.irecv(token(), src=peer(r), group=group, tag=BARRIER_TAG)
                        for r in members[1:]}
            missing = []
            for r, work in arrivals.items():
                try:
                    work.wait(timeout=left())
                except RuntimeError:       # timed out, or the peer's connection closed
                    missing.append(r)
            if missing:
                raise BootstrapTimeoutError(
                    f"rank {lead}: host barrier {name!r} timed out after {timeout_s:g} s; "
                    f"rank(s) {', '.join(map(str, missing))} of {n} never arrived (exited or "
                    f"hung?)", f"barrier {name!r}", missing)
            releases = [dist.isend(token(), dst=peer(r), group=group, tag=BARRIER_TAG)
                        for r in members[1:]]
            for work in releases:
                work.wait(timeout=left())
            return
        try:
            dist.isend(token(), dst=peer(lead), group=group, tag=BARRIER_TAG).wait(
                timeout=left())
            dist.irecv(token(), src=peer(lead), group=group, tag=BARRIER_TAG).wait(
                timeout=left())
        except RuntimeError as e:          # timed out, or the lead's connection closed
            raise BootstrapTimeoutError(
                f"rank {self.rank}: host barrier {name!r} timed out after {timeout_s:g} s: "
                f"rank {lead} of the group did not release it (it or another rank never "
                f"arrived: exited or hung?): {e}", f"barrier {name!r}") from e


def from_group(group, timeout_s: float = DEFAULT_TIMEOUT_S) -> TorchBootstrap:
    """The bootstrap of this process's rank of ``group`` (a ``torch.distributed``
    ``ProcessGroup``, e.g. the one handed to a buffer): exchange and barriers over that group
    only, rank and world size the group's; barriers bounded by ``timeout_s`` on a gloo group
    (``TorchBootstrap``)."""
    if group is None:
        raise ValueError("from_group: group is None: pass a torch.distributed ProcessGroup "
                         "(dist.group.WORLD for the default group)")
    return TorchBootstrap(timeout_s=timeout_s, group=group)


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

    def all_gather_bytes(self, data, name: str = "gather",
                         timeout_s: float | None = None) -> list[bytes]:
        return [bytes(data)]

    def barrier(self, name: str = "sync", timeout_s: float | None = None,
                ranks=None) -> None:
        member_ranks(self, ranks)
