"""A small kernel that calls every NVSHMEM device function of ``ir.nvshmem`` once, shared by
the link tests and the PTX checker tests: a put, a warp's put, a warp's put-with-signal, a
fence, a relaxed sys-scope store, a signal, a quiet and a signal wait, in that order
(``nvshmem_my_pe`` first: a query, not ordered)."""

from __future__ import annotations

from ir import KernelBuilder, Scope, Sem, nvshmem
from ir import types as T


def shmem_kernel(name: str = "shmem", sig_op: int = nvshmem.SIGNAL_SET):
    kb = KernelBuilder(name, block_threads=128)
    data = kb.param("data", T.ptr_global)
    sig = kb.param("sig", T.ptr_global)
    with kb.role("send") as r:
        me = nvshmem.my_pe(r)
        nvshmem.putmem_nbi(r, data, data + 64, 64, me + 1)
        nvshmem.putmem_nbi_warp(r, data + 512, data + 576, 64, me + 1)
        nvshmem.putmem_signal_nbi_warp(r, data + 1024, data + 1088, 64, sig, 1, sig_op, me + 1)
        nvshmem.fence(r)
        r.store(data + 256, me, sem=Sem.RELAXED, scope=Scope.SYS)
        nvshmem.signal_op(r, sig, 1, sig_op, me + 1)
        nvshmem.quiet(r)
        nvshmem.signal_wait_until(r, sig, nvshmem.CMP_GE, 1)
    return kb.build()
