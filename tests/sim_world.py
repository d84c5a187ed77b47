"""The real ``epgen.EmulatedWorld`` on the CPU: its ``backends.cuda`` calls and its
``Program`` are replaced by fakes backed by ``ir_sim.Sim``, so the world's own wiring
(buffers, pointer tables, launch arguments, generations, result extraction) runs unchanged
against the simulated kernels.

Streams keep their order: a launch depends on the previous launch of its stream and on the
events the stream waited for; host copies and memsets first run everything queued.

    with sim_world(cfg, seed) as world:
        got = world.dispatch(tokens, topk_ids)
"""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np

import backends
from epgen.runtime import world as world_mod

import sim_graph
from epgen.runtime import graph as graph_mod
from ir_sim import Sim


class FakeArray:
    def __init__(self, sim: Sim, shape, dtype, ptr=None):
        self.sim = sim
        self.shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        self.dtype = np.dtype(dtype)
        self.ptr = sim.mem.alloc(self.nbytes) if ptr is None else ptr

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("FakeArray supports [a:b] on the first axis only")
        start, stop, _ = index.indices(self.shape[0])
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        return FakeArray(self.sim, (max(stop - start, 0), *self.shape[1:]), self.dtype,
                         self.ptr + start * row)

    def copy_from_host(self, host, *, stream=None):
        self.sim.run()
        host = np.ascontiguousarray(host)
        if host.nbytes != self.nbytes:
            raise ValueError(f"copy of {host.nbytes} bytes into {self.nbytes}")
        self.sim.mem.put(self.ptr, host)
        return self

    def copy_from(self, src, *, stream=None):
        return self.copy_from_host(src.to_host())

    def to_host(self, out=None, *, stream=None):
        self.sim.run()
        return self.sim.mem.get(self.ptr, self.shape, self.dtype)

    def zero(self, *, stream=None):
        self.sim.run()
        self.sim.mem.write(self.ptr, bytes(self.nbytes))
        return self


class FakeStream:
    def __init__(self, sim):
        self.sim = sim
        self.last = None
        self.waits = []

    def wait(self, event):
        sim_graph.wait(self, event.launch)

    def record(self):
        return FakeEvent(self.last)

    def sync(self):
        self.sim.run()


class FakeEvent:
    def __init__(self, launch):
        self.launch = launch


def fake_cuda(sim: Sim) -> types.ModuleType:
    m = types.ModuleType("backends.cuda")
    m.create_stream = lambda device=None: FakeStream(sim)

    def refuse_while_capturing():
        # as the device memory pool does: no stream-ordered allocation during a capture
        if sim_graph.Recorder.nodes is not None:
            raise RuntimeError("sim: no memory operations on a capturing stream")

    def zeros(shape, dtype, device=None, stream=None):
        refuse_while_capturing()
        return FakeArray(sim, shape, dtype)

    m.zeros = zeros

    def to_device(host, device=None, stream=None):
        refuse_while_capturing()
        host = np.ascontiguousarray(host)
        a = FakeArray(sim, host.shape, host.dtype)
        sim.mem.put(a.ptr, host)
        return a

    m.to_device = to_device
    m.sm_count = lambda device=None: 132
    m.record_event = lambda stream: stream.record()
    m.gpu_available = lambda: False
    return m


def param_value(v):
    """A launch argument as the simulator holds it: an array's address, a float (f32
    parameters such as NVFP4's ``input_scale``) or an int."""
    if isinstance(v, FakeArray):
        return v.ptr
    return float(v) if isinstance(v, (float, np.floating)) else int(v)


class FakeProgram:
    """``Program``'s interface (``launch``, ``blocks_per_sm``, ``module``, ``device``,
    ``programmatic_ok``) on the simulator."""

    sim: Sim = None
    #: the simulator starts a launch after its dependencies have finished, which is also
    #: what a programmatic dependent launch with an implicit trigger waits for
    programmatic_ok = True

    def __init__(self, module, arch=None, device=None):
        self.module = module
        self.device = "sim"
        self.sim = FakeProgram.sim        # the simulator of the world being built
        self.launched = []                # (kernel name, programmatic) of every launch

    def launch(self, name, grid, args, stream=None, shmem=0, *, programmatic=False):
        self.launched.append((name, programmatic))
        k = self.module.kernel(name)
        params = {n: param_value(v) for n, v in args.items()}
        sim_graph.launch(self.sim, stream, k, grid, params)

    def launch_ranks(self, name, grid, rows, stream=None, *, programmatic=False):
        """``Program.launch_ranks`` on the simulator: the table packed as the real one is,
        copied into simulator memory at the call (the driver copies by-value arguments),
        one launch of every rank's blocks."""
        from epgen.runtime import rank_table
        self.launched.append((name, programmatic))
        k = self.module.kernel(name)
        table = rank_table.pack(k, rows, lambda p, v: param_value(v))
        ptr = self.sim.mem.alloc(table.nbytes, 8)
        self.sim.mem.put(ptr, table)
        sim_graph.launch(self.sim, stream, k, grid * k.rank_batch.ranks, {"rank_args": ptr})

    def blocks_per_sm(self, name, shmem=0):
        return 64


@contextlib.contextmanager
def patched_cuda(fake, module, program):
    """``backends.cuda`` replaced by ``fake`` and ``module.Program`` by ``program`` for the
    block; both restored afterwards."""
    saved_mod, saved_attr = sys.modules.get("backends.cuda"), getattr(backends, "cuda", None)
    saved_program = module.Program
    sys.modules["backends.cuda"] = fake
    backends.cuda = fake
    module.Program = program
    try:
        yield
    finally:
        module.Program = saved_program
        if saved_mod is not None:
            sys.modules["backends.cuda"] = saved_mod
        else:
            sys.modules.pop("backends.cuda", None)
        if saved_attr is not None:
            backends.cuda = saved_attr
        elif hasattr(backends, "cuda"):
            del backends.cuda


@contextlib.contextmanager
def sim_world(cfg, seed: int = 0, max_spins: int = 20000, timeouts: bool = False,
              **world_kwargs):
    """An ``EmulatedWorld`` of ``cfg`` whose kernels run on ``ir_sim.Sim(seed)``; its
    ``capture_round_trip`` graphs too (``sim_graph``)."""
    sim = Sim(seed=seed, max_spins=max_spins, timeouts=timeouts)
    FakeProgram.sim = sim
    real_graphs = graph_mod.cuda_graph
    graph_mod.cuda_graph = sim_graph.module       # RoundTripGraph captures on the simulator
    try:
        with patched_cuda(fake_cuda(sim), world_mod, FakeProgram):
            world = world_mod.EmulatedWorld(cfg, **world_kwargs)
            world.sim = sim
            yield world
    finally:
        graph_mod.cuda_graph = real_graphs
