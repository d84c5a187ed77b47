"""IR building blocks shared by the kernels and the formats' device emitters: 16-byte vector
copies (thread-strided, warp-wide, in segments, with their loads issued ahead of their stores),
word addressing, and the warp and block prefix sums with the comm barrier they use."""

from __future__ import annotations

import contextlib

import ir
from ir import AtomOp, CacheHint, Scope, Sem, ShflMode, diag
from ir import types as T

from . import fanout

VEC = T.vec(T.u32, 4)          # one 16-byte access
VEC_BYTES = 16
FAN_IN_FLIGHT = 4
"""Loads in flight per lane of a warp copy into several rows (``warp_copy`` into a
``fanout.FanAddress``)."""


def word(base, index, nbytes: int = 4):
    """Address of element ``index`` (int or u32 expression) of ``nbytes``-sized words at
    ``base``; constant indices fold into one immediate offset."""
    if isinstance(index, int):
        return base + index * nbytes if index else base
    return base + ir.as_expr(index).cast(T.u64) * nbytes


def copy_vectors(r: ir.RoleBuilder, dst, src, n_vec, first, stride, *, unroll: int = 4,
                 nc: bool = False, tag: str = "cp", tail: bool = True):
    """Copy ``n_vec`` 16-byte vectors ``src -> dst``; this thread takes vectors ``first,
    first + stride, ...`` and keeps ``unroll`` loads in flight (``ld.global{.nc}.v4.b32`` then
    ``st.global.v4.b32``). ``n_vec``, ``first`` and ``stride`` are u32. ``tail=False`` omits
    the one-at-a-time loop after the unrolled one (the caller knows it never runs). ``dst``
    may be a ``fanout.FanAddress``: each vector is loaded once and stored at every live
    row."""
    hint = CacheHint.NC if nc else CacheHint.NONE
    i = r.var(f"{tag}_i", T.u32, first)
    if unroll > 1:
        with r.while_(i + stride * (unroll - 1) < n_vec):
            vals = [r.load(src + (i + stride * u).cast(T.u64) * VEC_BYTES, VEC, cache=hint,
                           name=f"{tag}_v") for u in range(unroll)]
            for u, v in enumerate(vals):
                fanout.store(r, dst + (i + stride * u).cast(T.u64) * VEC_BYTES, v)
            r.assign(i, i + stride * unroll)
    if not tail and unroll > 1:
        return
    with r.while_(i < n_vec):
        v = r.load(src + i.cast(T.u64) * VEC_BYTES, VEC, cache=hint, name=f"{tag}_t")
        fanout.store(r, dst + i.cast(T.u64) * VEC_BYTES, v)
        r.assign(i, i + stride)


def warp_copy_unroll(n_vec: int, most: int = 8) -> int:
    """Loads in flight per lane for a warp copy of ``n_vec`` vectors: the largest divisor
    <= 8 of ``n_vec / 32`` when the lanes' share is even, so the copy has no tail trip
    (BF16 H=7168: 28 per lane, 7 in flight, 4 trips), else 4; ``most`` caps it."""
    if n_vec % 32:
        return min(4, most)
    share = n_vec // 32
    return max(d for d in range(1, most + 1) if share % d == 0)


def warp_copy(r: ir.RoleBuilder, dst, src, n_vec: int, tag: str = "cp"):
    """The calling warp copies ``n_vec`` 16-byte vectors ``src -> dst``, lane ``l`` vectors
    ``l, l + 32, ...``, ``warp_copy_unroll(n_vec)`` loads in flight (``ld.global.v4.b32``
    then ``st.global.v4.b32``); no tail loop when the unrolled trips cover every vector.
    Into a ``fanout.FanAddress`` at most ``FAN_IN_FLIGHT`` loads are in flight: the fan's
    row addresses hold registers too."""
    unroll = warp_copy_unroll(n_vec, FAN_IN_FLIGHT if isinstance(dst, fanout.FanAddress) else 8)
    copy_vectors(r, dst, src, n_vec, r.lane, 32, unroll=unroll, tag=tag,
                 tail=n_vec % (32 * unroll) != 0)


def warp_copy_segments(r: ir.RoleBuilder, src, segments, *, max_in_flight: int = 8,
                       tag: str = "cps"):
    """The calling warp copies the contiguous 16-byte vectors at ``src`` into consecutive
    destination segments ``[(dst, n_vec), ...]``: source vector ``i`` goes to the segment it
    falls in (a message's payload and its row-major scales, one source run, two output
    tensors). Lane ``l`` takes vectors ``l, l + 32, ...``, fully unrolled in trips of at most
    ``max_in_flight`` (the lane's share split evenly): every ``ld.global.v4.b32`` of a trip
    is issued before its ``st.global.v4.b32``, so the scales ride in the payload's round
    trip instead of a second one. Past the end a lane loads the last vector again and stores
    nothing."""
    n_vec = sum(n for _, n in segments)
    share = -(-n_vec // 32)
    trips = -(-share // max_in_flight)
    per_trip = -(-share // trips)
    starts = [sum(n for _, n in segments[:s]) for s in range(len(segments))]

    def dst_of(k: int, i):
        """Destination of vector ``i = lane + 32 k``: static when slot ``k``'s 32 vectors
        lie in one segment, else a ``selp`` on ``i``."""
        lo, hi = 32 * k, min(32 * k + 31, n_vec - 1)
        seg = [s for s in range(len(segments))
               if starts[s] <= hi and lo < starts[s] + segments[s][1]]
        addr = None
        for s in reversed(seg):
            here = segments[s][0] + (i - starts[s] if starts[s] else i).cast(T.u64) * VEC_BYTES
            addr = here if addr is None else fanout.select(i >= starts[s + 1], addr, here)
        return addr

    for t in range(trips):
        k0 = t * per_trip
        loads = issue_vector_loads(r, src, n_vec, r.lane, 31, 32, min(per_trip, share - k0),
                                   offset=32 * k0, tag=tag)
        store_vector_loads(r, loads, n_vec,
                           lambda u, i, k0=k0: dst_of(k0 + u, i))


def issue_vector_loads(r: ir.RoleBuilder, src, n_vec: int, first, first_max: int,
                       stride: int, count: int, *, offset: int = 0, nc: bool = False,
                       tag: str = "v"):
    """This thread's ``ld.global{.nc}.v4.b32`` of vectors ``i = first + offset + stride * u``,
    ``u < count``, all issued now (``first`` is at most ``first_max``; a vector that may lie
    past ``n_vec`` loads vector ``min(i, n_vec - 1)`` instead). Returns ``[(i, ragged,
    value)]`` for ``store_vector_loads``."""
    hint = CacheHint.NC if nc else CacheHint.NONE
    loads = []
    for u in range(count):
        step = offset + stride * u
        i = r.let(f"{tag}_i", first + step if step else first)
        ragged = first_max + step >= n_vec
        at = i.min(n_vec - 1) if ragged else i
        loads.append((i, ragged, r.load(src + at.cast(T.u64) * VEC_BYTES, VEC, cache=hint,
                                        name=f"{tag}_v")))
    return loads


def store_vector_loads(r: ir.RoleBuilder, loads, n_vec: int, dst_of):
    """The stores of ``issue_vector_loads``' values: value ``u`` (vector ``i``) to
    ``dst_of(u, i)``, the vectors past ``n_vec`` skipped."""
    for u, (i, ragged, v) in enumerate(loads):
        with r.if_(i < n_vec) if ragged else contextlib.nullcontext():
            fanout.store(r, dst_of(u, i), v)


def warp_inclusive_scan(r: ir.RoleBuilder, value, name: str = "scan") -> ir.Var:
    """Inclusive prefix sum over the 32 lanes (five ``shfl.sync.up.b32`` steps)."""
    acc = r.var(name, T.u32, value)
    for d in (1, 2, 4, 8, 16):
        up = r.shfl(ShflMode.UP, acc, d, name=f"{name}_up")
        with r.if_(r.lane >= d):
            r.assign(acc, acc + up)
    return acc


def comm_sync(r: ir.RoleBuilder):
    """The role's block barrier (reference ``_comm_barrier``), from its context
    (``kb.role(..., barrier_id=)``): ``bar.sync 0`` over the whole CTA when the role has no
    barrier id, else named barrier ``r.barrier_id`` over the role's threads (``bar.sync id,
    n_comm_threads``), so a comm role can share its block with other roles (the fused
    megakernel)."""
    if r.barrier_id is None:
        r.syncthreads()
        return
    r.bar_sync(r.barrier("comm", r.barrier_id))


def block_inclusive_scan(r: ir.RoleBuilder, value, warp_totals: ir.Expr, n_warps: int,
                         name: str = "bscan") -> ir.Var:
    """Inclusive prefix sum of a u32 over the role's threads (all ``n_warps`` warps take
    part): scan in each warp, warp totals through shared memory (``warp_totals``: ``n_warps``
    u32), warp 0 scans the totals, each warp adds its predecessors' sum. Three
    ``comm_sync``."""
    acc = warp_inclusive_scan(r, value, name)
    with r.if_(r.lane.eq(31)):
        r.store(warp_totals + r.warp.cast(T.u64) * 4, acc)
    comm_sync(r)
    with r.if_(r.warp.eq(0)):
        tot = r.var(f"{name}_tot", T.u32, 0)
        with r.if_(r.lane < n_warps):
            r.assign(tot, r.load(warp_totals + r.lane.cast(T.u64) * 4, T.u32, name=f"{name}_ld"))
        tscan = warp_inclusive_scan(r, tot, f"{name}_w")
        with r.if_(r.lane < n_warps):
            r.store(warp_totals + r.lane.cast(T.u64) * 4, tscan)
    comm_sync(r)
    with r.if_(r.warp > 0):
        prev = r.load(warp_totals + (r.warp - 1).cast(T.u64) * 4, T.u32, name=f"{name}_prev")
        r.assign(acc, acc + prev)
    comm_sync(r)
    return acc


def report_record(r: ir.RoleBuilder, err_buf, rank, kernel_name: str, magic: int, index,
                  expected, last_seen):
    """This thread claims a record of the error buffer (``atom.relaxed.sys.add`` on its count
    word) and, if one is left, stores a ``magic`` record (``ir.diag``: a bounds or an input
    record): kernel tag, rank, block, warp, ``index``, ``expected``, ``last_seen`` (u32
    each). The abort word is not raised: the kernel goes on."""
    slot = r.atomic(AtomOp.ADD, word(err_buf, diag.COUNT_WORD), 1, Sem.RELAXED, Scope.SYS,
                    name="rec_slot")
    with r.if_(slot < diag.MAX_RECORDS):
        base = r.let("rec_base", slot * diag.RECORD_WORDS + diag.HEADER_WORDS)
        F = diag.FIELDS
        vals = {"magic": ir.Const(magic, T.u32),
                "kernel_tag": ir.Const(diag.kernel_tag(kernel_name), T.u32),
                "rank": ir.as_expr(rank), "block": r.block, "warp": r.warp,
                "index": ir.as_expr(index).cast(T.u32),
                "expected": ir.as_expr(expected).cast(T.u32),
                "last_seen": ir.as_expr(last_seen).cast(T.u32)}
        for name, v in vals.items():
            r.store(word(err_buf, base + F[name]), v)
