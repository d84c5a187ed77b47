"""The simulator's side of rank masks: a ``SpinWait`` that may give up (``give_up`` word,
``shrink`` expiry) ends with the status the lowering gives it (backends/nvptx/spin_wait.py),
on a one-thread kernel; and ``Machine.hold`` / ``release``: a held stream's launch does not
start (or stops after some rounds) and ``drain`` returns without it."""

from __future__ import annotations

import numpy as np
import pytest

from backends import sim as sim_backend
from ir import diag
from ir import nodes as N
from ir import types as T
from ir.builder import KernelBuilder
from ir.enums import CmpOp


def _give_up_kernel() -> N.Module:
    """One thread waits for ``flag[0] >= 1`` unless ``mask[0]`` is set, with the shrink
    switch ``shrink``; stores the wait's status and last value into ``out``."""
    kb = KernelBuilder("gives_up", block_threads=1)
    flag, mask, out = (kb.param(n, T.ptr_global) for n in ("flag", "mask", "out"))
    shrink = kb.param("shrink", T.u32)
    kb.diagnostics(rank=0)
    with kb.role("waiter") as r:
        seen, status = r.spin_wait_or_give_up(flag, T.u32, CmpOp.GE, 1, buffer="flag",
                                              index=0, give_up=mask, shrink=shrink)
        r.store(out, status)
        r.store(out + 4, seen)
    return N.Module("give_up", (kb.build(),))


def _run(flag: int, mask: int, shrink: int, timeouts: bool = True):
    machine = sim_backend.Machine(0, timeouts=timeouts, max_spins=300)
    module = _give_up_kernel()
    kernel = machine.load_module(module).kernel("gives_up")
    arrays = [machine.to_device(np.array([v], np.uint32)) for v in (flag, mask)]
    out = machine.zeros((2,), np.uint32)
    err = machine.zeros((diag.BUFFER_WORDS,), np.uint32)
    kernel.launch(1, 1, (*arrays, out, shrink, err, 20_000_000))
    machine.drain()
    return [int(v) for v in out.to_host()], err.to_host(), module


def test_the_condition_holds():
    (status, seen), err, _ = _run(flag=3, mask=1, shrink=1)
    assert (status, seen) == (N.SPIN_MET, 3) and err[diag.COUNT_WORD] == 0


def test_a_set_give_up_word_ends_the_wait():
    """No deadline at all (timeouts off): the give_up word alone ends it."""
    (status, seen), err, _ = _run(flag=0, mask=1, shrink=0, timeouts=False)
    assert (status, seen) == (N.SPIN_GAVE_UP, 0) and err[diag.COUNT_WORD] == 0


def test_an_expiry_under_shrink_neither_records_nor_aborts():
    (status, _), err, _ = _run(flag=0, mask=0, shrink=1)
    assert status == N.SPIN_EXPIRED
    assert err[diag.COUNT_WORD] == 0 and err[diag.ABORT_WORD] == 0


def test_an_expiry_without_shrink_is_a_timeout_as_before():
    (status, _), err, module = _run(flag=0, mask=0, shrink=0)
    assert status == 0                       # the thread exited before its stores
    assert err[diag.ABORT_WORD] == 1
    (rec,) = diag.decode(err, module.kernels)
    assert (rec.kernel, rec.buffer, rec.elapsed_ns) == ("gives_up", "flag", 3 * 10_000_000)


# ---- holds -------------------------------------------------------------------------------------
def _stores_kernel(n: int) -> N.Module:
    """One thread stores 1 into ``out[0..n)``, one global store after another."""
    kb = KernelBuilder("stores", block_threads=1)
    out = kb.param("out", T.ptr_global)
    with kb.role("writer") as r:
        with r.for_range("i", 0, n, 1) as i:
            r.store(out + i.cast(T.u64) * 4, 1)
    return N.Module("stores", (kb.build(),))


def test_a_held_stream_does_not_start_until_released():
    machine = sim_backend.Machine(0)
    kernel = machine.load_module(_stores_kernel(8)).kernel("stores")
    held, free = machine.create_stream(), machine.create_stream()
    a, b = machine.zeros((8,), np.uint32), machine.zeros((8,), np.uint32)
    machine.hold(held)
    kernel.launch(1, 1, (a,), held)
    kernel.launch(1, 1, (b,), free)
    machine.drain()
    assert b.to_host().sum() == 8 and a.to_host().sum() == 0 and machine.held(held)
    machine.release(held)
    machine.drain()
    assert a.to_host().sum() == 8 and not machine.held(held)


def test_a_hold_after_some_rounds_stops_a_launch_half_way():
    """Every global store a switch point (``preempt=1``): held after 3 rounds, the thread
    has made at most 3 of its 40 stores; released, it finishes."""
    machine = sim_backend.Machine(0, preempt=1.0)
    kernel = machine.load_module(_stores_kernel(40)).kernel("stores")
    stream = machine.create_stream()
    out = machine.zeros((40,), np.uint32)
    machine.hold(stream, after_rounds=3)
    kernel.launch(1, 1, (out,), stream)
    machine.drain()
    done = int(out.to_host().sum())
    assert 0 < done <= 3 and machine.held(stream)
    machine.release(stream)
    machine.drain()
    assert out.to_host().sum() == 40


def test_a_launch_after_a_held_one_waits_for_it():
    machine = sim_backend.Machine(0)
    kernel = machine.load_module(_stores_kernel(4)).kernel("stores")
    held, other = machine.create_stream(), machine.create_stream()
    a, b = machine.zeros((4,), np.uint32), machine.zeros((4,), np.uint32)
    machine.hold(held)
    kernel.launch(1, 1, (a,), held)
    other.wait(held.record())
    kernel.launch(1, 1, (b,), other)
    machine.drain()
    assert a.to_host().sum() == 0 and b.to_host().sum() == 0
    machine.release(held)
    machine.drain()
    assert a.to_host().sum() == 4 and b.to_host().sum() == 4


def test_hold_refuses_a_bad_round_count():
    machine = sim_backend.Machine(0)
    with pytest.raises(ValueError, match="after_rounds"):
        machine.hold(machine.create_stream(), after_rounds=-1)
