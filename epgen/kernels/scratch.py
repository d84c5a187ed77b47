"""Shared-memory scratch of one role: static buffers, or slices of the kernel's dynamic shared
memory from a byte offset (the reference's ``comm_smem_base``).

In the standalone kernels a role owns its block, so each scratch array is a static
``.shared`` buffer. In a fused megakernel another role of the same block owns dynamic shared
memory ``[0, comm_smem_base)``; the comm role's scratch then starts at ``comm_smem_base`` in the
extern ``dyn_smem`` array, and the host launches with at least ``Scratch.end`` bytes of dynamic
shared memory.
"""

from __future__ import annotations

import ir

ALIGN = 16


class Scratch:
    """Allocates a role's shared scratch arrays: ``buffer(name, nbytes)`` returns a shared
    address; with ``base=None`` a static buffer, else the next 16-byte-aligned slice of
    ``dyn_smem`` at or after byte ``base``. ``end`` is the dynamic shared memory bytes needed."""

    def __init__(self, kb: ir.KernelBuilder, base: int | None = None):
        if base is not None and (isinstance(base, bool) or not isinstance(base, int)
                                 or base < 0 or base % ALIGN):
            raise ValueError(f"comm_smem_base must be None (static shared buffers) or a byte "
                             f"offset >= 0 and a multiple of {ALIGN}, got {base!r}")
        self.kb = kb
        self.base = base
        self.end = 0 if base is None else base

    def buffer(self, name: str, nbytes: int) -> ir.Expr:
        if self.base is None:
            return self.kb.shared_buffer(name, nbytes)
        addr = self.kb.dynamic_shared_memory() + self.end if self.end else \
            self.kb.dynamic_shared_memory()
        self.end += -(-nbytes // ALIGN) * ALIGN
        return addr


__all__ = ["Scratch"]
