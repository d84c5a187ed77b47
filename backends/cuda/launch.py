"""Kernel launch with typed, checked argument packing.

cuda.core's ``launch`` passes a plain Python ``int`` as a 64-bit *pointer* and a Python
``float`` as a ``double``, whatever the kernel parameter is. So arguments are packed here:

- with parameter types (IR type names ``'u32'``, ``'s64'``, ``'f32'``, ``'ptr.global'`` ... or IR
  type objects), :func:`pack_args` converts each value to that exact numpy type and checks its
  range. Python ints are accepted for pointer parameters (as addresses) and, only when
  ``int_scalars=True``, for integer parameters;
- without types, :func:`check_untyped_args` lets numpy/ctypes scalars through, turns device
  memory (``DeviceArray``, ``Buffer``, ``__cuda_array_interface__``, DLPack) into addresses and
  rejects Python ``int``/``float``/``bool`` with a ``TypeError`` naming the argument.

Where the driver reports parameter sizes (``cuKernelGetParamInfo``, asked once per parameter
below the count the PTX ``.entry`` or the driver gives, never past the last), :func:`launch`
also checks the count and byte size of every argument before launching.
"""

from __future__ import annotations

import ctypes
import numbers
import operator
from collections.abc import Sequence

import numpy as np

from . import compat
from .errors import check, cuda_errors
from .memory import as_device_pointer
from .graph import stream_handle
from .kernel import (KernelHandle, cufunction, kernel_param_sizes, probed_param_sizes,
                     set_max_dynamic_shared_memory)
from .stream import as_stream, using_device

__all__ = ["launch", "launch_by_value", "pack_args", "pack_arg", "check_untyped_args",
           "type_name"]

_INT_TYPES = {f"{kind}{bits}": (kind, bits) for kind in "usb" for bits in (8, 16, 32, 64)}
_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_SIGNED = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
_FLOATS = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
_CTYPES_SCALARS = (ctypes.c_bool, ctypes.c_int8, ctypes.c_int16, ctypes.c_int32,
                   ctypes.c_int64, ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32,
                   ctypes.c_uint64, ctypes.c_float, ctypes.c_double)
_CTYPES_INTS = _CTYPES_SCALARS[1:9]
_CTYPES_FLOATS = (ctypes.c_float, ctypes.c_double)


def type_name(param_type) -> str:
    """The IR spelling of a parameter type: a string as is, an IR type via ``.name``."""
    if isinstance(param_type, str):
        return param_type
    name = getattr(param_type, "name", None)
    if isinstance(name, str):
        return name
    raise TypeError(f"not a parameter type: {param_type!r}")


def _label(index: int, name: str | None, tname: str) -> str:
    return f"argument {index}" + (f" {name!r}" if name else "") + f" ({tname})"


def _is_bool(value) -> bool:
    return isinstance(value, bool | np.bool_ | ctypes.c_bool)


def _integer_value(value, label: str, int_scalars: bool) -> int:
    if _is_bool(value):
        raise TypeError(f"{label}: got a bool for an integer parameter")
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, _CTYPES_INTS):
        return int(value.value)
    if isinstance(value, int):
        if int_scalars:
            return value
        raise TypeError(f"{label}: a plain Python int is ambiguous for a scalar parameter "
                        "(cuda.core passes it as a 64-bit pointer); pass a numpy scalar such "
                        "as np.uint32(x), or pack with int_scalars=True")
    raise TypeError(f"{label}: expected an integer (numpy scalar), got {type(value).__name__}")


def _pack_int(kind: str, bits: int, value, label: str, int_scalars: bool):
    number = _integer_value(value, label, int_scalars)
    low = -(1 << (bits - 1)) if kind in "sb" else 0
    high = (1 << bits) - 1 if kind in "ub" else (1 << (bits - 1)) - 1
    if not low <= number <= high:
        raise ValueError(f"{label}: value {number} is outside the range [{low}, {high}]")
    if kind == "s":
        return _SIGNED[bits](number)
    return _UNSIGNED[bits](number & ((1 << bits) - 1))  # b: two's complement bits


def _float_value(value, label: str) -> float:
    if _is_bool(value) or isinstance(value, numbers.Integral):
        raise TypeError(f"{label}: got an integer for a float parameter; pass float(x) or a "
                        "numpy float scalar")
    if isinstance(value, np.floating | float):
        return float(value)
    if isinstance(value, _CTYPES_FLOATS):
        return float(value.value)
    raise TypeError(f"{label}: expected a float, got {type(value).__name__}")


def _pack_float(tname: str, value, label: str):
    number = _float_value(value, label)
    if tname == "bf16":
        return _to_bf16_bits(number, label)
    with np.errstate(over="ignore"):
        packed = _FLOATS[tname](number)
    if np.isinf(packed) and np.isfinite(number):
        raise ValueError(f"{label}: value {number} overflows {tname}")
    return packed


def _to_bf16_bits(number: float, label: str) -> np.uint16:
    """bfloat16 bits of ``number`` (round to nearest even), passed as a 16-bit integer."""
    with np.errstate(over="ignore"):
        bits = int(np.array(number, dtype=np.float32).view(np.uint32))
    if np.isnan(number):
        return np.uint16(0x7FC0)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    if (rounded & 0x7F80) == 0x7F80 and np.isfinite(number):
        raise ValueError(f"{label}: value {number} overflows bf16")
    return np.uint16(rounded & 0xFFFF)


def _pack_pred(value, label: str):
    if _is_bool(value):
        return np.bool_(bool(value.value if isinstance(value, ctypes.c_bool) else value))
    if isinstance(value, np.integer) and int(value) in (0, 1):
        return np.bool_(int(value))
    raise TypeError(f"{label}: expected a bool for a pred parameter, got {value!r}")


def pack_arg(param_type, value, *, index: int = 0, name: str | None = None,
             int_scalars: bool = False):
    """Convert one argument to what its kernel parameter expects (see :func:`pack_args`)."""
    tname = type_name(param_type)
    label = _label(index, name, tname)
    if tname.startswith("ptr."):
        if value is None:
            return 0
        try:
            return as_device_pointer(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{label}: {exc}") from exc
    if tname in _INT_TYPES:
        return _pack_int(*_INT_TYPES[tname], value, label, int_scalars)
    if tname in _FLOATS or tname == "bf16":
        return _pack_float(tname, value, label)
    if tname == "pred":
        return _pack_pred(value, label)
    raise TypeError(f"{label}: parameter type {tname!r} cannot be passed by cuda.core's launch "
                    "(vectors and structs must be flattened or passed through memory)")


def pack_args(param_types: Sequence, values: Sequence, *, names: Sequence[str] | None = None,
              int_scalars: bool = False) -> tuple:
    """Convert ``values`` to the exact types of the kernel parameters ``param_types``.

    Integer types (``u8``..``u64``, ``s8``..``s64``, ``b8``..``b64``) become the numpy scalar of
    that width after a range check (``ValueError`` when out of range); float types (``f16``,
    ``f32``, ``f64``; ``bf16`` as its 16 bits) likewise; ``pred`` a ``np.bool_``; ``ptr.*`` a
    Python int address (``None`` is the null pointer). A Python int for a scalar parameter is a
    ``TypeError`` unless ``int_scalars``. Errors name the argument.
    """
    param_types = list(param_types)
    values = list(values)
    if len(values) != len(param_types):
        raise TypeError(f"the kernel takes {len(param_types)} arguments, got {len(values)}")
    if names is not None and len(names) != len(param_types):
        raise ValueError(f"{len(names)} parameter names for {len(param_types)} parameters")
    return tuple(pack_arg(ptype, value, index=i, name=names[i] if names else None,
                          int_scalars=int_scalars)
                 for i, (ptype, value) in enumerate(zip(param_types, values)))


def check_untyped_args(values: Sequence, names: Sequence[str] | None = None) -> tuple:
    """Check arguments for a kernel whose parameter types are unknown: numpy and ctypes scalars
    pass through, device memory becomes its address, and anything whose width is ambiguous
    (Python ``int``, ``float``, ``bool``) or that is not device memory is a ``TypeError``."""
    packed = []
    for i, value in enumerate(values):
        label = f"argument {i}" + (f" {names[i]!r}" if names else "")
        if isinstance(value, bool):
            raise TypeError(f"{label}: a Python bool is ambiguous; pass np.bool_(x)")
        if isinstance(value, int):
            raise TypeError(f"{label}: a plain Python int would be passed as a 64-bit pointer; "
                            "pass a numpy scalar such as np.uint32(x) for a scalar, a "
                            "DeviceArray/Buffer for memory, or give the parameter types")
        if isinstance(value, float):
            raise TypeError(f"{label}: a Python float would be passed as a double; pass "
                            "np.float32(x) or np.float64(x)")
        if isinstance(value, (np.number, np.bool_, *_CTYPES_SCALARS)):
            packed.append(value)
        else:
            try:
                packed.append(as_device_pointer(value))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{label}: {exc}") from exc
    return tuple(packed)


def _arg_size(value) -> int:
    if isinstance(value, np.generic):
        return value.itemsize
    if isinstance(value, ctypes._SimpleCData):
        return ctypes.sizeof(value)
    return 8  # an int address


def _check_sizes(packed: tuple, sizes: Sequence[int] | None, kernel_name: str) -> None:
    if not sizes:
        return
    if len(packed) != len(sizes):
        raise TypeError(f"kernel {kernel_name} takes {len(sizes)} arguments, got {len(packed)}")
    for i, (value, size) in enumerate(zip(packed, sizes)):
        if _arg_size(value) != size:
            raise TypeError(f"argument {i} of kernel {kernel_name}: {type(value).__name__} is "
                            f"{_arg_size(value)} bytes but the parameter is {size} bytes")


def launch(kernel, grid, block, args: Sequence = (), stream=None, shmem: int = 0, *,
           param_types: Sequence | None = None, param_names: Sequence[str] | None = None,
           int_scalars: bool = False, cluster=None, cooperative: bool = False,
           programmatic: bool = False, sync: bool = False) -> None:
    """Launch ``kernel`` (a :class:`LoadedKernel` or a cuda.core ``Kernel``).

    ``grid``/``block`` are ints or up-to-3 tuples; ``shmem`` is the dynamic shared memory in
    bytes (the kernel's limit is raised when above 48 KiB); ``stream`` defaults to the device's
    default stream. Arguments are packed with ``param_types`` (or the ``LoadedKernel``'s) by
    :func:`pack_args`, else checked by :func:`check_untyped_args`. ``programmatic``: a
    programmatic dependent launch (``compat.launch_config``). With ``sync`` the stream is
    synchronised so a fault in the kernel raises :class:`CudaError` here.
    """
    if isinstance(kernel, KernelHandle):
        core_kernel, device, kname = kernel.kernel, kernel.device, repr(kernel.name)
        param_types = param_types if param_types is not None else kernel.param_types
        param_names = param_names if param_names is not None else kernel.param_names
    else:
        core_kernel, device, kname = kernel, None, repr(kernel)
    if param_types is not None:
        packed = pack_args(param_types, args, names=param_names, int_scalars=int_scalars)
    else:
        packed = check_untyped_args(args, param_names)
    shmem = operator.index(shmem)
    with using_device(device) as dev:
        if isinstance(kernel, KernelHandle):
            sizes = kernel.param_sizes()
        else:
            sizes = kernel_param_sizes(core_kernel)
            if sizes is None:       # a foreign kernel of unknown count: never launched unchecked
                sizes = probed_param_sizes(core_kernel)
        _check_sizes(packed, sizes, kname)
        _ensure_dynamic_smem(kernel, shmem)
        stream = as_stream(stream, dev)
        config = compat.launch_config(grid, block, shmem, cluster=cluster,
                                      cooperative=cooperative, programmatic=programmatic)
        with cuda_errors(f"launching kernel {kname}"):
            compat.core().launch(stream, config, core_kernel, *packed)
        if sync:
            with cuda_errors(f"kernel {kname} failed"):
                stream.sync()


def _ensure_dynamic_smem(kernel, shmem: int) -> None:
    if shmem <= 0:
        return
    if isinstance(kernel, KernelHandle):
        if shmem <= kernel._dynamic_smem_ok:
            return
        set_max_dynamic_shared_memory(kernel, shmem)
        kernel._dynamic_smem_ok = shmem
    else:
        set_max_dynamic_shared_memory(kernel, shmem)


def launch_by_value(kernel: KernelHandle, grid: int, block: int, param: np.ndarray,
                    stream=None, *, programmatic: bool = False) -> None:
    """Launch ``kernel``, whose one parameter is a by-value byte array, with ``param`` (a
    contiguous numpy array of exactly that many bytes): ``cuLaunchKernelEx`` with the
    address of the bytes, which cuda.core's ``launch`` cannot pass (structs by value are not
    supported there). The driver copies the bytes at the call, so ``param`` may change right
    after; a stream capture records them. ``programmatic``: a programmatic dependent launch
    (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``)."""
    data = np.ascontiguousarray(param)
    sizes = kernel.param_sizes()
    if sizes is not None and list(sizes) != [data.nbytes]:
        raise ValueError(f"kernel {kernel.name!r} takes parameters of {list(sizes)} bytes, "
                         f"got one of {data.nbytes} bytes")
    drv = compat.driver()
    with using_device(kernel.device) as dev:
        stream = as_stream(stream, dev)
        config = drv.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = int(grid), 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = int(block), 1, 1
        config.sharedMemBytes = 0
        config.hStream = stream_handle(stream)
        if programmatic:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
        else:
            config.numAttrs = 0
        addresses = np.array([data.ctypes.data], dtype=np.uint64)   # void *kernelParams[1]
        with cuda_errors(f"launching kernel {kernel.name!r}"):
            check(drv.cuLaunchKernelEx(config, cufunction(kernel), addresses.ctypes.data, 0),
                  "cuLaunchKernelEx")
