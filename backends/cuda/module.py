"""Loaded modules: PTX compiled (through the cubin cache) and loaded on a device.

``LoadedModule(ptx, arch)`` compiles and loads PTX; ``.kernel(name)`` returns a
:class:`LoadedKernel` (a :class:`~backends.cuda.kernel.KernelHandle` with a ``launch``
shorthand). The kernel-level functions (attributes, occupancy, the dynamic shared memory
limit) live in :mod:`backends.cuda.kernel` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import compat
from .compile import compile_ptx, normalize_arch
from .errors import check, cuda_errors
from .kernel import (DEFAULT_DYNAMIC_SMEM_LIMIT, KernelAttributes, KernelHandle, cufunction,
                     entry_param_count, kernel_attributes, max_active_blocks_per_sm,
                     set_max_dynamic_shared_memory)
from .launch import launch as _launch
from .stream import get_device, using_device

__all__ = ["LoadedModule", "LoadedKernel", "KernelAttributes", "kernel_attributes",
           "max_active_blocks_per_sm", "set_max_dynamic_shared_memory", "cufunction",
           "DEFAULT_DYNAMIC_SMEM_LIMIT"]


class LoadedKernel(KernelHandle):
    """A kernel of a :class:`LoadedModule` (see :class:`~backends.cuda.kernel.KernelHandle`)."""

    def launch(self, grid, block, args=(), stream=None, shmem: int = 0, **kwargs) -> None:
        """Shorthand for :func:`backends.cuda.launch.launch` on this kernel."""
        _launch(self, grid, block, args, stream, shmem, **kwargs)


class LoadedModule:
    """PTX compiled for ``arch`` (default: the device's) and loaded on ``device``.

    Compilation goes through :func:`~backends.cuda.compile.compile_ptx` and its cubin cache.
    """

    def __init__(self, ptx: str | bytes, arch: str | None = None, *, device=None,
                 cache_dir=None, use_cache: bool = True,
                 ptxas_options: Sequence[str] | None = None, name: str = "epgen") -> None:
        self.device = get_device(device)
        major, minor = self.device.compute_capability
        self.arch = normalize_arch(arch) if arch is not None else f"sm_{major}{minor}"
        self.ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        self.name = name
        self.object_code = compile_ptx(self.ptx, self.arch, cache_dir, use_cache=use_cache,
                                       ptxas_options=ptxas_options, name=name)
        self._kernels: dict[str, LoadedKernel] = {}

    def __repr__(self) -> str:
        return f"LoadedModule({self.name!r}, arch={self.arch!r}, kernels={sorted(self._kernels)})"

    def kernel(self, name: str, *, param_types: Sequence | None = None,
               param_names: Sequence[str] | None = None) -> LoadedKernel:
        """The kernel ``name`` (an ``.entry`` of the PTX). ``param_types`` (IR type names such
        as ``'u32'``, ``'ptr.global'``, or IR type objects) make :func:`launch` pack and
        range-check arguments; given again, they replace the stored ones."""
        loaded = self._kernels.get(name)
        if loaded is None:
            with using_device(self.device), \
                    cuda_errors(f"loading kernel {name!r} of module {self.name!r}"):
                core_kernel = self.object_code.get_kernel(name)
            loaded = LoadedKernel(self, name, core_kernel, self.device,
                                  param_count=entry_param_count(self.ptx, name))
            self._kernels[name] = loaded
        if param_types is not None:
            loaded.param_types = tuple(param_types)
        if param_names is not None:
            loaded.param_names = tuple(param_names)
        return loaded

    def cumodule(self):
        """The ``CUmodule`` of this library in the current context (``cuLibraryGetModule``),
        e.g. for ``nvshmem.bindings.cumodule_init``."""
        drv = compat.driver()
        handle = self.object_code.handle
        with using_device(self.device):
            if isinstance(handle, drv.CUlibrary):
                return check(drv.cuLibraryGetModule(handle), "cuLibraryGetModule")
            return handle
