"""NVSHMEM calls per token, counted from the PTX (``epgen.shmem_calls``): the call sites of
the SHMEM dispatch and whether each sits in a loop of the entry's control-flow graph; the
dispatch send kernel puts with a warp's put-with-signal in the send loop and quiets outside
every loop (no quiet per message), where a per-lane put and quiet in a loop (the former
fan-out's shape) counts one quiet per remote slot; the per-token numbers against the
formula of the module docstring, written out here."""

from __future__ import annotations

import pytest

import epgen
import ir
from backends.nvptx import emit_ptx
from epgen import ep_goldens as eg
from epgen import shmem_calls
from ir import nvshmem
from ir import types as T


def sites_of(cfg, kernel="ep_dispatch_async"):
    return [s for s in shmem_calls.call_sites(emit_ptx(epgen.build_module(cfg)))
            if s.kernel == kernel]


@pytest.mark.parametrize("variant", ["shmem_p2p1", "shmem_mixed", "shmem_mixed_ord_r"])
@pytest.mark.parametrize("kernel", ["ep_dispatch_async", "ep_dispatch"])
def test_the_send_kernel_puts_by_warp_in_the_loop_and_quiets_outside_it(variant, kernel):
    got = {(s.function, s.in_loop, s.after) for s in sites_of(eg.flag_variant_config(variant),
                                                                 kernel)}
    want = {("nvshmemx_putmem_signal_nbi_warp", True, None),   # per remote slot
            ("nvshmem_quiet", False, None),                     # per sending warp
            ("nvshmemx_signal_op", False, None),                # per remote expert
            ("nvshmem_quiet", False, "nvshmemx_signal_op")}     # the monitor's
    if kernel == "ep_dispatch":      # the fused kernel also receives: the consistency step
        want.add(("nvshmem_signal_wait_until", False, None))   # per remote count word
    assert got == want
    assert "nvshmem_putmem_nbi" not in {s.function for s in sites_of(
        eg.flag_variant_config(variant), kernel)}


def per_lane_kernel(loop: bool):
    """The former fan-out's shape: per token (a loop when ``loop``), a lane's put then its
    quiet; after the loop a signal."""
    kb = ir.KernelBuilder("old", 64)
    data = kb.param("data", T.ptr_global)
    n = kb.param("n", T.u32)
    with kb.role("send") as r:
        def slot():
            with r.if_(r.lane < 2):
                nvshmem.putmem_nbi(r, data, data + 64, 64, 1)
                nvshmem.quiet(r)
        if loop:
            with r.for_range("t", r.block, n, r.n_blocks):
                slot()
        else:
            slot()
        nvshmem.signal_op(r, data + 128, 1, nvshmem.SIGNAL_SET, 1)
    return kb.build()


def test_a_quiet_per_message_counts_per_remote_slot():
    cfg = eg.flag_variant_config("shmem_p2p1")
    sites = shmem_calls.call_sites(emit_ptx(per_lane_kernel(loop=True)))
    assert [(s.function, s.in_loop) for s in sites] == [
        ("nvshmem_putmem_nbi", True), ("nvshmem_quiet", True), ("nvshmemx_signal_op", False)]
    got = shmem_calls.per_token(cfg, sites, "old", tokens=64)
    K, R, P, E = cfg.layout.top_k, cfg.n_ranks, cfg.p2p_world_size, cfg.n_experts
    slots = K * (R - P) / R
    assert got["nvshmem_putmem_nbi"] == got["nvshmem_quiet"] == got["quiets"] == slots
    assert got["nvshmemx_signal_op"] == E * (R - P) / R / 64
    assert got["operations"] == slots + E * (R - P) / R / 64
    flat = shmem_calls.call_sites(emit_ptx(per_lane_kernel(loop=False)))
    assert not any(s.in_loop for s in flat)


@pytest.mark.parametrize("changes", [
    {"n_ranks": 4, "n_experts": 28, "n_sms": 8, "p2p_world_size": 1},
    {"n_ranks": 4, "n_experts": 16, "n_sms": 8, "p2p_world_size": 2},
], ids=["p2p1", "mixed"])
def test_calls_per_token_after_the_redesign(changes):
    cfg = eg.flag_variant_config("shmem_p2p1").replace(**changes)
    E, R, P, K = cfg.n_experts, cfg.n_ranks, cfg.p2p_world_size, cfg.layout.top_k
    T = 128
    got = shmem_calls.per_token(cfg, sites_of(cfg), tokens=T)
    warps = min(cfg.n_sms - cfg.layout.n_signal_sms, T) * min(cfg.num_threads // 32, K)
    remote_experts = E * (R - P) / R
    assert got["nvshmemx_putmem_signal_nbi_warp"] == pytest.approx(K * (R - P) / R)
    assert got["nvshmemx_signal_op"] == pytest.approx(remote_experts / T)
    assert got["quiets"] == pytest.approx((warps + remote_experts) / T)
    assert got["quiets"] < 1        # fewer than one quiet per token, where there was one per slot


def test_the_combine_puts_rows_by_warp_in_its_loops_and_quiets_once():
    from epgen.kernels import build_combine_module
    cfg = eg.flag_variant_config("shmem_mixed")
    sites = [s for s in shmem_calls.call_sites(emit_ptx(build_combine_module(cfg)))
             if s.kernel == "ep_combine_async"]
    puts = [s for s in sites if s.function == "nvshmemx_putmem_signal_nbi_warp"]
    quiets = [s for s in sites if s.function == "nvshmem_quiet"]
    assert len(puts) == cfg.n_ranks and all(s.in_loop for s in puts)   # one per source
    assert len(quiets) == 1 and not quiets[0].in_loop
    assert {s.function for s in sites} == {"nvshmemx_putmem_signal_nbi_warp",
                                           "nvshmemx_signal_op", "nvshmem_quiet"}
