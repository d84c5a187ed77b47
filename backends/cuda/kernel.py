"""Loaded kernels: attributes, occupancy, the dynamic shared memory limit, the raw
``CUfunction``.

:class:`KernelHandle` wraps a cuda.core ``Kernel`` with its name, device and optionally its
parameter types. It lives apart from :mod:`backends.cuda.module` (which loads modules and
subclasses it as ``LoadedKernel`` with a ``launch`` shorthand) so that
:mod:`backends.cuda.launch` can use it without importing the module loader: the import
order is kernel -> launch -> module.

The free functions accept a :class:`KernelHandle` or a bare cuda.core ``Kernel``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from . import compat
from .errors import check, cuda_errors
from .stream import using_device

__all__ = ["KernelHandle", "KernelAttributes", "kernel_attributes", "max_active_blocks_per_sm",
           "set_max_dynamic_shared_memory", "cufunction", "kernel_param_sizes",
           "driver_param_count", "driver_param_sizes", "entry_param_count", "DEFAULT_DYNAMIC_SMEM_LIMIT"]

#: Dynamic shared memory a kernel may use without raising its attribute (48 KiB).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


class KernelAttributes(NamedTuple):
    """Per-device attributes of a compiled kernel."""

    num_regs: int
    max_threads_per_block: int
    shared_size_bytes: int
    const_size_bytes: int
    local_size_bytes: int
    max_dynamic_shared_size_bytes: int
    ptx_version: int
    binary_version: int


class KernelHandle:
    """A loaded kernel: the cuda.core ``Kernel`` plus its name, device and (optional)
    parameter types/names used by :func:`~backends.cuda.launch.launch`; the base of
    :class:`~backends.cuda.module.LoadedKernel`, which adds the ``launch`` shorthand."""

    def __init__(self, module, name: str, kernel, device,
                 param_types: Sequence | None = None,
                 param_names: Sequence[str] | None = None,
                 param_count: int | None = None) -> None:
        self.module = module
        self.name = name
        self.kernel = kernel
        self.device = device
        self.param_types = tuple(param_types) if param_types is not None else None
        self.param_names = tuple(param_names) if param_names is not None else None
        #: how many parameters the kernel's ``.entry`` declares (None: unknown)
        self.param_count = param_count
        self._param_sizes: tuple[int, ...] | None = None
        self._dynamic_smem_ok = 0  # dynamic shared memory bytes known to be allowed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, device={self.device.device_id})"

    def attributes(self) -> KernelAttributes:
        """Registers, max threads per block, static shared/const/local sizes ..."""
        return kernel_attributes(self)

    def max_active_blocks_per_sm(self, block_threads: int, dynamic_smem: int = 0) -> int:
        """Occupancy: blocks of ``block_threads`` that fit on one SM at once."""
        return max_active_blocks_per_sm(self, block_threads, dynamic_smem)

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory."""
        set_max_dynamic_shared_memory(self, nbytes)

    def param_sizes(self) -> tuple[int, ...] | None:
        """Byte size of each kernel parameter from the driver, or None where the driver
        cannot tell (:func:`kernel_param_sizes`). The count comes from the PTX ``.entry``
        (``param_count``), else from the driver, else from the parameter types."""
        if self._param_sizes is None:
            count = self.param_count
            if count is None:
                count = driver_param_count(self.kernel)
            if count is None and self.param_types is not None:
                count = len(self.param_types)
            sizes = None if count is None else driver_param_sizes(self.kernel, count)
            self._param_sizes = () if sizes is None else sizes
        return self._param_sizes or None


#: the first driver versions with ``cu{Kernel,Func}GetParamInfo`` and ``...GetParamCount``
PARAM_INFO_DRIVER_VERSION = 12040
PARAM_COUNT_DRIVER_VERSION = 13000


def kernel_param_sizes(core_kernel, count: int | None = None) -> tuple[int, ...] | None:
    """The byte size of each parameter of a cuda.core ``Kernel`` from the driver, asked for
    indices below ``count`` only (None: the driver's own count, ``driver_param_count``);
    None where the driver cannot tell. Never an index past the last parameter: cuda.core's
    ``Kernel.arguments_info`` counts by probing until ``cuKernelGetParamInfo`` fails with
    ``CUDA_ERROR_INVALID_VALUE``, which compute-sanitizer reports as an API error."""
    if count is None:
        count = driver_param_count(core_kernel)
    return None if count is None else driver_param_sizes(core_kernel, count)


def _param_query(core_kernel, what: str, min_version: int):
    """(handle, the driver's ``cuKernel<what>`` or ``cuFunc<what>``, its name), or None
    below ``min_version``."""
    drv = compat.driver()
    if int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion")) < min_version:
        return None
    handle = compat.kernel_handle(core_kernel)
    call = ("cuKernel" if isinstance(handle, drv.CUkernel) else "cuFunc") + what
    query = getattr(drv, call, None)
    return None if query is None else (handle, query, call)


def driver_param_count(core_kernel) -> int | None:
    """How many parameters the driver says a cuda.core ``Kernel`` takes
    (``cuKernelGetParamCount`` / ``cuFuncGetParamCount``, driver 13.0+), else None."""
    q = _param_query(core_kernel, "GetParamCount", PARAM_COUNT_DRIVER_VERSION)
    if q is None:
        return None
    handle, query, call = q
    try:
        result = query(handle)
    except RuntimeError:    # the bindings declare it, the installed driver library lacks it
        return None
    return int(check(result, call))


def driver_param_sizes(core_kernel, count: int) -> tuple[int, ...] | None:
    """The byte sizes of parameters ``0 .. count-1`` of a cuda.core ``Kernel`` from the
    driver (``cuKernelGetParamInfo`` for a ``CUkernel``, ``cuFuncGetParamInfo`` for a
    ``CUfunction``), one call per index below ``count``; None on a driver without them."""
    if count == 0:
        return ()
    q = _param_query(core_kernel, "GetParamInfo", PARAM_INFO_DRIVER_VERSION)
    if q is None:
        return None
    handle, query, call = q
    return tuple(int(check(query(handle, i), call)[1]) for i in range(count))


def probed_param_sizes(core_kernel) -> tuple[int, ...]:
    """The byte sizes of a foreign cuda.core ``Kernel``'s parameters where nothing gives
    their count: ``cuKernelGetParamInfo`` asked index by index until the driver refuses one
    (compute-sanitizer reports that last call as an API error; epgen's own kernels never
    come here, their count is their PTX entry's). () where the driver cannot tell."""
    q = _param_query(core_kernel, "GetParamInfo", PARAM_INFO_DRIVER_VERSION)
    if q is None:
        return ()
    handle, query, _ = q
    sizes = []
    while True:
        err, _offset, size = query(handle, len(sizes))
        if int(err) != 0:
            return tuple(sizes)
        sizes.append(int(size))


def entry_param_count(ptx: str, name: str) -> int | None:
    """How many ``.param`` declarations the PTX ``.entry name( ... )`` has (0 for an entry
    without a parameter list); None when ``ptx`` has no such entry."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"(?![\w$])\s*(\()?", ptx)
    if m is None:
        return None
    if m.group(1) is None:
        return 0
    end = ptx.find(")", m.end())
    return len(re.findall(r"\.param\b", ptx[m.end():end if end >= 0 else None]))


def _unwrap(kernel) -> tuple[object, object | None, str]:
    """(cuda.core Kernel, device or None, display name)."""
    if isinstance(kernel, KernelHandle):
        return kernel.kernel, kernel.device, kernel.name
    return kernel, None, repr(kernel)


def kernel_attributes(kernel, device=None) -> KernelAttributes:
    """The :class:`KernelAttributes` of ``kernel`` on ``device`` (default: the kernel's)."""
    core_kernel, own_device, name = _unwrap(kernel)
    attr = compat.driver().CUfunction_attribute
    with using_device(device if device is not None else own_device) as dev, \
            cuda_errors(f"reading attributes of kernel {name}"):
        static = {field: int(compat.kernel_attribute(core_kernel, field, dev.device_id))
                  for field in KernelAttributes._fields
                  if field != "max_dynamic_shared_size_bytes"}
        # mutable attribute: read from the driver, cuda.core caches attribute values
        dynamic = compat.raw_kernel_attribute(
            core_kernel, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dev.device_id)
        return KernelAttributes(max_dynamic_shared_size_bytes=int(dynamic), **static)


def cufunction(kernel):
    """A ``CUfunction`` for ``kernel`` in its device's context (for raw driver calls such as
    ``cuLaunchKernel`` with by-value struct parameters)."""
    core_kernel, own_device, _ = _unwrap(kernel)
    with using_device(own_device):
        return compat.kernel_cufunction(core_kernel)


def set_max_dynamic_shared_memory(kernel, nbytes: int, device=None) -> None:
    """Raise ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` to ``nbytes`` if it is lower.

    Needed for more than 48 KiB of dynamic shared memory. Raises ``ValueError`` when static +
    dynamic shared memory exceeds the device's opt-in maximum per block."""
    core_kernel, own_device, name = _unwrap(kernel)
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"dynamic shared memory size {nbytes} is negative")
    drv = compat.driver()
    attr = drv.CUfunction_attribute
    with using_device(device if device is not None else own_device) as dev:
        current = compat.raw_kernel_attribute(
            core_kernel, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dev.device_id)
        if nbytes <= current:
            return
        static = compat.raw_kernel_attribute(
            core_kernel, attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, dev.device_id)
        optin = check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            drv.CUdevice(dev.device_id)), "cuDeviceGetAttribute")
        if static + nbytes > optin:
            raise ValueError(f"kernel {name} needs {static} B static + {nbytes} B dynamic shared "
                             f"memory, more than the device's {optin} B per block")
        compat.set_raw_kernel_attribute(
            core_kernel, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes,
            dev.device_id)


def max_active_blocks_per_sm(kernel, block_threads: int, dynamic_smem: int = 0,
                             device=None) -> int:
    """How many blocks of ``block_threads`` threads with ``dynamic_smem`` bytes of dynamic
    shared memory can be resident on one SM (``cuOccupancyMaxActiveBlocksPerMultiprocessor``).

    Raises the kernel's dynamic shared memory limit first when ``dynamic_smem`` needs it."""
    core_kernel, own_device, name = _unwrap(kernel)
    device = device if device is not None else own_device
    if dynamic_smem > DEFAULT_DYNAMIC_SMEM_LIMIT:
        set_max_dynamic_shared_memory(kernel, dynamic_smem, device)
    with using_device(device):
        occupancy = getattr(core_kernel, "occupancy", None)
        if occupancy is not None:
            with cuda_errors(f"occupancy of kernel {name}"):
                return int(occupancy.max_active_blocks_per_multiprocessor(
                    int(block_threads), int(dynamic_smem)))
        drv = compat.driver()
        return int(check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            compat.kernel_cufunction(core_kernel), int(block_threads), int(dynamic_smem)),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


