"""NVSHMEM's host library through ctypes: unique-id bootstrap, symmetric memory, module init.

Only what a one-process-per-PE world needs, called directly on ``libnvshmem_host.so.3`` (no
nvshmem4py, whose cu12 build pins cuda-python). The library comes from the
``nvidia-nvshmem-cu13`` wheel (``nvidia/nvshmem/lib/``, ``pip install 'epgen[shmem]'``) or
from the path in ``EPGEN_NVSHMEM_HOST_LIB``.

Layouts (``nvidia/nvshmem/include``, 3.8.0):

- ``nvshmemx_uniqueid_t`` (``bootstrap_device_host/nvshmem_uniqueid.h``): 128 bytes, an int
  version then 124 bytes; ``nvshmemx_get_uniqueid`` fills all of it, so the world ships the
  128 bytes as they are.
- ``nvshmemx_init_attr_t`` (``device_host/nvshmem_types.h``): 144 bytes: ``int version`` at 0,
  ``void *mpi_comm`` at 8, then ``nvshmemx_init_args_t`` (128 bytes) at 16: ``int version``
  at 16, ``nvshmemx_uniqueid_args_t`` (24 bytes: ``int version`` at 24, ``id`` pointer at 32,
  ``myrank`` at 40, ``nranks`` at 44), then in the v2 layout ``int cuda_device_id`` at 48
  (92 bytes of padding follow), in the v1 layout 96 bytes of padding at 48. The version words
  are ``(layout version << 16) + sizeof``: attr v2 ``(2 << 16) + 144``, v1 ``(1 << 16) + 144``;
  args v2 ``(2 << 16) + 128``, v1 ``(1 << 16) + 128``; uid args ``(1 << 16) + 24``.
  ``nvshmemx_set_attr_uniqueid_args`` writes only ``id``, ``myrank`` and ``nranks`` (checked
  on the 3.8.0 library): the caller sets the version words, which is what the header's inline
  ``nvshmemx_init_attr`` does before calling the library.
- ``NVSHMEMX_INIT_WITH_UNIQUEID = 1 << 3`` (``host/nvshmemx_api.h``).

The library's version (``nvshmemx_vendor_get_version_info``, callable before init) decides
the layout at run time: the v2 layout (with ``cuda_device_id``) from 3.8 on, where these
headers were read; the v1 layout before (an older library on the GPU machine), where NVSHMEM
uses the context current at init, so the caller makes its device current first either way.

Every call that returns a status is checked (``NvshmemError`` names the function and the
code); pointers NULL where they must not be raise too. This module imports nothing of epgen.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
from pathlib import Path

__all__ = ["NvshmemError", "NvshmemUnavailableError", "NvshmemHost", "find_host_library",
           "UNIQUEID_BYTES", "INIT_ATTR_BYTES", "INIT_WITH_UNIQUEID", "LIB_ENV",
           "init_attr_bytes", "SymmetricBuffer", "SymmetricMemoryResource"]

LIB_ENV = "EPGEN_NVSHMEM_HOST_LIB"
LIB_NAME = "libnvshmem_host.so.3"
INSTALL_HINT = "pip install 'epgen[shmem]'"

UNIQUEID_BYTES = 128
INIT_ATTR_BYTES = 144
INIT_ARGS_BYTES = 128
UNIQUEID_ARGS_BYTES = 24
INIT_WITH_UNIQUEID = 1 << 3
#: the first library version whose ``nvshmemx_init_args_t`` is the v2 layout we read
V2_LAYOUT_FROM = (3, 8)

# offsets in nvshmemx_init_attr_t
_ATTR_VERSION, _ATTR_MPI_COMM, _ARGS_VERSION, _UID_ARGS_VERSION = 0, 8, 16, 24
_UID_ARGS_ID, _UID_ARGS_MYRANK, _UID_ARGS_NRANKS, _ARGS_V2_DEVICE = 32, 40, 44, 48


class NvshmemError(RuntimeError):
    """An NVSHMEM host call failed: ``function`` and ``code`` (its return status)."""

    def __init__(self, function: str, code=None, detail: str = ""):
        self.function = function
        self.code = code
        text = f"{function} failed" + (f" with status {code}" if code is not None else "")
        super().__init__(text + (f": {detail}" if detail else ""))


class NvshmemUnavailableError(NvshmemError):
    """The NVSHMEM host library is not installed (or cannot be loaded)."""

    def __init__(self, detail: str):
        RuntimeError.__init__(self, detail)
        self.function, self.code = "dlopen", None


def find_host_library() -> Path:
    """``EPGEN_NVSHMEM_HOST_LIB`` when set, else ``libnvshmem_host.so.3`` of the installed
    ``nvidia-nvshmem`` wheel; ``NvshmemUnavailableError`` naming the install command when
    neither exists."""
    env = os.environ.get(LIB_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise NvshmemUnavailableError(
                f"{LIB_ENV}={env}: no such file (the NVSHMEM host library "
                f"{LIB_NAME}); unset it to use the wheel ({INSTALL_HINT})")
        return path
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    for root in (getattr(spec, "submodule_search_locations", None) or ()):
        path = Path(root) / "lib" / LIB_NAME
        if path.is_file():
            return path
    raise NvshmemUnavailableError(
        f"the NVSHMEM host library {LIB_NAME} was not found: the SHMEM world needs the "
        f"nvidia-nvshmem-cu13 wheel ({INSTALL_HINT}), or set {LIB_ENV} to the library's path")


def init_attr_bytes(rank: int, nranks: int, uid_address: int, version: tuple[int, int],
                    device: int | None = None) -> bytearray:
    """The ``nvshmemx_init_attr_t`` bytes for a unique-id init of PE ``rank`` of ``nranks``
    (``uid_address``: where the 128-byte unique id lives, kept alive until the init
    returns), in the layout of library ``version`` (module docstring): the version words,
    ``mpi_comm`` NULL, the uid args and, in the v2 layout, ``cuda_device_id`` (``device``,
    or -1, NVSHMEM's "not set")."""
    buf = bytearray(INIT_ATTR_BYTES)
    v2 = tuple(version[:2]) >= V2_LAYOUT_FROM
    layout = 2 if v2 else 1
    put = lambda off, fmt_, value: struct.pack_into(fmt_, buf, off, value)  # noqa: E731
    put(_ATTR_VERSION, "<i", (layout << 16) + INIT_ATTR_BYTES)
    put(_ATTR_MPI_COMM, "<Q", 0)
    put(_ARGS_VERSION, "<i", (layout << 16) + INIT_ARGS_BYTES)
    put(_UID_ARGS_VERSION, "<i", (1 << 16) + UNIQUEID_ARGS_BYTES)
    put(_UID_ARGS_ID, "<Q", uid_address)
    put(_UID_ARGS_MYRANK, "<i", rank)
    put(_UID_ARGS_NRANKS, "<i", nranks)
    if v2:
        put(_ARGS_V2_DEVICE, "<i", -1 if device is None else int(device))
    return buf


_SIGNATURES = {
    # name: (restype, argtypes)
    "nvshmemx_vendor_get_version_info": (None, [ctypes.POINTER(ctypes.c_int)] * 3),
    "nvshmemx_get_uniqueid": (ctypes.c_int, [ctypes.c_void_p]),
    "nvshmemx_set_attr_uniqueid_args": (ctypes.c_int, [ctypes.c_int, ctypes.c_int,
                                                       ctypes.c_void_p, ctypes.c_void_p]),
    "nvshmemx_hostlib_init_attr": (ctypes.c_int, [ctypes.c_uint, ctypes.c_void_p]),
    "nvshmemx_init_status": (ctypes.c_int, []),
    "nvshmem_my_pe": (ctypes.c_int, []),
    "nvshmem_n_pes": (ctypes.c_int, []),
    "nvshmem_malloc": (ctypes.c_void_p, [ctypes.c_size_t]),
    "nvshmem_free": (None, [ctypes.c_void_p]),
    "nvshmem_ptr": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int]),
    "nvshmemx_cumodule_init": (ctypes.c_int, [ctypes.c_void_p]),
    "nvshmemx_cumodule_finalize": (ctypes.c_int, [ctypes.c_void_p]),
    "nvshmemx_hostlib_finalize": (None, []),
}


#: the host libraries (resolved paths) an ``NvshmemHost`` of this process has initialised and
#: not finalised: NVSHMEM initialises once per process
_LIVE_LIBRARIES: set[Path] = set()


class NvshmemHost:
    """The host library loaded (``path`` default: ``find_host_library()``), every function of
    ``_SIGNATURES`` looked up (a missing symbol is an ``NvshmemUnavailableError`` naming it).
    Loading needs no GPU; ``init_uid`` and everything after it do. One ``NvshmemHost`` of a
    process at a time may be initialised (``init_uid`` refuses a second until the first is
    finalised): share it."""

    def __init__(self, path=None):
        self.path = Path(path) if path is not None else find_host_library()
        try:
            self.lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise NvshmemUnavailableError(
                f"cannot load the NVSHMEM host library {self.path}: {e} ({INSTALL_HINT})") from e
        missing = []
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name, None)
            if fn is None:
                missing.append(name)
                continue
            fn.restype, fn.argtypes = restype, argtypes
        if missing:
            raise NvshmemUnavailableError(
                f"{self.path} lacks {', '.join(missing)}: not an NVSHMEM 3 host library "
                f"({INSTALL_HINT})")
        self.initialized = False

    # -- plain queries -------------------------------------------------------------------------
    def version(self) -> tuple[int, int, int]:
        """The library's vendor version ``(major, minor, patch)`` (no init needed)."""
        v = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
        self.lib.nvshmemx_vendor_get_version_info(*(ctypes.byref(x) for x in v))
        return tuple(x.value for x in v)

    def get_uniqueid(self) -> bytes:
        """A fresh unique id (128 bytes) for rank 0 to hand to the others."""
        uid = ctypes.create_string_buffer(UNIQUEID_BYTES)
        self._check("nvshmemx_get_uniqueid", self.lib.nvshmemx_get_uniqueid(uid))
        return uid.raw

    # -- init and finalize ---------------------------------------------------------------------
    def init_uid(self, uid: bytes, rank: int, nranks: int, device: int | None = None) -> None:
        """``nvshmemx_set_attr_uniqueid_args`` then ``nvshmemx_hostlib_init_attr(
        NVSHMEMX_INIT_WITH_UNIQUEID)`` for PE ``rank`` of ``nranks``; the caller has made
        ``device``'s context current. Checks afterwards that NVSHMEM agrees on the PE and the
        PE count."""
        if len(uid) != UNIQUEID_BYTES:
            raise ValueError(f"an NVSHMEM unique id is {UNIQUEID_BYTES} bytes, got {len(uid)}")
        if self.path.resolve() in _LIVE_LIBRARIES:
            raise NvshmemError("nvshmemx_hostlib_init_attr", None,
                               f"NVSHMEM ({self.path}) is already initialised in this process "
                               f"by another NvshmemHost: it initialises once per process; "
                               f"share that initialisation, or finalise it first")
        self._uid = ctypes.create_string_buffer(bytes(uid), UNIQUEID_BYTES)
        raw = init_attr_bytes(rank, nranks, ctypes.addressof(self._uid), self.version(), device)
        attr = (ctypes.c_char * INIT_ATTR_BYTES).from_buffer(raw)
        self._check("nvshmemx_set_attr_uniqueid_args",
                    self.lib.nvshmemx_set_attr_uniqueid_args(rank, nranks, self._uid, attr))
        self._check("nvshmemx_hostlib_init_attr",
                    self.lib.nvshmemx_hostlib_init_attr(INIT_WITH_UNIQUEID, attr))
        self.initialized = True
        _LIVE_LIBRARIES.add(self.path.resolve())
        me, n = self.my_pe(), self.n_pes()
        if (me, n) != (rank, nranks):
            raise NvshmemError("nvshmemx_hostlib_init_attr", None,
                               f"asked for PE {rank} of {nranks}, NVSHMEM reports PE {me} "
                               f"of {n}")

    def finalize(self) -> None:
        """``nvshmemx_hostlib_finalize`` (the host library has no ``nvshmem_finalize``);
        nothing when not initialised."""
        if self.initialized:
            self.initialized = False
            _LIVE_LIBRARIES.discard(self.path.resolve())
            self.lib.nvshmemx_hostlib_finalize()

    def my_pe(self) -> int:
        return int(self.lib.nvshmem_my_pe())

    def n_pes(self) -> int:
        return int(self.lib.nvshmem_n_pes())

    # -- symmetric memory ----------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """``nvshmem_malloc`` (collective: every PE, same sizes, same order)."""
        ptr = self.lib.nvshmem_malloc(max(int(nbytes), 1))
        if not ptr:
            raise NvshmemError("nvshmem_malloc", None,
                               f"returned NULL for {nbytes} bytes (symmetric heap too small? "
                               f"NVSHMEM_SYMMETRIC_SIZE sets it)")
        return int(ptr)

    def free(self, ptr: int) -> None:
        """``nvshmem_free`` (collective, in the order of the allocations)."""
        self.lib.nvshmem_free(ctypes.c_void_p(ptr))

    def ptr(self, ptr: int, pe: int) -> int:
        """``nvshmem_ptr(ptr, pe)``: ``pe``'s copy of the symmetric address ``ptr`` as this
        process may load and store it, 0 when it cannot (no peer path)."""
        return int(self.lib.nvshmem_ptr(ctypes.c_void_p(ptr), int(pe)) or 0)

    def symmetric_resource(self) -> SymmetricMemoryResource:
        """A memory resource allocating symmetric memory of this library."""
        return SymmetricMemoryResource(self)

    # -- modules -------------------------------------------------------------------------------
    def cumodule_init(self, cumodule) -> None:
        """``nvshmemx_cumodule_init`` on a ``CUmodule`` (a cuda.bindings handle or an int):
        fills the module's NVSHMEM device state; before the module's first launch."""
        self._check("nvshmemx_cumodule_init",
                    self.lib.nvshmemx_cumodule_init(ctypes.c_void_p(int(cumodule))))

    def cumodule_finalize(self, cumodule) -> None:
        self._check("nvshmemx_cumodule_finalize",
                    self.lib.nvshmemx_cumodule_finalize(ctypes.c_void_p(int(cumodule))))

    @staticmethod
    def _check(name: str, status) -> None:
        if status != 0:
            raise NvshmemError(name, status)


class SymmetricBuffer:
    """What ``backends.cuda.DeviceArray`` needs of a cuda.core ``Buffer``: ``handle`` (the
    address) and ``close``. Closing does not free: symmetric memory is freed collectively by
    its ``SymmetricMemoryResource.free_all``."""

    def __init__(self, ptr: int, size: int):
        self.handle, self.size = ptr, size

    def close(self, stream=None) -> None:
        pass


class SymmetricMemoryResource:
    """A memory resource (``memory_resource=`` of ``backends.cuda.zeros`` and friends) whose
    allocations come from ``nvshmem_malloc``; it remembers them so that ``free_all`` releases
    them in order, collectively, before finalize."""

    def __init__(self, host: NvshmemHost):
        self.host = host
        self.allocations: list[SymmetricBuffer] = []

    def allocate(self, nbytes: int, stream=None) -> SymmetricBuffer:
        buf = SymmetricBuffer(self.host.malloc(nbytes), nbytes)
        self.allocations.append(buf)
        return buf

    def free_all(self) -> None:
        """``nvshmem_free`` of every allocation, last first (idempotent)."""
        while self.allocations:
            self.host.free(self.allocations.pop().handle)
