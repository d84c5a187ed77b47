"""The real ``epgen.P2PWorld`` on the CPU: as ``sim_world`` does for ``EmulatedWorld``, its
``backends.cuda`` calls and its ``Program`` are replaced by fakes backed by
``ir_sim.Sim``, here with several fake GPUs sharing the simulator's one address space (as
GPUs share one unified virtual address space).

The fakes keep the placement: every allocation remembers its GPU and its memory resource
(``FakePool``: a GPU and the peers its access list holds), every stream its GPU. Each launch
is checked before it runs (``FakeGpuProgram.launch``): the stream is on the program's GPU,
every pointer argument lies in memory of that GPU, and every entry of every pointer table
(``*_ptrs``) lies in memory that GPU may access: its own, or a pool of another GPU whose
access list names it, on a GPU it enabled peer access to. So a buffer a peer writes that the
world allocated from the wrong place, or a table built on the wrong GPU, fails here.

    with sim_p2p_world(cfg, seed, n_gpus=4) as world:
        got = world.dispatch(tokens, topk_ids)
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses

import numpy as np

from epgen.runtime import p2p_world as p2p_mod
from ir.types import PtrType

from ir_sim import Sim
from sim_world import FakeArray, FakeStream, fake_cuda, param_value, patched_cuda


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


class FakePool:
    """A peer-accessible memory resource of GPU ``device`` (``peer_memory_resource``)."""

    def __init__(self, device, peers):
        self.device = int(device)
        self.peers = frozenset(int(p) for p in peers)


class FakeGpu:
    def __init__(self, state, device_id):
        self.state = state
        self.device_id = device_id

    def sync(self):
        self.state.sim.run()


class FakeGpuStream(FakeStream):
    def __init__(self, sim, device):
        super().__init__(sim)
        self.device = device


class GpuState:
    """The fake machine: ``n_gpus`` GPUs, which pairs can reach each other (``reach``), the
    peer access enabled and every allocation with its GPU and memory resource."""

    def __init__(self, sim: Sim, n_gpus: int, reach=None):
        self.sim = sim
        self.n_gpus = n_gpus
        self.reach = reach or (lambda a, b: True)
        self.enabled: set[tuple[int, int]] = set()
        self.allocs: list[tuple[int, int, int, object]] = []     # (start, end, gpu, pool)
        self.starts: list[int] = []
        self.pools: list[FakePool] = []
        self.log: list[Launched] = []          # every launch, in enqueue order

    def record(self, array, device, pool):
        gpu = int(device) if device is not None else 0
        if pool is not None and pool.device != gpu:
            raise PlacementError(f"a pool of GPU {pool.device} used for an allocation on "
                                 f"GPU {gpu}")
        i = bisect.bisect(self.starts, array.ptr)
        self.starts.insert(i, array.ptr)
        self.allocs.insert(i, (array.ptr, array.ptr + max(array.nbytes, 1), gpu, pool))
        array.device, array.pool = gpu, pool
        return array

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


def fake_p2p_cuda(state: GpuState):
    sim = state.sim
    m = fake_cuda(sim)
    m.device_count = lambda: state.n_gpus
    m.can_access_peer = lambda a, b: int(a) == int(b) or bool(state.reach(int(a), int(b)))

    def enable_peer_access(a, b):
        if not m.can_access_peer(a, b):
            raise RuntimeError(f"device {a} cannot access device {b}")
        new = (int(a), int(b)) not in state.enabled
        state.enabled.add((int(a), int(b)))
        return new and int(a) != int(b)

    def peer_memory_resource(device, peers=()):
        pool = FakePool(device, set(peers) - {int(device)})
        state.pools.append(pool)
        return pool

    def zeros(shape, dtype, device=None, stream=None, memory_resource=None):
        return state.record(FakeArray(sim, shape, dtype), device, memory_resource)

    def to_device(host, device=None, stream=None, memory_resource=None):
        host = np.ascontiguousarray(host)
        a = state.record(FakeArray(sim, host.shape, host.dtype), device, memory_resource)
        sim.mem.put(a.ptr, host)
        return a

    m.enable_peer_access = enable_peer_access
    m.peer_memory_resource = peer_memory_resource
    m.zeros = zeros
    m.to_device = to_device
    m.create_stream = lambda device=None: FakeGpuStream(sim, int(device))
    m.get_device = lambda device=None: FakeGpu(state, int(device or 0))
    m.arch = lambda device=None: "sm_90"
    m.pointer_device = lambda x: getattr(x, "device", None)
    m.record_event = lambda stream: stream.record()
    return m


class FakeGpuProgram:
    """``Program`` on the simulator, one per fake GPU, checking placement at every launch."""

    state: GpuState = None
    blocks = 64
    programmatic_ok = True    # the simulator orders a launch after its dependencies anyway

    def __init__(self, module, arch=None, device=None, ptx=None):
        self.module = module
        self.device = int(device)
        self.arch = arch
        self.ptx = ptx if ptx is not None else f"<ptx of {module.name} for {arch}>"
        self.state = FakeGpuProgram.state

    def _check(self, name, args, stream):
        st = self.state
        if stream.device != self.device:
            raise PlacementError(f"{name} of GPU {self.device} launched on a stream of GPU "
                                 f"{stream.device}")
        for p in self.module.kernel(name).params:
            v = args[p.name]
            if not isinstance(p.dtype, PtrType) or v is None:
                continue
            address = v.ptr if isinstance(v, FakeArray) else int(v)
            owner, _pool = st.owner(address)
            if owner != self.device:
                raise PlacementError(f"{name} on GPU {self.device}: argument {p.name} is in "
                                     f"the memory of GPU {owner}")
            if p.name.endswith("_ptrs"):
                # read the table as it is (running the simulator here would run the launches
                # queued so far before this one exists)
                table = st.sim.mem.get(v.ptr, v.shape, v.dtype)
                for i, entry in enumerate(np.asarray(table).ravel()):
                    if not st.can_access(self.device, int(entry)):
                        gpu, pool = st.owner(int(entry))
                        where = (f"a pool shared with GPUs {sorted(pool.peers)}" if pool
                                 else "not a peer-accessible pool")
                        raise PlacementError(
                            f"{name} on GPU {self.device}: {p.name}[{i}] points into GPU "
                            f"{gpu}'s memory ({where}), which GPU {self.device} cannot access")

    def launch(self, name, grid, args, stream=None, shmem=0, *, programmatic=False):
        self._check(name, args, stream)
        k = self.module.kernel(name)
        params = {n: param_value(v) for n, v in args.items()}
        deps = ([stream.last] if stream.last is not None else []) + stream.waits
        stream.waits = []
        stream.last = self.state.sim.launch(k, grid, params, after=deps)
        self.state.log.append(Launched(self.device, name, int(args["my_rank"]), stream.last,
                                       tuple(deps)))

    def blocks_per_sm(self, name, shmem=0):
        return FakeGpuProgram.blocks


@contextlib.contextmanager
def fake_gpus(n_gpus: int, seed: int = 0, reach=None, max_spins: int = 20000,
              timeouts: bool = False):
    """``backends.cuda`` and ``p2p_world.Program`` replaced by the fakes of a machine of
    ``n_gpus`` fake GPUs on ``ir_sim.Sim(seed)``; yields the ``GpuState``."""
    sim = Sim(seed=seed, max_spins=max_spins, timeouts=timeouts)
    state = GpuState(sim, n_gpus, reach)
    FakeGpuProgram.state = state
    with patched_cuda(fake_p2p_cuda(state), p2p_mod, FakeGpuProgram):
        yield state


@contextlib.contextmanager
def sim_p2p_world(cfg, seed: int = 0, n_gpus: int | None = None, reach=None,
                  max_spins: int = 20000, timeouts: bool = False, **world_kwargs):
    """A ``P2PWorld`` of ``cfg`` on ``n_gpus`` fake GPUs (default: one per rank) whose
    kernels run on ``ir_sim.Sim(seed)``; ``reach(a, b)``: whether GPU a can access GPU b
    (default: all). ``world.gpus`` is the fake machine (``GpuState``), ``world.sim`` the
    simulator."""
    n = cfg.n_ranks if n_gpus is None else n_gpus
    with fake_gpus(n, seed, reach, max_spins, timeouts) as state:
        world = p2p_mod.P2PWorld(cfg, **world_kwargs)
        world.sim, world.gpus = state.sim, state
        yield world
