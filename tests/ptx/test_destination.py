"""The destination strategy (``epgen.kernels.destination``): chosen once from the
configuration when the parameters are declared, the same class on the send and the wait side,
and what each strategy leaves out of the IR."""

from __future__ import annotations

import pytest

import ir
from epgen.kernels import dispatch_async, dispatch_wait
from epgen.kernels.destination import strategy_class
from epgen.kernels.final_layout import CapacityStridedRows, ProdReservedRows
from epgen.kernels.staged import StagedDestination
from epgen.presets import load_preset

KINDS = [({}, StagedDestination), ({"ep_final_layout": True}, CapacityStridedRows),
         ({"ep_final_layout": True, "ep_prod_reserve": True}, ProdReservedRows)]


def _declared(cfg, side=dispatch_async):
    kb = ir.KernelBuilder("k", cfg.num_threads)
    return side.declare_params(kb, cfg)


@pytest.mark.parametrize("flags,kind", KINDS)
def test_both_sides_declare_one_strategy_from_the_config(flags, kind):
    cfg = load_preset("small").replace(**flags)
    send, wait = _declared(cfg), _declared(cfg, dispatch_wait)
    assert strategy_class(cfg) is kind
    assert type(send.dest) is kind and type(wait.dest) is kind
    # the strategy reads the kernel's own parameters
    assert send.dest.p.my_rank is send.my_rank and wait.dest.p.my_rank is wait.my_rank
    assert send.dest.shares_tokens is (kind is StagedDestination)


def test_fused_kernel_refuses_the_final_layout():
    from epgen.kernels import build_dispatch_fused
    with pytest.raises(ValueError, match="ep_final_layout: the fused single-launch kernel"):
        build_dispatch_fused(load_preset("small").replace(ep_final_layout=True))


def test_staged_count_word_is_clamped_to_the_block_capacity():
    cfg = load_preset("small")
    small = cfg.replace(recv_block_capacity=cfg.max_tokens_per_rank // 2)
    count = ir.Var("count", ir.types.u32)
    assert _declared(cfg).dest.count_word(count, None) is count
    assert _declared(small).dest.count_word(count, None) is not count


def test_offsets_only_in_the_capacity_strided_layout():
    """The monitor keeps a block offset (``fl_off``), and the aux block reads one back
    (``block_off``), only where the count word carries one."""
    for flags, kind in KINDS:
        cfg = load_preset("small").replace(**flags)
        carries = kind is CapacityStridedRows
        p, w = _declared(cfg), _declared(cfg, dispatch_wait)
        with ir.KernelBuilder("k", cfg.num_threads).role("monitor") as r:
            assert (p.dest.offset_var(r) is not None) is carries, flags
            assert (w.dest.count_offset_var(r) is not None) is carries, flags
