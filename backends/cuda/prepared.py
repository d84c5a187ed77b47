"""A kernel launch packed once and enqueued cheaply: ``PreparedLaunch``.

``launch`` packs and checks every argument on every call (type conversion, range checks,
the driver's parameter sizes), which costs tens of microseconds of host time per launch.
A prepared launch does that once: the arguments live in one byte buffer at the offsets the
parameters' sizes and alignments give, ``kernelParams`` (one pointer per parameter into
that buffer) and the ``CUlaunchConfig`` are built once, and ``launch(stream)`` is one
``cuLaunchKernelEx``, called through ctypes with those prebuilt structures
(``raw_driver``; the cuda-bindings wrapper converts its config on every call: 6 us against
about 1 us). ``set(name, value)`` rewrites one parameter in place, checked like a
first packing; the driver copies the parameters at the call (and a stream capture records
them), so a later ``set`` never changes a launch already enqueued.
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import raw_driver
from .errors import cuda_errors
from .graph import stream_handle
from .kernel import KernelHandle, cufunction
from .launch import _INT_TYPES, pack_arg, type_name
from .stream import as_stream, using_device

__all__ = ["PreparedLaunch", "param_dtype", "param_layout"]

#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (cuda.h)
_PROGRAMMATIC_ATTR = 6


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the id, padding, and the 64-byte value union (its first
    int: ``programmaticStreamSerializationAllowed``)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def param_dtype(param_type) -> np.dtype:
    """The numpy type that holds a parameter of IR type ``param_type`` by value."""
    t = type_name(param_type)
    if t.startswith("ptr."):
        return np.dtype(np.uint64)
    if t in _INT_TYPES:
        kind, bits = _INT_TYPES[t]
        return np.dtype(f"{'i' if kind == 's' else 'u'}{bits // 8}")
    return np.dtype({"f16": np.float16, "f32": np.float32, "f64": np.float64,
                     "bf16": np.uint16, "pred": np.bool_}[t])


def param_layout(param_types) -> tuple[list[int], int]:
    """Each parameter's byte offset in the packed buffer (aligned to its own size, as the
    PTX parameter space lays them out) and the buffer's size."""
    offsets, end = [], 0
    for t in param_types:
        size = param_dtype(t).itemsize
        end = -(-end // size) * size
        offsets.append(end)
        end += size
    return offsets, end


class PreparedLaunch:
    """``kernel`` (a ``KernelHandle`` with parameter types) on ``grid`` x ``block`` threads
    with ``args`` (a sequence in parameter order, or a dict by parameter name), packed
    once (module docstring). ``programmatic``: a programmatic dependent launch."""

    def __init__(self, kernel: KernelHandle, grid: int, block: int, args, *,
                 programmatic: bool = False):
        if kernel.param_types is None:
            raise TypeError(f"kernel {kernel.name!r}: a prepared launch needs parameter types")
        self.kernel = kernel
        self.types = list(kernel.param_types)
        self.names = list(kernel.param_names or [f"arg{i}" for i in range(len(self.types))])
        self._index = {n: i for i, n in enumerate(self.names)}
        #: the kernel's parameter names
        self.params = frozenset(self.names)
        offsets, size = param_layout(self.types)
        sizes = kernel.param_sizes()
        if sizes is not None and list(sizes) != [param_dtype(t).itemsize for t in self.types]:
            raise TypeError(f"kernel {kernel.name!r}: the driver's parameter sizes "
                            f"{list(sizes)} do not match its types {self.types}")
        self._buf = np.zeros(max(size, 8), np.uint8)
        self._slots = [self._buf[o:o + param_dtype(t).itemsize].view(param_dtype(t))
                       for o, t in zip(offsets, self.types)]
        self._params = np.array([self._buf.ctypes.data + o for o in offsets], np.uint64)
        values = [args[n] for n in self.names] if isinstance(args, dict) else list(args)
        if len(values) != len(self.types):
            raise TypeError(f"kernel {kernel.name!r} takes {len(self.types)} arguments, got "
                            f"{len(values)}")
        for i, v in enumerate(values):
            self._write(i, v)
        cfg = _LaunchConfig(int(grid), 1, 1, int(block), 1, 1, 0, None, None, 0)
        if programmatic:
            self._attr = _LaunchAttribute(_PROGRAMMATIC_ATTR, b"", 1, b"")
            cfg.attrs, cfg.numAttrs = ctypes.pointer(self._attr), 1
        self._config = cfg
        self._config_ref = ctypes.byref(cfg)
        self._stream = None
        with using_device(kernel.device):
            self._func = int(cufunction(kernel))
        self._param_ptr = int(self._params.ctypes.data)
        self._launch = raw_driver.launch_kernel_ex()

    def _write(self, i: int, value) -> None:
        packed = pack_arg(self.types[i], value, index=i, name=self.names[i], int_scalars=True)
        self._slots[i][0] = packed

    def set(self, name: str, value) -> None:
        """Rewrite parameter ``name`` for the launches enqueued after this call."""
        i = self._index.get(name)
        if i is None:
            raise KeyError(f"kernel {self.kernel.name!r} has no parameter {name!r}")
        self._write(i, value)

    def slot(self, name: str) -> np.ndarray:
        """Parameter ``name``'s one-element view in the packed buffer: writing ``slot[0]``
        is ``set`` without its checks, for a caller that has checked the value (the hot
        path of a per-call update)."""
        return self._slots[self._index[name]]

    def value(self, name: str):
        """The packed value of parameter ``name`` (a numpy scalar)."""
        return self._slots[self._index[name]][0]

    def launch(self, stream) -> None:
        """Enqueue the launch on ``stream`` (a cuda.core ``Stream``, anything ``as_stream``
        takes, or a raw ``CUstream`` handle as an int): one ``cuLaunchKernelEx``."""
        key = stream if isinstance(stream, int) else id(stream)
        if key != self._stream:
            self._config.hStream = stream if isinstance(stream, int) else \
                int(stream_handle(as_stream(stream, self.kernel.device)))
            self._stream = key
        err = self._launch(self._config_ref, self._func, self._param_ptr, None)
        if err:
            with cuda_errors(f"launching kernel {self.kernel.name!r}"):
                raw_driver.raise_for(err, "cuLaunchKernelEx")
