"""``ShmemSession``: this process's one NVSHMEM initialisation, shared by its ``ShmemWorld``\\ s.

NVSHMEM initialises once per process (``NvshmemHost.init_uid`` refuses a second live
initialisation). A session is that initialisation: the rank and the PE count, the GPU
NVSHMEM is bound to, the bootstrap (unique-id exchange and host barriers) and the host
library. Any number of ``ShmemWorld(cfg, session=s)`` may live on it at once (e.g. one per
token format or shape), each with its own kernels and its own symmetric allocations
(``host.symmetric_resource()``: one pool per world, all from the one symmetric heap).

- **Creation** (collective): ``ShmemSession(rank, n_ranks, device=, bootstrap=, host=)``.
  ``rank`` and ``n_ranks`` default to the bootstrap's (``bootstrap.from_group(group)``: a
  ``torch.distributed`` group's), else ``RANK`` and ``WORLD_SIZE``; with neither, one PE.
  The GPU is ``device`` or ``LOCAL_RANK % device_count``; it is made current, rank 0 takes
  a unique id, the bootstrap broadcasts it (``nvshmem-<name>``) and every PE initialises.
- **Worlds**: every PE creates the same worlds in the same order (their symmetric
  allocations and barriers must pair up). A world on a session takes the session's rank,
  GPU, backend, bootstrap and host; its ``cfg.n_ranks`` must be the session's PE count.
  Its barrier names start with its process-wide index (``w<k>-``), unique across the worlds
  of a session and across sessions. Its ``close()`` frees only its own pool (collectively,
  after its close barrier) and leaves NVSHMEM up.
- **Close**: ``close()`` (or leaving ``with ShmemSession(...) as s:``) closes every world of
  the session still open, last created first (each frees its pool collectively, in the same
  order on every PE), meets the others at a bounded barrier (``<name>-close``) and
  finalises NVSHMEM once. Idempotent.
- **Failures**: a close barrier of a world that a peer never reaches marks the session
  ``lost`` (``mark_lost``): from then on nothing collective is attempted (the worlds still
  open close without their barrier and free nothing; ``close`` does not finalise, and says
  so with a ``RuntimeWarning``), since every collective step would wait for the dead peer.
- **Private sessions**: ``ShmemWorld(cfg)`` without ``session=`` makes one of its own
  (``name="w<k>"``) and closes it right after its own close barrier and free, without a
  second barrier: the world behaves as if it owned NVSHMEM.
"""

from __future__ import annotations

import itertools
import os
import warnings

from backends import cuda as cuda_backend
from backends.cuda.errors import CudaUnavailableError
from backends.cuda.nvshmem_host import NvshmemHost

from . import bootstrap as bootstrap_mod
from .world_args import device_ordinal

__all__ = ["ShmemSession", "NVSHMEM_ENV_DEFAULTS", "resolve_device", "local_sharers",
           "set_env_defaults", "default_barrier_timeout"]

#: set before NVSHMEM initialises, where the environment does not say otherwise
NVSHMEM_ENV_DEFAULTS = {"NVSHMEM_DISABLE_NVLS": "1"}

_SESSION_INDEX = itertools.count()    # sessions of this process: their default names


def default_barrier_timeout() -> float:
    """The bound of a host barrier: ``EPGEN_BARRIER_TIMEOUT_S``, else
    ``bootstrap.DEFAULT_TIMEOUT_S``."""
    return float(os.environ.get("EPGEN_BARRIER_TIMEOUT_S") or bootstrap_mod.DEFAULT_TIMEOUT_S)


def resolve_device(device: int | None, n_devices: int, local_rank: int,
                   who: str = "ShmemWorld") -> int:
    """The GPU of this PE: ``device``, else ``local_rank % n_devices``. ``device`` is
    checked first (``ValueError``), then the machine (``CudaUnavailableError`` without a
    GPU). ``who`` starts the messages."""
    if device is not None:
        device = device_ordinal(who, "device", device)
    if n_devices < 1:
        raise CudaUnavailableError(f"{who}: no usable CUDA GPU here "
                                   f"(backends.cuda.device_count() is 0)")
    if device is None:
        return local_rank % n_devices
    if device >= n_devices:
        raise ValueError(f"{who}: device {device} is not a GPU of this machine "
                         f"(ordinals 0..{n_devices - 1})")
    return device


def local_sharers(device: int, n_devices: int, local_world_size: int) -> int:
    """How many PEs of this node run on GPU ``device`` (``LOCAL_RANK % n_devices``)."""
    return max(1, sum(1 for k in range(local_world_size) if k % n_devices == device))


def set_env_defaults(env=None) -> dict:
    """``NVSHMEM_ENV_DEFAULTS`` into ``env`` (default ``os.environ``) where absent; returns
    what was set."""
    env = os.environ if env is None else env
    out = {}
    for k, v in NVSHMEM_ENV_DEFAULTS.items():
        if k not in env:
            env[k] = out[k] = v
    return out


def resolve_session_rank(rank, n_ranks, bootstrap) -> tuple[int, int]:
    """``(rank, n_ranks)`` of a session: the arguments, else the bootstrap's, else ``RANK``
    and ``WORLD_SIZE``, else PE 0 of 1. Given ones must agree with the bootstrap's."""
    for name, value in (("rank", rank), ("n_ranks", n_ranks)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"ShmemSession: {name} must be an integer, got {value!r}")
    if bootstrap is not None:
        b_rank, b_size = bootstrap.rank, bootstrap.world_size
        if rank is not None and rank != b_rank:
            raise ValueError(f"ShmemSession: rank={rank}, but the bootstrap is rank {b_rank}: "
                             f"they must agree (leave rank unset to take the bootstrap's)")
        if n_ranks is not None and n_ranks != b_size:
            raise ValueError(f"ShmemSession: n_ranks={n_ranks}, but the bootstrap has "
                             f"world_size={b_size}: they must agree (one PE per process of "
                             f"the bootstrap)")
        rank, n_ranks = b_rank, b_size
    env_rank, env_size = bootstrap_mod.env_rank()
    if n_ranks is None:
        n_ranks = env_size if env_size is not None else 1
    elif env_size is not None and bootstrap is None and env_size != n_ranks:
        raise ValueError(f"ShmemSession: WORLD_SIZE={env_size} processes, but n_ranks="
                         f"{n_ranks}: start one process per PE")
    if n_ranks < 1:
        raise ValueError(f"ShmemSession: n_ranks must be >= 1, got {n_ranks}")
    if rank is None:
        rank = env_rank
    if rank is None:
        if n_ranks > 1:
            raise ValueError(f"ShmemSession: no rank (RANK unset) of n_ranks={n_ranks}: start "
                             f"the processes with 'epgen launch -n {n_ranks} -- CMD' or "
                             f"torchrun, or pass rank= or bootstrap=")
        rank = 0
    if not 0 <= rank < n_ranks:
        raise ValueError(f"ShmemSession: rank {rank} is not in [0, n_ranks={n_ranks})")
    return int(rank), int(n_ranks)


def resolve_session_backend(backend):
    """``(backend, cuda)``: what a world passes as its ``backend`` (``"cuda"`` or the
    ``backends.sim.Machine``) and the object it runs on (``backends.cuda`` or that
    machine)."""
    if isinstance(backend, str) and backend == "cuda":
        return "cuda", cuda_backend
    if getattr(backend, "RUNS_IR", False):
        return backend, backend
    raise ValueError(f"ShmemSession: backend must be 'cuda' or a backends.sim.Machine (a "
                     f"simulated session for tests), got {backend!r}")


class ShmemSession:
    """This process's NVSHMEM initialisation, shared by its ``ShmemWorld``\\ s (module
    docstring). ``rank``/``n_ranks`` (default: the bootstrap's, else ``RANK``/``WORLD_SIZE``),
    ``device`` (default ``LOCAL_RANK % device_count``), ``bootstrap`` (default
    ``bootstrap.from_env``; ``bootstrap.from_group(group)`` for a ``torch.distributed``
    group), ``host`` (default ``NvshmemHost()``), ``barrier_timeout_s`` (the bound of the
    close barriers; default ``EPGEN_BARRIER_TIMEOUT_S`` or 120 s), ``backend`` (``"cuda"``
    or a ``backends.sim.Machine``), ``name`` (of its unique-id broadcast and barriers;
    default ``s<k>``, k counting this process's sessions).

    Attributes: ``rank``, ``n_ranks``, ``device_id``, ``sharers`` (PEs of this node on the
    GPU), ``bootstrap``, ``host``, ``backend``, ``cuda``, ``barrier_timeout_s``, ``name``,
    ``worlds`` (the open worlds, in creation order), ``closed``, ``lost``."""

    def __init__(self, rank: int | None = None, n_ranks: int | None = None, *,
                 device: int | None = None, bootstrap=None, host=None,
                 barrier_timeout_s: float | None = None, backend="cuda",
                 name: str | None = None):
        self.closed = True                    # nothing to finalise until NVSHMEM is up
        self.lost = False
        self._worlds: list = []
        if device is not None:
            device_ordinal("ShmemSession", "device", device)
        self.rank, self.n_ranks = resolve_session_rank(rank, n_ranks, bootstrap)
        self.backend, self.cuda = resolve_session_backend(backend)
        self.barrier_timeout_s = (default_barrier_timeout() if barrier_timeout_s is None
                                  else float(barrier_timeout_s))
        n_dev = self.cuda.device_count()
        self.device_id = resolve_device(device, n_dev, bootstrap_mod.local_rank(),
                                        "ShmemSession")
        self.sharers = local_sharers(self.device_id, n_dev, int(
            os.environ.get("LOCAL_WORLD_SIZE") or 1)) if device is None else 1
        self.name = f"s{next(_SESSION_INDEX)}" if name is None else str(name)
        self.bootstrap = bootstrap if bootstrap is not None else bootstrap_mod.from_env(
            self.rank, self.n_ranks, self.barrier_timeout_s)
        self.host = NvshmemHost() if host is None else host
        set_env_defaults()
        dev = self.cuda.get_device(self.device_id)
        if hasattr(dev, "set_current"):       # NVSHMEM binds the context current at init
            dev.set_current()
        uid = self.host.get_uniqueid() if self.rank == 0 else None
        uid = self.bootstrap.broadcast_bytes(uid, f"nvshmem-{self.name}")
        # cuda_device_id stays NVSHMEM's "unset" (-1, as its default initializer has it):
        # NVSHMEM takes the context made current above
        self.host.init_uid(uid, self.rank, self.n_ranks)
        self.closed = False

    # -- the worlds ------------------------------------------------------------------------------
    @property
    def worlds(self) -> tuple:
        """The open worlds of the session, in creation order."""
        return tuple(self._worlds)

    def check_world(self, cfg, *, rank=None, device=None, bootstrap=None, host=None,
                    backend=None) -> None:
        """The rules of a ``ShmemWorld(cfg, rank, device=, bootstrap=, host=, backend=,
        session=self)``: the session is open; ``bootstrap`` and ``host`` are the session's
        (not given); ``rank``, ``device`` and ``backend`` are unset or the session's;
        ``cfg.n_ranks`` is the session's PE count. A ``ValueError`` naming the argument and
        the rule (``RuntimeError`` for a closed session)."""
        if self.closed:
            raise RuntimeError(f"ShmemWorld: session= is closed (session {self.name!r}): "
                               f"a world needs an open session")
        for arg, value in (("bootstrap", bootstrap), ("host", host)):
            if value is not None:
                raise ValueError(f"ShmemWorld: {arg}= with session=: a world on a session "
                                 f"uses the session's {arg} (pass it to ShmemSession)")
        if rank is not None and rank != self.rank:
            raise ValueError(f"ShmemWorld: rank={rank}, but session= is rank {self.rank}: a "
                             f"world on a session is the session's rank (leave rank unset)")
        if cfg.n_ranks != self.n_ranks:
            raise ValueError(f"ShmemWorld: cfg.n_ranks={cfg.n_ranks}, but session= has "
                             f"n_ranks={self.n_ranks} PEs: a world on a session spans every "
                             f"PE of it")
        if device is not None:
            d = device_ordinal("ShmemWorld", "device", device)
            if d != self.device_id:
                raise ValueError(f"ShmemWorld: device={d}, but session= runs on GPU "
                                 f"{self.device_id} (NVSHMEM is bound to it): leave device "
                                 f"unset or pass the session's")
        if backend is not None and not (backend is self.backend or (
                isinstance(backend, str) and backend == self.backend)):
            raise ValueError(f"ShmemWorld: backend={backend!r}, but session= runs on "
                             f"{self.backend!r}: leave backend unset or pass the session's")

    def register(self, world) -> None:
        """Record an open world of the session (``ShmemWorld`` calls it once its NVSHMEM
        side is up)."""
        if self.closed:
            raise RuntimeError(f"ShmemSession {self.name!r} is closed")
        self._worlds.append(world)

    def release(self, world) -> None:
        """Forget a world (``ShmemWorld.close`` calls it, whatever it could free)."""
        if world in self._worlds:
            self._worlds.remove(world)

    def mark_lost(self) -> None:
        """Record that a peer is gone (a bounded barrier it never reached): nothing
        collective is attempted from now on (module docstring)."""
        self.lost = True

    # -- barriers ---------------------------------------------------------------------------------
    def barrier(self, name: str = "user", timeout_s: float | None = None) -> None:
        """A host barrier of every PE of the session (``<name of the session>-<name>``);
        ``timeout_s``: this wait's bound (default: the bootstrap's)."""
        self.bootstrap.barrier(f"{self.name}-{name}", timeout_s=timeout_s)

    # -- close ------------------------------------------------------------------------------------
    def close(self, barrier: bool = True, _raise: bool = True) -> None:
        """Close every open world (last created first), meet the others at a bounded barrier
        and finalise NVSHMEM; idempotent. ``barrier=False`` skips the barrier (a world
        closing its private session right after its own close barrier). After a lost peer
        (``lost``, or this barrier timing out) NVSHMEM is not finalised (it would wait for
        the peer): a ``RuntimeWarning`` says so; the barrier's ``BootstrapTimeoutError`` is
        raised unless ``_raise`` is False (another error propagating). The first error of a
        world's close is raised after the others are closed."""
        if self.closed:
            return
        self.closed = True
        first_error = None
        for world in reversed(list(self._worlds)):
            try:
                world.close(_raise=_raise)
            except Exception as e:            # close the others all the same
                first_error = first_error or e
        self._worlds.clear()
        why = "a peer was lost earlier"
        if not self.lost and barrier:
            try:
                self.bootstrap.barrier(f"{self.name}-close", timeout_s=self.barrier_timeout_s)
            except bootstrap_mod.BootstrapTimeoutError as e:
                self.lost = True
                why = str(e)
                first_error = first_error or e
        if not self.lost:
            self.host.finalize()
        elif first_error is None or not _raise:
            warnings.warn(f"ShmemSession.close ({self.name!r}): {why}; NVSHMEM not "
                          f"finalised", RuntimeWarning, stacklevel=2)
        if first_error is not None and _raise:
            raise first_error

    @property
    def finalized(self) -> bool:
        """Whether NVSHMEM was shut down (False while open, and after a close that had to
        skip it)."""
        return not getattr(self.host, "initialized", False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(_raise=exc_type is None)
        return False

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._worlds)} world(s)"
        return (f"ShmemSession({self.name!r}, rank {self.rank} of {self.n_ranks}, GPU "
                f"{self.device_id}, {state})")
