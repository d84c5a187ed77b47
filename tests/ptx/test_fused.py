"""CPU tests of the fused dispatch kernel (``ep_dispatch``), the shared expert and the
fused-kernel role parameters: structure, verifier, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
import ir
from epgen import reference, routing
from epgen.kernels import build_dispatch_fused, build_dispatch_wait, build_module
from epgen.kernels import dispatch_async, dispatch_wait
from epgen.presets import load_preset
from ir import nodes as N


def small(**flags):
    return load_preset("small").replace(**flags)


def _ops(kernel, role, cls):
    return [s for s in N.walk(kernel.role(role).body) if isinstance(s, cls)]


# ---- the module and the fused kernel ---------------------------------------------------------
def test_module_holds_the_fused_kernel_and_only_it_with_the_shared_expert():
    assert [k.name for k in build_module(small()).kernels] == [
        "ep_dispatch_async", "ep_dispatch_wait", "ep_dispatch"]
    assert [k.name for k in build_module(small(fused_shared_expert=True)).kernels] == \
        ["ep_dispatch"]


def test_standalone_wait_refuses_the_shared_expert():
    with pytest.raises(ValueError, match="fused_shared_expert.*fused"):
        build_dispatch_wait(small(fused_shared_expert=True))


@pytest.mark.parametrize("se", [False, True], ids=["plain", "se"])
def test_fused_roles_in_kernel_order(se):
    cfg = small(fused_shared_expert=se)
    k = build_dispatch_fused(cfg)
    ir.verify(k)
    n_sig = cfg.layout.n_signal_sms
    names = [r.name for r in k.roles]
    # the shared expert keeps the staged send path; the plain kernel sends on the warp path,
    # whose monitor work is split around a comm role over every block
    send = ["monitor", "comm"] if se else ["monitor", "comm", "signal"]
    assert names == send + ["aux"] + (["pack"] if se else []) + ["copy"]
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    blocks = {r.name: (r.blocks.start, r.blocks.stop) for r in k.roles}
    assert blocks["monitor"] == (ir.Const(0, ir.types.u32), ir.Const(n_sig, ir.types.u32))
    assert blocks["comm"] == (ir.Const(n_sig if se else 0, ir.types.u32), None)
    if not se:
        assert blocks["signal"] == blocks["monitor"]
    assert blocks["aux"] == (last, None) and blocks["copy"][1] == last
    assert all(r.threads is None for r in k.roles)
    params = [p.name for p in k.params]
    assert len(params) == len(set(params))
    assert {"input_tokens", "topk_ids", "recv_buf_ptrs", "counters", "recv_buf_p",
            "atomic_counter", "output_tokens", "my_rank", "err_buf", "timeout_ns"} <= set(params)
    assert ("allreduce_world_size" in params) is False


def test_fused_se_with_skip_a2a_takes_the_allreduce_world_and_verifies():
    cfg = epgen.EPConfig(num_threads=128, n_sms=9, n_experts=8, n_ranks=1,
                         max_tokens_per_rank=32, p2p_world_size=1, use_shmem=False,
                         skip_a2a=True, fused_shared_expert=True,
                         token_fmt=epgen.BF16Format(hid_dim=128, top_k=2))
    k = build_dispatch_fused(cfg)
    ir.verify(k)
    assert k.param("allreduce_world_size").dtype == ir.types.u32
    text = ir.print_kernel(k)
    assert "%se_row0" in text and "%se_tokens" in text


def test_send_blocks_publish_send_buf_ready_and_packers_wait_for_all_of_them():
    cfg = small(fused_shared_expert=True)
    lay = cfg.layout
    k = build_dispatch_fused(cfg)
    f_byte = 4 * lay.send_buf_ready_offset
    bumps = [s for s in _ops(k, "comm", N.AtomicRMW)
             if s.sem is ir.Sem.RELEASE and s.dst is None and f_byte_of(s.addr) == f_byte]
    assert len(bumps) == 1 and bumps[0].scope is ir.Scope.GPU
    waits = _ops(k, "pack", N.SpinWait)
    assert len(waits) == 1 and waits[0].sem is ir.Sem.ACQUIRE and waits[0].scope is ir.Scope.GPU
    # n_send_sms = grid - n_signal_sms, the number of comm blocks (not the monitors)
    assert waits[0].expected == ir.SRegRead(ir.SReg.NCTAID_X) - lay.n_signal_sms
    assert f_byte_of(waits[0].addr) == f_byte
    started = [s for s in _ops(k, "pack", N.AtomicRMW) if s.dst is not None]
    assert len(started) == 1 and f_byte_of(started[0].addr) == f_byte + 4
    # nothing bumps send_buf_ready without the shared expert, and the monitors never do
    assert not [s for s in _ops(k, "monitor", N.AtomicRMW) if f_byte_of(s.addr) == f_byte]
    plain = build_dispatch_fused(small())
    assert not [s for r in plain.roles for s in N.walk(r.body)
                if isinstance(s, (N.AtomicRMW, N.SpinWait)) and f_byte_of(s.addr) == f_byte]


def f_byte_of(addr):
    """Constant byte offset of an address ``ptradd(...($atomic_counter, c)..., c2)``."""
    total = 0
    while isinstance(addr, N.PtrAdd):
        if not isinstance(addr.offset, N.Const):
            return None
        total += addr.offset.value
        addr = addr.base
    return total if isinstance(addr, N.Param) and addr.name == "atomic_counter" else None


def test_reference_shared_expert_layout():
    cfg = epgen.EPConfig(num_threads=128, n_sms=9, n_experts=8, n_ranks=2,
                         max_tokens_per_rank=16, p2p_world_size=2, use_shmem=False,
                         fused_shared_expert=True, token_fmt=epgen.BF16Format(128, 2))
    rng = np.random.default_rng(1)
    toks, ids = routing.routing(rng, cfg, [16, 5])
    for rk, res in enumerate(reference.dispatch(cfg, toks, ids)):
        T = toks[rk].shape[0]
        assert res.row_offsets[0] == 0 and res.row_offsets[1] == T
        assert res.expert_ids.tolist() == list(range(cfg.layout.n_local_experts + 1))
        assert np.array_equal(res.out_tokens[:T], toks[rk])
        assert (res.src_info[:T] == -1).all()
        assert (res.block_starts >= T).all()
        assert res.row_offsets[-1] == T + res.counts.sum()


def test_split_world_refuses_the_shared_expert():
    with pytest.raises(ValueError, match="fused=False.*fused_shared_expert"):
        epgen.EmulatedWorld(small(fused_shared_expert=True), fused=False)


# ---- role parameters -------------------------------------------------------------------------
def test_monitor_warps_are_the_roles_own():
    """The reference's ``comm_warp_base`` is the role's first warp (``r.warp_base``): block
    ``b`` monitors experts ``b * role_warps + w`` with ``w`` the role-local warp."""
    cfg = small()
    kb = ir.KernelBuilder("m", cfg.num_threads)
    p = dispatch_async.declare_params(kb, cfg)
    with kb.role("monitor", blocks=(0, 4), threads=(64, 192)) as r:
        assert r.warp_base == 2
        dispatch_async.monitor_and_signal_completion(r, cfg, p)
    k = kb.build()
    ir.verify(k)
    idx = _ops(k, "monitor", N.Assign)[0]
    assert idx.dst.name == "expert_idx"
    # role-local warp (tid - 64) / 32, six warps per block
    assert idx.value == ir.SRegRead(ir.SReg.CTAID_X) * 6 + (ir.SRegRead(ir.SReg.TID_X) - 64) // 32
    kb = ir.KernelBuilder("m", cfg.num_threads)
    with pytest.raises(ValueError, match="role monitor: threads must start on a warp"):
        with kb.role("monitor", threads=(48, 192)):
            pass


def test_comm_roles_stride_by_their_own_warps():
    cfg = small()
    kb = ir.KernelBuilder("m", cfg.num_threads)
    p = dispatch_async.declare_params(kb, cfg)
    with kb.role("comm", blocks=(2, None), threads=(96, 160), barrier_id=4) as r:
        dispatch_async.copy_and_send_tokens(r, cfg, p, 2)
    k = kb.build()
    ir.verify(k)
    text = ir.print_kernel(k)
    # the warp send path: one token per comm warp, the role's 5 warps per block, warp ids
    # counted from the role's first thread; no block-wide join, so no barrier is declared
    assert "%n_send_blocks:u32 = sub(@nctaid.x, 2:u32)" in text
    assert "%n_send_warps:u32 = mul(%n_send_blocks, 5:u32)" in text
    assert "div(sub(@tid.x, 96:u32), 32:u32)" in text
    loops = [s for s in N.walk(k.role("comm").body) if isinstance(s, N.For)]
    # rounds of min(32 // K, 4) = 4 tokens (small: K = 4)
    assert loops[0].var.name == "t0"
    assert "step=mul(%n_send_warps, 4:u32)" in text
    assert k.role("comm").barriers == ()
    # with ep_send_join_named the block-staged broadcast keeps its join: the role's threads
    kb = ir.KernelBuilder("m", cfg.num_threads)
    named = cfg.replace(ep_send_join_named=True)
    p = dispatch_async.declare_params(kb, named)
    with kb.role("comm", blocks=(2, None), threads=(96, 160)) as r:
        dispatch_async.copy_and_send_tokens(r, named, p, 2)
    k = kb.build()
    fan = [s for s in N.walk(k.role("comm").body) if isinstance(s, N.For) and s.var.name == "v"]
    assert fan[0].step == ir.Const(160, ir.types.u32)        # the role's 160 threads broadcast
    assert {b.id: b.count for b in k.role("comm").barriers} == {3: 160}


def test_comm_smem_base_puts_the_copy_scratch_in_dynamic_shared_memory():
    cfg = small()
    kb = ir.KernelBuilder("w", cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    with kb.role("copy", blocks=(0, 8), threads=(32, 224), barrier_id=3, smem_base=256) as r:
        dispatch_wait.copy_received_tokens_to_output(r, cfg, p)
        assert r.scratch_end == 256 + dispatch_wait.copy_scratch_bytes(cfg, 192)
    k = kb.build()
    ir.verify(k)
    assert k.dynamic_shared and not k.shared
    text = ir.print_kernel(k)
    assert "ptradd(&dyn_smem, 256:u64)" in text and "ptradd(&dyn_smem, 272:u64)" in text
    for bad in (8, -16, True, "0"):
        with pytest.raises(ValueError, match="smem_base must be"):
            with ir.KernelBuilder("x", 64).role("copy", smem_base=bad):
                pass


@pytest.mark.parametrize("kw,match", [
    (dict(l1_release_token_block=48), "l1_release_token_block must be a positive divisor"),
    (dict(l1_release_token_block=0), "l1_release_token_block"),
    (dict(l1_release_atomic_pad=0), "l1_release_atomic_pad"),
    (dict(l1_release_delta=2**32), "l1_release_delta"),
    (dict(l1_arrival_ptr=None), "needs l1_arrival_ptr"),
])
def test_l1_release_parameters_are_checked(kw, match):
    from epgen.kernels.staged_copy import L1Release
    cfg = small()
    kb = ir.KernelBuilder("w", cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    args = dict(l1_arrival_ptr=kb.param("l1", ir.types.ptr_global))
    args.update(kw)
    release = L1Release(args.pop("l1_arrival_ptr"),
                        **{k.removeprefix("l1_release_"): v for k, v in args.items()})
    with pytest.raises(ValueError, match=match):
        with kb.role("copy") as r:
            dispatch_wait.copy_received_tokens_to_output(r, cfg, p, l1_release=release)
