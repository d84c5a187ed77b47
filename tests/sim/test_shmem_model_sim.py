"""The simulator's model of NVSHMEM's delivery (``backends.sim.shmem``) on small kernels, two
PEs in one machine: a put lands rounds after the call, not at it; a put-with-signal's signal
always lands after its data; a plain signal may land before an earlier put of the same
thread, unless an ``nvshmem_fence`` separates them; ``nvshmem_quiet`` returns only once
everything its thread and its warp issued has landed; a warp-collective call is one transfer
and refuses lanes with different arguments; a thread or warp that exits with operations
issued after its last quiet is an error, landed or not.

Each kernel runs on PE 0 and sends to PE 1; the order in which transfers land is read from
the simulator (its ``Transfers.land`` hook, wrapped)."""

from __future__ import annotations

import numpy as np
import pytest

import ir
from ir import nvshmem
from ir import types as T
from backends import sim as sim_backend

N = 64          # bytes a put moves


def machine_with_heap(seed):
    """A machine whose PEs 0 and 1 each have a ``data`` (N bytes) and a ``sig`` (8 bytes)
    symmetric buffer, and a plain ``out`` array; the landing order is recorded in
    ``machine.landed`` (``"put"`` / ``"signal"``, with the scheduler round)."""
    m = sim_backend.Machine(seed)
    bufs = {(pe, name): m.zeros((size,), np.uint8)
            for pe in (0, 1) for name, size in (("data", N), ("sig", 8))}
    heap = m.symmetric_heap()
    for (pe, name), b in bufs.items():
        heap.register(pe, name, b.ptr, b.nbytes)
    m.bufs = bufs
    m.src = m.to_device(np.arange(N, dtype=np.uint8) + 1)
    m.out = m.zeros((N,), np.uint8)
    m.landed = []
    m.rounds = [0]
    land = m.sim.transfers.land

    def record(t):
        m.landed.append((t.kind, m.rounds[0]))
        land(t)
    m.sim.transfers.land = record
    deliver = m.sim.transfers.deliver_round

    def count_round():
        m.rounds[0] += 1
        deliver()
    m.sim.transfers.deliver_round = count_round
    return m


def run(m, body, threads=32):
    """Launch one block of ``threads`` whose role is ``body(r, p)`` (``p``: the parameters
    ``data``, ``sig``, ``src``, ``out``: PE 0's addresses) and run it."""
    kb = ir.KernelBuilder("k", threads)
    p = {name: kb.param(name, T.ptr_global) for name in ("data", "sig", "src", "out")}
    with kb.role("main") as r:
        body(r, p)
    module = m.load_module(ir.Module("m", (kb.build(),)))
    module.kernel("k").launch(1, threads, (m.bufs[(0, "data")], m.bufs[(0, "sig")], m.src,
                                           m.out))
    m.drain()


def lane0(r, fn):
    with r.if_(r.lane.eq(0)):
        fn()


def test_a_put_lands_rounds_after_the_call():
    late = 0
    for seed in range(8):
        m = machine_with_heap(seed)
        run(m, lambda r, p: lane0(r, lambda: (
            nvshmem.putmem_nbi(r, p["data"], p["src"], N, 1), nvshmem.quiet(r))))
        assert [k for k, _ in m.landed] == ["put"]
        late += m.landed[0][1] > 1
        assert np.array_equal(m.bufs[(1, "data")].to_host(), m.src.to_host())
    assert late >= 6        # the mean delay is Sim.shmem_delay rounds


def test_put_with_signal_lands_the_signal_after_the_data():
    for seed in range(12):
        m = machine_with_heap(seed)

        def body(r, p):
            nvshmem.putmem_signal_nbi_warp(r, p["data"], p["src"], N, p["sig"], 5,
                                           nvshmem.SIGNAL_ADD, 1)
            r.warp_sync()
            lane0(r, lambda: nvshmem.quiet(r))
        run(m, body)
        kinds = [k for k, _ in m.landed]
        assert kinds == ["put", "signal"], (seed, m.landed)
        assert m.bufs[(1, "sig")].to_host().view(np.uint64)[0] == 5


def _put_then_signal(fence: bool):
    def body(r, p):
        def calls():
            nvshmem.putmem_nbi(r, p["data"], p["src"], N, 1)
            if fence:
                nvshmem.fence(r)
            nvshmem.signal_op(r, p["sig"], 1, nvshmem.SIGNAL_SET, 1)
            nvshmem.quiet(r)
        lane0(r, calls)
    return body


def test_a_plain_signal_is_not_ordered_after_an_earlier_put():
    orders = set()
    for seed in range(16):
        m = machine_with_heap(seed)
        run(m, _put_then_signal(fence=False))
        orders.add(tuple(k for k, _ in m.landed))
    assert orders == {("put", "signal"), ("signal", "put")}


def test_a_fence_orders_the_put_before_the_signal():
    for seed in range(16):
        m = machine_with_heap(seed)
        run(m, _put_then_signal(fence=True))
        assert [k for k, _ in m.landed] == ["put", "signal"], (seed, m.landed)


def test_quiet_returns_once_every_transfer_has_landed():
    """After the quiet lane 0 copies PE 1's image of ``data`` to ``out``: the put's bytes are
    there, every seed."""
    def body_for(offset):
        def body(r, p):
            nvshmem.putmem_signal_nbi_warp(r, p["data"], p["src"], N, p["sig"], 1,
                                           nvshmem.SIGNAL_SET, 1)
            r.warp_sync()
            with r.if_(r.lane.eq(0)):
                nvshmem.quiet(r)
                for i in range(N // 8):
                    v = r.load(p["data"] + (offset + i * 8), T.u64, name="v")
                    r.store(p["out"] + i * 8, v)
        return body
    for seed in range(6):
        m = machine_with_heap(seed)
        run(m, body_for(m.bufs[(1, "data")].ptr - m.bufs[(0, "data")].ptr))
        assert np.array_equal(m.out.to_host(), m.src.to_host()), seed


def test_exit_without_quiet_is_an_error_even_when_the_transfer_landed():
    """Lane 0 puts, then stays busy long enough for the put to land, and exits without a
    quiet."""
    def body(r, p):
        def calls():
            nvshmem.putmem_nbi(r, p["data"], p["src"], N, 1)
            with r.for_range("i", 0, 2000, 1):
                r.load(p["src"], T.u32, name="busy")
        lane0(r, calls)
    m = machine_with_heap(0)
    with pytest.raises(sim_backend.SimError, match="never completed"):
        run(m, body)
    assert m.landed, "the put should have landed while lane 0 was busy"


def test_a_warp_call_left_unquieted_is_an_error():
    def body(r, p):
        nvshmem.putmem_nbi_warp(r, p["data"], p["src"], N, 1)
    with pytest.raises(sim_backend.SimError, match=r"warp 0 \(its warp calls\) exits with 1"):
        run(machine_with_heap(0), body)


def test_a_warp_call_is_one_transfer_and_needs_the_same_arguments():
    m = machine_with_heap(0)

    def body(r, p):
        nvshmem.putmem_nbi_warp(r, p["data"], p["src"], N, 1)
        r.warp_sync()
        lane0(r, lambda: nvshmem.quiet(r))
    run(m, body)
    assert [k for k, _ in m.landed] == ["put"]
    with pytest.raises(sim_backend.SimError, match="different arguments"):
        run(machine_with_heap(0), lambda r, p: nvshmem.putmem_nbi_warp(
            r, p["data"], p["src"], ir.as_expr(r.lane).cast(T.u64) + 8, 1))
