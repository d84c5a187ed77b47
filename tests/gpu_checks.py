"""Checks shared by the GPU test files."""

from __future__ import annotations

import pytest

import epgen


def only_rank0_records(world, toks, ids):
    """Load every rank's inputs, run only rank 0's round trip (the others never launch), and
    return the records of the ``EPTimeoutError`` it must raise; the world keeps all its
    ranks afterwards (``check`` re-armed it)."""
    world.load_inputs(toks, ids)
    others = world.ranks[1:]
    world.ranks = world.ranks[:1]
    try:
        world.enqueue_round_trip()
        with pytest.raises(epgen.EPTimeoutError) as info:
            world.check()
    finally:
        world.ranks += others
    records = info.value.records
    assert all(r.rank == 0 for r in records), records
    return records


def kinds(records) -> set:
    """``(kernel, role, buffer)`` of each record."""
    return {(r.kernel, r.role, r.buffer) for r in records}
