"""Helpers shared by the world tests (GPU test files and the simulator tests), and the
check that a command-line import stays light."""

from __future__ import annotations

import os

import pytest

import epgen
from epgen import round_trips


def make_cfg(R, E, H, K, T, threads, sms, fmt: str = "BF16", **flags):
    """A configuration: R ranks (one P2P group), E experts, hidden H, top-k K, T tokens per
    rank at most, ``threads`` per block, ``sms`` blocks per rank, token format ``fmt``."""
    from epgen.formats import make_format
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format(fmt, H, K), **flags)


def checked_calls(world, rng, seed, counts, calls: int, graph: bool):
    """``calls`` round trips of ``world`` with fresh inputs of ``counts`` tokens per rank
    (an int or a list, or a callable giving one per call), each as a stream call or, with
    ``graph``, a replay of one captured graph (``dispatch_replayed``), checked by
    ``epgen.round_trips.checked_calls`` (the failure names the seed and the call). Yields
    ``call`` after each check."""
    inputs = round_trips.drawn_inputs(rng, world.cfg, counts, calls)
    for checked in round_trips.checked_calls(world, inputs, seed=seed, replayed=graph):
        yield checked.index


def run_checked(world, inputs, seed) -> None:
    """Every ``(tokens, topk_ids)`` of ``inputs`` as one checked call of ``world``
    (``epgen.round_trips.checked_calls``); with ``ep_prod_reserve`` the block starts must
    also equal the reference's (the standard layout exactly)."""
    checks = {"block_starts": same_block_starts} if world.cfg.ep_prod_reserve else None
    for _ in round_trips.checked_calls(world, inputs, seed=seed, checks=checks):
        pass


def same_block_starts(checked) -> list[str]:
    """The ranks whose ``block_starts`` differ from the reference's."""
    return [f"rank {want.rank} block_starts differ"
            for want, got in zip(checked.expected, checked.results)
            if not (got.block_starts == want.block_starts).all()]


_worlds = {}


def world_for(cfg):
    """One ``EmulatedWorld`` per configuration for the whole test session."""
    if cfg not in _worlds:
        _worlds[cfg] = epgen.EmulatedWorld(cfg)
    return _worlds[cfg]


def run_only(world, ranks):
    """Run one round trip of only the ranks in ``ranks`` (the others never launch) and return
    the ``EPTimeoutError`` it must raise; the world keeps all its ranks afterwards (``check``
    re-armed it)."""
    everyone = world.ranks
    world.ranks = [rk for rk in everyone if rk.rank in ranks]
    try:
        world.enqueue_round_trip()
        with pytest.raises(epgen.EPTimeoutError) as info:
            world.check()
    finally:
        world.ranks = everyone
    return info.value


def only_rank0_records(world, toks, ids):
    """Load every rank's inputs, run only rank 0, and return the timeout records (each from
    rank 0)."""
    world.load_inputs(toks, ids)
    records = run_only(world, {0}).records
    assert all(r.rank == 0 for r in records), records
    return records


def kinds(records) -> set:
    """``(kernel, role, buffer)`` of each record."""
    return {(r.kernel, r.role, r.buffer) for r in records}


def assert_imports_light(code: str, repo: str) -> None:
    """Run ``code`` in a fresh interpreter (``PYTHONPATH=repo``); it must print the sorted
    list of heavy modules it loaded, and that list must be empty."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", code + "; print(sorted(x for x in ('torch', "
                          "'cupy', 'matplotlib', 'cuda.core', 'backends.cuda') "
                          "if x in sys.modules))"], capture_output=True, text=True, cwd=repo,
                         env={**os.environ, "PYTHONPATH": repo}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"

