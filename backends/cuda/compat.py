"""Every cuda.core version difference epgen cares about, in one place.

Version drift handled here (each seen on the versions the tests ran with):

- < 0.5: the API lives in ``cuda.core.experimental``; 0.5+ at top-level ``cuda.core``.
- 1.0: ``LaunchConfig(cooperative_launch=)`` became ``is_cooperative=``; ``kernel.attributes.x()``
  methods became properties with per-device views ``kernel.attributes[dev]``.
- 1.2: ``MemoryResource.allocate(size, *, stream=)`` takes the stream keyword-only (passing it by
  keyword works on every version); ``Kernel.handle`` is a ``CUkernel`` (library loading), so a
  ``CUfunction`` must come from ``cuKernelGetFunction``.

Nothing here imports cuda.core at import time: :func:`core` does, lazily, and raises
:class:`CudaUnavailableError` when it cannot.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import operator
import re
from types import ModuleType

from .errors import CudaUnavailableError, check

__all__ = ["CUDA_CORE_VERSION", "CUDA_CORE_GE_0_5", "CUDA_CORE_GE_1_0", "CUDA_CORE_GE_1_2",
           "core", "driver", "buffer_type", "launch_config", "kernel_attribute", "kernel_handle",
           "kernel_cufunction", "raw_kernel_attribute", "set_raw_kernel_attribute",
           "buffer_pointer", "allocate", "device_memory_pool"]


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.2.0"`` -> ``(1, 2, 0)``; missing or non-numeric parts count as 0."""
    parts = [int(m) for m in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def _installed_version() -> tuple[int, int, int] | None:
    try:
        return parse_version(importlib.metadata.version("cuda-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


#: cuda-core's version as installed (None when the distribution metadata is missing).
CUDA_CORE_VERSION: tuple[int, int, int] | None = _installed_version()


def _ge(major: int, minor: int) -> bool:
    return CUDA_CORE_VERSION is not None and CUDA_CORE_VERSION[:2] >= (major, minor)


CUDA_CORE_GE_0_5 = _ge(0, 5)   # top-level namespace
CUDA_CORE_GE_1_0 = _ge(1, 0)   # is_cooperative; attribute properties
CUDA_CORE_GE_1_2 = _ge(1, 2)   # keyword-only allocate stream; Kernel.handle is CUkernel


@functools.cache
def _load_core() -> tuple[ModuleType | None, str]:
    try:
        root = importlib.import_module("cuda.core")
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
        return None, f"cannot import cuda.core ({type(exc).__name__}: {exc})"
    if hasattr(root, "Device"):
        return root, ""
    try:  # cuda-core < 0.5
        return importlib.import_module("cuda.core.experimental"), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot import cuda.core.experimental ({type(exc).__name__}: {exc})"


def core() -> ModuleType:
    """The cuda.core namespace holding ``Device``, ``Program``, ``launch`` ...; raises
    :class:`CudaUnavailableError` when cuda-core cannot be imported."""
    module, reason = _load_core()
    if module is None:
        raise CudaUnavailableError(f"cuda-core is not usable: {reason}")
    return module


def driver() -> ModuleType:
    """``cuda.bindings.driver``; raises :class:`CudaUnavailableError` when not importable."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except Exception as exc:  # noqa: BLE001
        raise CudaUnavailableError(f"cuda-bindings is not usable ({exc})") from exc


def buffer_type() -> type | None:
    """cuda.core's ``Buffer`` class, or ``None`` when cuda-core is unavailable."""
    module, _ = _load_core()
    return getattr(module, "Buffer", None) if module is not None else None


def _dims(label: str, value) -> int | tuple[int, ...]:
    """cuda.core accepts only Python ints; accept numpy integers too."""
    if isinstance(value, tuple | list):
        dims = tuple(operator.index(v) for v in value)
        if not 1 <= len(dims) <= 3:
            raise ValueError(f"{label} must have 1 to 3 dimensions, got {value!r}")
        return dims
    return operator.index(value)


def launch_config(grid, block, shmem: int = 0, *, cluster=None, cooperative: bool = False,
                  programmatic: bool = False):
    """A ``LaunchConfig`` with the keyword names of the installed cuda.core. ``programmatic``:
    programmatic dependent launch (PDL, ``programmatic_stream_serialization``): the kernel
    may start once every block of the previous kernel on its stream has triggered or exited
    (cuda.core 1.x; ``CudaUnavailableError`` on an older one)."""
    kwargs = {"grid": _dims("grid", grid), "block": _dims("block", block),
              "shmem_size": operator.index(shmem)}
    if cluster is not None:
        kwargs["cluster"] = _dims("cluster", cluster)
    if cooperative:
        kwargs["is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"] = True
    if programmatic:
        if not CUDA_CORE_GE_1_0:
            raise CudaUnavailableError("programmatic dependent launch needs cuda-core 1.0 or "
                                       "later (LaunchConfig.programmatic_stream_serialization)")
        kwargs["programmatic_stream_serialization"] = True
    return core().LaunchConfig(**kwargs)


def kernel_attribute(kernel, name: str, device_id: int):
    """Read ``kernel.attributes.<name>`` for one device through cuda.core (a property with a
    per-device view on >= 1.0, a method taking the device before)."""
    view = kernel.attributes
    if CUDA_CORE_GE_1_0:
        return getattr(view[device_id], name)
    return getattr(view, name)(device_id)


def kernel_handle(kernel):
    """The driver handle of a cuda.core ``Kernel`` (``CUkernel`` on 1.2; ``CUfunction`` where a
    version loaded modules the legacy way)."""
    handle = getattr(kernel, "handle", None)
    return handle if handle is not None else kernel._handle


def kernel_cufunction(kernel):
    """A ``CUfunction`` for ``kernel`` in the *current* context (``cuKernelGetFunction`` for a
    ``CUkernel``)."""
    drv = driver()
    handle = kernel_handle(kernel)
    if isinstance(handle, drv.CUkernel):
        return check(drv.cuKernelGetFunction(handle), "cuKernelGetFunction")
    return handle


def raw_kernel_attribute(kernel, attribute, device_id: int) -> int:
    """A ``CUfunction_attribute`` read directly from the driver (never a cached value)."""
    drv = driver()
    handle = kernel_handle(kernel)
    if isinstance(handle, drv.CUkernel):
        return check(drv.cuKernelGetAttribute(attribute, handle, drv.CUdevice(device_id)),
                     "cuKernelGetAttribute")
    return check(drv.cuFuncGetAttribute(attribute, handle), "cuFuncGetAttribute")


def set_raw_kernel_attribute(kernel, attribute, value: int, device_id: int) -> None:
    """Set a ``CUfunction_attribute`` (``cuKernelSetAttribute`` for the device, or
    ``cuFuncSetAttribute`` on a legacy ``CUfunction``)."""
    drv = driver()
    handle = kernel_handle(kernel)
    if isinstance(handle, drv.CUkernel):
        check(drv.cuKernelSetAttribute(attribute, int(value), handle, drv.CUdevice(device_id)),
              "cuKernelSetAttribute")
    else:
        check(drv.cuFuncSetAttribute(handle, attribute, int(value)), "cuFuncSetAttribute")


def buffer_pointer(buffer) -> int:
    """Device address of a cuda.core ``Buffer`` (``handle`` is an int on 1.2, a
    ``CUdeviceptr`` on older versions; ``int()`` covers both)."""
    return int(buffer.handle)


def allocate(memory_resource, nbytes: int, stream):
    """``memory_resource.allocate`` (a ``Device`` or a ``MemoryResource``) on ``stream``; the
    stream goes by keyword, which 1.2 requires and older versions accept."""
    return memory_resource.allocate(nbytes, stream=stream)


def device_memory_pool(device_id: int):
    """A ``DeviceMemoryResource`` owning a new memory pool on ``device_id`` (default options);
    its ``peer_accessible_by`` (cuda.core 0.4+) sets which devices may access its
    allocations. Raises :class:`CudaUnavailableError` on a cuda.core without it."""
    core_ns = core()
    mr_type = getattr(core_ns, "DeviceMemoryResource", None)
    options = getattr(core_ns, "DeviceMemoryResourceOptions", None)
    if mr_type is None or options is None or not hasattr(mr_type, "peer_accessible_by"):
        raise CudaUnavailableError(
            f"cuda-core {CUDA_CORE_VERSION} has no DeviceMemoryResource with "
            "peer_accessible_by: peer-accessible pools need a newer cuda-core")
    return mr_type(int(device_id), options())
