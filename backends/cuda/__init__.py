"""epgen's CUDA runtime layer over cuda-python's ``cuda.core``.

Importing this package needs no GPU and no driver (cuda.core itself is imported lazily);
touching a device without one raises :class:`CudaUnavailableError`. Use :func:`gpu_available`
to skip GPU work.

- ``errors``  -- :class:`CudaError`, :func:`check` for raw ``cuda.bindings`` results
- ``compat``  -- cuda.core version differences
- ``compile`` -- :func:`compile_ptx` with the on-disk cubin cache
- ``module``  -- :class:`LoadedModule`, :class:`LoadedKernel`, attributes and occupancy
- ``memory``  -- :class:`DeviceArray`, :func:`as_device_pointer`
- ``launch``  -- :func:`launch`, :func:`pack_args`
- ``stream``  -- devices, streams, events, peer access
"""

from .compile import CacheInfo, cache_info, cache_key, cache_path, compile_ptx, default_cache_dir
from .errors import CompileError, CudaError, CudaUnavailableError, check, cuda_errors
from .launch import check_untyped_args, launch, pack_arg, pack_args
from .memory import (DeviceArray, as_device_pointer, empty, peer_memory_resource,
                     pointer_device, to_device, zeros)
from .module import (KernelAttributes, LoadedKernel, LoadedModule, kernel_attributes,
                     max_active_blocks_per_sm, set_max_dynamic_shared_memory)
from .stream import (Timer, arch, as_stream, can_access_peer, create_event, create_stream,
                     default_stream, device_count, driver_version, elapsed_ms,
                     enable_peer_access, get_device, gpu_available, record, record_event,
                     require_driver, sm_count, using_device)

__all__ = [
    "CacheInfo", "CompileError", "CudaError", "CudaUnavailableError", "DeviceArray",
    "KernelAttributes", "LoadedKernel", "LoadedModule", "Timer", "arch", "as_device_pointer",
    "as_stream", "cache_info", "cache_key", "cache_path", "can_access_peer", "check",
    "check_untyped_args", "compile_ptx", "create_event", "create_stream", "cuda_errors",
    "default_cache_dir", "default_stream", "device_count", "driver_version", "elapsed_ms",
    "empty", "enable_peer_access", "get_device", "gpu_available", "kernel_attributes", "launch",
    "max_active_blocks_per_sm", "pack_arg", "pack_args", "peer_memory_resource",
    "pointer_device", "record", "record_event", "require_driver",
    "set_max_dynamic_shared_memory", "sm_count", "to_device", "using_device", "zeros",
]
