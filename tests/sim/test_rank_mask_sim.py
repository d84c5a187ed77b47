"""Rank masks (``ep_rank_mask``; docs/design.md, "Rank masks") on the CPU simulator, against
``epgen.reference`` with the masked ranks removed (``reference.mask_ranks``):

- masks set by hand: a masked rank is not launched, the others' dispatch and combine equal
  the reference without it; masked and unmasked over and over;
- shrink (``shrink=True``, the simulator's deadlines on): a rank that never launches, one
  that is late (its launches held back, then released while the others run their next
  call), one that stops half-way through its sends; ``check()`` names the rank, later calls
  do not wait for it at all, its late stores change nothing, and it rejoins;
- without shrink the same missing rank is an ``EPTimeoutError``, as before;
- on ``P2PWorld`` (one simulated GPU per rank, placement checked) too.
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference
from backends import sim as sim_backend
from epgen.errors import EPTimeoutError

from mask_checks import assert_survivors, combine_and_check, draw, expected, mask_cfg

LAYOUTS = {"staged": False, "final_layout": True}
#: enough polls for the default deadline (2 s: poll 201) and the ready flag's (3 x)
MAX_SPINS = 1000


def _machine(seed, timeouts=True):
    return sim_backend.Machine(seed, timeouts=timeouts, max_spins=MAX_SPINS)


def _call(world, rng, masked, absent=(), combine=True):
    """One dispatch (and combine) with ``absent`` ranks sitting out, checked against the
    reference without ``masked``; returns the ranks the call masked (dispatch, combine)."""
    (toks, ids), (full_t, full_i) = draw(rng, world.cfg, absent)
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    got = world.check()
    res = world.results()
    assert_survivors(world.cfg, res, full_t, full_i, set(masked) | set(absent), absent=absent)
    comb = combine_and_check(world, rng, res, full_t, full_i, set(masked) | set(absent),
                             absent=absent) if combine else []
    return got, comb


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_by_hand_is_neither_sent_to_nor_waited_for(layout, seed):
    rng = np.random.default_rng(seed)
    cfg = mask_cfg(final=LAYOUTS[layout])
    # no deadlines at all: a wait on the masked rank would be a SimHang
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed, max_spins=MAX_SPINS))
    assert _call(world, rng, []) == ([], [])
    world.update_mask(2, True)
    assert world.masked_ranks == [2]
    assert list(world.query_mask()) == [0, 0, 1, 0]
    assert _call(world, rng, [2]) == ([], [])
    assert world.results()[2] is None           # not launched


def test_mask_and_unmask_over_and_over(seed):
    """Eight calls, a different set of ranks masked by hand before each (none, one, two,
    back to none), every call exact for the ranks that take part."""
    rng = np.random.default_rng(seed)
    cfg = mask_cfg()
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed, max_spins=MAX_SPINS))
    for masked in ([], [1], [1, 3], [3], [], [0], [0, 2], []):
        for r in range(cfg.n_ranks):
            world.update_mask(r, r in masked)
        assert world.masked_ranks == masked
        assert _call(world, rng, masked) == ([], [])
    assert list(world.query_mask()) == [0, 0, 0, 0]


def test_a_view_of_one_rank(seed):
    """``on=``: one rank's view only; the world keeps launching every rank."""
    cfg = mask_cfg()
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed))
    world.update_mask(3, True, on=[0])
    assert list(world.query_mask(0)) == [0, 0, 0, 1]
    assert list(world.query_mask(1)) == [0, 0, 0, 0]
    assert world.masked_ranks == []
    world.clean_mask(on=0)
    assert list(world.query_mask(0)) == [0, 0, 0, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_that_never_launches_is_masked_under_shrink(layout, seed):
    rng = np.random.default_rng(seed)
    cfg = mask_cfg(final=LAYOUTS[layout])
    machine = _machine(seed)
    world = epgen.EmulatedWorld(cfg, backend=machine, shrink=True)
    got, comb = _call(world, rng, [1], absent=[1])
    assert got == [1] and world.last_masked == [] and comb == []
    assert world.masked_ranks == [1]
    # every other rank masked it, and pushed its own mask into rank 1's view
    for r in (0, 2, 3):
        assert world.query_mask(r)[1] == 1
    assert list(world.query_mask(1)) == [1, 0, 1, 1]
    # later calls do not wait for it at all: no wait may reach the deadline's poll
    machine.sim.max_spins = 50
    assert _call(world, rng, [1]) == ([], [])
    machine.sim.max_spins = MAX_SPINS
    world.update_mask(1, False)
    assert world.masked_ranks == [] and list(world.query_mask()) == [0, 0, 0, 0]
    assert _call(world, rng, []) == ([], [])


def test_without_shrink_a_missing_rank_is_a_timeout(seed):
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(mask_cfg(), backend=_machine(seed))
    (toks, ids), _ = draw(rng, world.cfg, absent=[1])
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    with pytest.raises(EPTimeoutError, match="recv_count"):
        world.check()
    assert world.masked_ranks == []


def test_check_can_raise_for_a_masked_rank(seed):
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(mask_cfg(), backend=_machine(seed), shrink=True)
    (toks, ids), _ = draw(rng, world.cfg, absent=[2])
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    with pytest.raises(EPTimeoutError, match=r"masked rank 2") as err:
        world.check(raise_masked=True)
    assert {rec.masked for rec in err.value.records} == {2}
    assert world.masked_ranks == [2]            # masked all the same


def test_shrink_can_be_switched(seed):
    rng = np.random.default_rng(seed)
    world = epgen.EmulatedWorld(mask_cfg(), backend=_machine(seed), shrink=True)
    world.shrink = False
    (toks, ids), _ = draw(rng, world.cfg, absent=[0])
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    with pytest.raises(EPTimeoutError):
        world.check()
    world.shrink = True
    assert _call(world, rng, [0], absent=[0])[0] == [0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_late_rank_is_masked_and_its_late_stores_change_nothing(layout, seed):
    """Rank 2's launches are held back (late): the others mask it; its call runs only while
    the others run their next call (released after they were enqueued): it sends nothing to
    the ranks that masked it (their push), and their results stay exact. Unmasking waits for
    nothing held and re-arms; the next call is exact for all four."""
    rng = np.random.default_rng(seed)
    cfg = mask_cfg(final=LAYOUTS[layout])
    machine = _machine(seed)
    world = epgen.EmulatedWorld(cfg, backend=machine, shrink=True)
    late = 2
    machine.hold(world.ranks[late].stream)
    (toks, ids), (full_t, full_i) = draw(rng, cfg)
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    assert world.check() == [late]
    res = world.results()
    res[late] = None            # its call has not run yet
    assert_survivors(cfg, res, full_t, full_i, {late})
    assert machine.held(world.ranks[late].stream)
    with pytest.raises(RuntimeError, match="held back"):
        world.update_mask(late, False)
    # the next call, the late rank's call running in the middle of it
    (toks, ids), (full_t, full_i) = draw(rng, cfg)
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    machine.release(world.ranks[late].stream)
    assert world.check() == []
    assert_survivors(cfg, world.results(), full_t, full_i, {late}, absent=[late])
    assert not machine.held(world.ranks[late].stream)
    world.update_mask(late, False)
    assert _call(world, rng, []) == ([], [])


def test_a_rank_that_stops_mid_send_is_masked(seed):
    """Rank 1 stops a few scheduler rounds into its dispatch_async (its sends under way) and
    stays stopped: every other rank either got all of its count words or none (a source
    missing one word counts nothing at all); those that masked it have the reference
    without it, the others the full reference. Released during the next call, its stores
    land in its own receive blocks only: the next call is exact."""
    rng = np.random.default_rng(seed)
    cfg = mask_cfg()
    machine = _machine(seed)
    world = epgen.EmulatedWorld(cfg, backend=machine, shrink=True)
    stopped = 1
    # a few rounds: its monitor and comm blocks are under way, no count word published yet
    machine.hold(world.ranks[stopped].stream, after_rounds=int(rng.integers(2, 7)))
    (toks, ids), (full_t, full_i) = draw(rng, cfg)
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    got = world.check()
    assert machine.held(world.ranks[stopped].stream) and got == [stopped]
    res = world.results()
    for r in range(cfg.n_ranks):
        if r == stopped:
            continue
        masked = {stopped} if world.query_mask(r)[stopped] else set()
        reference.assert_match(cfg, expected(cfg, full_t, full_i, masked)[r], res[r])
    (toks, ids), (full_t, full_i) = draw(rng, cfg)
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    machine.release(world.ranks[stopped].stream)
    assert world.check() == []
    assert_survivors(cfg, world.results(), full_t, full_i, {stopped}, absent=[stopped])
    world.update_mask(stopped, False)
    assert _call(world, rng, []) == ([], [])


def test_combine_masks_a_rank_that_skips_its_combine(seed):
    """Every rank dispatches; rank 3 then makes no combine call (its combine kernels are
    held back): the others' combine_wait masks it and its rows weigh nothing."""
    rng = np.random.default_rng(seed)
    cfg = mask_cfg()
    machine = _machine(seed)
    world = epgen.EmulatedWorld(cfg, backend=machine, shrink=True)
    (toks, ids), (full_t, full_i) = draw(rng, cfg)
    results = world.dispatch(toks, ids)
    assert world.last_masked == []
    world.combiner()                            # built before the hold
    machine.hold(world.ranks[3].stream)
    got = combine_and_check(world, rng, results, full_t, full_i, {3})
    assert got == [3] and world.masked_ranks == [3]
    machine.release(world.ranks[3].stream)
    world.synchronize()
    world.update_mask(3, False)
    assert _call(world, rng, []) == ([], [])


def test_p2p_world_masks_too(seed):
    from sim_p2p import PlacementMachine
    rng = np.random.default_rng(seed)
    cfg = mask_cfg()
    machine = PlacementMachine(seed, n_gpus=cfg.n_ranks, timeouts=True, max_spins=MAX_SPINS)
    world = epgen.P2PWorld(cfg, backend=machine, shrink=True)
    assert _call(world, rng, [3], absent=[3])[0] == [3]
    world.update_mask(3, False)
    world.update_mask(0, True)
    assert _call(world, rng, [0]) == ([], [])


def test_the_rank_mask_constructor_rules(seed):
    cfg = mask_cfg()
    with pytest.raises(ValueError, match="shrink=True needs ep_rank_mask"):
        epgen.EmulatedWorld(cfg.replace(ep_rank_mask=False), backend="sim", shrink=True)
    with pytest.raises(ValueError, match="batched=True with ep_rank_mask"):
        epgen.EmulatedWorld(cfg, backend="sim", batched=True)
    with pytest.raises(ValueError, match="fused=True with ep_rank_mask"):
        epgen.EmulatedWorld(cfg, backend="sim", fused=True)
    with pytest.raises(ValueError, match="shrink must be a bool"):
        epgen.EmulatedWorld(cfg, backend="sim", shrink=1)
    world = epgen.EmulatedWorld(cfg, backend="sim")
    with pytest.raises(ValueError, match="rank: must be a rank in"):
        world.update_mask(4, True)
    with pytest.raises(ValueError, match="masked: must be a bool"):
        world.update_mask(1, "yes")
    with pytest.raises(ValueError, match="on: ranks"):
        world.update_mask(1, True, on=[7])
    plain = epgen.EmulatedWorld(cfg.replace(ep_rank_mask=False), backend="sim")
    with pytest.raises(ValueError, match="query_mask: the rank mask needs"):
        plain.query_mask()
