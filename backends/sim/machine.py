"""``Machine``: the simulated GPUs, with the surface of the ``backends.cuda`` module that the
``epgen`` worlds use, so a world takes a machine where it would take that module.

One machine is one interpreter (``interp.Sim``: one seeded interleaving, one memory) and
``n_gpus`` GPUs that share its address space: ``device_count``, ``get_device`` (an object with
``sync()``), ``sm_count``, ``arch``, ``create_stream``, ``record_event``, ``zeros`` / ``empty``
/ ``to_device`` (``memory.DeviceArray``), ``can_access_peer`` / ``enable_peer_access`` /
``peer_memory_resource`` / ``pointer_device``, ``load_module`` (``launch.LoadedModule``),
``pack_arg`` and ``launch_by_value`` as ``backends.cuda`` has them, and ``graph``
(``capture`` and ``GraphExec``, ``graph.py``). ``RUNS_IR`` tells a caller that modules are
loaded as IR, not PTX. ``drain()`` runs every queued launch to completion.

What it does not model: the hardware's limits (SM count and architecture are what the
machine is told, ``sm_count=132``, ``arch="sm_90"``; residency, shared memory size and
registers are not limited), access permissions between GPUs (every GPU reaches every byte:
``reach(a, b)`` only decides what ``can_access_peer`` answers), and CUDA errors beyond the
ones named in the modules.
"""

from __future__ import annotations

import numpy as np

from . import launch as _launch
from .graph import Node, graph_api
from .interp import Sim
from .memory import DeviceArray, SimError
from .shmem import SymmetricHeap
from .stream import Stream, record_event
from .traffic import Ranges, Traffic, TrafficCounter


class Pool:
    """A peer-accessible memory resource of GPU ``device`` (``peer_memory_resource``)."""

    def __init__(self, device: int, peers):
        self.device = int(device)
        self.peers = frozenset(int(p) for p in peers)

    def __repr__(self) -> str:
        return f"sim.Pool(device={self.device}, peers={sorted(self.peers)})"


class Device:
    """GPU ``device_id`` of a machine (``get_device``)."""

    def __init__(self, machine, device_id: int):
        self.machine = machine
        self.device_id = int(device_id)
        self.name = f"sim GPU {device_id}"
        self.compute_capability = (9, 0)

    def __index__(self) -> int:
        return self.device_id

    def __eq__(self, other) -> bool:
        """The same GPU of the same machine, or its ordinal."""
        if isinstance(other, Device):
            return other.machine is self.machine and other.device_id == self.device_id
        return isinstance(other, int) and not isinstance(other, bool) and \
            other == self.device_id

    def __hash__(self) -> int:
        return hash(self.device_id)

    def __repr__(self) -> str:
        return f"sim.Device({self.device_id})"

    def sync(self) -> None:
        self.machine.drain()


class Machine:
    """``n_gpus`` simulated GPUs on one interpreter (module docstring). ``seed`` fixes the
    interleaving; ``max_spins``, ``timeouts`` and ``preempt`` are the interpreter's (a wait
    polling more than ``max_spins`` times raises ``SimHang``; with ``timeouts`` a bounded wait
    expires as on the GPU once its polls, ``SIM_POLL_NS`` of simulated time each, pass its
    ``timeout_ns``: ``interp.polls_to_expiry``). ``reach(a, b)``: whether GPU a can access GPU b
    (default: every pair). ``memory``: ``"sc"`` (every access sequentially consistent, the
    default) or ``"weak"`` (the PTX memory model's weak behaviours, ``weak.py``)."""

    RUNS_IR = True
    name = "sim"
    #: ``max_active_blocks_per_sm`` of every kernel (no residency limit is modelled)
    blocks_per_sm = _launch.BLOCKS_PER_SM
    pack_arg = staticmethod(_launch.pack_arg)
    launch_by_value = staticmethod(_launch.launch_by_value)
    record_event = staticmethod(record_event)

    def __init__(self, seed: int = 0, *, n_gpus: int = 1, max_spins: int = 20000,
                 timeouts: bool = False, preempt: float = 0.2, sm_count: int = 132,
                 arch: str = "sm_90", reach=None, shmem_delay: int = 256, memory: str = "sc"):
        if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
            raise ValueError(f"Machine: n_gpus must be a positive integer, got {n_gpus!r}")
        self.seed = seed
        self.sim = Sim(seed=seed, max_spins=max_spins, preempt=preempt, timeouts=timeouts,
                       shmem_delay=shmem_delay, memory=memory)
        self.memory = memory
        self.mem = self.sim.mem
        self.n_gpus = n_gpus
        self._sm_count = int(sm_count)
        self._arch = arch
        self.reach = reach or (lambda a, b: True)
        self.enabled: set[tuple[int, int]] = set()     # peer access enabled (a, b)
        self.capture = None                            # the open graph capture
        self.graph = graph_api(self)
        self._default_streams: dict[int, Stream] = {}
        self._allocations = Ranges()                    # every allocation's device

    def __repr__(self) -> str:
        weak = ", memory='weak'" if self.memory == "weak" else ""
        return f"sim.Machine(seed={self.seed}, n_gpus={self.n_gpus}{weak})"

    # -- devices ---------------------------------------------------------------------------------
    def ordinal(self, device=None) -> int:
        d = 0 if device is None else int(getattr(device, "device_id", device))
        if not 0 <= d < self.n_gpus:
            raise ValueError(f"sim: device {d} does not exist (the machine has {self.n_gpus} "
                             f"GPU{'s' if self.n_gpus != 1 else ''})")
        return d

    @staticmethod
    def gpu_available() -> bool:
        """No CUDA GPU: this is the simulator."""
        return False

    def device_count(self) -> int:
        return self.n_gpus

    def get_device(self, device=None) -> Device:
        return Device(self, self.ordinal(device))

    def sm_count(self, device=None) -> int:
        self.ordinal(device)
        return self._sm_count

    def arch(self, device=None) -> str:
        self.ordinal(device)
        return self._arch

    def can_access_peer(self, a, b) -> bool:
        a, b = self.ordinal(a), self.ordinal(b)
        return a == b or bool(self.reach(a, b))

    def enable_peer_access(self, a, b) -> bool:
        """Whether access of GPU a to GPU b was newly enabled (False for a == b or when it
        already was)."""
        if not self.can_access_peer(a, b):
            raise RuntimeError(f"sim: device {a} cannot access device {b}")
        a, b = self.ordinal(a), self.ordinal(b)
        new = (a, b) not in self.enabled
        self.enabled.add((a, b))
        return new and a != b

    # -- streams ---------------------------------------------------------------------------------
    def create_stream(self, device=None) -> Stream:
        return Stream(self, self.ordinal(device))

    def default_stream(self, device=None) -> Stream:
        d = self.ordinal(device)
        if d not in self._default_streams:
            self._default_streams[d] = Stream(self, d)
        return self._default_streams[d]

    def touch(self, stream) -> None:
        """A stream is used: while a capture is open it joins the capture."""
        if self.capture is not None:
            self.capture.touch(stream)

    def drain(self) -> None:
        """Run every queued launch to completion, except those of held streams (``hold``)
        and those that depend on them."""
        self.sim.run()

    def hold(self, stream, after_rounds: int | None = None) -> None:
        """Hold ``stream``'s launches (``interp.Sim.hold``): none starts or runs from now, or
        once they have run ``after_rounds`` more scheduler rounds (a rank that stops half-way
        through a kernel); ``drain`` returns with them queued. A rank whose launch is late,
        or that stops mid-send, in the simulator."""
        if stream.machine is not self:
            raise SimError("sim: hold: a stream of another machine")
        self.sim.hold(stream, after_rounds)

    def release(self, stream) -> None:
        """End ``stream``'s hold; the next ``drain`` runs its launches."""
        self.sim.release(stream)

    def held(self, stream) -> bool:
        """Whether ``stream`` has launches queued that a hold keeps back."""
        return any(la.stream is stream for la in self.sim.pending())

    # -- memory ------------------------------------------------------------------------------------
    def _refuse_while_capturing(self) -> None:
        if self.capture is not None:
            raise SimError("sim: no memory operations on a capturing stream")

    def peer_memory_resource(self, device, peers=()) -> Pool:
        d = self.ordinal(device)
        return Pool(d, {self.ordinal(p) for p in peers} - {d})

    def _place(self, device, memory_resource) -> tuple[int, Pool | None]:
        d = self.ordinal(device)
        if memory_resource is not None and memory_resource.device != d:
            raise SimError(f"sim: a memory resource of GPU {memory_resource.device} used for "
                           f"an allocation on GPU {d}")
        return d, memory_resource

    def zeros(self, shape, dtype, device=None, stream=None, memory_resource=None) -> DeviceArray:
        self._refuse_while_capturing()
        d, pool = self._place(device, memory_resource)
        return self._note_allocation(DeviceArray(self, shape, dtype, device=d, pool=pool))

    empty = zeros

    def to_device(self, host, device=None, stream=None, memory_resource=None) -> DeviceArray:
        self._refuse_while_capturing()
        host = np.ascontiguousarray(host)
        d, pool = self._place(device, memory_resource)
        a = self._note_allocation(DeviceArray(self, host.shape, host.dtype, device=d,
                                              pool=pool))
        self.mem.put(a.ptr, host)
        return a

    def _note_allocation(self, a: DeviceArray) -> DeviceArray:
        self._allocations.add(a.ptr, a.nbytes, a.device)
        return a

    @staticmethod
    def pointer_device(obj) -> int | None:
        return obj.device if isinstance(obj, DeviceArray) else getattr(obj, "device", None)

    # -- the traffic counter (traffic.py) ---------------------------------------------------------
    def count_traffic(self, on: bool = True) -> None:
        """Start counting the bytes every launch's threads write, by owner (``traffic.py``),
        from zero; ``on=False`` stops and drops the count. Off by default."""
        self.sim.traffic = TrafficCounter(self._allocations) if on else None

    def assign_traffic_owner(self, owner, *, streams=(), buffers=None) -> None:
        """While counting: ``owner`` (any hashable, e.g. a rank) owns the launches of
        ``streams`` and the memory of ``buffers`` (``{label: DeviceArray}``, disjoint) in
        place of their GPU, and the counts name each buffer by its label. A ``SimError``
        when the counter is off."""
        if self.sim.traffic is None:
            raise SimError("sim: assign_traffic_owner: the traffic counter is off (call "
                           "count_traffic() first)")
        self.sim.traffic.assign(owner, streams, buffers)

    def link_traffic(self, reset: bool = False) -> Traffic:
        """The bytes counted since ``count_traffic()`` or the last reset
        (``traffic.Traffic``: by source owner, destination owner, buffer label and kind);
        ``reset`` zeroes the count after reading it. A ``SimError`` when the counter is
        off."""
        if self.sim.traffic is None:
            raise SimError("sim: link_traffic: the traffic counter is off (call "
                           "count_traffic() first)")
        return self.sim.traffic.read(reset)

    # -- NVSHMEM ---------------------------------------------------------------------------------
    def symmetric_heap(self):
        """The symmetric heap of the NVSHMEM model (``shmem.SymmetricHeap``, made on first
        use): a world registers each PE's symmetric buffers there."""
        if self.sim.shmem is None:
            self.sim.shmem = SymmetricHeap()
        return self.sim.shmem

    # -- modules and launches --------------------------------------------------------------------
    def load_module(self, module, device=None) -> _launch.LoadedModule:
        """``module`` (an ``ir.Module``) loaded on ``device``: its kernels run as IR."""
        return _launch.LoadedModule(self, module, self.ordinal(device))

    def check_launch(self, kernel: _launch.LoadedKernel, args: dict, stream: Stream) -> None:
        """Called before every launch (``args``: the arguments as given, by parameter name;
        empty for a by-value table): a subclass can refuse one (tests check placement)."""

    def launch(self, kernel: _launch.LoadedKernel, grid: int, params: dict, stream=None,
               raw_args: dict | None = None, shmem: int = 0):
        """Queue ``kernel`` on ``stream`` after the stream's earlier work and the events it
        waited for (or, while a capture is open, record it), each block with ``shmem`` bytes
        of dynamic shared memory; returns the launch (or node)."""
        stream = self.default_stream(kernel.device) if stream is None else stream
        if stream.machine is not self:
            raise SimError(f"sim: {kernel.name} launched on a stream of another machine")
        self.check_launch(kernel, raw_args or {}, stream)
        deps = stream.take_dependencies()
        if self.capture is None:
            stream.last = self.sim.launch(kernel.ir, grid, params, after=deps, shmem=shmem,
                                          stream=stream)
        else:
            node = Node(kernel.ir, grid, params, [d for d in deps if isinstance(d, Node)],
                        shmem)
            self.capture.nodes.append(node)
            stream.last = node
        self.launched(kernel, params, stream, deps)
        return stream.last

    def launched(self, kernel, params: dict, stream: Stream, deps: list) -> None:
        """Called after every launch is queued (``stream.last`` is it; ``deps`` what it waits
        for): a subclass can log them."""
