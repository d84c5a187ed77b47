"""The NVSHMEM device functions the kernels may call, and builders that emit them.

One table, ``FUNCTIONS``, names each device function by its C name with its signature and its
role in the memory model, so that every layer agrees on it: the kernel builders emit calls
through the helpers below (``putmem_nbi``, ``putmem_nbi_warp``, ``putmem_signal_nbi_warp``,
``quiet``, ``fence``, ``signal_op``), the NVPTX backend declares and links them from NVSHMEM's
device bitcode, the PTX checker knows which calls order memory, and the CPU simulator models
each one.

PTX Mapping: every helper is one ``ir.Call`` statement, lowered to
``call.uni (ret), <name>, (args)`` of an ``.extern .func`` that the link step resolves.

Ordering roles (what NVSHMEM promises about the call; docs/shmem.md, "What NVSHMEM
promises", has the sources):

- ``"put"``: a non-blocking copy into a peer's symmetric memory; nothing about when it is
  delivered, nor in which order with the caller's other operations.
- ``"put_signal"``: a non-blocking put, then an atomic update of a 64-bit signal word at the
  same peer that is delivered only after the put's data (the one ordering a put carries by
  itself).
- ``"fence"``: the operations the caller issued to one peer before the fence are delivered
  before those it issues to that peer after it (order, not completion).
- ``"quiet"``: every operation the caller issued is complete (delivered at its peer, its
  source readable again) when the call returns.
- ``"signal"``: an atomic update of a 64-bit signal word in a peer's symmetric memory; a
  non-blocking operation like a put, unordered with the caller's earlier puts.
- ``"wait"``: blocks until a 64-bit signal word in the caller's own symmetric memory
  compares true with a value, then makes the data that arrived with it visible to the
  caller's loads (on a network transport NVSHMEM's consistency step; nothing to do over
  NVLink). The kernels call it only after their own bounded poll has seen the value, so it
  returns at once: it is there for the consistency step, not to wait.
- ``"query"``: no memory effect.

Groups: a ``"thread"`` function is one thread's call; a ``"warp"`` function
(``nvshmemx_*_warp``) is called by every lane of a warp with the same arguments and is one
operation of the warp (NVSHMEM synchronises the warp before and after it).
"""

from __future__ import annotations

import attrs

from . import types as T
from .nodes import Cast, as_expr

#: ``sig_op`` of ``nvshmemx_signal_op``: set the word (``NVSHMEM_SIGNAL_SET``) or add to it
#: (``NVSHMEM_SIGNAL_ADD``); the values of ``nvshmemx_signal_op_t`` in NVSHMEM's
#: ``device_host_transport/nvshmem_common_transport.h`` (3.4 to 3.8)
SIGNAL_SET = 9
SIGNAL_ADD = 10
#: ``cmp`` of ``nvshmem_signal_wait_until``: the values of ``nvshmemx_cmp_type_t`` in
#: NVSHMEM's ``device_host_transport/nvshmem_constants.h`` (3.8)
CMP_EQ = 0
CMP_GE = 5


@attrs.frozen
class DeviceFunction:
    """One NVSHMEM device function: C name, return type (None: void), parameter types,
    ordering role and the group that calls it (``"thread"`` or ``"warp"``; module
    docstring)."""

    name: str
    ret: T.DType | None
    params: tuple
    role: str
    group: str = "thread"


# C pointers are generic pointers (``T.ptr_generic``, LLVM ``ptr``): declared with the types of
# the bitcode's definitions, our calls stay direct ``call.uni`` once linked (an integer where the
# definition has a pointer makes LLVM call through a prototype, ``call %rd, (...), prototype``)
FUNCTIONS: dict[str, DeviceFunction] = {f.name: f for f in (
    # void nvshmem_putmem_nbi(void *dest, const void *source, size_t nbytes, int pe)
    DeviceFunction("nvshmem_putmem_nbi", None, (T.ptr_generic, T.ptr_generic, T.u64, T.s32),
                   "put"),
    # void nvshmemx_putmem_nbi_warp(void *dest, const void *source, size_t bytes, int pe)
    DeviceFunction("nvshmemx_putmem_nbi_warp", None,
                   (T.ptr_generic, T.ptr_generic, T.u64, T.s32), "put", "warp"),
    # void nvshmemx_putmem_signal_nbi_warp(void *dest, const void *source, size_t nelems,
    #                                      uint64_t *sig_addr, uint64_t signal, int sig_op,
    #                                      int pe)
    DeviceFunction("nvshmemx_putmem_signal_nbi_warp", None,
                   (T.ptr_generic, T.ptr_generic, T.u64, T.ptr_generic, T.u64, T.s32, T.s32),
                   "put_signal", "warp"),
    # void nvshmem_fence(void)
    DeviceFunction("nvshmem_fence", None, (), "fence"),
    # void nvshmem_quiet(void)
    DeviceFunction("nvshmem_quiet", None, (), "quiet"),
    # void nvshmemx_signal_op(uint64_t *sig_addr, uint64_t signal, int sig_op, int pe)
    DeviceFunction("nvshmemx_signal_op", None, (T.ptr_generic, T.u64, T.s32, T.s32),
                   "signal"),
    # uint64_t nvshmem_signal_wait_until(uint64_t *sig_addr, int cmp, uint64_t cmp_val)
    DeviceFunction("nvshmem_signal_wait_until", T.u64, (T.ptr_generic, T.s32, T.u64), "wait"),
    # int nvshmem_my_pe(void)
    DeviceFunction("nvshmem_my_pe", T.s32, (), "query"),
)}


def is_nvshmem(name: str) -> bool:
    """Whether ``name`` is one of the NVSHMEM device functions of ``FUNCTIONS``."""
    return name in FUNCTIONS


def _call(r, name: str, *args):
    f = FUNCTIONS[name]
    return r.call(name, [_as(a, t) for a, t in zip(args, f.params)], ret=f.ret,
                  arg_types=f.params)


def _as(value, dtype):
    e = as_expr(value)
    return e if getattr(e, "dtype", None) == dtype else Cast(dtype, e)


def putmem_nbi(r, dest, source, nbytes, pe):
    """``nvshmem_putmem_nbi(dest, source, nbytes, pe)``: ``dest`` is the symmetric address
    (this PE's address of the same symmetric object), ``pe`` the target; pointers or u64
    addresses (cast to generic pointers)."""
    return _call(r, "nvshmem_putmem_nbi", dest, source, nbytes, pe)


def putmem_nbi_warp(r, dest, source, nbytes, pe):
    """``nvshmemx_putmem_nbi_warp(dest, source, nbytes, pe)``: the whole warp calls it with the
    same arguments (one put of the warp); ``dest`` symmetric, as ``putmem_nbi``."""
    return _call(r, "nvshmemx_putmem_nbi_warp", dest, source, nbytes, pe)


def putmem_signal_nbi_warp(r, dest, source, nbytes, sig_addr, value, sig_op: int, pe):
    """``nvshmemx_putmem_signal_nbi_warp(dest, source, nbytes, sig_addr, value, sig_op, pe)``:
    the whole warp calls it with the same arguments; the put of ``nbytes`` to ``dest``, then
    ``sig_op`` (``SIGNAL_SET`` / ``SIGNAL_ADD``) of ``value`` on the u64 word ``sig_addr``,
    delivered after the data (both addresses symmetric, ``pe`` the target)."""
    return _call(r, "nvshmemx_putmem_signal_nbi_warp", dest, source, nbytes, sig_addr, value,
                 sig_op, pe)


def fence(r):
    """``nvshmem_fence()``."""
    return _call(r, "nvshmem_fence")


def quiet(r):
    """``nvshmem_quiet()``."""
    return _call(r, "nvshmem_quiet")


def signal_op(r, sig_addr, value, sig_op: int, pe):
    """``nvshmemx_signal_op(sig_addr, value, sig_op, pe)``: ``sig_addr`` symmetric, a u64
    word."""
    return _call(r, "nvshmemx_signal_op", sig_addr, value, sig_op, pe)


def signal_wait_until(r, sig_addr, cmp: int, value):
    """``nvshmem_signal_wait_until(sig_addr, cmp, value)``: ``sig_addr`` this PE's own u64
    signal word; returns the word (a u64 ``Var``). Called only once a bounded poll has seen
    the condition hold (module docstring, role ``"wait"``)."""
    return _call(r, "nvshmem_signal_wait_until", sig_addr, cmp, value)


def my_pe(r):
    """``nvshmem_my_pe()``: this PE's number (an s32 ``Var``)."""
    return _call(r, "nvshmem_my_pe")


__all__ = ["DeviceFunction", "FUNCTIONS", "SIGNAL_SET", "SIGNAL_ADD", "is_nvshmem",
           "putmem_nbi", "putmem_nbi_warp", "putmem_signal_nbi_warp", "fence", "quiet",
           "signal_op", "signal_wait_until", "my_pe", "CMP_EQ", "CMP_GE"]
