"""Checked round trips: calls on a world, each compared with ``epgen.reference``.

The one loop behind ``epgen run`` (every world, ``--graph``, ``--combine``, one process per
rank under ``--world shmem``) and the tests' round trips::

    inputs = drawn_inputs(rng, world.cfg, tokens_per_rank, calls=3)
    for checked in checked_calls(world, inputs, seed=seed):
        print(f"call {checked.index}: {checked.rows} rows")

Each call runs ``call(tokens, topk_ids)`` (``world.dispatch`` unless told otherwise, or a
replay of one captured graph with ``replayed=True``), compares its results with
``reference.dispatch`` of the same inputs, then runs the caller's extra ``checks`` (a combine,
an exact layout) on a matching call. The first call that differs raises ``MismatchError``,
naming the seed and the call; the loop yields every call that matched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs

from . import reference, routing


@attrs.define
class CheckedCall:
    """One call of ``checked_calls``: its index, inputs (every rank's), the world's results
    and the reference's for the compared ranks, the seconds ``call`` took on the host, and
    the differences found (``dispatch``: from ``reference.compare``; ``checks``: each extra
    check's, by name, run only when the dispatch matched)."""

    index: int
    tokens: list
    topk_ids: list
    results: list
    expected: list
    seconds: float
    dispatch: list[str]
    checks: dict[str, list[str]] = attrs.field(factory=dict)

    @property
    def rows(self) -> int:
        """The rows the compared ranks received."""
        return sum(int(r.row_offsets[-1]) for r in self.results)

    @property
    def matches(self) -> bool:
        """No difference from the reference, in the dispatch or any extra check."""
        return not self.dispatch and not any(self.checks.values())

    def differences(self) -> list[str]:
        """Every difference, the dispatch's first, then each failing check's under its name."""
        return self.dispatch + [f"{name}: {d}" for name, diffs in self.checks.items()
                                for d in diffs]


class MismatchError(AssertionError):
    """A call's results differ from the reference; ``checked`` is that call. The message
    names the seed, the call and the first differences."""

    def __init__(self, checked: CheckedCall, seed, limit: int = 10):
        self.checked = checked
        self.seed = seed
        failed = (["dispatch"] if checked.dispatch else []) + \
            [name for name, diffs in checked.checks.items() if diffs]
        super().__init__(f"seed {seed}, call {checked.index}: differs from the reference "
                         f"({', '.join(failed)})"
                         + "".join(f"\n  {d}" for d in checked.differences()[:limit]))


def drawn_inputs(rng, cfg, counts, calls: int, weights=None) -> Iterator[tuple[list, list]]:
    """``calls`` inputs ``(tokens, topk_ids)`` of every rank drawn from ``rng``
    (``routing.routing``), each when the loop asks for it, so draws made between calls (a
    combine's router weights) keep their order. ``counts``: tokens per rank, an int or one
    per rank, or a function of the call index giving either; ``weights``: the expert
    popularity (``routing.zipf_weights``; None: uniform)."""
    for index in range(calls):
        yield routing.routing(rng, cfg, counts(index) if callable(counts) else counts,
                              weights)


def checked_calls(world, inputs: Iterable[tuple[Sequence, Sequence]], *, seed,
                  call: Callable[[list, list], list] | None = None, replayed: bool = False,
                  ranks: Sequence[int] | None = None,
                  checks: Mapping[str, Callable[[CheckedCall], list[str]]] | None = None,
                  limit: int = 10) -> Iterator[CheckedCall]:
    """Run one call of ``world`` per ``(tokens, topk_ids)`` of ``inputs`` (every rank's),
    compare it with ``reference.dispatch`` (the input scale the world has after the call),
    and yield a ``CheckedCall`` for each call that matched; raise ``MismatchError`` at the
    first that did not (``seed`` names it).

    ``call(tokens, topk_ids)`` returns the results of the compared ranks (default
    ``world.dispatch``); ``replayed``: instead, a replay of one graph captured on the first
    call (``world.dispatch_replayed``; the graph keeps the first call's token counts).
    ``ranks``: the ranks compared, in the order ``call`` returns them (default every rank).
    ``checks``: ``name -> check(checked)`` returning differences, run after a dispatch that
    matched. ``limit``: differences kept per comparison."""
    if call is not None and replayed:
        raise ValueError("checked_calls: call and replayed=True are exclusive")
    cfg = world.cfg
    if replayed:
        call = _replaying(world)
    elif call is None:
        call = world.dispatch
    for index, (tokens, topk_ids) in enumerate(inputs):
        start = time.perf_counter()
        results = list(call(tokens, topk_ids))
        seconds = time.perf_counter() - start
        expected = reference.dispatch(cfg, tokens, topk_ids, input_scale=world.input_scale)
        if ranks is not None:
            expected = [expected[r] for r in ranks]
        if len(results) != len(expected):
            dispatch = [f"{len(results)} results, expected {len(expected)}"]
        else:
            dispatch = [d for want, got in zip(expected, results)
                        for d in reference.compare(cfg, want, got, limit=limit)]
        checked = CheckedCall(index, tokens, topk_ids, results, expected, seconds, dispatch)
        if not dispatch:
            for name, check in (checks or {}).items():
                checked.checks[name] = list(check(checked))
        if not checked.matches:
            raise MismatchError(checked, seed, limit)
        yield checked


def _replaying(world) -> Callable[[list, list], list]:
    """``world.dispatch_replayed`` as a call: captures on the first call, replays after."""
    graph = None

    def replay(tokens, topk_ids):
        nonlocal graph
        graph, results = world.dispatch_replayed(tokens, topk_ids, graph)
        return results
    return replay
