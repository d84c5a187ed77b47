"""PTX checks of ``ep_final_layout`` and ``ep_prod_reserve`` (docs/final-layout.md): the
instructions that distinguish each flag from the staged kernels of the same preset
(``ep/small``), tied to the IR operations that must produce them.

- capacity-strided: the reservation is one ``atom.relaxed.sys.global.add.u64`` on the
  destination's cursor; the base reaches the comm warps through ``st.release.gpu.global.b32``
  / ``ld.acquire.gpu.global.b32``; dispatch_wait re-arms the cursors (a second
  ``st.global.b64``).
- ``ep_prod_reserve``: the early count and the mailbox are 64-bit ``st.release.sys.global.b64``
  stores, polled with ``ld.acquire.sys.global.b64`` for the generation in the high word; no
  cursor atomic and no hand-off.
- both: dispatch_wait has no 16-byte (``.v4``) access at all: it moves no payload.
"""

from __future__ import annotations

import functools
import re

import attrs
import pytest

from backends import nvptx
from backends.nvptx import check
from epgen import goldens
from ir import nodes as N
from ir.enums import Scope, Sem

BASE, FINAL, PROD = "ep/small", "ep/final_layout", "ep/final_layout_prod_reserve"
ASYNC, WAIT = "ep_dispatch_async", "ep_dispatch_wait"


@functools.lru_cache(maxsize=None)
def module(name):
    return goldens.build_module(name)


@functools.lru_cache(maxsize=None)
def bodies(name) -> dict:
    return check.entry_bodies(goldens.emit_ptx(module(name)))


def count(name, kernel, instr: str) -> int:
    """Occurrences of the exact instruction ``instr`` (``st.release.sys.global.b64``)."""
    return len(re.findall(r"(?<![\w.])" + re.escape(instr) + r"(?=\s)", bodies(name)[kernel]))


def vector_accesses(name, kernel) -> list[str]:
    return re.findall(r"(?<![\w.])(?:ld|st)\.[\w.:]*\.v[24]\.\w+", bodies(name)[kernel])


def ir_nodes(name, kernel, role, node_type, **fields):
    k = module(name).kernel(kernel)
    out = []
    for nd in N.walk(k.role(role).body):
        if isinstance(nd, node_type) and all(getattr(nd, f) == v for f, v in fields.items()):
            out.append(nd)
    return out


def params_used(kernel) -> set[str]:
    """Names of the parameters any statement of ``kernel`` reads (addresses and values)."""
    used = set()
    for role in kernel.roles:
        for nd in N.walk(role.body):
            for field in attrs.fields(type(nd)):
                v = getattr(nd, field.name)
                if isinstance(v, N.ExprOps):
                    used |= {e.name for e in N.walk_expr(v) if isinstance(e, N.Param)}
    return used


def spin_sites(name, kernel, role, buffer):
    return [s for s in ir_nodes(name, kernel, role, N.SpinWait) if s.site.buffer == buffer]


@pytest.mark.parametrize("name", [FINAL, PROD])
def test_variants_pass_the_ptx_checker(name):
    """Every ordered IR operation of the variant appears in its PTX with its qualifiers."""
    report = nvptx.check_ptx(module(name), goldens.emit_ptx(module(name)))
    assert report.ops


# ---- ep_final_layout alone: cursor reservation and base hand-off --------------------------------
def test_cursor_reservation_is_one_relaxed_sys_atomic():
    atom = "atom.relaxed.sys.global.add.u64"
    assert count(FINAL, ASYNC, atom) == 1
    assert count(BASE, ASYNC, atom) == count(PROD, ASYNC, atom) == 0
    (node,) = ir_nodes(FINAL, ASYNC, "monitor", N.AtomicRMW, scope=Scope.SYS)
    assert node.sem is Sem.RELAXED and node.value.dtype.bits == 64
    for name in (BASE, FINAL, PROD):            # no other sys-scope RMW anywhere
        sys_atoms = [i for k in (ASYNC, WAIT)
                     for i in re.findall(r"(?:atom|red)\.\w+\.sys\.[\w.]+", bodies(name)[k])]
        assert sys_atoms == ([atom] if name == FINAL else []), name


def test_base_hand_off_is_gpu_release_acquire():
    (store,) = ir_nodes(FINAL, ASYNC, "monitor", N.Store, sem=Sem.RELEASE, scope=Scope.GPU)
    assert store.value.dtype.bits == 32
    (spin,) = spin_sites(FINAL, ASYNC, "comm", "final_base_handoff")
    assert (spin.sem, spin.scope, spin.shift, spin.mask) == (Sem.ACQUIRE, Scope.GPU, 31, 1)
    assert count(FINAL, ASYNC, "st.release.gpu.global.b32") == 1
    assert count(BASE, ASYNC, "st.release.gpu.global.b32") == 0
    assert count(PROD, ASYNC, "st.release.gpu.global.b32") == 0
    # the hand-off poll comes on top of the monitor's finished-counter poll
    poll = "ld.acquire.gpu.global.b32"
    assert count(FINAL, ASYNC, poll) >= count(BASE, ASYNC, poll) + 1
    assert not spin_sites(PROD, ASYNC, "comm", "final_base_handoff")


def test_capacity_strided_wait_rearms_the_cursors():
    """The sentinels (every variant) and the L cursors (capacity-strided only)."""
    assert count(BASE, WAIT, "st.global.b64") == 1
    assert count(PROD, WAIT, "st.global.b64") == 1
    assert count(FINAL, WAIT, "st.global.b64") == 2


# ---- ep_prod_reserve: early counts, mailboxes, generations ---------------------------------------
def test_early_count_and_mailbox_are_64bit_sys_releases():
    rel = "st.release.sys.global.b64"
    # count word (every variant) + early count + mailbox
    assert count(BASE, ASYNC, rel) == count(FINAL, ASYNC, rel) == 1
    assert count(PROD, ASYNC, rel) == 3
    # early count and mailbox in role monitor, the count word in role signal (after the sends)
    stores = [s for role in ("monitor", "signal")
              for s in ir_nodes(PROD, ASYNC, role, N.Store, sem=Sem.RELEASE, scope=Scope.SYS)]
    assert len(stores) == 3 and all(s.value.dtype.bits == 64 for s in stores)
    tagged = [s for s in stores if any(isinstance(e, N.Var) and e.name.startswith("prod_gen")
                                       for e in N.walk_expr(s.value))]
    assert len(tagged) == 2                     # early count and mailbox carry the generation


def test_generation_polls_are_64bit_sys_acquires():
    # the reserver's early-count poll and the comm warps' mailbox poll
    assert count(PROD, ASYNC, "ld.acquire.sys.global.b64") == 2
    assert count(BASE, ASYNC, "ld.acquire.sys.global.b64") == 0
    (early,) = spin_sites(PROD, ASYNC, "monitor", "prod_early_count")
    (mailbox,) = spin_sites(PROD, ASYNC, "comm", "prod_mailbox")
    for spin in (early, mailbox):
        assert (spin.sem, spin.scope, spin.dtype.bits) == (Sem.ACQUIRE, Scope.SYS, 64)
        assert (spin.shift, spin.mask) == (32, 0xFFFFFFFF)
        assert isinstance(spin.expected, N.Cast) and spin.expected.a.name.startswith("prod_gen")


def test_generation_is_a_device_word_the_wait_advances():
    """No generation launch argument: dispatch_async reads the rank's generation word
    (relaxed, gpu scope), dispatch_wait's aux block stores the next one."""
    async_k, wait_k = module(PROD).kernel(ASYNC), module(PROD).kernel(WAIT)
    assert "prod_gen" not in [p.name for p in async_k.params]
    assert async_k.param("prod_gen_word") and wait_k.param("prod_gen_word")
    reads = [ld for role in ("monitor", "comm")
             for ld in ir_nodes(PROD, ASYNC, role, N.Load, sem=Sem.RELAXED, scope=Scope.GPU)
             if isinstance(ld.addr, N.Param) and ld.addr.name == "prod_gen_word"]
    assert len(reads) >= 2
    (advance,) = [st for st in ir_nodes(PROD, WAIT, "aux", N.Store, sem=Sem.RELAXED,
                                        scope=Scope.GPU)
                  if isinstance(st.addr, N.Param) and st.addr.name == "prod_gen_word"]
    assert advance.value.dtype.bits == 32
    assert count(PROD, WAIT, "st.relaxed.gpu.global.b32") >= 1


def test_peer_written_words_are_peer_params():
    """The mailbox and the header array are written by other ranks: marked peer, so the
    verifier demands sys scope for any ordered access to them."""
    assert module(PROD).kernel(ASYNC).param("prod_gen_p").peer
    assert module(FINAL).kernel(WAIT).param("hdr_p").peer
    assert not module(FINAL).kernel(ASYNC).param("base_handoff_p").peer


# ---- both: dispatch_wait moves no payload ----------------------------------------------------------
@pytest.mark.parametrize("name", [FINAL, PROD])
def test_dispatch_wait_has_no_payload_copy(name):
    assert vector_accesses(BASE, WAIT), "the staged wait copies payload with .v4 accesses"
    # the header pass's vectors: each row's top-k ids loaded at once (ld .v2/.v4, as
    # LLVM narrows it) and its (source index, k) stored as one st.global.v2.b32; no
    # 16-byte store (the payload copy's)
    assert sorted(set(vector_accesses(name, WAIT))) in (
        ["ld.global.v2.b32", "st.global.v2.b32"], ["ld.global.v4.b32", "st.global.v2.b32"])
    used = params_used(module(name).kernel(WAIT))
    assert "output_tokens" not in used and "recv_buf_p" not in used
    assert {"hdr_p", "src_info"} <= used
    assert {"output_tokens", "recv_buf_p"} <= params_used(module(BASE).kernel(WAIT))


@pytest.mark.parametrize("name", [FINAL, PROD])
def test_sources_write_output_rows_and_header_rows(name):
    """The comm warps' 16-byte stores: staging into the send buffer (the unrolled copy and its
    tail), then the payload row and the header row into the destination (no receive-buffer
    message copy; the staged layout broadcasts from shared memory instead)."""
    assert count(name, ASYNC, "st.global.v4.b32") >= 3
    k = module(name).kernel(ASYNC)
    loads = [nd for nd in N.walk(k.role("comm").body) if isinstance(nd, N.Load)]
    tables = {e.name for nd in loads for e in N.walk_expr(nd.addr) if isinstance(e, N.Param)}
    assert {"out_ptrs", "hdr_ptrs"} <= tables and "recv_buf_ptrs" not in tables


# ---- order inside the builders (program order of the IR) ---------------------------------------
def _first(stmts, pred) -> int:
    return next(i for i, nd in enumerate(stmts) if pred(nd))


def _addr_vars(nd) -> set[str]:
    addr = getattr(nd, "addr", None)
    return {e.name for e in N.walk_expr(addr) if isinstance(e, N.Var)} if addr is not None \
        else set()


@pytest.mark.parametrize("name,buffer", [(FINAL, "final_base_handoff"), (PROD, "prod_mailbox")])
def test_rows_are_written_only_after_the_base_wait(name, buffer):
    body = list(N.walk(module(name).kernel(ASYNC).role("comm").body))
    wait = _first(body, lambda nd: isinstance(nd, N.SpinWait) and nd.site.buffer == buffer)
    # the warp send path: lane k's row addresses (out_addr, hdr_addr, from out_dst/hdr_dst)
    # reach every lane as dst0..dstK-1
    written = re.compile(r"(hdr_addr|dst\d+)(_\d+)?$")   # kernel-unique names get suffixes
    peer_stores = [i for i, nd in enumerate(body) if isinstance(nd, N.Store)
                   and any(written.match(v) for v in _addr_vars(nd))]
    assert peer_stores and min(peer_stores) > wait


def test_monitor_counts_before_it_reserves_or_publishes():
    for name, is_reserve in ((FINAL, lambda nd: isinstance(nd, N.AtomicRMW)
                              and nd.scope is Scope.SYS),
                             (PROD, lambda nd: isinstance(nd, N.Store) and nd.scope is Scope.SYS)):
        body = list(N.walk(module(name).kernel(ASYNC).role("monitor").body))
        # the block histogram: the second bar.sync 0 ends the counting, then the count load
        joins = [i for i, nd in enumerate(body) if isinstance(nd, N.BarSync)]
        counted = _first(body, lambda nd: isinstance(nd, N.Load) and nd.dst.name == "count")
        assert len(joins) == 2 and joins[1] < counted, name
        assert _first(body, is_reserve) > counted, name
        # the monitor blocks send only afterwards: the roles run in kernel order, monitor
        # (count, reserve), comm (every block sends), signal (wait, publish)
        assert [r.name for r in module(name).kernel(ASYNC).roles] == ["monitor", "comm",
                                                                      "signal"], name
