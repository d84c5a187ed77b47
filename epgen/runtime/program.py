"""An IR module compiled for a GPU, launched with arguments by parameter name."""

from __future__ import annotations

import ir

from . import rank_table


class Program:
    """``module`` lowered to PTX for ``arch`` (default: the device's), compiled (with the cubin
    cache) and loaded on ``device``. ``launch(kernel, grid, args)`` takes ``args`` as a dict
    keyed by the IR parameter names, so an argument can never land in the wrong slot.
    ``ptx``: ``module`` already lowered for ``arch`` (a world loading one module on several
    GPUs lowers it once); a module that calls NVSHMEM is lowered with NVSHMEM's device
    bitcode linked in (``nvptx.emit_linked_ptx``: our PTX unchanged otherwise). A rank-batched module (``ir.batch_ranks``) launches with
    ``launch_ranks``. ``backend``: ``backends.cuda`` (None, the default) or a
    ``backends.sim.Machine``, which loads the IR itself (no PTX: ``ptx`` is None)."""

    def __init__(self, module: ir.Module, arch: str | None = None, device=None,
                 ptx: str | None = None, backend=None):
        from backends import cuda
        self.backend = cuda if backend is None else backend
        self.module = module
        self._kernels = {}
        if getattr(self.backend, "RUNS_IR", False):
            self.device = self.backend.get_device(device)
            self.arch, self.ptx = arch or self.backend.arch(self.device), None
            self.loaded = self.backend.load_module(module, self.device)
            #: the simulator starts a launch after its dependencies have finished, which is
            #: also what a programmatic dependent launch with an implicit trigger waits for
            self.programmatic_ok = True
            return
        from backends import nvptx
        self.device = cuda.get_device(device)
        self.arch = arch or cuda.arch(self.device)
        self.ptx = ptx if ptx is not None else nvptx.emit_linked_ptx(module, arch=self.arch)
        self.loaded = cuda.LoadedModule(self.ptx, self.arch, device=self.device, name=module.name)
        from backends.cuda import compat
        #: whether ``launch(..., programmatic=True)`` can be a programmatic dependent launch
        #: here: a Hopper-or-later device (PDL is sm_90+) and cuda-core 1.0+ (its LaunchConfig
        #: field)
        self.programmatic_ok = (compat.CUDA_CORE_GE_1_0
                                and self.device.compute_capability[0] >= 9)

    def kernel(self, name: str):
        if name not in self._kernels:
            k = self.module.kernel(name)
            if k.rank_batch is not None:      # one by-value table (launch_ranks)
                self._kernels[name] = self.loaded.kernel(name)
            else:
                self._kernels[name] = self.loaded.kernel(
                    name, param_types=[p.dtype for p in k.params],
                    param_names=[p.name for p in k.params])
        return self._kernels[name]

    def launch_ranks(self, name: str, grid: int, rows: list[dict], stream=None, *,
                     programmatic: bool = False):
        """One launch of a rank-batched kernel (``ir.RankBatch``) for every rank: ``rows``
        holds each rank's arguments by IR parameter name, ``grid`` is one rank's grid; the
        arguments travel by value in the kernel's table (``rank_table.pack``)."""
        if getattr(self.backend, "RUNS_IR", False):
            launch_by_value, pack_arg = self.backend.launch_by_value, self.backend.pack_arg
        else:
            from backends.cuda.launch import launch_by_value, pack_arg
        k = self.module.kernel(name)
        if k.rank_batch is None:
            raise ValueError(f"kernel {name}: launch_ranks needs a rank-batched kernel "
                             f"(ir.batch_ranks)")
        if grid != k.rank_batch.blocks:
            raise ValueError(f"kernel {name}: built for {k.rank_batch.blocks} blocks per rank, "
                             f"launched with {grid}")
        table = rank_table.pack(k, rows, lambda p, v: pack_arg(p.dtype, v, name=p.name,
                                                               int_scalars=True))
        launch_by_value(self.kernel(name), grid * k.rank_batch.ranks, k.block_threads, table,
                        stream, programmatic=programmatic)

    def launch(self, name: str, grid: int, args: dict, stream=None, shmem: int = 0, *,
               programmatic: bool = False):
        k = self._checked(name, args)
        names = [p.name for p in k.params]
        self.kernel(name).launch(grid, k.block_threads, [args[n] for n in names], stream,
                                 shmem, int_scalars=True, programmatic=programmatic)

    def _checked(self, name: str, args: dict):
        """Kernel ``name``'s IR, after ``TypeError`` unless ``args`` names exactly its
        parameters."""
        k = self.module.kernel(name)
        names = [p.name for p in k.params]
        missing = [n for n in names if n not in args]
        extra = sorted(set(args) - set(names))
        if missing or extra:
            raise TypeError(f"kernel {name}: missing arguments {missing}, unknown {extra}")
        return k

    def prepare(self, name: str, grid: int, args: dict, *, programmatic: bool = False):
        """``name``'s launch with ``args`` (by IR parameter name) packed once: an object
        with ``set(param, value)`` and ``launch(stream)`` (``backends.cuda.prepared``; the
        simulator keeps the arguments and launches through ``launch``)."""
        k = self._checked(name, args)
        if getattr(self.backend, "RUNS_IR", False):
            return _HeldLaunch(self, name, grid, dict(args), programmatic)
        from backends.cuda.prepared import PreparedLaunch
        return PreparedLaunch(self.kernel(name), grid, k.block_threads, args,
                              programmatic=programmatic and self.programmatic_ok)

    def blocks_per_sm(self, name: str, shmem: int = 0) -> int:
        """How many blocks of ``name`` one SM holds at once (the driver's occupancy answer)."""
        return self.kernel(name).max_active_blocks_per_sm(self.module.kernel(name).block_threads,
                                                          shmem)


class _HeldLaunch:
    """``Program.prepare`` on a backend that runs the IR: the arguments kept by name and
    launched through ``Program.launch``."""

    def __init__(self, program, name, grid, args, programmatic):
        self.program, self.name, self.grid, self.args = program, name, grid, args
        self.programmatic = programmatic
        self.params = frozenset(args)

    def set(self, name: str, value) -> None:
        if name not in self.args:
            raise KeyError(f"kernel {self.name!r} has no parameter {name!r}")
        self.args[name] = value

    def value(self, name: str):
        return self.args[name]

    def launch(self, stream) -> None:
        self.program.launch(self.name, self.grid, self.args, stream,
                            programmatic=self.programmatic)
