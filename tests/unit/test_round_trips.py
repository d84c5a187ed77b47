"""``epgen.round_trips``, the checked round-trip loop of ``epgen run`` and the tests, on a
stand-in world that returns the reference's results (optionally altered): every call
compared, the first difference raised naming the seed and the call, extra checks only after a
matching dispatch, the compared ranks, graph replays, inputs drawn lazily."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, round_trips, routing
from epgen.presets import load_preset

CFG = load_preset("small")


class FakeWorld:
    """Returns ``reference.dispatch`` of its inputs; ``corrupt`` (a call index) flips one
    token element of the last rank's first received row on that call."""

    def __init__(self, corrupt: int | None = None):
        self.cfg, self.input_scale = CFG, 1.0
        self.corrupt, self.calls, self.graphs = corrupt, 0, []

    def dispatch(self, tokens, topk_ids):
        got = reference.dispatch(self.cfg, tokens, topk_ids)
        if self.calls == self.corrupt:
            last = got[-1]
            e, src = np.argwhere(last.counts > 0)[0]
            last.out_tokens[last.block_starts[e, src], 0] ^= np.uint16(1)
        self.calls += 1
        return got

    def dispatch_replayed(self, tokens, topk_ids, graph=None):
        self.graphs.append(graph)
        return graph or "graph", self.dispatch(tokens, topk_ids)


def inputs(seed, calls=3):
    rng = np.random.default_rng(seed)
    return list(round_trips.drawn_inputs(rng, CFG, 4, calls))


def test_matching_calls_are_yielded_in_order(seed):
    got = list(round_trips.checked_calls(FakeWorld(), inputs(seed), seed=seed))
    assert [c.index for c in got] == [0, 1, 2]
    assert all(c.matches and c.dispatch == [] for c in got)
    assert got[0].rows == sum(int(r.row_offsets[-1]) for r in got[0].expected)


def test_the_first_difference_raises_naming_seed_and_call(seed):
    seen = []
    with pytest.raises(round_trips.MismatchError) as info:
        for checked in round_trips.checked_calls(FakeWorld(corrupt=1), inputs(seed),
                                                 seed=seed):
            seen.append(checked.index)
    assert seen == [0]
    assert str(info.value).startswith(f"seed {seed}, call 1: differs from the reference "
                                      f"(dispatch)")
    assert info.value.checked.index == 1 and info.value.checked.dispatch
    assert isinstance(info.value, AssertionError)      # a test failure where tests use it


def test_checks_run_after_a_matching_dispatch_only(seed):
    ran = []

    def check(checked):
        ran.append(checked.index)
        return ["combine differs"] if checked.index == 2 else []
    with pytest.raises(round_trips.MismatchError, match=r"call 2: .*\(combine\)") as info:
        for _ in round_trips.checked_calls(FakeWorld(), inputs(seed), seed=seed,
                                           checks={"combine": check}):
            pass
    assert ran == [0, 1, 2]
    assert info.value.checked.differences() == ["combine: combine differs"]
    ran.clear()
    with pytest.raises(round_trips.MismatchError, match=r"\(dispatch\)"):
        for _ in round_trips.checked_calls(FakeWorld(corrupt=0), inputs(seed), seed=seed,
                                           checks={"combine": check}):
            pass
    assert ran == []


def test_only_the_named_ranks_are_compared(seed):
    """A world's own rank (the SHMEM process): rank 0's result alone, against the
    reference's rank 0; the corrupted last rank is not looked at."""
    world = FakeWorld(corrupt=0)
    calls = round_trips.checked_calls(world, inputs(seed, 1), seed=seed, ranks=[0],
                                      call=lambda t, i: world.dispatch(t, i)[:1])
    (checked,) = list(calls)
    assert [r.rank for r in checked.results] == [0] == [r.rank for r in checked.expected]
    wrong = round_trips.checked_calls(world, inputs(seed, 1), seed=seed, ranks=[0],
                                      call=lambda t, i: world.dispatch(t, i)[1:])
    with pytest.raises(round_trips.MismatchError):
        list(wrong)


def test_replayed_calls_pass_the_graph_on(seed):
    world = FakeWorld()
    list(round_trips.checked_calls(world, inputs(seed), seed=seed, replayed=True))
    assert world.graphs == [None, "graph", "graph"]
    with pytest.raises(ValueError, match="exclusive"):
        list(round_trips.checked_calls(world, inputs(seed), seed=seed, replayed=True,
                                       call=world.dispatch))


def test_inputs_are_drawn_when_the_loop_asks(seed):
    """Draws the caller makes between calls (a combine's weights) come after the call's
    routing, as with the routing drawn in the loop by hand."""
    rng = np.random.default_rng(seed)
    drawn = round_trips.drawn_inputs(rng, CFG, lambda call: [call, 4 - call], 2)
    first = next(drawn)
    between = rng.random()
    second = next(drawn)
    by_hand = np.random.default_rng(seed)
    want_first = routing.routing(by_hand, CFG, [0, 4])
    want_between = by_hand.random()
    want_second = routing.routing(by_hand, CFG, [1, 3])
    assert between == want_between
    for got, want in ((first, want_first), (second, want_second)):
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            assert np.array_equal(a, b)
