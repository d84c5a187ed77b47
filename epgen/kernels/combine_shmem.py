"""combine_async's sinks: where a returned row and the arrival word go, by peer stores to a
source in the sender's P2P group, by NVSHMEM to one outside it (``cfg.needs_shmem``:
``use_shmem`` with ``p2p_world_size < n_ranks``; docs/combine.md).

Source ``s`` is in destination ``d``'s P2P group when ``s // P == d // P`` (``P =
p2p_world_size``). Under the SHMEM transport the combine receive buffer and the arrival
words are symmetric objects, and entry ``s`` of the tables a destination is given
(``combine_buf_ptrs``, ``arrival_ptrs``) holds ``s``'s buffer as this rank reaches it for an
in-group ``s``, and this rank's *own* buffer for a remote ``s``: the symmetric address that
an NVSHMEM call names, with ``s`` as the target PE. So the row address combine_async
computes from the table entry is, either way, the address of slot ``(t, k)`` the call needs.

- **A row** (``send_row``): to an in-group source the warp's 16-byte-vector copy through the
  peer address (``warp_copy``); to a remote one lane 0 issues ``nvshmem_putmem_nbi`` of the
  ``H * 2`` bytes to slot ``(t, k)`` of ``s``'s receive buffer (the expert-output row is the
  put's source).
- **Before the warp counts itself done** (``complete_puts``): lane 0, which issued the
  warp's puts to a remote ``s``, runs ``nvshmem_quiet``.
- **The arrival word** (``publish_arrival``): the last warp stores ``rows + 1`` into word
  ``my_rank`` of ``s``'s arrival words, ``st.release.sys`` to an in-group source,
  ``nvshmemx_signal_op(SIGNAL_SET)`` to a remote one. Under the SHMEM transport the words are
  u64 (``CombineLayout.arrival_word_bytes``: a signal sets a u64 word), else u32.

Ordering, remote source ``s``: every put of a warp is complete at ``s`` when its lane 0's
quiet returns, and that quiet precedes, in lane 0's program order, its acq_rel add to the
done counter ``s``. The adds form a release sequence that the last warp's acquiring add
reads, so every warp's quiet has returned before the last warp issues its signal, which comes
after that add in its program order. When ``s``'s combine_wait sees the word non-zero
(``ld.acquire.sys``), every row sent to it is already in its receive buffer. Nothing relies
on the order in which NVSHMEM delivers puts or signals, as in dispatch's SHMEM path
(``shmem_send``). In-group sources keep the peer-store argument of combine_async.
"""

from __future__ import annotations

import ir
from ir import Scope, Sem, nvshmem
from ir import types as T

from ..combine_layout import CombineLayout
from .common import load_pointer, warp_copy, word
from .shmem_send import in_group, is_remote


def send_row(r: ir.RoleBuilder, cfg, p, s: int, dst, src, row_bytes: int, n_vec: int):
    """One returned row ``src -> dst`` (slot ``(t, k)`` of source ``s``): ``warp_copy``
    (``ld.global.v4.b32`` / ``st.global.v4.b32``); under the SHMEM transport, for a remote
    ``s``, lane 0's ``nvshmem_putmem_nbi(dst, src, row_bytes, s)`` instead."""
    if not cfg.needs_shmem:
        warp_copy(r, dst, src, n_vec, tag="cb")
        return
    with r.if_(in_group(cfg, s, p.my_rank)):
        warp_copy(r, dst, src, n_vec, tag="cb")
    with r.if_(is_remote(cfg, s, p.my_rank) & r.lane.eq(0)):
        nvshmem.putmem_nbi(r, ir.Cast(T.u64, dst), ir.Cast(T.u64, src), row_bytes, s)


def complete_puts(r: ir.RoleBuilder, cfg, p, s: int):
    """Under the SHMEM transport, for a remote ``s``: lane 0 completes the warp's puts to
    ``s`` (``nvshmem_quiet``), before the warp counts itself done. Nothing otherwise."""
    if not cfg.needs_shmem:
        return
    with r.if_(is_remote(cfg, s, p.my_rank) & r.lane.eq(0)):
        nvshmem.quiet(r)


def publish_arrival(r: ir.RoleBuilder, cfg, p, s: int, value, sender=None):
    """The last warp: ``value`` into word ``sender`` (default ``my_rank``; 0 under
    ``skip_a2a``, where each device is its own world) of ``s``'s arrival words,
    ``st.release.sys.u32`` through the table; under the SHMEM transport ``st.release.sys.u64``
    to an in-group ``s`` and ``nvshmemx_signal_op(SIGNAL_SET)`` to a remote one."""
    arr = load_pointer(r, p.arrival_ptrs, s, f"arr{s}")
    if not cfg.needs_shmem:
        r.store(word(arr, p.my_rank if sender is None else sender), value, Sem.RELEASE,
                Scope.SYS)
        return
    nbytes = CombineLayout(cfg).arrival_word_bytes
    value = ir.as_expr(value).cast(T.u64)
    with r.if_(in_group(cfg, s, p.my_rank)):
        r.store(word(arr, p.my_rank, nbytes), value, Sem.RELEASE, Scope.SYS)
    with r.if_(is_remote(cfg, s, p.my_rank)):
        sig = r.let("arrival_sym", ir.Cast(T.u64, word(arr, p.my_rank, nbytes)))
        nvshmem.signal_op(r, sig, value, nvshmem.SIGNAL_SET, s)


__all__ = ["send_row", "complete_puts", "publish_arrival"]
