"""``EmulatedGroup``: every rank of a DeepEP-style group in this process, on one GPU or on
the CPU simulator, for tests and single-GPU development.

``group.rank(r)`` stands where DeepEP takes a ``torch.distributed`` process group (it has
``rank()`` and ``size()``), so ``Buffer(group.rank(r), ...)`` builds rank ``r``'s buffer as
each process of a real group would. The worlds are shared: the first rank that calls with a
new shape makes the world of that shape (an ``EmulatedWorld`` of every rank, two of them:
one per result slot), and every rank's buffer gets its rank's port of it.

``group.run(fn)`` calls ``fn(rank)`` on one thread per rank and returns the results in rank
order (re-raising the first error, named by rank): what one process per rank would do.
On the simulator this is how calls must be made (a rank's call waits for the others); on a
GPU each thread also sets its own CUDA stream (``group.stream(r)``), so the ranks' kernels
run at once, as their receive kernels need. A rank whose ``fn`` raises ends the others'
simulator waits (``PeerFailedError`` naming it) and the group: its later calls are refused.

Shrink mode (the buffers' ``enable_shrink``, every rank's alike): the worlds have rank masks
(``ep_rank_mask`` with ``shrink``; on the simulator the waits' deadlines count). A rank whose
``fn`` returns makes no more calls (``leave``): on the simulator the others' calls go on
without it, and their kernels mask it when their waits for it expire, as DeepEP's shrink
test has a failed rank simply stop calling.
"""

from __future__ import annotations

import threading

from backends import sim as sim_backend

from ..runtime.world import EmulatedWorld
from ..errors import EPInputError
from . import normal
from .ports import DevicePort, PeerFailedError, Rendezvous, SimPort, run_sim_step

#: a simulator rank waits at most this long for the other ranks' calls (seconds)
SIM_RENDEZVOUS_TIMEOUT_S = 120.0

#: the kernels' bounded waits on a GPU when ``timeout_ns`` is not given: the rank threads
#: call at their own pace, so a rank's receive waits for peers whose threads may still be
#: busy with host work (their checks of the last call, say) for seconds; like DeepEP's own
#: bound (about 100 s), long enough never to expire in a working run
GPU_TIMEOUT_NS = 60_000_000_000


def default_gpu_grid(sms: int, n_ranks: int) -> int:
    """The blocks per rank an ``EmulatedGroup`` on a GPU of ``sms`` SMs gives each rank's
    kernels unless told: ``sms // n_ranks``, every rank's grid together one block per SM.

    Why no more: the ranks share the SMs with each other's host-driven work. A rank's
    receive kernel spins until every peer's send has run, and a peer's send sits in its
    stream behind whatever its thread enqueued first (the torch ops that check the last
    result, say). Those must find room on SMs the spinning kernels hold. At twice this
    (``2 * sms // n_ranks``, what a process per PE under MPS gets, where MPS keeps each
    client to its share) four ranks on an H100 stalled until the bounded waits expired in
    about half the runs; at this grid and at half of it, never (docs/deepep.md). A shape
    that needs more (a receive block per local expert and one: ``kernel_grid``) gets its
    need, so 8 ranks of 256 experts still take 33 blocks each, as many in all as the grid
    that stalled."""
    return max(1, sms // n_ranks)


class MaskBook:
    """Shrink mode on the simulator: every rank's mask, the ranks its buffer's calls masked
    (``update``, ``clean``) and those its worlds' kernels masked when a wait for them expired
    (``learn``), kept here so that the worlds are only touched inside their steps, one
    thread at a time: each step first brings the view of every rank taking part up to its
    mask (``apply``), then learns what its kernels masked. A rank's mask thus spans every
    world (a rank one world masked is not waited for by the next)."""

    def __init__(self, n_ranks: int):
        self.lock = threading.Lock()
        self.set = [set() for _ in range(n_ranks)]
        self.learned = [set() for _ in range(n_ranks)]

    def update(self, rank: int, q: int, masked: bool) -> None:
        """Rank ``rank``'s buffer masks (``masked``) or unmasks rank ``q``."""
        with self.lock:
            if masked:
                self.set[rank].add(q)
            else:
                self.set[rank].discard(q)
                self.learned[rank].discard(q)

    def clean(self, rank: int) -> None:
        """Rank ``rank``'s buffer unmasks every rank."""
        with self.lock:
            self.set[rank].clear()
            self.learned[rank].clear()

    def of(self, rank: int) -> set[int]:
        """The ranks rank ``rank`` masks."""
        with self.lock:
            return self.set[rank] | self.learned[rank]

    def apply(self, world, present) -> None:
        """Before a step of ``world``: each rank of ``present``'s view set to its mask."""
        for r in present:
            want = self.of(r)
            have = {int(q) for q in world.query_mask(r).nonzero()[0]}
            for q in sorted(want - have):
                world.update_mask(q, True, on=[r])
            for q in sorted(have - want):
                world.update_mask(q, False, on=[r])

    def learn(self, world, present) -> None:
        """After a step of ``world``: what its kernels masked in each view of ``present``."""
        for r in present:
            seen = {int(q) for q in world.query_mask(r).nonzero()[0]}
            with self.lock:
                self.learned[r] |= seen - self.set[r]


class EmulatedRank:
    """Rank ``r`` of an ``EmulatedGroup``: ``rank()``, ``size()`` as a process group has
    them, and ``group``."""

    def __init__(self, group: EmulatedGroup, r: int):
        self.group, self.r = group, r

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.group.n_ranks


class EmulatedGroup:
    """``n_ranks`` ranks in this process (module docstring). ``backend``: ``"cuda"`` (one
    GPU, ``device``) or ``"sim"`` (the CPU simulator; ``sim_seed`` fixes its interleaving).
    ``n_sms`` and ``num_threads``: the kernels' grid per rank (default on a GPU
    ``default_gpu_grid``, of at least 512 threads; on the simulator the fewest blocks of 64
    threads the shape allows: ``LowLatencyShape.grid``);
    ``timeout_ns``: the kernels' bounded waits (default: the configuration's on the
    simulator, ``GPU_TIMEOUT_NS`` on a GPU)."""

    def __init__(self, n_ranks: int, *, backend: str = "cuda", device: int = 0,
                 n_sms: int | None = None, num_threads: int | None = None,
                 timeout_ns: int | None = None, sim_seed: int = 0,
                 rendezvous_timeout_s: float = SIM_RENDEZVOUS_TIMEOUT_S):
        if backend not in ("cuda", "sim"):
            raise ValueError(f"backend: {backend!r} must be 'cuda' or 'sim'")
        if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
            raise ValueError(f"n_ranks: must be a positive int, got {n_ranks!r}")
        self.n_ranks, self.backend, self.device = n_ranks, backend, device
        self.sim = backend == "sim"
        if timeout_ns is None and backend == "cuda":
            timeout_ns = GPU_TIMEOUT_NS
        self.n_sms, self.num_threads, self.timeout_ns = n_sms, num_threads, timeout_ns
        self.sim_seed, self.rendezvous_timeout_s = sim_seed, rendezvous_timeout_s
        self._lock = threading.Lock()
        # CUDA graph captures on the rank threads (``capture``): one at a time, between two
        # meetings of every rank's thread
        self._capture_lock = threading.Lock()
        self._capture_meet = threading.Barrier(n_ranks)
        self._worlds = {}             # (shape, slot) -> [port per rank]
        self._failed = None           # (rank, error) of the first rank that failed in run()
        self._streams = None
        #: rank masks (DeepEP's shrink mode): set by the first buffer that makes a world
        self.shrink: bool | None = None
        #: shrink mode: every rank's mask (``MaskBook``)
        self.mask_book = MaskBook(n_ranks)
        self._left: set[int] = set()  # ranks whose run function returned (shrink mode)

    def rank(self, r: int) -> EmulatedRank:
        if not 0 <= r < self.n_ranks:
            raise ValueError(f"rank {r}: the group has ranks 0..{self.n_ranks - 1}")
        return EmulatedRank(self, r)

    def shapes_in_use(self) -> list:
        """The ``(LowLatencyShape, slot)`` of every world made so far."""
        with self._lock:
            return list(self._worlds)

    def grid(self, shape) -> tuple[int | None, int | None]:
        """``(n_sms, num_threads)`` asked of every rank's kernels for ``shape`` (class
        docstring; None: the least the shape needs, ``LowLatencyShape.grid``)."""
        if self.sim:
            return self.n_sms, self.num_threads or max(64, -(-shape.num_experts // 32) * 32)
        if self.n_sms is not None:
            return self.n_sms, self.num_threads
        from backends.cuda import sm_count
        return default_gpu_grid(sm_count(self.device), self.n_ranks), self.num_threads

    def _raise_if_failed(self, r: int) -> None:
        """``PeerFailedError`` for rank ``r`` when a rank of the group has failed."""
        if self._failed is not None:
            failed, why = self._failed
            raise PeerFailedError(f"rank {r}: rank {failed} of the group failed "
                                  f"({type(why).__name__}: {why})")

    def port(self, torch, shape, slot: int, r: int, shrink: bool = False):
        """Rank ``r``'s port of the world of ``shape`` for result slot ``slot``, making the
        world on first use. ``shrink``: rank ``r``'s buffer has DeepEP's shrink mode (the
        worlds then have rank masks, ``ep_rank_mask``, with ``shrink``; every rank's buffer
        must agree: ``EPInputError`` otherwise)."""
        key = (shape, slot)
        with self._lock:
            self._raise_if_failed(r)
            if self.shrink is None:
                self.shrink = bool(shrink)
            elif self.shrink != bool(shrink):
                raise EPInputError(f"enable_shrink: rank {r}'s buffer has enable_shrink="
                                   f"{bool(shrink)}, another rank's {self.shrink}: every "
                                   f"rank of the group must agree")
            ports = self._worlds.get(key)
            if ports is None:
                ports = self._worlds[key] = self._make(torch, shape)
        return ports[r]

    def _make(self, torch, shape) -> list:
        n_sms, threads = self.grid(shape)
        cfg = shape.config(n_sms=n_sms, num_threads=threads, p2p_world_size=self.n_ranks,
                           use_shmem=False, rank_mask=bool(self.shrink))
        if self.sim:
            # shrink: the waits' deadlines count (in polls), so a missing rank is masked
            machine = sim_backend.Machine(self.sim_seed, timeouts=bool(self.shrink))
            world = EmulatedWorld(cfg, backend=machine, timeout_ns=self.timeout_ns,
                                  fused=False, shrink=bool(self.shrink))
            ports = []
            book = self.mask_book if self.shrink else None
            rv = Rendezvous(self.n_ranks,
                            lambda op, p: run_sim_step(world, ports, op, p, book),
                            self.rendezvous_timeout_s)
            ports.extend(SimPort(torch, world, r, rv) for r in range(self.n_ranks))
            for r in sorted(self._left):
                rv.leave(r)
            return ports
        world = EmulatedWorld(cfg, device=self.device, timeout_ns=self.timeout_ns, fused=False,
                              shrink=bool(self.shrink))
        return [DevicePort(torch, world, r) for r in range(self.n_ranks)]

    def normal_port(self, torch, shape, slot: int, r: int):
        """Rank ``r``'s port of the normal-mode world of ``shape`` (a ``normal.NormalShape``)
        for result slot ``slot``, making the world on first use (``normal.make_ports``; the
        grid as ``grid`` says, raised to what the shape needs)."""
        key = (shape, slot)
        with self._lock:
            self._raise_if_failed(r)
            ports = self._worlds.get(key)
            if ports is None:
                n_sms, threads = self.grid(shape)
                ports = self._worlds[key] = normal.make_ports(
                    torch, shape, sim=self.sim, n_sms=n_sms, num_threads=threads,
                    timeout_ns=self.timeout_ns, sim_seed=self.sim_seed,
                    rendezvous_timeout_s=self.rendezvous_timeout_s, device=self.device)
        return ports[r]

    def leave(self, r: int) -> None:
        """Rank ``r`` makes no more calls (its ``run`` function returned): in shrink mode the
        other ranks' simulator steps go on without it (``Rendezvous.leave``)."""
        with self._lock:
            if not self.shrink:
                return
            self._left.add(r)
            ports = [p for ps in self._worlds.values() for p in ps]
        for rv in {id(p.rv): p.rv for p in ports if hasattr(p, "rv")}.values():
            rv.leave(r)

    def worlds(self) -> list:
        """Every world made so far (one per shape and result slot)."""
        with self._lock:
            return [ps[0].world for ps in self._worlds.values()]

    def abort(self, r: int, error: BaseException) -> None:
        """Rank ``r`` failed: the other ranks' simulator waits end with an error naming it
        instead of waiting for its calls."""
        with self._lock:
            if self._failed is None:
                self._failed = (r, error)
            ports = [p for ps in self._worlds.values() for p in ps]
        for rv in {id(p.rv): p.rv for p in ports if hasattr(p, "rv")}.values():
            rv.abort(r, error)

    def stream(self, torch, r: int):
        """Rank ``r``'s CUDA stream (``run`` makes it current on the rank's thread)."""
        if self._streams is None:
            self._streams = [torch.cuda.Stream(device=self.device) for _ in range(self.n_ranks)]
        return self._streams[r]

    def capture(self, graph, fn, stream=None):
        """Capture ``fn()`` into ``graph`` (a ``torch.cuda.CUDAGraph``) on the calling rank
        thread's ``stream`` (default its current one) and return ``fn``'s result; every
        rank's thread of ``run`` calls it, each for its own graph.

        Why not ``torch.cuda.graph`` on each thread: it starts by synchronising the whole
        device, which fails while another rank's thread captures, and waits for every rank's
        kernels, which may be waiting for a rank that has not launched yet. Here each thread
        first finishes its own stream's work, then every thread meets, the captures run one
        after another (nothing of any rank running meanwhile), and the threads meet again
        before any rank launches more."""
        torch = __import__("torch")
        limit = self.rendezvous_timeout_s
        torch.cuda.current_stream(self.device).synchronize()
        self._capture_meet.wait(limit)
        try:
            with self._capture_lock:
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    out = fn()
        finally:
            self._capture_meet.wait(limit)
        return out

    def run(self, fn, timeout_s: float | None = None) -> list:
        """``fn(rank)`` on one thread per rank (on a GPU with the rank's stream current);
        returns the results in rank order, or raises the first rank's error (its message
        noted with the rank). ``timeout_s`` bounds the whole run (default: the rendezvous
        timeout)."""
        results, errors = [None] * self.n_ranks, [None] * self.n_ranks
        torch = None if self.sim else __import__("torch")

        def body(r):
            try:
                if torch is None:
                    results[r] = fn(r)
                    self.leave(r)
                else:
                    # the device's primary context current on this thread too (the kernels
                    # are launched through the driver API)
                    torch.cuda.set_device(self.device)
                    with torch.cuda.stream(self.stream(torch, r)):
                        results[r] = fn(r)
            except BaseException as e:
                errors[r] = e
                self.abort(r, e)
        if torch is not None:
            for r in range(self.n_ranks):
                self.stream(torch, r)
        threads = [threading.Thread(target=body, args=(r,), name=f"ep-rank-{r}", daemon=True)
                   for r in range(self.n_ranks)]
        for t in threads:
            t.start()
        limit = self.rendezvous_timeout_s if timeout_s is None else timeout_s
        for r, t in enumerate(threads):
            t.join(limit)
            if t.is_alive():
                raise TimeoutError(f"EmulatedGroup.run: rank {r} still running after "
                                   f"{limit:g} s")
        for r, e in enumerate(errors):      # the first failure, not the others' reports of it
            if e is not None and not isinstance(e, PeerFailedError):
                e.add_note(f"(raised on rank {r} of the EmulatedGroup)")
                raise e
        for r, e in enumerate(errors):
            if e is not None:
                raise e
        return results


__all__ = ["EmulatedGroup", "EmulatedRank", "MaskBook", "default_gpu_grid"]
