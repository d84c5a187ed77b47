"""``P2PWorld.combine`` on simulated GPUs with placement checks (``sim_p2p.PlacementMachine``:
every launch's pointer arguments on its own GPU, every table entry in memory its GPU may
reach): bit for bit against ``epgen.reference.combine`` on 2 and 4 GPUs, ranks sharing GPUs,
weights and None, a residual, back-to-back calls; the SHMEM transport between P2P groups
(4 ranks in groups of 2, the simulator's NVSHMEM model); a corrupted ``src_info`` row; the
receive buffers must come from the peer-accessible pools (a placement error otherwise); the
combine kernels' residency per GPU."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing
from epgen.presets import config_from_dict, preset_data
from epgen.runtime import combine as combine_mod
from epgen.runtime.placement import CapacityError
from epgen.runtime.program import Program

from combine_checks import corrupted_row_check, expert_outputs, weights
from sim_p2p import PlacementError, sim_p2p_world


def _cfg(R=2, P=None, **change):
    return config_from_dict({**preset_data("small"), "n_ranks": R,
                             "p2p_world_size": R if P is None else P, "n_experts": 2 * R,
                             "num_threads": 64, "n_sms": R + 2, "max_tokens_per_rank": 4,
                             "use_shmem": P is not None, **change})


def _round_trips(world, rng, seed, calls=3):
    cfg = world.cfg
    R, T = cfg.n_ranks, cfg.max_tokens_per_rank
    for call in range(calls):
        counts = [T] * R if call == 0 else [int(rng.integers(0, T + 1)) for _ in range(R)]
        toks, ids = routing.routing(rng, cfg, counts)
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        res = [rng.integers(0, 1 << 16, size=(len(i), cfg.token_fmt.hid_dim),
                            dtype=np.uint16) & np.uint16(0xBFFF) for i in ids]
        cases = [("weighted", w, None), ("unreduced", None, None), ("residual", w, res)]
        for what, wt, rr in cases:
            got = world.combine(ys, wt, residual=rr)
            want = reference.combine(cfg, results, ys, wt, residual=rr,
                                     n_tokens=[len(i) for i in ids])
            for s, (g, r) in enumerate(zip(got, want)):
                assert g.shape == r.shape and np.array_equal(g, r), \
                    f"seed {seed} call {call} {what} rank {s}: " \
                    f"{np.count_nonzero(g != r)} elements differ"


@pytest.mark.parametrize("R", [2, 4])
def test_combine_matches_the_reference(R, seed):
    with sim_p2p_world(_cfg(R), seed) as world:
        _round_trips(world, np.random.default_rng(seed), seed)
        assert set(world._combiner.programs) == set(world.device_ids)


def test_ranks_sharing_gpus(seed):
    with sim_p2p_world(_cfg(4), seed, n_gpus=2, devices=[0, 0, 1, 1]) as world:
        _round_trips(world, np.random.default_rng(seed), seed, calls=2)


def test_shmem_between_p2p_groups(seed):
    """4 ranks in P2P groups of 2: peer stores inside a group (through the pools), the
    simulator's NVSHMEM between them."""
    with sim_p2p_world(_cfg(4, P=2), seed) as world:
        _round_trips(world, np.random.default_rng(seed), seed, calls=2)


def test_a_corrupted_src_info_row_is_reported_and_writes_nothing(seed):
    with sim_p2p_world(_cfg(2), seed) as world:
        corrupted_row_check(world, np.random.default_rng(seed))


def test_receive_buffers_outside_the_pools_are_a_placement_error(seed, monkeypatch):
    """The check can fail: combine buffers in default memory are not reachable by the peer
    GPU, and the first launch is refused naming the table."""
    real = combine_mod.CombineBuffers.__init__
    monkeypatch.setattr(combine_mod.CombineBuffers, "__init__",     # default memory only
                        lambda self, cuda, cfg, rk, **memory: real(self, cuda, cfg, rk))
    cfg = _cfg(2)
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        results = world.dispatch(toks, ids)
        with pytest.raises(PlacementError, match="combine_buf_ptrs"):
            world.combine(expert_outputs(rng, cfg, results), None)


def test_combine_residency_is_checked_per_gpu(seed, monkeypatch):
    cfg = _cfg(2)
    with sim_p2p_world(cfg, seed, n_gpus=1, devices=[0, 0]) as world:
        monkeypatch.setattr(Program, "blocks_per_sm", lambda self, name, shmem=0: 0)
        with pytest.raises(CapacityError, match="P2PWorld.combine: GPU 0: 2 ranks"):
            world.combiner()


def test_a_missing_combine_async_times_out_on_every_gpu_then_recovers(seed, monkeypatch):
    """Rank 1's ep_combine_async never runs: both ranks' ep_combine_wait give up on their own
    GPU's deadline (word 1 never arrives), one EPTimeoutError holds the records of both
    GPUs' error buffers, and after it the world works again."""
    from epgen.errors import EPTimeoutError
    from epgen.kernels.combine_async import KERNEL_NAME as C_ASYNC

    cfg = _cfg(2)
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed, max_spins=300, timeouts=True) as world:
        _round_trips(world, rng, seed, calls=1)             # builds the combiner
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        results = world.dispatch(toks, ids)
        real = combine_mod.Combiner.program_of

        class Skip:
            def __init__(self, program, rank):
                self.program, self.rank = program, rank

            def launch(self, name, *a, **kw):
                if not (name == C_ASYNC and self.rank == 1):
                    self.program.launch(name, *a, **kw)
        monkeypatch.setattr(combine_mod.Combiner, "program_of",
                            lambda self, rk: Skip(real(self, rk), rk.rank))
        with pytest.raises(EPTimeoutError) as err:
            world.combine(expert_outputs(rng, cfg, results), None)
        recs = err.value.records
        assert {r.rank for r in recs} == {0, 1}, recs
        assert {r.kernel for r in recs} == {"ep_combine_wait"}, recs
        for d in world.device_ids:
            assert not world.errs[d].array.to_host().any(), f"GPU {d} buffer re-armed"
        monkeypatch.setattr(combine_mod.Combiner, "program_of", real)
        _round_trips(world, rng, seed, calls=1)
