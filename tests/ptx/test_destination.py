"""The send path's destination strategy (``epgen.kernels.destination``): chosen once per build
from the declared parameters, and what each strategy leaves out of the IR."""

from __future__ import annotations

import pytest

import ir
from epgen.kernels import dispatch_async
from epgen.kernels.destination import FinalRowsDestination, StagedDestination, destination
from epgen.presets import load_preset


def _declared(cfg):
    kb = ir.KernelBuilder("k", cfg.num_threads)
    return dispatch_async.declare_params(kb, cfg)


@pytest.mark.parametrize("flags,kind,prod", [
    ({}, StagedDestination, None),
    ({"ep_final_layout": True}, FinalRowsDestination, False),
    ({"ep_final_layout": True, "ep_prod_reserve": True}, FinalRowsDestination, True),
])
def test_the_build_picks_one_strategy(flags, kind, prod):
    cfg = load_preset("small").replace(**flags)
    dest = destination(cfg, _declared(cfg))
    assert type(dest) is kind
    assert dest.final is (kind is FinalRowsDestination)
    assert dest.shares_tokens is not dest.final     # the final rows keep a warp per token
    if prod is not None:
        assert dest.prod_reserve is prod


def test_params_without_a_config_are_staged():
    """``declare_params(kb)`` (the fused kernel's phase 1, unit tests) declares no final-layout
    parameter: the staged receive buffer."""
    cfg = load_preset("small").replace(ep_final_layout=True)
    kb = ir.KernelBuilder("k", cfg.num_threads)
    assert type(destination(cfg, dispatch_async.declare_params(kb))) is StagedDestination


def test_staged_count_word_is_clamped_to_the_block_capacity():
    cfg = load_preset("small")
    small = cfg.replace(recv_block_capacity=cfg.max_tokens_per_rank // 2)
    count = ir.Var("count", ir.types.u32)
    assert destination(cfg, _declared(cfg)).count_word(count, None) is count
    assert destination(small, _declared(small)).count_word(count, None) is not count


def test_offsets_only_in_the_capacity_strided_layout():
    """The monitor keeps a block offset (``fl_off``) only where the count word carries one."""
    for flags, carries in [({}, False), ({"ep_final_layout": True}, True),
                           ({"ep_final_layout": True, "ep_prod_reserve": True}, False)]:
        cfg = load_preset("small").replace(**flags)
        kb = ir.KernelBuilder("k", cfg.num_threads)
        p = dispatch_async.declare_params(kb, cfg)
        with kb.role("monitor") as r:
            assert (destination(cfg, p).offset_var(r) is not None) is carries, flags
