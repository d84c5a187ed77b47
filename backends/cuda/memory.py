"""Device arrays and device-pointer extraction.

:class:`DeviceArray` is a C-contiguous device allocation with a numpy ``shape``/``dtype``,
backed by a cuda.core ``Buffer`` from the device's memory resource (stream-ordered where the
device supports memory pools). Copies and memsets are enqueued on the array's stream (or the
one given); :meth:`DeviceArray.to_host` synchronises that stream. Views made with
:meth:`DeviceArray.subarray` or slicing share the allocation.

:func:`as_device_pointer` turns anything epgen accepts as device memory into an int address.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import operator

import numpy as np

from .. import dlpack
from . import compat
from .errors import check, cuda_errors
from .stream import _ordinal, as_stream, get_device, using_device

__all__ = ["DeviceArray", "empty", "zeros", "to_device", "as_device_pointer",
           "peer_memory_resource", "pointer_device"]


def _shape(shape) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    dims = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    return dims


class DeviceArray:
    """A C-contiguous array in device memory.

    Create with :func:`empty`, :func:`zeros` or :func:`to_device` (or the constructor, which
    allocates uninitialised memory). ``ptr`` is the device address as an int;
    ``__cuda_array_interface__`` (version 3) lets CuPy/torch/numba consume it.
    """

    def __init__(self, shape, dtype, *, stream=None, device=None, memory_resource=None) -> None:
        self.shape = _shape(shape)
        self.dtype = np.dtype(dtype)
        self.device = get_device(device)
        self.stream = as_stream(stream, self.device)
        self._base: DeviceArray | None = None
        self._offset = 0
        self._host_keepalive = None
        mr = memory_resource if memory_resource is not None else self.device
        with using_device(self.device):
            # a zero-byte request is not portable across memory resources
            self._buffer = compat.allocate(mr, max(self.nbytes, 1), self.stream)
        self._ptr = compat.buffer_pointer(self._buffer)

    @classmethod
    def _view(cls, base: DeviceArray, byte_offset: int, shape, dtype) -> DeviceArray:
        view = cls.__new__(cls)
        view.shape = _shape(shape)
        view.dtype = np.dtype(dtype)
        view.device = base.device
        view.stream = base.stream
        view._base = base._base if base._base is not None else base
        view._offset = base._offset + byte_offset
        view._buffer = base._buffer
        view._ptr = base._ptr + byte_offset
        view._host_keepalive = None
        return view

    # -- properties ---------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """Device address of the first element."""
        return self._ptr

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def base(self) -> DeviceArray | None:
        """The owning array of a view (None for an owner)."""
        return self._base

    @property
    def buffer(self):
        """The cuda.core ``Buffer`` holding the whole allocation (shared by views)."""
        return self._buffer

    @property
    def __cuda_array_interface__(self) -> dict:
        stream = int(self.stream.handle)
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self._ptr if self.nbytes else 0, False),
            "version": 3,
            "strides": None,
            # 0 is not allowed by the protocol; the legacy default stream is 1
            "stream": stream if stream != 0 else 1,
        }

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr={self._ptr:#x}, "
                f"device={self.device.device_id})")

    # -- views --------------------------------------------------------------------------------
    def subarray(self, byte_offset: int, shape, dtype=None) -> DeviceArray:
        """A view of ``shape``/``dtype`` starting ``byte_offset`` bytes into this array.

        The view must lie inside this array and be aligned to its dtype's size."""
        dtype = np.dtype(dtype if dtype is not None else self.dtype)
        byte_offset = operator.index(byte_offset)
        nbytes = math.prod(_shape(shape)) * dtype.itemsize
        if byte_offset < 0 or byte_offset + nbytes > self.nbytes:
            raise ValueError(f"sub-array [{byte_offset}, {byte_offset + nbytes}) lies outside "
                             f"the {self.nbytes}-byte array")
        if (self._ptr + byte_offset) % dtype.alignment:
            raise ValueError(f"byte offset {byte_offset} is not aligned for {dtype} "
                             f"({dtype.alignment} bytes)")
        return DeviceArray._view(self, byte_offset, shape, dtype)

    def __getitem__(self, index) -> DeviceArray:
        """Contiguous slices along the first axis (``a[2:5]``) or one row (``a[3]``)."""
        if not self.shape:
            raise IndexError("cannot index a 0-d DeviceArray")
        rows, rest = self.shape[0], self.shape[1:]
        row_bytes = math.prod(rest) * self.itemsize
        if isinstance(index, slice):
            start, stop, step = index.indices(rows)
            if step != 1:
                raise IndexError("DeviceArray slices must be contiguous (step 1)")
            count = max(0, stop - start)
            return DeviceArray._view(self, start * row_bytes, (count, *rest), self.dtype)
        row = operator.index(index)
        if row < 0:
            row += rows
        if not 0 <= row < rows:
            raise IndexError(f"index {index} out of range for axis 0 of size {rows}")
        return DeviceArray._view(self, row * row_bytes, rest, self.dtype)

    # -- transfers ----------------------------------------------------------------------------
    def copy_from_host(self, host, *, stream=None) -> DeviceArray:
        """Enqueue a host -> device copy of ``host`` (same dtype and element count).

        Pageable memory is staged by the driver before this returns; the array keeps a
        reference to the source until the next copy, so pinned sources stay alive."""
        src = np.ascontiguousarray(host)
        if src.dtype != self.dtype:
            raise TypeError(f"dtype mismatch: host {src.dtype}, device {self.dtype}")
        if src.size != self.size:
            raise ValueError(f"size mismatch: host {src.shape}, device {self.shape}")
        if self.nbytes:
            stream = as_stream(stream, self.device) if stream is not None else self.stream
            drv = compat.driver()
            with using_device(self.device):
                check(drv.cuMemcpyHtoDAsync(self._ptr, src.ctypes.data, self.nbytes,
                                            stream.handle), "cuMemcpyHtoDAsync")
            self._host_keepalive = src
        return self

    def to_host(self, out: np.ndarray | None = None, *, stream=None) -> np.ndarray:
        """Copy to a host array (``out`` or a new one) and wait for the copy."""
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif out.dtype != self.dtype or out.size != self.size or not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous with the array's dtype and size")
        stream = as_stream(stream, self.device) if stream is not None else self.stream
        if self.nbytes:
            drv = compat.driver()
            with using_device(self.device):
                check(drv.cuMemcpyDtoHAsync(out.ctypes.data, self._ptr, self.nbytes,
                                            stream.handle), "cuMemcpyDtoHAsync")
                stream.sync()
        return out

    def copy_from(self, src, *, stream=None) -> DeviceArray:
        """Enqueue a device -> device copy from ``src`` (a DeviceArray of the same byte size,
        or any device memory :func:`as_device_pointer` accepts, read for ``self.nbytes``)."""
        if isinstance(src, DeviceArray) and src.nbytes != self.nbytes:
            raise ValueError(f"size mismatch: source {src.nbytes} bytes, "
                             f"destination {self.nbytes} bytes")
        if self.nbytes:
            stream = as_stream(stream, self.device) if stream is not None else self.stream
            drv = compat.driver()
            with using_device(self.device):
                check(drv.cuMemcpyDtoDAsync(self._ptr, as_device_pointer(src), self.nbytes,
                                            stream.handle), "cuMemcpyDtoDAsync")
        return self

    def copy_rows_from(self, src_ptr: int, pitch: int, row_bytes: int, rows: int, *,
                       stream=None) -> DeviceArray:
        """Enqueue a device -> device copy of ``rows`` rows of ``row_bytes`` bytes that lie
        ``pitch`` bytes apart from ``src_ptr`` into this array, packed (``cuMemcpy2DAsync``:
        a strided view such as ``x[:, :H]`` of a wider tensor)."""
        if rows * row_bytes != self.nbytes:
            raise ValueError(f"size mismatch: {rows} rows of {row_bytes} bytes, destination "
                             f"{self.nbytes} bytes")
        if pitch < row_bytes:
            raise ValueError(f"pitch {pitch} is smaller than a row ({row_bytes} bytes)")
        if self.nbytes:
            stream = as_stream(stream, self.device) if stream is not None else self.stream
            drv = compat.driver()
            m = drv.CUDA_MEMCPY2D()
            m.srcMemoryType = m.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
            m.srcDevice, m.srcPitch = int(src_ptr), int(pitch)
            m.dstDevice, m.dstPitch = self._ptr, int(row_bytes)
            m.WidthInBytes, m.Height = int(row_bytes), int(rows)
            with using_device(self.device):
                check(drv.cuMemcpy2DAsync(m, stream.handle), "cuMemcpy2DAsync")
        return self

    def fill_bytes(self, value: int, *, stream=None) -> DeviceArray:
        """Set every byte to ``value`` (0..255) with ``cuMemsetD8Async``."""
        value = operator.index(value)
        if not 0 <= value <= 0xFF:
            raise ValueError(f"byte value {value} is outside 0..255")
        if self.nbytes:
            stream = as_stream(stream, self.device) if stream is not None else self.stream
            drv = compat.driver()
            with using_device(self.device):
                check(drv.cuMemsetD8Async(self._ptr, value, self.nbytes, stream.handle),
                      "cuMemsetD8Async")
        return self

    def fill_u32(self, value: int, *, stream=None) -> DeviceArray:
        """Set every 32-bit word to ``value`` with ``cuMemsetD32Async`` (the array must be
        4-byte aligned and a multiple of 4 bytes)."""
        value = operator.index(value)
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"u32 value {value} is outside 0..2**32-1")
        if self._ptr % 4 or self.nbytes % 4:
            raise ValueError("fill_u32 needs a 4-byte aligned array of whole 32-bit words")
        if self.nbytes:
            stream = as_stream(stream, self.device) if stream is not None else self.stream
            drv = compat.driver()
            with using_device(self.device):
                check(drv.cuMemsetD32Async(self._ptr, value, self.nbytes // 4, stream.handle),
                      "cuMemsetD32Async")
        return self

    def zero(self, *, stream=None) -> DeviceArray:
        """Set all bytes to zero (a 32-bit memset when aligned)."""
        if self._ptr % 4 == 0 and self.nbytes % 4 == 0:
            return self.fill_u32(0, stream=stream)
        return self.fill_bytes(0, stream=stream)

    def close(self) -> None:
        """Free the allocation now (stream-ordered on the array's stream). Only the owner can
        be closed; views must not be used afterwards."""
        if self._base is not None:
            raise ValueError("close() the owning array, not a view")
        self._buffer.close(self.stream)


def empty(shape, dtype, *, stream=None, device=None, memory_resource=None) -> DeviceArray:
    """An uninitialised :class:`DeviceArray`."""
    return DeviceArray(shape, dtype, stream=stream, device=device,
                       memory_resource=memory_resource)


def zeros(shape, dtype, *, stream=None, device=None, memory_resource=None) -> DeviceArray:
    """A zero-filled :class:`DeviceArray` (the memset is enqueued on ``stream``)."""
    return empty(shape, dtype, stream=stream, device=device,
                 memory_resource=memory_resource).zero()


def to_device(host, *, stream=None, device=None, memory_resource=None) -> DeviceArray:
    """A :class:`DeviceArray` holding a copy of the host array ``host``."""
    src = np.asarray(host)
    return empty(src.shape, src.dtype, stream=stream, device=device,
                 memory_resource=memory_resource).copy_from_host(src)


def read_device(ptr: int, nbytes: int, *, stream, device=None) -> np.ndarray:
    """``nbytes`` bytes at device address ``ptr`` as a new host uint8 array, copied on
    ``stream`` (ordered after its work) and waited for."""
    out = np.empty(int(nbytes), np.uint8)
    if nbytes:
        stream = as_stream(stream, device)
        drv = compat.driver()
        with using_device(device):
            check(drv.cuMemcpyDtoHAsync(out.ctypes.data, int(ptr), int(nbytes), stream.handle),
                  "cuMemcpyDtoHAsync")
            stream.sync()
    return out


def peer_memory_resource(device, peers=()):
    """A new stream-ordered memory pool on ``device`` whose allocations the devices ``peers``
    can read and write: cuda.core's ``DeviceMemoryResource`` with its own pool (not the
    device's default pool, whose access would then change for every allocation of the
    process) and ``peer_accessible_by`` set to ``peers`` (``cuMemPoolSetAccess``; ``device``
    itself is ignored in ``peers``). Pass it as ``memory_resource=`` to :func:`zeros`,
    :func:`empty` or :func:`to_device`.

    Pool allocations are mapped into the peers by this access setting alone;
    ``cuCtxEnablePeerAccess`` (:func:`~backends.cuda.stream.enable_peer_access`) does not
    cover them. Raises :class:`CudaError` when a peer cannot access ``device``."""
    dev = get_device(device)
    others = sorted({_ordinal(p) for p in peers} - {int(dev.device_id)})
    with using_device(dev), cuda_errors(f"creating a memory pool on device {dev.device_id} "
                                        f"accessible by devices {others}"):
        mr = compat.device_memory_pool(dev.device_id)
        if others:
            mr.peer_accessible_by = others
    return mr


def pointer_device(obj) -> int | None:
    """The ordinal of the device whose memory ``obj`` (anything :func:`as_device_pointer`
    accepts) lies in: a ``DeviceArray``'s device, a DLPack CUDA array's device id, else
    ``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL``; None for a null pointer or memory the driver
    does not know (e.g. pageable host memory)."""
    address = as_device_pointer(obj)
    if not address:
        return None
    # the array's own word first: on two H200s the driver answered 0 for a DeviceArray
    # allocated from GPU 1's memory pool
    if isinstance(obj, DeviceArray):
        return int(obj.device.device_id)
    if hasattr(obj, "__dlpack_device__"):
        device_type, device_id = obj.__dlpack_device__()
        if int(device_type) in (_DL_CUDA, _DL_CUDA_MANAGED):
            return int(device_id)
    drv = compat.driver()
    err, value = drv.cuPointerGetAttribute(
        drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address)
    if int(err) != 0:
        return None
    return int(value)


# -- pointer extraction -------------------------------------------------------------------------
_DL_CUDA, _DL_CUDA_MANAGED = dlpack.DL_CUDA, dlpack.DL_CUDA_MANAGED


def _pointer_from_cai(interface: dict) -> int:
    if interface.get("mask") is not None:
        raise TypeError("masked __cuda_array_interface__ arrays are not supported")
    data = interface.get("data")
    if not data:
        raise TypeError("__cuda_array_interface__ has no 'data' entry")
    return int(data[0] or 0)


def _pointer_from_dlpack(obj) -> int:
    """Peek at a legacy DLPack capsule's data pointer (the capsule is left unconsumed, so
    its deleter runs when it is dropped; ``obj`` keeps the memory alive)."""
    device_type, _ = obj.__dlpack_device__()
    if int(device_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(f"{type(obj).__name__} is not in CUDA device memory "
                        f"(DLPack device type {int(device_type)})")
    try:
        capsule = obj.__dlpack__(stream=-1)  # -1: no synchronisation requested
    except (TypeError, ValueError, RuntimeError, BufferError):
        capsule = obj.__dlpack__()
    tensor = dlpack.tensor_of(capsule)
    return int(tensor.data or 0) + int(tensor.byte_offset)


def as_device_pointer(obj) -> int:
    """The device address of ``obj`` as an int.

    Accepts a :class:`DeviceArray`, a cuda.core ``Buffer``, a ``CUdeviceptr``, a non-negative
    integer address, anything with ``__cuda_array_interface__`` (CuPy, torch CUDA tensors) or
    DLPack (``__dlpack__`` on a CUDA device). Host numpy arrays and bools are refused.
    """
    if isinstance(obj, DeviceArray):
        return obj.ptr
    if isinstance(obj, bool | np.bool_):
        raise TypeError("a bool is not a device pointer")
    if isinstance(obj, numbers.Integral):
        address = int(obj)
        if not 0 <= address < 2**64:
            raise ValueError(f"device address {address} is outside 0..2**64-1")
        return address
    if isinstance(obj, np.ndarray):
        raise TypeError("a host numpy array is not device memory; copy it with to_device()")
    buffer_type = compat.buffer_type()
    if buffer_type is not None and isinstance(obj, buffer_type):
        return compat.buffer_pointer(obj)
    if type(obj).__name__ == "CUdeviceptr" and type(obj).__module__.startswith("cuda."):
        return int(obj)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _pointer_from_cai(interface)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _pointer_from_dlpack(obj)
    raise TypeError(f"cannot get a device pointer from {type(obj).__name__}: expected a "
                    "DeviceArray, cuda.core Buffer, int address, or an object with "
                    "__cuda_array_interface__ / __dlpack__")
