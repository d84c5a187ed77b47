"""The PTX checker: ordered IR operations -> the PTX instruction each must produce; passes on
emitted PTX, fails as soon as a qualifier (``.release``, ``.sys`` ...) or an instruction is
dropped from the text."""

from __future__ import annotations

import re

import pytest

from backends.nvptx import PtxCheckError, check_ptx, emit_ptx, ordered_ops
from backends.nvptx.check import entry_bodies
from ir import AtomOp, CmpOp, KernelBuilder, Scope, Sem, nvshmem
from ir import nodes as N
from ir import types as T
from nvshmem_kernel import shmem_kernel as _shared_kernel


def protocol_kernel(name="proto", cluster=True):
    """A producer/consumer kernel with one of every kind of ordered operation."""
    kb = KernelBuilder(name, block_threads=1024)
    data = kb.param("data", T.ptr_global, peer=True)
    flags = kb.param("flags", T.ptr_global, peer=True)
    gen = kb.param("gen", T.ptr_generic)
    smem = kb.shared_buffer("stage", 256)
    kb.diagnostics()
    with kb.role("producer", threads=(0, 512)) as r:
        bar = r.named_barrier("producers", 3)
        v = r.load(data, T.u32)                                     # weak: not checked
        r.store(data + 64, v)
        r.bar_sync(bar)
        r.syncthreads()                                            # barrier 0: not checked
        r.fence(Sem.RELEASE, Scope.SYS)
        r.store(flags, 1, sem=Sem.RELEASE, scope=Scope.SYS)
        r.store(smem, v, sem=Sem.VOLATILE)
        r.red(AtomOp.ADD, flags + 8, 1, sem=Sem.RELEASE, scope=Scope.GPU)
        r.atomic(AtomOp.EXCH, flags + 16, 5, sem=Sem.ACQ_REL, scope=Scope.SYS, dtype=T.u64)
        if cluster:
            r.store(gen, v, sem=Sem.RELAXED, scope=Scope.CLUSTER)
    with kb.role("consumer", threads=(512, 512)) as r:
        r.bar_arrive(r.named_barrier("consumers", 4))
        r.spin_wait(flags, T.u32, CmpOp.EQ, 1, buffer="flags", index=0, sem=Sem.ACQUIRE,
                    scope=Scope.SYS)
        r.fence(Sem.ACQUIRE, Scope.GPU)
        w = r.load(data + 4, T.u64, sem=Sem.ACQUIRE, scope=Scope.GPU)
        x = r.load(smem + 8, T.u32, sem=Sem.RELAXED, scope=Scope.CTA)
        old = r.cas(flags + 24, 0, x, sem=Sem.ACQUIRE, scope=Scope.GPU)
        r.store(data + 128, w + old.cast(T.u64))
    return kb.build()


EXPECTED = [
    ("producer", "bar.sync 3, 512"),
    ("producer", "fence.release.sys"),
    ("producer", "st.release.sys.global.b32"),
    ("producer", "st.volatile.shared.b32"),
    ("producer", "red.release.gpu.global.add.u32"),
    ("producer", "atom.acq_rel.sys.global.exch.b64"),
    ("producer", "st.relaxed.cluster.b32"),
    ("consumer", "bar.arrive 4, 512"),
    ("consumer", "ld.acquire.sys.global.b32"),
    ("consumer", "fence.acquire.gpu"),
    ("consumer", "ld.acquire.gpu.global.b64"),
    ("consumer", "ld.relaxed.cta.shared.b32"),
    ("consumer", "atom.acquire.gpu.global.cas.b32"),
]


@pytest.fixture(scope="module")
def kernel():
    return protocol_kernel()


@pytest.fixture(scope="module")
def ptx(kernel):
    return emit_ptx(kernel)


def test_ordered_ops_lists_every_ordered_operation(kernel):
    ops = ordered_ops(kernel)
    assert [(o.role, o.expected) for o in ops] == EXPECTED
    assert all(o.kernel == "proto" for o in ops)
    assert isinstance(ops[8].node, N.SpinWait)


def test_fences_follow_the_architecture():
    kb = KernelBuilder("f", block_threads=32)
    with kb.role("r") as r:
        r.fence(Sem.ACQUIRE, Scope.GPU)
        r.fence(Sem.RELEASE, Scope.CTA)
        r.fence(Sem.ACQ_REL, Scope.SYS)
        r.fence(Sem.SC, Scope.GPU)
    k = kb.build()
    assert [o.expected for o in ordered_ops(k, "sm_90")] == [
        "fence.acquire.gpu", "fence.release.cta", "fence.acq_rel.sys", "fence.sc.gpu"]
    assert [o.expected for o in ordered_ops(k, "sm_80")] == [
        "fence.acq_rel.gpu", "fence.acq_rel.cta", "fence.acq_rel.sys", "fence.sc.gpu"]
    for arch in ("sm_80", "sm_90", "sm_100"):
        check_ptx(k, emit_ptx(k, arch))


def test_passes_on_emitted_ptx(kernel, ptx):
    report = check_ptx(kernel, ptx)
    assert len(report.ops) == len(EXPECTED)
    assert all(n >= 1 for n in report.found.values())
    assert report.found[("proto", "st.release.sys.global.b32")] == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_100"])
def test_passes_on_other_architectures(arch):
    k = protocol_kernel(cluster=False)
    check_ptx(k, emit_ptx(k, arch))


@pytest.mark.parametrize("old,new,missing", [
    ("st.release.sys.global.b32", "st.relaxed.sys.global.b32", "st.release.sys.global.b32"),
    ("st.release.sys.global.b32", "st.release.gpu.global.b32", "st.release.sys.global.b32"),
    ("st.release.sys.global.b32", "st.global.b32", "st.release.sys.global.b32"),
    ("ld.acquire.sys.global.b32", "ld.acquire.gpu.global.b32", "ld.acquire.sys.global.b32"),
    ("fence.release.sys", "fence.release.gpu", "fence.release.sys"),
    ("fence.acquire.gpu", "fence.acq_rel.gpu", "fence.acquire.gpu"),
    ("red.release.gpu.global.add.u32", "red.relaxed.gpu.global.add.u32",
     "red.release.gpu.global.add.u32"),
    ("atom.acq_rel.sys.global.exch.b64", "atom.acq_rel.gpu.global.exch.b64",
     "atom.acq_rel.sys.global.exch.b64"),
    ("atom.acquire.gpu.global.cas.b32", "atom.global.cas.b32", "atom.acquire.gpu.global.cas.b32"),
    ("st.volatile.shared.b32", "st.shared.b32", "st.volatile.shared.b32"),
    ("ld.relaxed.cta.shared.b32", "ld.shared.b32", "ld.relaxed.cta.shared.b32"),
    ("bar.sync \t3, 512;", "bar.sync \t3;", "bar.sync 3, 512"),
    ("bar.arrive \t4, 512;", "bar.arrive \t4, 256;", "bar.arrive 4, 512"),
])
def test_fails_when_a_qualifier_is_dropped(kernel, ptx, old, new, missing):
    assert old in ptx
    mutated = ptx.replace(old, new)
    with pytest.raises(PtxCheckError) as err:
        check_ptx(kernel, mutated)
    assert f"`{missing}`" in str(err.value)
    assert [ops[0].expected for ops, _ in err.value.missing] == [missing]


def test_failure_message_names_kernel_role_and_counts(kernel, ptx):
    mutated = ptx.replace("st.release.sys.global.b32", "st.relaxed.sys.global.b32")
    with pytest.raises(PtxCheckError) as err:
        check_ptx(kernel, mutated)
    msg = str(err.value)
    assert ("kernel proto: `st.release.sys.global.b32` expected 1x, found 0x, for role "
            "producer: Store release sys") in msg


def test_count_each_expected_instruction():
    """Two IR releases need two PTX releases: one dropped is caught even if one remains."""
    kb = KernelBuilder("twice", block_threads=32)
    g = kb.param("g", T.ptr_global)
    with kb.role("r") as r:
        r.store(g, 1, sem=Sem.RELEASE, scope=Scope.SYS)
        r.store(g + 4, 2, sem=Sem.RELEASE, scope=Scope.SYS)
    k = kb.build()
    ptx = emit_ptx(k)
    assert check_ptx(k, ptx).found[("twice", "st.release.sys.global.b32")] == 2
    first = ptx.index("st.release.sys.global.b32")
    mutated = ptx[:first] + "st.relaxed.sys.global.b32" + ptx[first + 25:]
    with pytest.raises(PtxCheckError, match=r"expected 2x, found 1x"):
        check_ptx(k, mutated)


def test_duplicates_from_unrolling_pass():
    kb = KernelBuilder("unrolled", block_threads=32)
    g = kb.param("g", T.ptr_global)
    with kb.role("r") as r:
        with r.for_range("i", 0, 4) as i:
            r.store(g + i.cast(T.u64) * 4, i, sem=Sem.RELEASE, scope=Scope.GPU)
    k = kb.build()
    report = check_ptx(k, emit_ptx(k))
    assert report.found[("unrolled", "st.release.gpu.global.b32")] == 4


def test_counts_are_per_kernel():
    """A release present in one kernel does not satisfy another kernel's."""
    a, b = protocol_kernel("a"), protocol_kernel("b")
    m = N.Module("two", (a, b))
    ptx = emit_ptx(m)
    check_ptx(m, ptx)
    start = ptx.index(".entry b(")
    mutated = ptx[:start] + ptx[start:].replace("fence.release.sys", "fence.release.gpu")
    with pytest.raises(PtxCheckError, match="kernel b: `fence.release.sys`"):
        check_ptx(m, mutated)


def test_missing_kernel_fails(kernel):
    other = protocol_kernel("other")
    with pytest.raises(PtxCheckError, match="kernel other"):
        check_ptx(N.Module("m", (kernel, other)), emit_ptx(kernel))


def test_report_counts_by_scope(kernel, ptx):
    scopes = check_ptx(kernel, ptx).by_scope["proto"]
    # atomics: red.release.gpu, atom.acq_rel.sys exch, cas acquire gpu, and the spin-wait's
    # record claim (atom.relaxed.gpu)
    assert scopes["atomics"] == {"gpu": 3, "sys": 1}
    assert scopes["releases"]["sys"] >= 3          # fence.release.sys, st.release.sys, exch
    assert scopes["releases"]["gpu"] == 1          # red.release.gpu
    assert scopes["acquires"]["sys"] >= 2          # spin poll (maybe unrolled), exch acq_rel
    assert scopes["acquires"]["gpu"] == 3          # fence, ld.acquire.gpu, cas


def test_text_without_target_is_rejected(kernel):
    with pytest.raises(ValueError, match=".target"):
        check_ptx(kernel, "")


# ---------------------------------------------------------------------------------------------
# NVSHMEM calls: ordered operations, in IR order


def shmem_kernel(name="shmem"):
    """A put, a warp's put, a warp's put-with-signal, a fence, a relaxed store, a signal and a
    quiet, in that order."""
    return _shared_kernel(name, nvshmem.SIGNAL_SET)


SHMEM_ORDER = ["call.uni nvshmem_putmem_nbi", "call.uni nvshmemx_putmem_nbi_warp",
               "call.uni nvshmemx_putmem_signal_nbi_warp", "call.uni nvshmem_fence",
               "st.relaxed.sys.global.b32", "call.uni nvshmemx_signal_op",
               "call.uni nvshmem_quiet", "call.uni nvshmem_signal_wait_until"]


def _call_block(ptx: str, name: str) -> str:
    """The ``{ // callseq ... }`` block of PTX text that calls ``name``."""
    m = re.search(r"\t\{ // callseq (\d+), 0\n(?:(?!\t\} // callseq).*\n)*?\tcall\.uni[^\n]*"
                  + re.escape(name) + r", [^\n]*\n(?:.*\n)*?\t\} // callseq \1\n", ptx)
    assert m, name
    return m.group(0)


def test_nvshmem_calls_are_ordered_operations_in_ir_order():
    k = shmem_kernel()
    assert [op.expected for op in ordered_ops(k)] == SHMEM_ORDER
    report = check_ptx(k, emit_ptx(k))
    assert report.found[("shmem", "call.uni nvshmem_quiet")] == 1


@pytest.mark.parametrize("name", ["nvshmem_putmem_nbi", "nvshmemx_putmem_nbi_warp",
                                  "nvshmemx_putmem_signal_nbi_warp", "nvshmem_fence",
                                  "nvshmemx_signal_op", "nvshmem_quiet",
                                  "nvshmem_signal_wait_until"])
def test_dropping_an_nvshmem_call_fails(name):
    k = shmem_kernel()
    ptx = emit_ptx(k)
    dropped = ptx.replace(_call_block(ptx, name), "")
    assert dropped != ptx
    with pytest.raises(PtxCheckError, match=rf"`call.uni {name}` expected 1x, found 0x") as e:
        check_ptx(k, dropped)
    assert e.value.missing and not e.value.misordered


def test_nvshmem_calls_out_of_ir_order_fail():
    k = shmem_kernel()
    ptx = emit_ptx(k)
    put = _call_block(ptx, "nvshmemx_putmem_signal_nbi_warp")
    fence = _call_block(ptx, "nvshmem_fence")
    swapped = ptx.replace(put, "@@PUT@@").replace(fence, put).replace("@@PUT@@", fence)
    assert swapped != ptx
    with pytest.raises(PtxCheckError, match=r"`call.uni nvshmem_fence` \(Call nvshmem_fence\) "
                                            r"is not after `call.uni "
                                            r"nvshmemx_putmem_signal_nbi_warp`") as e:
        check_ptx(k, swapped)
    assert not e.value.missing


def test_an_ordered_operation_moved_across_an_nvshmem_call_fails():
    k = shmem_kernel()
    ptx = emit_ptx(k)
    store = re.search(r"\tst\.relaxed\.sys\.global\.b32[^\n]*\n", ptx).group(0)
    signal = _call_block(ptx, "nvshmemx_signal_op")
    quiet = _call_block(ptx, "nvshmem_quiet")
    # the store after the quiet: it is no longer between the fence and the signal
    moved = ptx.replace(store, "").replace(quiet, quiet + store)
    with pytest.raises(PtxCheckError, match=r"`call.uni nvshmemx_signal_op` .* is not after "
                                            r"`st.relaxed.sys.global.b32`"):
        check_ptx(k, moved)
    # the store before the fence: not after the fence that precedes it in the IR
    fence = _call_block(ptx, "nvshmem_fence")
    moved = ptx.replace(store, "").replace(fence, store + fence)
    with pytest.raises(PtxCheckError, match=r"`st.relaxed.sys.global.b32` .* is not after "
                                            r"`call.uni nvshmem_fence`"):
        check_ptx(k, moved)
    assert signal in ptx


def test_order_is_not_checked_without_nvshmem_calls(kernel, ptx):
    # the protocol kernel's roles may be laid out freely: only counts are checked there
    assert check_ptx(kernel, ptx).ops


def test_entry_bodies_end_at_the_entry_closing_brace():
    ptx = (".version 8.6\n.target sm_90\n.visible .entry a()\n{\n\t{ // callseq 0, 0\n"
           "\tcall.uni f, ();\n\t}\n\tret;\n}\n.func f()\n{\n\tst.release.sys.global.b32 "
           "[%rd1], %r1;\n}\n")
    bodies = entry_bodies(ptx)
    assert list(bodies) == ["a"]
    assert "call.uni f" in bodies["a"] and "st.release" not in bodies["a"]
