"""Device memory of ``backends.sim``: one flat little-endian byte memory shared by every
simulated GPU (as GPUs share one unified virtual address space), and ``DeviceArray``, the
simulator's counterpart of ``backends.cuda.DeviceArray`` (``ptr``, ``shape``, ``dtype``,
``nbytes``, ``[a:b]`` views on the first axis, ``copy_from_host``, ``copy_from``,
``to_host``, ``fill_bytes``, ``zero``).

Host copies and memsets are synchronous: each first runs every launch queued on the machine
(``Machine.drain``), whatever stream it names, then touches the bytes; a CUDA copy on a
stream waits only for that stream's work, so the simulator orders more strongly, never less.
What it does not model: allocation failures and pools (every allocation succeeds and is
never freed: a world lives for one process), memory bandwidth, access permissions (tests
that need placement checks add them in a ``Machine`` subclass).
"""

from __future__ import annotations

import numpy as np

BASE_ADDR = 0x10000


class SimError(RuntimeError):
    """The kernel did something the IR forbids (out-of-range access, mismatched collectives),
    or the host used the simulator in a way CUDA refuses."""


class Memory:
    """One flat little-endian byte memory; addresses start at ``BASE_ADDR``."""

    def __init__(self):
        self.buf = bytearray()

    def alloc(self, nbytes: int, align: int = 256) -> int:
        start = (len(self.buf) + align - 1) // align * align
        self.buf.extend(bytes(start + max(int(nbytes), 1) - len(self.buf)))
        return BASE_ADDR + start

    def _off(self, addr: int, n: int) -> int:
        off = addr - BASE_ADDR
        if off < 0 or off + n > len(self.buf):
            raise SimError(f"access of {n} bytes at {addr:#x} outside memory")
        return off

    def read(self, addr: int, n: int) -> bytes:
        off = self._off(addr, n)
        return bytes(self.buf[off:off + n])

    def write(self, addr: int, data: bytes) -> None:
        off = self._off(addr, len(data))
        self.buf[off:off + len(data)] = data

    # numpy convenience
    def put(self, addr: int, array) -> None:
        self.write(addr, np.ascontiguousarray(array).tobytes())

    def get(self, addr: int, shape, dtype):
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        return np.frombuffer(self.read(addr, n), dtype=dt).reshape(shape).copy()


def _shape(shape) -> tuple:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)


class DeviceArray:
    """An allocation (or a view of one) in the machine's memory, on GPU ``device`` and from
    memory resource ``pool`` (None: the device's default)."""

    def __init__(self, machine, shape, dtype, ptr: int | None = None, device: int = 0,
                 pool=None):
        self.machine = machine
        self.shape = _shape(shape)
        self.dtype = np.dtype(dtype)
        self.device = int(device)
        self.pool = pool
        self.ptr = machine.mem.alloc(self.nbytes) if ptr is None else int(ptr)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"sim.DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"

    def __getitem__(self, index) -> DeviceArray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("sim.DeviceArray supports [a:b] on the first axis only")
        start, stop, _ = index.indices(self.shape[0])
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        return DeviceArray(self.machine, (max(stop - start, 0), *self.shape[1:]), self.dtype,
                           self.ptr + start * row, self.device, self.pool)

    def copy_from_host(self, host, *, stream=None) -> DeviceArray:
        self.machine.drain()
        host = np.ascontiguousarray(host)
        if host.nbytes != self.nbytes:
            raise ValueError(f"copy of {host.nbytes} bytes into {self.nbytes}")
        self.machine.mem.put(self.ptr, host)
        return self

    def copy_from(self, src, *, stream=None) -> DeviceArray:
        return self.copy_from_host(src.to_host())

    def to_host(self, out=None, *, stream=None) -> np.ndarray:
        self.machine.drain()
        got = self.machine.mem.get(self.ptr, self.shape, self.dtype)
        if out is not None:
            out[...] = got
            return out
        return got

    def fill_bytes(self, value: int, *, stream=None) -> DeviceArray:
        self.machine.drain()
        self.machine.mem.write(self.ptr, bytes([int(value) & 0xFF]) * self.nbytes)
        return self

    def zero(self, *, stream=None) -> DeviceArray:
        return self.fill_bytes(0, stream=stream)
