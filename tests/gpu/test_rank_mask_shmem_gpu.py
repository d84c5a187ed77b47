"""Rank masks on ``ShmemWorld`` (``ep_rank_mask`` with ``shrink=True``; docs/design.md, "Rank
masks") on one GPU: one process per PE under ``epgen launch --keep-going`` (MPS when the
session started it), the last PE killed (``pe_programs.die``: SIGKILL, under MPS after the
control daemon ended its GPU work) at a chosen point of a chosen call:

- ``between``: after its previous call, before it launches anything of this one;
- ``dispatch``: right after enqueuing its dispatch kernels;
- ``combine``: after its dispatch, right after enqueuing its combine kernels.

Every other PE runs every call to its end: each dispatch and combine equals the numpy
reference with the dead PE's experts removed (``reference.mask_ranks``) once it is masked,
the full reference before its death, and either in the call it dies in (its kernels may or
may not have finished their sends before the process went); each call ends within
``BOUND_S`` (two kernel deadlines and the end-of-call barrier's three, plus the host's own
time). This file is each PE's program (``python tests/gpu/test_rank_mask_shmem_gpu.py pe
...``).

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_rank_mask_shmem_gpu.py
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from pe_programs import PES, die, launch_pe_program  # noqa: E402

#: the kernels' deadline (ns): short, so that a death costs seconds
TIMEOUT_NS = 2_000_000_000
#: a survivor's call ends within: two kernel deadlines (the waits that mask the dead PE, the
#: copy blocks' ready flag), the end-of-call barrier's bound (three deadlines, at least 5 s)
#: and 10 s of host time (a check of the results, the first call's kernel loading)
BOUND_S = 2 * TIMEOUT_NS / 1e9 + max(5.0, 3 * TIMEOUT_NS / 1e9) + 10.0
CALLS, DIES_AT = 4, 1
MODES = ("between", "dispatch", "combine")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", PES)
def test_process_group_survives_a_killed_pe(n, mode, seed, nvshmem_wheel):
    launch_pe_program(__file__, [str(seed), mode], n, "survived", keep_going=True,
                      survivors=range(n - 1))


def _config(n: int):
    from epgen.presets import config_from_dict, preset_data, with_overrides
    table = with_overrides(preset_data("small"), {
        "n_ranks": n, "n_experts": 4 * n, "p2p_world_size": n, "use_shmem": False,
        "ep_rank_mask": True, "n_sms": 8, "num_threads": 512, "timeout_ns": TIMEOUT_NS})
    table.pop("description", None)
    return config_from_dict(table)


def _expected(cfg, toks, ids, w, masked):
    """``(dispatch results, combine results)`` of every rank with ``masked`` removed."""
    from epgen import combine_run, reference
    mt, mi = reference.mask_ranks(cfg, toks, ids, masked)
    mw = [x if q not in masked else x[:0] for q, x in enumerate(w)]
    return reference.dispatch(cfg, mt, mi), combine_run.expected(cfg, mt, mi, mw)


def pe_main(seed: int, mode: str) -> int:
    """One PE's calls (module docstring); the last PE dies in call ``DIES_AT``."""
    import warnings

    from epgen import combine_run, reference, routing
    from epgen.runtime.shmem_world import ShmemWorld

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    victim = n - 1
    cfg = _config(n)
    world = ShmemWorld(cfg, rank, device=0, shrink=True)
    rng = np.random.default_rng(seed)
    for call in range(CALLS):
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        w = combine_run.router_weights(rng, cfg, ids)
        dying = rank == victim and call == DIES_AT
        if dying and mode == "between":
            die(rank, "before its call")
        if dying and mode == "dispatch":
            world.load_inputs(toks[rank], ids[rank])
            world.enqueue_round_trip()
            die(rank, "in its dispatch")
        t0 = time.monotonic()
        got = world.dispatch(toks[rank], ids[rank])
        if dying:                                        # mode "combine"
            comb = world.prepare_combine()
            comb.load([combine_run.expert_outputs(cfg, got)], [w[rank]])
            comb.enqueue()
            die(rank, "in its combine")
        out = world.combine(combine_run.expert_outputs(cfg, got), w[rank])
        took = time.monotonic() - t0
        full = (reference.dispatch(cfg, toks, ids), combine_run.expected(cfg, toks, ids, w))
        masked = _expected(cfg, toks, ids, w, {victim})
        # before the death the full reference; in its call either (the dispatch and the
        # combine each: the dead PE's sends may have finished before it went); after it the
        # masked one
        allowed = [full] if call < DIES_AT else [full, masked] if call == DIES_AT else [masked]
        ok = any(not reference.compare(cfg, d[rank], got) for d, _ in allowed) and \
            any(not combine_run.differences([out], [c[rank]]) for _, c in allowed)
        print(f"rank {rank} call {call}: {took:.1f} s, masked {world.masked_ranks}, "
              f"{'matches' if ok else 'MISMATCH'}", flush=True)
        if not ok or (call and took > BOUND_S):   # call 0 also loads the combine kernels
            print(f"rank {rank}: FAILED in call {call} (bound {BOUND_S:.0f} s)", flush=True)
            return 1
    if world.masked_ranks != [victim]:
        print(f"rank {rank}: FAILED: masked {world.masked_ranks}, not [{victim}]", flush=True)
        return 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # the session is lost: no free
        world.close()
    print(f"rank {rank}: survived", flush=True)
    sys.stdout.flush()
    os._exit(0)           # NVSHMEM stays up (a peer is gone): nothing collective at exit


if __name__ == "__main__":
    if sys.argv[1:2] != ["pe"]:
        sys.exit("usage: test_rank_mask_shmem_gpu.py pe SEED MODE")
    sys.exit(pe_main(int(sys.argv[2]), sys.argv[3]))
