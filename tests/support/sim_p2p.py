"""The real ``epgen.P2PWorld`` on the CPU with placement checks: a ``backends.sim.Machine``
of several simulated GPUs (sharing one address space, as GPUs share one unified virtual
address space) that also checks, at every launch, what a real machine would fault on or
what would be wrong there.

``PlacementMachine`` keeps every allocation with its GPU and memory resource (a
``backends.sim.Pool``: a GPU and the peers its access list holds). Each launch is checked
before it is queued (``check_launch``): the stream is on the program's GPU, every pointer
argument lies in memory of that GPU, and every entry of every pointer table (``*_ptrs``)
lies in memory that GPU may access: its own, or a pool of another GPU whose access list
names it, on a GPU it enabled peer access to. So a buffer a peer writes that the world
allocated from the wrong place, or a table built on the wrong GPU, fails here.

    with sim_p2p_world(cfg, seed, n_gpus=4) as world:
        got = world.dispatch(tokens, topk_ids)
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses

import numpy as np

from backends import sim as sim_backend
from epgen.runtime import p2p_world as p2p_mod
from ir.types import PtrType


class PlacementError(AssertionError):
    """A launch would touch memory its GPU cannot (or should not) access."""


@dataclasses.dataclass(frozen=True)
class Launched:
    """One launch: its GPU, kernel, rank, simulator launch and the launches it waits for."""

    device: int
    kernel: str
    rank: int
    launch: object
    deps: tuple


class PlacementMachine(sim_backend.Machine):
    """A ``backends.sim.Machine`` that records every allocation (``allocs``: (start, end,
    gpu, pool), sorted), every pool (``pools``) and every launch (``log``), and checks every
    launch's placement."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allocs: list[tuple[int, int, int, object]] = []
        self.starts: list[int] = []
        self.pools: list = []
        self.log: list[Launched] = []

    def _record(self, array):
        i = bisect.bisect(self.starts, array.ptr)
        self.starts.insert(i, array.ptr)
        self.allocs.insert(i, (array.ptr, array.ptr + max(array.nbytes, 1), array.device,
                               array.pool))
        return array

    def zeros(self, shape, dtype, device=None, stream=None, memory_resource=None):
        if memory_resource is not None and memory_resource.device != self.ordinal(device):
            raise PlacementError(f"a pool of GPU {memory_resource.device} used for an "
                                 f"allocation on GPU {self.ordinal(device)}")
        return self._record(super().zeros(shape, dtype, device, stream, memory_resource))

    def to_device(self, host, device=None, stream=None, memory_resource=None):
        return self._record(super().to_device(host, device, stream, memory_resource))

    def peer_memory_resource(self, device, peers=()):
        pool = super().peer_memory_resource(device, peers)
        self.pools.append(pool)
        return pool

    def owner(self, address: int):
        """(gpu, pool) of the allocation holding ``address``."""
        i = bisect.bisect(self.starts, address) - 1
        if i < 0 or not self.allocs[i][0] <= address < self.allocs[i][1]:
            raise PlacementError(f"address {address:#x} is in no allocation")
        return self.allocs[i][2], self.allocs[i][3]

    def can_access(self, gpu: int, address: int) -> bool:
        owner, pool = self.owner(address)
        if owner == gpu:
            return True
        return (pool is not None and gpu in pool.peers and self.reach(gpu, owner)
                and (gpu, owner) in self.enabled)

    def check_launch(self, kernel, args, stream):
        name, device = kernel.name, kernel.device
        if stream.device != device:
            raise PlacementError(f"{name} of GPU {device} launched on a stream of GPU "
                                 f"{stream.device}")
        for p in kernel.ir.params:
            v = args.get(p.name)
            if not isinstance(p.dtype, PtrType) or v is None:
                continue
            address = v.ptr if isinstance(v, sim_backend.DeviceArray) else int(v)
            owner, _pool = self.owner(address)
            if owner != device:
                raise PlacementError(f"{name} on GPU {device}: argument {p.name} is in "
                                     f"the memory of GPU {owner}")
            if p.name.endswith("_ptrs"):
                # read the table as it is (draining here would run the launches queued so
                # far before this one exists)
                table = self.mem.get(v.ptr, v.shape, v.dtype)
                for i, entry in enumerate(np.asarray(table).ravel()):
                    if not self.can_access(device, int(entry)):
                        gpu, pool = self.owner(int(entry))
                        where = (f"a pool shared with GPUs {sorted(pool.peers)}" if pool
                                 else "not a peer-accessible pool")
                        raise PlacementError(
                            f"{name} on GPU {device}: {p.name}[{i}] points into GPU "
                            f"{gpu}'s memory ({where}), which GPU {device} cannot access")

    def launched(self, kernel, params, stream, deps):
        self.log.append(Launched(kernel.device, kernel.name, int(params.get("my_rank", -1)),
                                 stream.last, tuple(deps)))


@contextlib.contextmanager
def fake_gpus(n_gpus: int, seed: int = 0, reach=None, max_spins: int = 20000,
              timeouts: bool = False):
    """A ``PlacementMachine`` of ``n_gpus`` simulated GPUs on seed ``seed``; pass it as a
    world's ``backend``."""
    yield PlacementMachine(seed, n_gpus=n_gpus, reach=reach, max_spins=max_spins,
                           timeouts=timeouts)


@contextlib.contextmanager
def sim_p2p_world(cfg, seed: int = 0, n_gpus: int | None = None, reach=None,
                  max_spins: int = 20000, timeouts: bool = False, **world_kwargs):
    """A ``P2PWorld`` of ``cfg`` on ``n_gpus`` simulated GPUs (default: one per rank) with
    placement checks; ``reach(a, b)``: whether GPU a can access GPU b (default: all).
    ``world.gpus`` is the machine (``PlacementMachine``), ``world.sim`` the interpreter."""
    n = cfg.n_ranks if n_gpus is None else n_gpus
    with fake_gpus(n, seed, reach, max_spins, timeouts) as machine:
        world = p2p_mod.P2PWorld(cfg, backend=machine, **world_kwargs)
        world.sim, world.gpus = machine.sim, machine
        yield world
