"""The role context of ``ir.KernelBuilder.role``: the thread range, the barrier id and the
shared-memory base a role carries, what ``comm_sync`` and ``r.scratch`` make of them, and the
arguments it refuses."""

from __future__ import annotations

import pytest

import ir
from epgen.primitives import comm_sync
from ir import nodes as N
from ir import types as T


def _bar_syncs(kernel, role):
    return [s.barrier for s in N.walk(kernel.role(role).body) if isinstance(s, N.BarSync)]


def test_a_role_without_context_joins_the_whole_block_with_static_scratch():
    kb = ir.KernelBuilder("k", 128)
    with kb.role("r") as r:
        assert (r.barrier_id, r.smem_base, r.warp_base, r.scratch_end) == (None, None, 0, 0)
        a = r.scratch("a", 20)
        comm_sync(r)
        r.store(a, 1)
    k = kb.build()
    assert a == N.SharedAddr("a") and k.shared == (N.SharedBuffer("a", 20, 16),)
    assert not k.dynamic_shared
    assert _bar_syncs(k, "r") == [N.NamedBarrier("cta", 0, None)]


def test_barrier_id_and_smem_base_come_from_the_role():
    kb = ir.KernelBuilder("k", 256)
    with kb.role("comm", threads=(64, 192), barrier_id=5, smem_base=32) as r:
        assert r.warp_base == 2 and r.n_threads == 192
        first, second = r.scratch("a", 20), r.scratch("b", 4)
        comm_sync(r)
        comm_sync(r)
        assert r.scratch_end == 32 + 32 + 16      # two 16-byte aligned slices from byte 32
        r.store(first, 1)
        r.store(second, 2)
    k = kb.build()
    ir.verify(k)
    dyn = N.SharedAddr("dyn_smem")
    assert first == dyn + 32 and second == dyn + 64
    assert k.dynamic_shared and k.shared == ()
    # one named barrier over the role's threads, declared once
    assert k.role("comm").barriers == (N.NamedBarrier("comm", 5, 192),)
    assert _bar_syncs(k, "comm") == [N.NamedBarrier("comm", 5, 192)] * 2


def test_scratch_at_base_zero_starts_at_the_dynamic_memory():
    kb = ir.KernelBuilder("k", 64)
    with kb.role("r", smem_base=0) as r:
        assert r.scratch("a", 8) == N.SharedAddr("dyn_smem")
        assert r.scratch_end == 16


@pytest.mark.parametrize("kw,match", [
    (dict(threads=(16, 32)), "threads must start on a warp"),
    (dict(barrier_id=0), "barrier_id must be None"),
    (dict(barrier_id=16), "barrier_id must be None"),
    (dict(barrier_id=True), "barrier_id must be None"),
    (dict(smem_base=8), "smem_base must be None"),
    (dict(smem_base=-16), "smem_base must be None"),
    (dict(smem_base="0"), "smem_base must be None"),
])
def test_bad_role_context_is_refused_by_name(kw, match):
    kb = ir.KernelBuilder("k", 64)
    with pytest.raises(ValueError, match=f"role r: {match}"):
        with kb.role("r", **kw):
            pass
    assert kb.roles == []


def test_the_role_barrier_reuses_a_barrier_of_the_same_id():
    """A role whose barrier id another of its barriers already has (``ep_send_join_named``'s
    NB_SEND) joins on that one: one declaration."""
    kb = ir.KernelBuilder("k", 64)
    with kb.role("r", barrier_id=3) as r:
        r.bar_sync(r.barrier("send_join", 3))
        comm_sync(r)
    assert [b.id for b in kb.build().role("r").barriers] == [3]


def test_scratch_types():
    kb = ir.KernelBuilder("k", 64)
    with kb.role("r", smem_base=16) as r:
        assert r.scratch("a", 4).dtype == T.ptr_shared
