"""Loading and launching on ``backends.sim``: the counterparts of ``backends.cuda``'s
``LoadedModule`` / ``LoadedKernel``, ``pack_arg`` and ``launch_by_value``.

There is no PTX: ``LoadedModule(machine, module, device)`` loads an ``ir.Module`` and its
kernels run as IR in the machine's interpreter (``interp.Sim``). A launch takes the
arguments in parameter order as the cuda backend's (``LoadedKernel.launch(grid, block,
args, stream)``): device arrays become their addresses, floats stay floats (f32 parameters
such as NVFP4's ``input_scale``), everything else an integer; the block size must be the
kernel's ``block_threads``. A rank-batched kernel (``ir.RankBatch``) launches with
``launch_by_value`` and its by-value table (u64 words), copied at the call as the driver
copies by-value parameters.

What it does not model: occupancy (every block of every launch is live at once: the
simulator interleaves all their threads, so ``max_active_blocks_per_sm`` answers a
fixed ``Machine.blocks_per_sm``, ``BLOCKS_PER_SM``), a dynamic shared memory limit (each
block of a launch gets its own ``shmem`` bytes, the kernel's ``dyn_smem``), launch latency,
and programmatic dependent launch beyond its ordering (a launch starts after its
dependencies have finished, which is what an implicit trigger waits for).
"""

from __future__ import annotations

import numbers

import numpy as np

from ir import nodes as N
from ir.types import DType, PtrType

from .memory import DeviceArray

#: what ``max_active_blocks_per_sm`` answers: no residency limit is modelled
BLOCKS_PER_SM = 64


def pack_arg(param_type, value, *, index: int = 0, name: str | None = None,
             int_scalars: bool = True):
    """One argument as the simulator holds it: a pointer parameter's address (a
    ``DeviceArray``'s ``ptr``, an int, or None for the null pointer), a float for a float
    parameter, an int otherwise (``TypeError`` naming the argument for anything else)."""
    label = f"argument {index}" + (f" {name!r}" if name else "")
    if isinstance(param_type, PtrType):
        if value is None:
            return 0
        if isinstance(value, DeviceArray):
            return value.ptr
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise TypeError(f"{label}: expected a sim.DeviceArray or an address, got "
                        f"{type(value).__name__}")
    if isinstance(param_type, DType) and param_type.kind == "f":
        if not isinstance(value, (numbers.Real, np.floating)):
            raise TypeError(f"{label}: expected a float, got {type(value).__name__}")
        return float(value)
    if isinstance(value, (bool, np.bool_)):
        return int(bool(value))
    if isinstance(value, (numbers.Integral, np.integer)):
        return int(value)
    if isinstance(value, DeviceArray):
        return value.ptr
    raise TypeError(f"{label}: expected an integer, got {type(value).__name__}")


class LoadedKernel:
    """One kernel of a ``LoadedModule``."""

    def __init__(self, module: LoadedModule, kernel: N.Kernel):
        self.module = module
        self.ir = kernel
        self.name = kernel.name
        self.device = module.device

    def __repr__(self) -> str:
        return f"sim.LoadedKernel({self.name!r})"

    def max_active_blocks_per_sm(self, block_threads: int, dynamic_smem: int = 0) -> int:
        return self.module.machine.blocks_per_sm

    def _check_block(self, block, shmem) -> None:
        if int(block) != self.ir.block_threads:
            raise ValueError(f"kernel {self.name}: built for {self.ir.block_threads} threads "
                             f"per block, launched with {block}")
        if isinstance(shmem, bool) or not isinstance(shmem, numbers.Integral) or shmem < 0:
            raise ValueError(f"kernel {self.name}: shmem must be a byte count >= 0, got "
                             f"{shmem!r}")

    def launch(self, grid, block, args=(), stream=None, shmem: int = 0, *,
               int_scalars: bool = True, programmatic: bool = False) -> None:
        """Queue one launch of ``grid`` blocks on ``stream`` (``args`` in parameter order)."""
        self._check_block(block, shmem)
        params = self.ir.params
        args = list(args)
        if len(args) != len(params):
            raise TypeError(f"kernel {self.name} takes {len(params)} arguments, got {len(args)}")
        values = {p.name: pack_arg(p.dtype, v, index=i, name=p.name)
                  for i, (p, v) in enumerate(zip(params, args))}
        self.module.launched.append((self.name, bool(programmatic)))
        self.module.machine.launch(self, int(grid), values, stream, raw_args=dict(
            zip((p.name for p in params), args)), shmem=int(shmem))


def launch_by_value(kernel: LoadedKernel, grid: int, block: int, param: np.ndarray,
                    stream=None, *, programmatic: bool = False) -> None:
    """Queue a launch of the rank-batched ``kernel`` with its by-value table ``param`` (the
    u64 words ``ranks x params``; copied now)."""
    kernel._check_block(block, 0)
    if kernel.ir.rank_batch is None:
        raise ValueError(f"kernel {kernel.name}: launch_by_value needs a rank-batched kernel")
    table = np.array(param, copy=True).view(np.uint64).reshape(-1)
    kernel.module.launched.append((kernel.name, bool(programmatic)))
    kernel.module.machine.launch(kernel, int(grid), {"rank_args": table}, stream)


class LoadedModule:
    """``module`` (an ``ir.Module``) loaded on GPU ``device`` of ``machine``; ``launched``:
    ``(kernel name, programmatic)`` of every launch through it, in call order."""

    def __init__(self, machine, module, device: int = 0):
        self.machine = machine
        self.ir = module
        self.name = module.name
        self.device = int(device)
        self.launched: list[tuple[str, bool]] = []
        self._kernels: dict[str, LoadedKernel] = {}

    def __repr__(self) -> str:
        return f"sim.LoadedModule({self.name!r}, device={self.device})"

    def kernel(self, name: str, *, param_types=None, param_names=None) -> LoadedKernel:
        if name not in self._kernels:
            self._kernels[name] = LoadedKernel(self, self.ir.kernel(name))
        return self._kernels[name]
