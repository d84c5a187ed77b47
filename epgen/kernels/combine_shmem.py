"""combine_async's sinks: where a returned row and the arrival word go, by peer stores to a
source in the sender's P2P group, by NVSHMEM to one outside it (``cfg.needs_shmem``:
``use_shmem`` with ``p2p_world_size < n_ranks``; docs/combine.md), and how combine_wait reads
the arrival word under the SHMEM transport.

Source ``s`` is in destination ``d``'s P2P group when ``s // P == d // P`` (``P =
p2p_world_size``). Under the SHMEM transport the combine receive buffer and the arrival
words are symmetric objects, and entry ``s`` of the tables a destination is given
(``combine_buf_ptrs``, ``arrival_ptrs``) holds ``s``'s buffer as this rank reaches it for an
in-group ``s``, and this rank's *own* buffer for a remote ``s``: the symmetric address that
an NVSHMEM call names, with ``s`` as the target PE. So the row address combine_async
computes from the table entry is, either way, the address of slot ``(t, k)`` the call needs.

The arrival word of destination ``d`` at source ``s`` is a u64 under the SHMEM transport
(``CombineLayout.arrival_word_bytes``: signals update u64 words), armed at 0. Its high half
holds ``rows + 1`` once ``d`` has published the number of rows it returns to ``s``; its low
half counts the rows that have landed (``arrival_value``).

- **A row** (``send_row``): to an in-group source the warp's 16-byte-vector copy through the
  peer address (``warp_copy``); to a remote one the whole warp calls
  ``nvshmemx_putmem_signal_nbi_warp(row, expert-output row, H * 2, arrival word, 1,
  SIGNAL_ADD, s)``: the row, then 1 added to the low half, which NVSHMEM delivers after the
  row. No quiet per row. A row combine_async refuses (``src_info`` out of bounds, reported
  and not written) still adds its 1, by lane 0's ``nvshmemx_signal_op(SIGNAL_ADD)``
  (``skip_row``), so the source's count of published rows is reached.
- **The arrival word** (``publish_arrival``): the last warp publishes ``rows`` for source
  ``s``: ``st.release.sys`` of ``(rows + 1) << 32 | rows`` to an in-group source (its rows,
  peer stores, are all there: the release publishes them), ``nvshmemx_signal_op(SIGNAL_ADD)``
  of ``(rows + 1) << 32`` to a remote one. Without the SHMEM transport: ``rows + 1`` into a
  u32 word, as ever.
- **Completing the puts** (``complete_puts``): each warp, after its last source, completes
  its operations with one ``nvshmem_quiet`` of lane 0 (after ``bar.warp.sync``) when it
  issued any: the rows' source is the caller's expert-output buffer, free again when the
  kernel ends, and NVSHMEM completes nothing at a kernel's end.
- **The wait** (``wait_arrival``, combine_wait): the source's thread ``d`` waits (bounded,
  ``ld.acquire.sys``) until the high half is non-zero, reads ``rows`` from it, then waits
  (bounded, ``ld.acquire.sys``) until the low half equals ``rows``.

Ordering, remote source ``s``: each 1 in the low half lands after its row (put-with-signal),
the publication is an atomic add of the same word (signals on one word are atomic with each
other), and the waiting thread's acquire reads a value that every one of those signals
contributed to, so when it sees ``rows`` rows counted, every row sent to it is in its receive
buffer and in its causal past. Nothing relies on the order in which NVSHMEM delivers rows and
the publication. In-group sources keep the peer-store argument of combine_async.
"""

from __future__ import annotations

import ir
from ir import CmpOp, Scope, Sem, nvshmem
from ir import types as T

from ..combine_layout import CombineLayout
from .common import load_pointer, warp_copy, word
from .shmem_send import in_group, is_remote, issued_flag, landed_consistently


def arrival_value(rows) -> ir.Expr:
    """The u64 arrival word once ``rows`` rows are published and have all landed:
    ``(rows + 1) << 32 | rows``."""
    rows = ir.as_expr(rows).cast(T.u64)
    return ((rows + 1) << 32) | rows


def arrival_signal(r: ir.RoleBuilder, cfg, p, s: int):
    """Under the SHMEM transport, this rank's own (symmetric) address of its arrival word at
    source ``s`` (word ``my_rank`` of ``arrival_ptrs[s]``), else None."""
    if not cfg.needs_shmem:
        return None
    arr = load_pointer(r, p.arrival_ptrs, s, f"arr_sig{s}")
    nbytes = CombineLayout(cfg).arrival_word_bytes
    return r.let(f"arrival_sig{s}", ir.Cast(T.u64, word(arr, p.my_rank, nbytes)))


def send_row(r: ir.RoleBuilder, cfg, p, s: int, dst, src, row_bytes: int, n_vec: int,
             sig=None, issued=None):
    """One returned row ``src -> dst`` (slot ``(t, k)`` of source ``s``), the whole warp:
    ``warp_copy`` (``ld.global.v4.b32`` / ``st.global.v4.b32``); under the SHMEM transport,
    for a remote ``s``, ``nvshmemx_putmem_signal_nbi_warp(dst, src, row_bytes, sig, 1,
    SIGNAL_ADD, s)`` instead (``sig``: ``arrival_signal``), and ``issued`` := 1."""
    if not cfg.needs_shmem:
        warp_copy(r, dst, src, n_vec, tag="cb")
        return
    with r.if_(in_group(cfg, s, p.my_rank)):
        warp_copy(r, dst, src, n_vec, tag="cb")
    with r.if_(is_remote(cfg, s, p.my_rank)):
        nvshmem.putmem_signal_nbi_warp(r, ir.Cast(T.u64, dst), ir.Cast(T.u64, src), row_bytes,
                                       sig, 1, nvshmem.SIGNAL_ADD, s)
        r.assign(issued, 1)


def skip_row(r: ir.RoleBuilder, cfg, p, s: int, sig=None, issued=None):
    """A row combine_async refuses (its ``src_info`` out of bounds: reported, not written):
    under the SHMEM transport, for a remote ``s``, lane 0 still counts it landed
    (``nvshmemx_signal_op(SIGNAL_ADD)`` of 1 on the low half: there is no data to order it
    after), so the source's wait for its published rows ends; ``issued`` := 1. Nothing
    otherwise (an in-group source waits for the publication only)."""
    if not cfg.needs_shmem:
        return
    with r.if_(is_remote(cfg, s, p.my_rank) & r.lane.eq(0)):
        nvshmem.signal_op(r, sig, 1, nvshmem.SIGNAL_ADD, s)
        r.assign(issued, 1)


def complete_puts(r: ir.RoleBuilder, cfg, issued):
    """Under the SHMEM transport, the whole warp after its last source: ``bar.warp.sync``,
    then lane 0's ``nvshmem_quiet`` when the warp (or lane 0's publication) issued any
    operation. Nothing otherwise."""
    if not cfg.needs_shmem:
        return
    r.warp_sync()
    with r.if_(r.lane.eq(0) & issued.ne(0)):
        nvshmem.quiet(r)


def publish_arrival(r: ir.RoleBuilder, cfg, p, s: int, rows, sender=None, issued=None):
    """The last warp's lane 0: ``rows + 1`` into word ``sender`` (default ``my_rank``; 0
    under ``skip_a2a``, where each device is its own world) of ``s``'s arrival words,
    ``st.release.sys.u32`` through the table; under the SHMEM transport
    ``st.release.sys.u64`` of ``arrival_value(rows)`` to an in-group ``s`` and
    ``nvshmemx_signal_op(SIGNAL_ADD)`` of ``(rows + 1) << 32`` to a remote one (``issued``
    := 1)."""
    arr = load_pointer(r, p.arrival_ptrs, s, f"arr{s}")
    if not cfg.needs_shmem:
        r.store(word(arr, p.my_rank if sender is None else sender), rows + 1, Sem.RELEASE,
                Scope.SYS)
        return
    nbytes = CombineLayout(cfg).arrival_word_bytes
    with r.if_(in_group(cfg, s, p.my_rank)):
        r.store(word(arr, p.my_rank, nbytes), arrival_value(rows), Sem.RELEASE, Scope.SYS)
    with r.if_(is_remote(cfg, s, p.my_rank)):
        sig = r.let("arrival_sym", ir.Cast(T.u64, word(arr, p.my_rank, nbytes)))
        published = (ir.as_expr(rows).cast(T.u64) + 1) << 32
        nvshmem.signal_op(r, sig, published, nvshmem.SIGNAL_ADD, s)
        r.assign(issued, 1)


def wait_arrival(r: ir.RoleBuilder, cfg, arrival, d):
    """combine_wait's thread ``d``, under the SHMEM transport: bounded waits
    (``ld.acquire.sys``) until arrival word ``d``'s high half is non-zero (``rows + 1``
    published), then until its low half equals ``rows`` (every row landed); once both held,
    NVSHMEM's consistency step (``shmem_send.landed_consistently`` of the word's final value
    ``(rows + 1) << 32 | rows``), so rows a network transport wrote are visible to the
    reduce's loads."""
    nbytes = CombineLayout(cfg).arrival_word_bytes
    at = word(arrival, d, nbytes)
    seen = r.spin_wait(at, T.u64, CmpOp.NE, 0, buffer="combine_arrival", index=d,
                       sem=Sem.ACQUIRE, scope=Scope.SYS, shift=32, name="published")
    rows = r.let("rows_published", (seen >> 32) - 1)
    landed = r.spin_wait(at, T.u64, CmpOp.EQ, rows, buffer="combine_rows_landed", index=d,
                         sem=Sem.ACQUIRE, scope=Scope.SYS, mask=0xFFFFFFFF, name="landed")
    final = r.let("arrival_final", ((rows + 1) << 32) | rows)
    landed_consistently(r, at, ((seen >> 32).ne(0)) & ((landed & 0xFFFFFFFF).eq(rows)), final)


__all__ = ["issued_flag", "arrival_value", "arrival_signal", "send_row", "skip_row",
           "complete_puts",
           "publish_arrival", "wait_arrival"]
