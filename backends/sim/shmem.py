"""The NVSHMEM device functions of ``ir.nvshmem`` on the simulator: every PE in one process.

The symmetric heap is modelled by a table, ``SymmetricHeap``: the caller (a world) registers,
per PE, the base and size of each symmetric buffer under one name (``register(pe, name,
base, nbytes)``). A symmetric address is an address inside some PE's registered buffer; the
same buffer of PE ``b`` at the same offset is its image on ``b`` (``translate``). The kernels
pass this PE's own address of a symmetric object, as NVSHMEM requires; the PE that issued a
call is the one whose buffer holds the address (the simulator does not tell a launch's PE
apart otherwise, so ``nvshmem_my_pe`` is not modelled).

What each call does (``Sim`` runs them, one ``ir.Call`` statement each):

- ``nvshmem_putmem_nbi(dest, source, nbytes, pe)``: the bytes of ``source`` are read at the
  call and queued on the calling thread; they reach ``pe``'s image of ``dest`` only at the end
  of that thread's next ``nvshmem_quiet`` or ``nvshmem_fence`` (a delayed delivery: a
  protocol that signals before it has completed its puts reads stale bytes). A thread that
  exits with a put still queued is a ``SimError`` (a put nobody completed).
- ``nvshmem_quiet()`` / ``nvshmem_fence()``: with puts queued, the thread first waits a random
  number of scheduler rounds below ``Sim.shmem_delay`` (256; the transfer's time, every other
  thread running on meanwhile), then its queued puts land in issue order and the call
  returns. So anything the thread did between a put and its quiet (a count, a flag) is seen
  by the others long before the bytes land.
- ``nvshmemx_signal_op(sig_addr, value, sig_op, pe)``: at once, atomically, the u64 word at
  ``pe``'s image of ``sig_addr`` is set to ``value`` (``SIGNAL_SET``) or incremented by it
  (``SIGNAL_ADD``).

Any other extern function is a ``SimError`` naming it.
"""

from __future__ import annotations

from .memory import SimError


class SymmetricHeap:
    """Per PE, the registered symmetric buffers: ``name -> (base, nbytes)``."""

    def __init__(self):
        self.buffers: dict[int, dict[str, tuple[int, int]]] = {}

    def register(self, pe: int, name: str, base: int, nbytes: int) -> None:
        """Buffer ``name`` of PE ``pe`` is ``nbytes`` bytes at ``base``."""
        pe = int(pe)
        if pe < 0:
            raise SimError(f"shmem: PE must be >= 0, got {pe}")
        self.buffers.setdefault(pe, {})[str(name)] = (int(base), int(nbytes))

    @property
    def n_pes(self) -> int:
        return len(self.buffers)

    def locate(self, addr: int, nbytes: int = 1) -> tuple[int, str, int]:
        """``(pe, name, offset)`` of the registered buffer holding ``[addr, addr + nbytes)``;
        ``SimError`` when no buffer does (not a symmetric address)."""
        for pe, bufs in self.buffers.items():
            for name, (base, size) in bufs.items():
                if base <= addr and addr + nbytes <= base + size:
                    return pe, name, addr - base
        raise SimError(f"shmem: address {addr:#x} (+{nbytes} bytes) is in no registered "
                       f"symmetric buffer (registered: {self._names()})")

    def translate(self, addr: int, pe: int, nbytes: int = 1) -> int:
        """``pe``'s address of the symmetric address ``addr`` (the same buffer, the same
        offset)."""
        if not self.buffers:
            raise SimError("shmem: an NVSHMEM call, but no symmetric buffer is registered "
                           "(the world registers them: backends.sim.Machine.symmetric_heap)")
        _, name, off = self.locate(addr, nbytes)
        target = self.buffers.get(int(pe))
        if target is None or name not in target:
            raise SimError(f"shmem: PE {pe} has no symmetric buffer {name!r} (PEs: "
                           f"{sorted(self.buffers)})")
        return target[name][0] + off

    def _names(self) -> str:
        names = sorted({n for bufs in self.buffers.values() for n in bufs})
        return ", ".join(names) or "none"


__all__ = ["SymmetricHeap"]
