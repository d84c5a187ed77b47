"""The driver entry points of the per-call hot paths, called through ctypes on
``libcuda.so.1`` with raw handles (ints): a cuda-bindings call converts and wraps its
arguments on every call (microseconds each), a ctypes call with fixed argument types costs
well under one. Only what a prepared launch and the torch API's stream fork and join call
per call lives here; everything else goes through ``cuda.bindings.driver``.

Each function returns nothing and raises ``CudaError`` (the driver's name for the result)
on a failure, like ``errors.check``.
"""

from __future__ import annotations

import ctypes
import functools

from . import compat
from .errors import check

__all__ = ["launch_kernel_ex", "event_record", "stream_wait_event", "raise_for"]


@functools.cache
def _lib():
    return ctypes.CDLL("libcuda.so.1")


def _entry(name: str, argtypes):
    fn = getattr(_lib(), name)
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


@functools.cache
def launch_kernel_ex():
    """``cuLaunchKernelEx(config*, CUfunction, void** params, void** extra)`` as a ctypes
    function returning the raw ``CUresult`` (the caller checks it: ``raise_for``)."""
    return _entry("cuLaunchKernelEx", [ctypes.c_void_p] * 4)


@functools.cache
def _event_record():
    return _entry("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p])


@functools.cache
def _stream_wait_event():
    return _entry("cuStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint])


def raise_for(err: int, call: str) -> None:
    """Raise the ``CudaError`` of a non-zero raw ``CUresult`` ``err`` of ``call``."""
    if err:
        check((compat.driver().CUresult(err),), call)


def event_record(event: int, stream: int) -> None:
    """``cuEventRecord(event, stream)``."""
    err = _event_record()(event, stream)
    if err:
        raise_for(err, "cuEventRecord")


def stream_wait_event(stream: int, event: int) -> None:
    """``cuStreamWaitEvent(stream, event, 0)``."""
    err = _stream_wait_event()(stream, event, 0)
    if err:
        raise_for(err, "cuStreamWaitEvent")
