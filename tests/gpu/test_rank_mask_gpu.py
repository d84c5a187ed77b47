"""Rank masks (``ep_rank_mask``; docs/design.md "Rank masks") on the GPU, against
``epgen.reference`` with the masked ranks removed (``reference.mask_ranks``):

- ``EmulatedWorld`` with shrink, a rank whose launches are withheld (its inputs None): the
  others mask it within the deadline plus a bound, ``check()`` names it, their dispatch and
  combine are exact, the next call does not wait for it at all, and it rejoins;
- masks set by hand, then the 1000-call loop with a rank lost half-way (withheld, masked by
  the kernels) and brought back three quarters of the way, every call checked;
- ``P2PWorld`` on two GPUs, the same withheld rank.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import epgen

from mask_checks import assert_survivors, combine_and_check, draw, mask_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

#: the tests' deadline: 50 ms
TIMEOUT_NS = 50_000_000
#: a call that masks a rank ends within the deadline (count words), three for the ready flag
#: of the copy blocks at worst, plus this slack (launches, the host's checks)
SLACK_S = 2.0
LAYOUTS = {"staged": False, "final_layout": True}


def _cfg(final=False, R=4):
    """Four ranks of 4 experts, top-4, 64 tokens of H=1024 (a real GPU shape, small)."""
    from world_checks import make_cfg
    return make_cfg(R, 4 * R, 1024, 4, 64, 256, 6, ep_rank_mask=True,
                    ep_final_layout=final)


def _call(world, rng, masked, absent=(), combine=True):
    (toks, ids), (full_t, full_i) = draw(rng, world.cfg, absent)
    world.load_inputs(toks, ids)
    t0 = time.monotonic()
    world.enqueue_round_trip()
    got = world.check()
    elapsed = time.monotonic() - t0
    res = world.results()
    gone = set(masked) | set(absent)
    assert_survivors(world.cfg, res, full_t, full_i, gone, absent=absent)
    if combine:
        assert combine_and_check(world, rng, res, full_t, full_i, gone, absent=absent) == []
    return got, elapsed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_withheld_rank_is_masked_within_the_deadline(layout, seed):
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(_cfg(LAYOUTS[layout]), timeout_ns=TIMEOUT_NS, shrink=True)
    _call(world, rng, [])                                   # warm: compiled, loaded
    got, elapsed = _call(world, rng, [2], absent=[2])
    assert got == [2] and world.masked_ranks == [2]
    assert TIMEOUT_NS / 1e9 <= elapsed < 3 * TIMEOUT_NS / 1e9 + SLACK_S, elapsed
    got, elapsed = _call(world, rng, [2])                   # no waiting for it at all
    assert got == [] and elapsed < TIMEOUT_NS / 1e9, elapsed
    world.update_mask(2, False)
    assert _call(world, rng, [])[0] == []


def test_masks_by_hand_need_no_deadline(seed):
    """Unbounded waits (``timeout_ns=0``): a wait on a masked rank would hang the test."""
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(_cfg(), timeout_ns=0)
    for masked in ([], [1], [1, 3], [], [0, 2], []):
        for r in range(world.cfg.n_ranks):
            world.update_mask(r, r in masked)
        assert _call(world, rng, masked)[0] == []


def test_1000_calls_with_a_rank_lost_half_way(seed):
    """Calls 0..499 with every rank; call 500 rank 1 is withheld and masked by the others'
    kernels; calls 501..749 without it, none waiting for it; it rejoins before call 750;
    every call's dispatch checked, one in ten with its combine."""
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(_cfg(), timeout_ns=TIMEOUT_NS, shrink=True)
    for call in range(1000):
        if call == 750:
            world.update_mask(1, False)
        lost = 500 <= call < 750
        absent = [1] if call == 500 else []
        got, elapsed = _call(world, rng, [1] if lost else [], absent=absent,
                             combine=call % 10 == 0)
        assert got == ([1] if call == 500 else []), f"call {call}: masked {got}"
        if lost and call > 500:
            assert elapsed < TIMEOUT_NS / 1e9, f"call {call} waited {elapsed:.3f} s"


@pytest.mark.multigpu(2)
def test_p2p_world_masks_a_withheld_rank(seed):
    rng = np.random.default_rng(seed)
    world = epgen.P2PWorld(_cfg(), devices=[0, 0, 1, 1], timeout_ns=TIMEOUT_NS, shrink=True)
    _call(world, rng, [])
    got, _ = _call(world, rng, [3], absent=[3])
    assert got == [3]
    world.update_mask(3, False)
    assert _call(world, rng, [])[0] == []
