"""CPU tests of the ``ep_fused_roles`` test kernel (an ffn role and the comm role in one
block, the L1 arrival counters): structure, verifier, clear errors, the numpy models."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import ir
from epgen.kernels import dispatch_wait
from epgen.kernels.fused_roles import (FFN_SMEM_BYTES, FusedRolesSpec, build_fused_roles,
                                       dynamic_smem_bytes, ffn_consume_l1_arrivals,
                                       row_checksums)
from epgen.presets import load_preset
from ir import nodes as N


def small(**flags):
    return load_preset("small").replace(**flags)


def _ops(kernel, role, cls):
    return [s for s in N.walk(kernel.role(role).body) if isinstance(s, cls)]


def test_fused_roles_kernel_places_the_comm_role_after_the_ffn_role():
    cfg = small()
    spec = FusedRolesSpec()
    k = build_fused_roles(cfg, spec)
    ir.verify(k)
    assert [r.name for r in k.roles] == ["ffn", "copy", "aux"]
    ffn, copy = k.role("ffn"), k.role("copy")
    assert (ffn.threads.base, ffn.threads.count) == (0, spec.ffn_threads)
    assert (copy.threads.base, copy.threads.count) == (spec.ffn_threads,
                                                       cfg.num_threads - spec.ffn_threads)
    assert {b.id for b in ffn.barriers} == {spec.ffn_barrier_id}
    assert {(b.id, b.count) for b in copy.barriers} == {
        (spec.comm_barrier_id, cfg.num_threads - spec.ffn_threads)}
    from ir.verify import roles_concurrent
    assert roles_concurrent(k, ffn, copy)
    releases = [s for s in _ops(k, "copy", N.AtomicRMW) if s.sem is ir.Sem.RELEASE]
    assert len(releases) == 1 and releases[0].scope is ir.Scope.GPU and releases[0].dst is None
    assert releases[0].value == ir.Const(spec.l1_release_delta, ir.types.u32)
    polls = [s for s in _ops(k, "ffn", N.SpinWait)]
    assert [s.site.buffer for s in polls] == ["ready_flag", "l1_arrival"]
    assert all(s.sem is ir.Sem.ACQUIRE and s.scope is ir.Scope.GPU for s in polls)
    assert dynamic_smem_bytes(cfg) == FFN_SMEM_BYTES + 32


def test_verifier_rejects_one_barrier_id_for_both_roles():
    cfg = small()
    kb = ir.KernelBuilder("clash", cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    l1, out = kb.param("l1", ir.types.ptr_global), kb.param("out", ir.types.ptr_global)
    smem = kb.dynamic_shared_memory()
    spec = FusedRolesSpec()
    with kb.role("ffn", blocks=(0, 8), threads=(0, 64)) as r:
        ffn_consume_l1_arrivals(r, cfg, p, spec, smem, l1, out)
    with kb.role("copy", blocks=(0, 8), threads=(64, 192), barrier_id=spec.ffn_barrier_id,
                 smem_base=FFN_SMEM_BYTES) as r:
        dispatch_wait.copy_received_tokens_to_output(r, cfg, p)
    with pytest.raises(ir.VerifyError, match=f"barrier id {spec.ffn_barrier_id} is also used"):
        ir.verify(kb.build())


@pytest.mark.parametrize("change,match", [
    (dict(ffn_threads=48), "ffn_threads"), (dict(ffn_threads=256), "ffn_threads"),
    (dict(comm_barrier_id=2), "distinct non-zero"), (dict(ffn_barrier_id=0), "distinct"),
])
def test_fused_roles_spec_errors(change, match):
    with pytest.raises(ValueError, match=match):
        build_fused_roles(small(), attrs.evolve(FusedRolesSpec(), **change))


def test_expected_l1_counters():
    spec = FusedRolesSpec(l1_release_token_block=16, l1_release_atomic_pad=4,
                          l1_release_delta=3)
    cfg = small()
    counts = np.array([0, 1, 16, 17, 128, 129, 5, 32])
    words = spec.expected_counters(cfg, counts)
    assert words.tolist()[::4] == [0, 3, 3, 6, 24, 27, 3, 6]
    assert not words.reshape(-1, 4)[:, 1:].any()


def test_row_checksum_model():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 2**16, (5, 64), dtype=np.uint16)
    words = rows.view("<u4")
    want = [sum(int(w) * (2 * i + 1) for i, w in enumerate(row)) % 2**32 for row in words]
    assert row_checksums(rows).tolist() == want
    assert row_checksums(rows[:0]).shape == (0,)


def test_tile_scales_land_before_the_l1_release():
    """BlockwiseFP8 copies its scales a tile at a time after the tile's barrier: the comm
    role then needs one more barrier before warp 0 publishes the tile's rows on the L1
    arrival counter, and room for the tile's message addresses in its dynamic shared
    memory."""
    from epgen.formats import make_format
    cfg = small().replace(token_fmt=make_format("BlockwiseFP8", 256, 4))
    text = ir.print_module(ir.Module("m", (build_fused_roles(cfg, FusedRolesSpec()),)))
    scales = text.index("%ts_i:u32")      # the tile scale copy (unrolled or a loop)
    release = text.index("red.release.gpu", scales)
    assert "bar.sync comm id=1" in text[scales:release]
    assert dynamic_smem_bytes(cfg) == dynamic_smem_bytes(small()) + 8 * 128


@pytest.mark.parametrize("flags", [dict(ep_final_layout=True),
                                   dict(ep_final_layout=True, ep_prod_reserve=True)])
def test_final_layout_refuses_the_l1_release(flags):
    """The final layout's header pass publishes no L1 arrivals: asking for them (the
    fused-roles kernel does) is an error naming both, not a kernel whose ffn waits forever."""
    with pytest.raises(ValueError, match="emit_l1_release is not implemented with "
                                         "ep_final_layout"):
        build_fused_roles(small(**flags), FusedRolesSpec())


def test_final_layout_refuses_a_scatter_sm_id():
    cfg = small(ep_final_layout=True)
    kb = ir.KernelBuilder("k", cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    with kb.role("copy", blocks=(0, 8)) as r:
        with pytest.raises(ValueError, match="scatter_sm_id is not taken with ep_final_layout"):
            dispatch_wait.copy_received_tokens_to_output(r, cfg, p, scatter_sm_id=r.block)
