"""Demo kernels built in the IR. They are the foundation's examples (docs/ir.md walks through
them), its golden variants (``golden/demo/*``) and its first GPU tests.

- ``copy16``: a grid-stride 16-byte vector copy with several loads in flight per thread.
- ``producer_consumer``: two roles in one grid. Producer blocks write a chunk, join on their
  own named barrier, and publish it with one ``st.release.sys``; consumer blocks (other blocks
  of the same grid) acquire it with a bounded wait, join on theirs, and transform the chunk.
- ``handshake``: one kernel launched once per emulated rank, on two streams. Each rank writes a
  payload into its peer's inbox and bumps the peer's arrival counter with
  ``red.release.sys.add``; then it waits (bounded) for its own counter and copies its inbox
  out. Launching one rank alone exercises the timeout path: the wait expires and the host
  raises with the diagnostic record instead of hanging.
"""

from __future__ import annotations

import ir
from ir import AtomOp, CacheHint, CmpOp, Scope, Sem
from ir import types as T

from .goldens import golden

V16 = T.vec(T.u32, 4)


def build_copy16(block_threads: int = 1024, loads_in_flight: int = 4,
                 cache: CacheHint = CacheHint.NC) -> ir.Kernel:
    """``dst[i] = src[i]`` over ``n_vec`` 16-byte vectors. Blocks take tiles of
    ``block_threads * loads_in_flight`` consecutive vectors (grid-strided); each thread issues
    its ``loads_in_flight`` ``ld.global.nc.v4`` loads (one per warp-contiguous row of the tile)
    before its stores. A grid-strided loop copies the vectors past the last whole tile."""
    kb = ir.KernelBuilder("copy16", block_threads)
    dst = kb.param("dst", T.ptr_global)
    src = kb.param("src", T.ptr_global)
    n_vec = kb.param("n_vec", T.u64)
    tile = block_threads * loads_in_flight
    with kb.role("copy") as r:
        n_tiles = r.let("n_tiles", n_vec // tile)
        with r.for_range("t", r.block.cast(T.u64), n_tiles, r.n_blocks.cast(T.u64), T.u64) as t:
            base = r.let("base", t * tile + r.tid.cast(T.u64))
            vals = [r.load(src + (base + u * block_threads) * 16, V16, cache=cache,
                           name=f"v{u}") for u in range(loads_in_flight)]
            for u, v in enumerate(vals):
                r.store(dst + (base + u * block_threads) * 16, v)
        with r.for_range("i", n_tiles * tile + r.global_thread_id(T.u64), n_vec,
                         r.grid_threads(T.u64), T.u64) as i:
            r.store(dst + i * 16, r.load(src + i * 16, V16, cache=cache, name="tail"))
    return kb.build()


def build_producer_consumer(block_threads: int = 256) -> ir.Kernel:
    """Blocks ``[0, n_producers)`` produce, the rest consume.

    Producer block ``p`` writes ``data[p*chunk + j] = seed ^ (p*chunk + j)`` for its chunk,
    joins on barrier ``produce`` (id 1), then thread 0 publishes ``flags[p] = epoch`` with
    ``st.release.sys``. Consumer block ``c`` reads producer ``(c - n_producers) % n_producers``:
    thread 0 waits (``ld.acquire.sys``, bounded) for ``flags[p] == epoch``, the block joins on
    barrier ``consume`` (id 2), and every thread writes ``out[c'*chunk + j] = data[..] * 3 + c'``
    with ``c' = c - n_producers``.
    """
    kb = ir.KernelBuilder("producer_consumer", block_threads)
    data = kb.param("data", T.ptr_global, peer=True)
    flags = kb.param("flags", T.ptr_global, peer=True)
    out = kb.param("out", T.ptr_global)
    n_producers = kb.param("n_producers", T.u32)
    chunk = kb.param("chunk_words", T.u32)
    seed = kb.param("seed", T.u32)
    epoch = kb.param("epoch", T.u32)
    kb.diagnostics(rank=0)

    with kb.role("producer", blocks=(0, n_producers)) as r:
        produced = r.named_barrier("produce", 1)
        base = r.let("base", r.block * chunk)
        with r.for_range("j", r.tid, chunk, block_threads) as j:
            r.store(data + (base + j).cast(T.u64) * 4, seed ^ (base + j))
        r.bar_sync(produced)
        with r.if_(r.tid.eq(0)):
            r.store(flags + r.block.cast(T.u64) * 4, epoch, Sem.RELEASE, Scope.SYS)

    with kb.role("consumer", blocks=(n_producers, None)) as r:
        consumed = r.named_barrier("consume", 2)
        c = r.let("c", r.block - n_producers)
        p = r.let("p", c % n_producers)
        with r.if_(r.tid.eq(0)):
            r.spin_wait(flags + p.cast(T.u64) * 4, T.u32, CmpOp.EQ, epoch, buffer="flags",
                        index=p, sem=Sem.ACQUIRE, scope=Scope.SYS, backoff_ns=64)
        r.bar_sync(consumed)
        with r.for_range("j", r.tid, chunk, block_threads) as j:
            x = r.load(data + (p * chunk + j).cast(T.u64) * 4, T.u32, name="x")
            r.store(out + (c * chunk + j).cast(T.u64) * 4, x * 3 + c)
    return kb.build()


def build_handshake(block_threads: int = 256) -> ir.Kernel:
    """One emulated rank of a two-rank exchange (launch it once per rank, on its own stream).

    Role ``send`` (every block): copy this block's chunk of ``payload`` into the peer's inbox,
    join on barrier ``sent`` (id 1), then thread 0 does ``red.release.sys.add`` of 1 on the
    peer's arrival counter. Role ``receive`` (same threads, afterwards): thread 0 waits
    (bounded, ``ld.acquire.sys``) until its own counter reaches ``epoch * n_blocks``, the block
    joins on barrier ``received`` (id 2), and the chunk of the inbox is copied to ``out``.
    Counters only grow, so back-to-back calls need no reset: call ``epoch`` expects
    ``epoch * n_blocks`` arrivals.
    """
    kb = ir.KernelBuilder("handshake", block_threads)
    payload = kb.param("payload", T.ptr_global)
    peer_inbox = kb.param("peer_inbox", T.ptr_global, peer=True)
    peer_arrivals = kb.param("peer_arrivals", T.ptr_global, peer=True)
    inbox = kb.param("inbox", T.ptr_global, peer=True)
    arrivals = kb.param("arrivals", T.ptr_global, peer=True)
    out = kb.param("out", T.ptr_global)
    chunk = kb.param("chunk_vecs", T.u32)
    epoch = kb.param("epoch", T.u32)
    my_rank = kb.param("my_rank", T.u32)
    kb.diagnostics(rank=my_rank)

    def copy_chunk(r, dst, src):
        base = r.block * chunk
        with r.for_range("j", r.tid, chunk, block_threads) as j:
            off = (base + j).cast(T.u64) * 16
            r.store(dst + off, r.load(src + off, V16, name="vec"))

    with kb.role("send") as r:
        sent = r.named_barrier("sent", 1)
        copy_chunk(r, peer_inbox, payload)
        r.bar_sync(sent)
        with r.if_(r.tid.eq(0)):
            r.red(AtomOp.ADD, peer_arrivals, 1, Sem.RELEASE, Scope.SYS)

    with kb.role("receive") as r:
        received = r.named_barrier("received", 2)
        with r.if_(r.tid.eq(0)):
            r.spin_wait(arrivals, T.u32, CmpOp.GE, epoch * r.n_blocks, buffer="arrivals",
                        index=0, sem=Sem.ACQUIRE, scope=Scope.SYS, backoff_ns=128)
        r.bar_sync(received)
        copy_chunk(r, out, inbox)
    return kb.build()


@golden("demo/copy16")
def copy16_module() -> ir.Module:
    """demo: grid-stride copy of 16-byte vectors (1024 threads, 4 ld.global.nc.v4 in flight
    per thread)"""
    return ir.Module("copy16", (build_copy16(),))


@golden("demo/producer_consumer")
def producer_consumer_module() -> ir.Module:
    """demo: producer and consumer roles in one grid (named barriers, st.release.sys /
    bounded ld.acquire.sys wait)"""
    return ir.Module("producer_consumer", (build_producer_consumer(),))


@golden("demo/handshake")
def handshake_module() -> ir.Module:
    """demo: one rank of a two-rank exchange (peer inbox, red.release.sys.add arrival
    counter, bounded wait)"""
    return ir.Module("handshake", (build_handshake(),))
