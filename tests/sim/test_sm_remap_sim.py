"""The SM arguments of the reference methods as builder inputs: the test kernel
``ep_dispatch_sm_remap`` (every role on remapped SMs, ``sm_map.ReversedSubsetSMs``) against
the numpy reference on the simulator, bit for bit, over back-to-back calls (so the remapped
roles also re-arm every word); and the default map building the kernel unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import ir
from backends.sim import SimHang
from epgen import EPTimeoutError, reference, routing
from epgen.kernels import build_dispatch_fused
from epgen.kernels.sm_map import ROLE_ARGS, ReversedSubsetSMs, SMMap
from epgen.kernels.sm_remap import KERNEL_NAME, build_dispatch_sm_remap
from epgen.runtime.sm_remap_run import SMRemapRunner

from sim_world import sim_world
from test_final_layout_sim import make_cfg

CASES = {
    "warp_send": {},                                    # the monitor blocks send too
    "join_named": {"ep_send_join_named": True},         # block-staged broadcast, every block
    "ord_r": {"ep_ord_r": True, "has_rank_flag": True},
    "shared_expert": {"fused_shared_expert": True},     # comm blocks only, the packers
}


def _cfg(**flags):
    return make_cfg(2, 8, 16, 2, 12, 128, 6, **flags)


@pytest.mark.parametrize("case", list(CASES))
def test_remapped_kernel_matches_the_reference(case, seed):
    cfg = _cfg(**CASES[case])
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed, fused=True) as world:
        runner = SMRemapRunner(world)
        for call in range(3):
            counts = [int(rng.integers(0 if call == 1 else 1, cfg.max_tokens_per_rank + 1))
                      for _ in range(cfg.n_ranks)]
            toks, ids = routing.routing(rng, cfg, counts)
            got = runner.dispatch(toks, ids)
            try:
                reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, {case} call {call}: {exc}") from None
        launched = {k for k, *_ in runner.program.loaded.launched}
        assert launched == {KERNEL_NAME}


def test_every_sm_argument_is_remapped():
    """Each role's builder gets every SM argument it takes, and the remapped kernel differs
    from the default one only by them (the default map builds ``ep_dispatch`` unchanged)."""
    for flags in ({}, {"fused_shared_expert": True}):
        cfg = _cfg(**flags)
        default = ir.print_module(ir.Module("m", (build_dispatch_fused(cfg),)))
        assert default == ir.print_module(ir.Module("m", (build_dispatch_fused(cfg, SMMap()),)))
        k = build_dispatch_sm_remap(cfg)
        ir.verify(k)
        text = ir.print_module(ir.Module("m", (k,)))
        assert text != default
        for role in k.roles:
            kwargs = ReversedSubsetSMs().args(cfg, role.name, _StubRole())
            assert set(kwargs) == set(ROLE_ARGS[role.name]), role.name
        for name in ("remap_sm_id", "remap_n_send", "remap_n_copy", "remap_scatter_id"):
            assert f"%{name}" in text, name
        if cfg.fused_shared_expert:
            assert "%remap_pack_id" in text and "%remap_n_comm" in text


def test_remap_needs_room():
    with pytest.raises(ValueError, match="n_sms >= n_signal_sms \\+ 3"):
        build_dispatch_sm_remap(make_cfg(2, 4, 16, 2, 12, 128, 3))


class _OneSendSM(ReversedSubsetSMs):
    """A wrong map: every send block claims send SM 0."""

    def args(self, cfg, role, r):
        out = super().args(cfg, role, r)
        if role == "comm":
            out["sm_id"] = ir.Const(0, ir.types.u32)
        return out


def test_a_wrong_send_map_is_caught(seed):
    """The check can fail: with every send block on the same tokens, the copies overflow
    their slots, so the counts never match (a wait that never ends) or the outputs differ."""
    cfg = _cfg()
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank] * cfg.n_ranks)
    with sim_world(cfg, seed, fused=True, timeout_ns=2_000_000) as world:
        runner = SMRemapRunner(world, _OneSendSM())
        with pytest.raises((AssertionError, EPTimeoutError, SimHang)):
            reference.assert_match(cfg, reference.dispatch(cfg, toks, ids),
                                   runner.dispatch(toks, ids))


class _StubRole:
    """Enough of a RoleBuilder for ``ReversedSubsetSMs.args``."""
    block = ir.SRegRead(ir.SReg.CTAID_X)

    def let(self, name, value):
        return value


@pytest.mark.parametrize("fused", [False, True])
def test_words_reserved_for_a_fused_consumer_stay_untouched(fused, seed):
    """The L1 virtual-slot ticket and the L2 pool cursors are placement only here (the layout
    reserves them for a fused consumer): after back-to-back round trips, split or fused, with
    every word the kernels wait on re-armed, they still hold their initial 0."""
    cfg = _cfg(fused_shared_expert=fused)
    lay = cfg.layout
    base = lay.dispatch_wait_region.offset
    reserved = slice(base + lay.l1_vslot_ticket_offset,
                     base + lay.l2_pool_cursor_offset + lay.l2_pool_cursor_slots)
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed, fused=fused) as world:
        for call in range(2):
            toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
            world.dispatch(toks, ids)
            for r, rk in enumerate(world.ranks):
                words = rk.counters.to_host()
                assert not words[reserved].any(), f"seed {seed}, call {call}, rank {r}"
                # the check reads the words the kernels do use too: the ready flag is down
                assert words[base + lay.ready_flag_offset] == 0
