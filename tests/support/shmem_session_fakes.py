"""Stand-ins for NVSHMEM's host library and the bootstrap, for ``ShmemSession`` and the
``ShmemWorld``\\ s on it in one test process (tests/unit/test_shmem_session.py,
tests/sim/test_shmem_session_sim.py).

``SharedHeap`` plays NVSHMEM for every PE of a test: ``view(pe)`` is PE ``pe``'s host object.
Each PE has one symmetric heap (``heaps[pe]``: its live allocations, in order, from every
pool of every world); ``ptr(p, pe)`` maps an address of this PE's k-th allocation to the same
offset of PE ``pe``'s k-th (as ``nvshmem_ptr`` does for symmetric memory allocated in the same
order everywhere). Everything is logged in ``log``: ``("uid", pe)``, ``("init", pe, rank,
nranks)``, ``("finalize", pe)``, ``("malloc", pe, nbytes)``, ``("free", pe, nbytes)``.
``FakeBootstrap`` logs ``("broadcast", rank, name)`` and ``("barrier", rank, name)`` there
too, and fails (``BootstrapTimeoutError``) a barrier whose full name is in ``fail``.
``HeapMachine`` is a ``backends.sim.Machine`` that records every allocation made from a
``HeapPool``.
"""

from __future__ import annotations

from backends import sim as sim_backend
from backends.sim.machine import Pool
from epgen.runtime import bootstrap as bootstrap_mod


class SharedHeap:
    """NVSHMEM of the PEs of one test (module docstring)."""

    def __init__(self, log=None):
        self.log = [] if log is None else log
        self.heaps: dict[int, list] = {}

    def view(self, pe: int) -> "HostView":
        return HostView(self, pe)

    def count(self, kind: str, pe: int | None = None) -> int:
        """How many ``kind`` entries the log has (of PE ``pe``, or of every PE)."""
        return sum(1 for e in self.log if isinstance(e, tuple) and e[0] == kind
                   and (pe is None or e[1] == pe))


class HostView:
    """PE ``pe``'s ``NvshmemHost`` stand-in."""

    def __init__(self, shared: SharedHeap, pe: int):
        self.shared, self.pe = shared, pe
        self.initialized = False

    def get_uniqueid(self) -> bytes:
        self.shared.log.append(("uid", self.pe))
        return b"u" * 128

    def init_uid(self, uid, rank, nranks, device=None):
        assert len(uid) == 128
        self.shared.log.append(("init", self.pe, rank, nranks))
        self.initialized = True

    def finalize(self):
        self.shared.log.append(("finalize", self.pe))
        self.initialized = False

    def symmetric_resource(self) -> "HeapPool":
        return HeapPool(self)

    def ptr(self, p: int, pe: int) -> int:
        mine = self.shared.heaps.get(self.pe, [])
        theirs = self.shared.heaps.get(pe, [])
        for i, a in enumerate(mine):
            if a.ptr <= p < a.ptr + a.nbytes:
                if i >= len(theirs):         # the peer's allocation not made yet: a placeholder
                    return 0x1000 + pe
                return theirs[i].ptr + (p - a.ptr)
        raise AssertionError(f"nvshmem_ptr of a non-symmetric address {p:#x}")

    def cumodule_init(self, m):
        raise AssertionError("no NVSHMEM device code in these kernels")


class HeapPool(Pool):
    """A world's symmetric memory resource: its allocations (``allocs``) are also PE ``pe``'s
    heap entries; ``free_all`` frees them, last first, and takes them off the heap."""

    def __init__(self, host: HostView):
        super().__init__(0, ())
        self.host = host
        self.allocs: list = []

    def record(self, array) -> None:
        self.allocs.append(array)
        self.host.shared.heaps.setdefault(self.host.pe, []).append(array)
        self.host.shared.log.append(("malloc", self.host.pe, array.nbytes))

    def free_all(self) -> None:
        heap = self.host.shared.heaps[self.host.pe]
        while self.allocs:
            a = self.allocs.pop()
            heap.remove(a)
            self.host.shared.log.append(("free", self.host.pe, a.nbytes))


class HeapMachine(sim_backend.Machine):
    """A ``backends.sim.Machine`` that records each allocation from a ``HeapPool`` in it."""

    def zeros(self, shape, dtype, device=None, stream=None, memory_resource=None):
        a = super().zeros(shape, dtype, device, stream, memory_resource)
        if isinstance(memory_resource, HeapPool):
            memory_resource.record(a)
        return a

    def to_device(self, host, device=None, stream=None, memory_resource=None):
        a = super().to_device(host, device, stream, memory_resource)
        if isinstance(memory_resource, HeapPool):
            memory_resource.record(a)
        return a


class FakeBootstrap:
    """Rank ``rank`` of ``n``: a broadcast that returns rank 0's bytes (everyone's the same
    here), barriers that pass at once unless their full name is in ``fail``."""

    kind = "fake"

    def __init__(self, rank: int, n: int, log: list, fail=()):
        self.rank, self.world_size, self.log, self.fail = rank, n, log, set(fail)

    def broadcast_bytes(self, data, name="nvshmem"):
        self.log.append(("broadcast", self.rank, name))
        return b"u" * 128

    def barrier(self, name="sync", timeout_s=None):
        self.log.append(("barrier", self.rank, name))
        if name in self.fail:
            raise bootstrap_mod.BootstrapTimeoutError(
                f"rank {self.rank}: host barrier {name!r}: a peer never arrived", name)
