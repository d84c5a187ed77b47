"""The DLPack C structures (``dlpack.h``) that epgen reads from a producer's capsule, and
reading one: device type and id, data pointer, dtype, shape and strides. No CUDA needed."""

from __future__ import annotations

import ctypes

#: device types: host, CUDA, pinned host, CUDA managed
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def tensor_of(capsule) -> DLTensor:
    """The ``DLTensor`` of a legacy (``"dltensor"``), unconsumed capsule; valid while the
    capsule lives."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return DLTensor.from_address(get(capsule, b"dltensor"))


__all__ = ["DL_CPU", "DL_CUDA", "DL_CUDA_HOST", "DL_CUDA_MANAGED", "DLDevice", "DLDataType",
           "DLTensor", "tensor_of"]
