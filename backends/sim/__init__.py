"""``backends.sim``: the kernel IR run on the CPU, behind the surface of ``backends.cuda``.

The way numba-cuda's simulator mirrors its driver, this package mirrors the parts of
``backends.cuda`` the ``epgen`` worlds use, and runs the kernels' IR (``ir.Module``, no PTX)
in a Python interpreter instead of on a GPU:

- ``interp``   -- ``Sim``, the interpreter: every thread of every grid a generator, threads
  interleaved in a seeded random order; ``SimHang`` for a wait that never ends
- ``numerics`` -- ``fma_f32`` and the e4m3 conversions the interpreter computes with
- ``memory``   -- the flat byte memory and ``DeviceArray``; ``SimError``
- ``stream``   -- ``Stream`` and ``Event``, with stream order and event waits
- ``launch``   -- ``LoadedModule`` / ``LoadedKernel``, ``pack_arg``, ``launch_by_value``
- ``graph``    -- graphs by stream capture (``capture``, ``GraphExec``)
- ``machine``  -- ``Machine``: the simulated GPUs, the object a world takes as its backend
- ``shmem``    -- ``SymmetricHeap`` and ``Transfers``: the NVSHMEM device functions over every
  PE in one process (puts and signals land rounds late, in any order NVSHMEM allows)
- ``weak``     -- ``WeakMemory``: the weak-memory mode, ``Machine(memory="weak")``: global
  memory under an operational model of the PTX memory consistency model

    machine = Machine(seed=1)
    world = epgen.EmulatedWorld(cfg, backend=machine)     # or backend="sim", sim_seed=1

What it models and what not: see each module; in short, the IR's semantics exactly
(integer widths, f32 rounding, atomics, warp collectives, barriers, bounded waits), every
access sequentially consistent by default (``memory="weak"``: the weak model of ``weak.py``),
no caches, no time, no occupancy limits. It is slow: a few microseconds per IR statement per thread (docs/sim.md).

This package imports only ``ir``, numpy, ml_dtypes and the standard library.
"""

from .graph import GraphExec
from .interp import SIM_POLL_NS, SimHang, Sim, polls_to_expiry, unpack_rank_table
from .launch import LoadedKernel, LoadedModule, launch_by_value, pack_arg
from .machine import Device, Machine, Pool
from .memory import DeviceArray, Memory, SimError
from .numerics import fma_f32
from .shmem import SymmetricHeap
from .stream import Event, Stream, record_event

__all__ = ["SIM_POLL_NS", "Device", "DeviceArray", "Event", "GraphExec", "LoadedKernel", "LoadedModule",
           "Machine", "Memory", "Pool", "Sim", "SimError", "SimHang", "Stream", "SymmetricHeap",
           "fma_f32",
           "launch_by_value", "pack_arg", "polls_to_expiry", "record_event",
           "unpack_rank_table"]
