"""Arrays from other libraries as epgen inputs: numpy (and ``ml_dtypes``), torch tensors on
the host or a CUDA device, DLPack (``__dlpack__``) and ``__cuda_array_interface__`` (CuPy,
numba) objects, with their strides and producer stream.

``describe(obj, name)`` reads only metadata (never element values) into an ``ArrayInfo``:
shape, dtype name (``"bfloat16"`` for BF16, numpy names otherwise), byte strides, where the
data lives, its device address and the stream the producer named. The rules the runtime
applies from it:

- a host input becomes a C-contiguous numpy array (``host_array``; torch CPU BF16 tensors are
  read as their uint16 bits);
- a device input is copied to the device as it is when C-contiguous, row by row
  (``cuMemcpy2DAsync``) when only its rows are apart (a ``x[:, :H]`` view of a wider
  tensor), and otherwise refused with an ``EPInputError`` naming it: a transposed or
  element-strided view is never read as if it were contiguous;
- the copy is ordered after the producer: torch's current stream (a torch tensor's) and a
  CUDA-array-interface stream are waited on with an event; another DLPack object is asked to
  order its stream before the consumer's (``__dlpack__(stream=...)``).

torch is imported only for a torch tensor (recognised by its type's module).
"""

from __future__ import annotations

import attrs
import numpy as np

from backends import dlpack
from backends.dlpack import DL_CPU as _DL_CPU
from backends.dlpack import DL_CUDA as _DL_CUDA
from backends.dlpack import DL_CUDA_HOST as _DL_CUDA_HOST
from backends.dlpack import DL_CUDA_MANAGED as _DL_CUDA_MANAGED

from .errors import EPInputError
#: DLPack dtype codes: int, uint, float, bfloat
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT = 0, 1, 2, 4


@attrs.frozen
class ArrayInfo:
    """What epgen knows of an input without reading it. ``strides`` are in bytes;
    ``device`` is the CUDA ordinal (None on the host); ``ptr`` the device address of element
    0 (None on the host); ``stream``: the producer's stream handle from a
    ``__cuda_array_interface__`` (None when none was named)."""

    name: str
    shape: tuple
    dtype: str
    itemsize: int
    strides: tuple
    device: int | None
    ptr: int | None
    stream: int | None
    obj: object = attrs.field(repr=False)

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def contiguous(self) -> bool:
        """C-contiguous (the strides of dimensions of extent 1 do not matter)."""
        expect = self.itemsize
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    @property
    def row_pitch(self) -> int | None:
        """For a 2-D array whose rows are each contiguous and do not overlap: the bytes from
        one row to the next (the row size when C-contiguous); else None."""
        if self.size == 0 or self.contiguous:
            return self.shape[-1] * self.itemsize if self.shape else self.itemsize
        if len(self.shape) != 2:
            return None
        rows, cols = self.shape
        s_row, s_col = self.strides
        if (cols != 1 and s_col != self.itemsize) or s_row < cols * self.itemsize:
            return None
        return s_row if rows > 1 else cols * self.itemsize


def _is_torch(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr")


def _torch_info(obj, name: str) -> ArrayInfo:
    item = obj.element_size()
    dev = obj.device.index if obj.is_cuda else None
    if obj.is_cuda and dev is None:
        dev = 0
    return ArrayInfo(name, tuple(int(d) for d in obj.shape), str(obj.dtype).removeprefix("torch."),
                     item, tuple(int(s) * item for s in obj.stride()), dev,
                     int(obj.data_ptr()) if obj.is_cuda else None, None, obj)


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    """The byte strides of a C-contiguous array of ``shape``."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= int(n)
    return tuple(reversed(out))


def _cai_info(obj, cai: dict, name: str) -> ArrayInfo:
    if cai.get("mask") is not None:
        raise EPInputError(f"{name}: masked __cuda_array_interface__ arrays are not supported")
    dt = np.dtype(cai["typestr"])
    shape = tuple(int(d) for d in cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        strides = _c_strides(shape, dt.itemsize)
    ptr = int(cai["data"][0] or 0)
    dev = _device_of(ptr)
    stream = cai.get("stream")
    return ArrayInfo(name, shape, dt.name, dt.itemsize, tuple(int(s) for s in strides),
                     0 if dev is None else dev, ptr, None if stream is None else int(stream), obj)


def _device_of(ptr: int) -> int | None:
    """The CUDA ordinal of device address ``ptr`` (``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL``),
    or None where no driver answers."""
    if not ptr:
        return None
    try:
        from backends.cuda.memory import pointer_device
        return pointer_device(ptr)
    except Exception:       # no driver (a CPU machine): the address cannot be asked about
        return None


def _dl_dtype(code: int, bits: int, lanes: int, name: str) -> tuple[str, int]:
    if lanes != 1:
        raise EPInputError(f"{name}: DLPack vector dtypes (lanes={lanes}) are not supported")
    if code == _DL_BFLOAT and bits == 16:
        return "bfloat16", 2
    kind = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f"}.get(code)
    if kind is None:
        raise EPInputError(f"{name}: DLPack dtype code {code} is not supported")
    dt = np.dtype(f"{kind}{bits // 8}")
    return dt.name, dt.itemsize


def _dlpack_info(obj, name: str) -> ArrayInfo:
    """Metadata of a DLPack producer from its (legacy, unconsumed) capsule; the capsule is
    kept with the info, so its memory outlives the copy."""
    dev_type, dev_id = (int(v) for v in obj.__dlpack_device__())
    try:
        capsule = obj.__dlpack__(stream=None)
    except TypeError:
        capsule = obj.__dlpack__()
    t = dlpack.tensor_of(capsule)
    dtype, item = _dl_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes, name)
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) * item for i in range(t.ndim))
    else:
        strides = _c_strides(shape, item)
    ptr = int(t.data or 0) + int(t.byte_offset)
    on_dev = dev_type in (_DL_CUDA, _DL_CUDA_MANAGED)
    if not on_dev and dev_type not in (_DL_CPU, _DL_CUDA_HOST):
        raise EPInputError(f"{name}: DLPack device type {dev_type} is neither the host nor "
                           f"a CUDA device")
    return ArrayInfo(name, shape, dtype, item, strides, dev_id if on_dev else None,
                     ptr if on_dev else None, None, (obj, capsule))


def describe(obj, name: str) -> ArrayInfo:
    """``obj``'s ``ArrayInfo`` (module docstring); no element is read."""
    if _is_torch(obj):
        return _torch_info(obj, name)
    cai = getattr(obj, "__cuda_array_interface__", None) if not isinstance(obj, np.ndarray) \
        else None
    if cai is not None:
        return _cai_info(obj, cai, name)
    if not isinstance(obj, np.ndarray) and hasattr(obj, "__dlpack__") \
            and hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) in (_DL_CUDA, _DL_CUDA_MANAGED):
            return _dlpack_info(obj, name)
        try:
            arr = np.from_dlpack(obj)
        except (TypeError, BufferError, RuntimeError):    # e.g. a dtype numpy lacks
            arr = np.asarray(obj)
    else:
        arr = np.asarray(obj)
    return ArrayInfo(name, arr.shape, arr.dtype.name, arr.dtype.itemsize, arr.strides, None,
                     None, None, arr)


def host_array(obj, name: str) -> np.ndarray:
    """A host input as a C-contiguous numpy array (torch BF16: its uint16 bits); a device
    input is refused with an ``EPInputError`` naming it (``read_device`` copies one)."""
    if _is_torch(obj):
        if obj.is_cuda:
            raise EPInputError(f"{name}: a CUDA tensor where a host array is needed")
        t = obj.detach().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    info = describe(obj, name)
    if info.on_device:
        raise EPInputError(f"{name}: a device array where a host array is needed")
    return np.ascontiguousarray(info.obj)


def host_bf16(obj, name: str) -> np.ndarray:
    """A host BF16 input as its uint16 bit patterns: uint16 bits, an ``ml_dtypes.bfloat16``
    array or a torch CPU bfloat16 tensor. Anything else (another dtype, None, a device
    array) is an ``EPInputError`` naming ``name`` and the rule."""
    if obj is None:
        raise EPInputError(f"{name}: missing (None), must be BF16 bits as uint16 (or a "
                           f"bfloat16 array or tensor)")
    arr = host_array(obj, name)
    if arr.dtype == np.uint16:
        return arr
    if arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2:
        return arr.view(np.uint16)
    raise EPInputError(f"{name}: dtype {arr.dtype}, must be BF16 bits as uint16 (or a "
                       f"bfloat16 array or tensor)")


def host_float32(obj, name: str) -> np.ndarray:
    """A host array of real numbers as float32 (integers and other float widths converted,
    a bfloat16 array or tensor by its values). Strings, booleans, complex or object arrays,
    None and device arrays are an ``EPInputError`` naming ``name`` and the rule."""
    if obj is None:
        raise EPInputError(f"{name}: missing (None), must be a float32 array")
    if _is_torch(obj) and not obj.is_cuda and obj.is_floating_point():
        obj = obj.float()       # a BF16 tensor's values, not its bits (host_array's view)
    arr = host_array(obj, name)
    if arr.dtype.name == "bfloat16" or arr.dtype.kind in "fiu":
        return arr.astype(np.float32, copy=False)
    raise EPInputError(f"{name}: dtype {arr.dtype}, must be float32 (an array of real "
                       f"numbers)")


def device_rows(info: ArrayInfo) -> tuple[int, int, int, int]:
    """``(ptr, pitch, row_bytes, rows)`` of a device input to copy to a contiguous buffer:
    one copy when it is contiguous (``pitch == row_bytes``), one 2-D copy when its rows are
    apart. ``EPInputError`` naming it otherwise, and nothing is copied."""
    if not info.on_device:
        raise EPInputError(f"{info.name}: a host array where a device array is needed")
    pitch = info.row_pitch
    if pitch is None:
        raise EPInputError(
            f"{info.name}: a device array must be C-contiguous, or 2-D with contiguous rows "
            f"(unit stride along the last dimension); got shape {info.shape} with byte "
            f"strides {info.strides}: pass a contiguous copy (e.g. .contiguous())")
    rows = info.shape[0] if len(info.shape) > 1 else 1
    row_bytes = info.nbytes // rows if rows else 0
    if pitch == row_bytes or rows <= 1:
        return info.ptr, info.nbytes, info.nbytes, 1
    return info.ptr, pitch, row_bytes, rows


def order_after_producer(info: ArrayInfo, stream) -> None:
    """Make ``stream`` (a backend stream) wait for the producer of a device input: a DLPack
    object orders its stream before ``stream`` itself; a named CUDA-array-interface stream
    is waited on with an event. Host inputs and producers that name no stream: nothing."""
    if not info.on_device:
        return
    from backends.cuda.stream import wait_for_stream_handle
    obj = info.obj[0] if isinstance(info.obj, tuple) else info.obj
    if _is_torch(obj):      # the producer is torch's current stream on the tensor's device
        import torch
        wait_for_stream_handle(stream, int(torch.cuda.current_stream(obj.device).cuda_stream)
                               or 1)
    elif isinstance(info.obj, tuple):
        obj.__dlpack__(stream=int(stream.handle))
    elif info.stream is not None:
        wait_for_stream_handle(stream, info.stream)


def read_to_host(info: ArrayInfo, stream) -> np.ndarray:
    """A C-contiguous host copy of an input, strides honoured (BF16 as uint16 bits): a host
    input as ``host_array``; a device input copied on ``stream`` after its producer and
    waited for (what the synchronising numpy API does with device top-k ids)."""
    if not info.on_device:
        return host_array(info.obj, info.name)
    if any(st < 0 for st in info.strides):
        raise EPInputError(f"{info.name}: negative strides {info.strides} are not supported")
    dt = np.dtype(np.uint16) if info.dtype == "bfloat16" else np.dtype(info.dtype)
    if info.size == 0:
        return np.empty(info.shape, dt)
    extent = sum((n - 1) * st for n, st in zip(info.shape, info.strides)) + info.itemsize
    from backends.cuda.memory import read_device
    order_after_producer(info, stream)
    raw = read_device(info.ptr, extent, stream=stream, device=info.device)
    return np.ascontiguousarray(np.ndarray(info.shape, dt, buffer=raw, strides=info.strides))


__all__ = ["ArrayInfo", "describe", "host_array", "host_bf16", "host_float32", "device_rows",
           "order_after_producer", "read_to_host"]
