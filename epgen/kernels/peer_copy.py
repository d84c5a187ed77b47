"""``ep_peer_copy_<mode>``: the bare copy of messages to the other PEs, by each of the ways
a dispatch can move them, so that the copy's rate is measured apart from everything else a
dispatch does (``epgen bench --world shmem --copy-rate``, ``epgen.bench.copy_rate``).

Every PE runs the kernel at once. Message ``i < n_msgs`` (``msg_bytes`` each, a multiple of
16) is source bytes ``[i * msg_bytes, (i + 1) * msg_bytes)`` of this PE's ``src`` and goes to
the same bytes of PE ``message_peer(my_rank, i, n_pes)``'s ``dst``: the peers in turn, so
every PE sends to every other one, as a uniform dispatch does. Slot ``i`` of a PE's ``dst``
is written by exactly one source (``message_source``). Global warp ``w`` of the grid copies
messages ``w, w + W, ...`` (``W`` warps in the grid), one message at a time, in one of
``MODES``:

- ``stores``: the warp's direct copy through the peer's ``nvshmem_ptr`` address
  (``dst_peers[peer]``): ``primitives.warp_copy`` (``ld.global.v4.b32``, several in flight
  per lane, then ``st.global.v4.b32``), what a dispatch does inside its P2P group;
- ``puts``: ``nvshmemx_putmem_nbi_warp(dst_own + off, src + off, msg_bytes, peer)``;
- ``put_signals``: ``nvshmemx_putmem_signal_nbi_warp(..., sig_own, 1, SIGNAL_ADD, peer)``,
  the call a dispatch makes for each remote message: 1 added to the peer's signal word,
  delivered after the message.

A warp that issued puts completes them once, after its last message (``bar.warp.sync``,
lane 0's ``nvshmem_quiet``), as the dispatch's senders do; so when the kernel ends every
message has landed, in every mode. ``dst_own`` and ``sig_own`` are this PE's own addresses
of the symmetric ``dst`` buffer and signal word (a put names its target by the PE and this
PE's address of the object).
"""

from __future__ import annotations

import ir
from ir import nvshmem
from ir import types as T

from ..primitives import VEC_BYTES, warp_copy
from .common import load_pointer
from .shmem_send import complete_remote_puts, issued_flag

#: how a message reaches its peer (module docstring)
MODES = ("stores", "puts", "put_signals")


def kernel_name(mode: str) -> str:
    """The entry point of ``mode``."""
    if mode not in MODES:
        raise ValueError(f"peer copy mode {mode!r}: one of {', '.join(MODES)}")
    return f"ep_peer_copy_{mode}"


def message_peer(rank, i, n_pes):
    """The PE message ``i`` of PE ``rank`` goes to: ``(rank + 1 + i % (n_pes - 1)) %
    n_pes`` (ints or u32 expressions)."""
    return (rank + 1 + i % (n_pes - 1)) % n_pes


def message_source(pe: int, i: int, n_pes: int) -> int:
    """The one PE whose message ``i`` lands in slot ``i`` of PE ``pe`` (``message_peer``
    inverted)."""
    return (pe - 1 - i % (n_pes - 1)) % n_pes


def build_peer_copy(mode: str, msg_bytes: int, block_threads: int) -> ir.Kernel:
    """The ``mode`` kernel (module docstring) for messages of ``msg_bytes`` on blocks of
    ``block_threads``."""
    if msg_bytes <= 0 or msg_bytes % VEC_BYTES:
        raise ValueError(f"peer copy: msg_bytes={msg_bytes} must be a positive multiple of "
                         f"{VEC_BYTES}")
    if block_threads % 32:
        raise ValueError(f"peer copy: block_threads={block_threads} must be whole warps")
    kb = ir.KernelBuilder(kernel_name(mode), block_threads)
    src = kb.param("src", T.ptr_global)
    dst_own = kb.param("dst_own", T.u64)
    dst_peers = kb.param("dst_peers", T.ptr_global)
    sig_own = kb.param("sig_own", T.u64)
    n_msgs = kb.param("n_msgs", T.u32)
    my_rank = kb.param("my_rank", T.u32)
    n_pes = kb.param("n_pes", T.u32)
    warps = block_threads // 32
    with kb.role("copy", blocks=(0, None)) as r:
        issued = issued_flag(r)
        first = r.let("warp_g", r.block * warps + r.warp)
        stride = r.let("warps_g", r.n_blocks * warps)
        with r.for_range("i", first, n_msgs, stride) as i:
            peer = r.let("peer", message_peer(my_rank, i, n_pes))
            off = r.let("off", i.cast(T.u64) * msg_bytes)
            if mode == "stores":
                base = load_pointer(r, dst_peers, peer, "dst_peer")
                warp_copy(r, base + off, src + off, msg_bytes // VEC_BYTES)
            elif mode == "puts":
                nvshmem.putmem_nbi_warp(r, dst_own + off, ir.Cast(T.u64, src) + off,
                                        msg_bytes, peer.cast(T.s32))
                r.assign(issued, 1)
            else:
                nvshmem.putmem_signal_nbi_warp(r, dst_own + off, ir.Cast(T.u64, src) + off,
                                               msg_bytes, sig_own, 1, nvshmem.SIGNAL_ADD,
                                               peer.cast(T.s32))
                r.assign(issued, 1)
        if mode != "stores":
            complete_remote_puts(r, issued)
    return kb.build()


def build_peer_copy_module(msg_bytes: int, block_threads: int) -> ir.Module:
    """Every mode's kernel in one module."""
    return ir.Module("ep_peer_copy", tuple(build_peer_copy(m, msg_bytes, block_threads)
                                           for m in MODES))


__all__ = ["MODES", "kernel_name", "message_peer", "message_source", "build_peer_copy",
           "build_peer_copy_module"]
