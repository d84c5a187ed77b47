"""``P2PWorld`` on the CPU: its pure placement rules (devices, P2P groups, peer pairs, the
co-residency check, the peer-access error), and the real world on simulated GPUs
(``backends.sim``, with the placement checks of ``tests/support/sim_p2p.py``): the generated kernels
run in the IR simulator, every launch checked for placement (its stream and pointer arguments
on its GPU, every pointer-table entry in memory its GPU may access), against the numpy reference, with every flag variant the
simulator runs; the ordering between calls (cross-GPU event waits), timeouts reported from
every GPU's error buffer, and mutations of the placement that these checks must catch.

The simulator is sequentially consistent and does not run the quantising formats' cvt
instructions: memory ordering and the formats are the GPU tests' (tests/gpu/test_p2p_gpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import routing
from epgen.runtime import p2p_world as p2p_mod
from epgen.runtime.p2p_world import (PeerAccessError, assign_devices, check_peer_access,
                                     gpu_shares, peer_pairs, peers_of)
from epgen.runtime.placement import CapacityError, p2p_group, residency_problems
from epgen.runtime.rank_buffers import RankBuffers
from epgen.runtime.rank_world import RankWorld

from backends.cuda.errors import CudaUnavailableError
from backends.sim import SimHang
import format_cases
from sim_p2p import PlacementError, PlacementMachine, fake_gpus, sim_p2p_world
from world_checks import run_checked, run_only

# (R, E, H, K, max_tpr, num_threads, n_sms): tiny grids (the simulator runs every thread)
SHAPES = {"R2-E4": (2, 4, 16, 2, 4, 64, 4), "R4-E8": (4, 8, 16, 2, 3, 64, 6)}
FLAGS = {
    "staged": {},
    "final_layout": {"ep_final_layout": True},
    "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
    "fused": {"fused": True},
    "fused_shared_expert": {"fused_shared_expert": True},
}
WORLD_KWARGS = ("fused",)


def make_cfg(R, E, H, K, T, threads, sms, p2p=None, **flags):
    flags = {k: v for k, v in flags.items() if k not in WORLD_KWARGS}
    flags.setdefault("use_shmem", False)
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=p2p or R,
                          token_fmt=epgen.BF16Format(hid_dim=H, top_k=K), **flags)


def world_kwargs(flags):
    return {k: v for k, v in flags.items() if k in WORLD_KWARGS}


def random_inputs(rng, cfg, n_calls):
    return [routing.routing(rng, cfg, [int(rng.integers(0, cfg.max_tokens_per_rank + 1))
                                       for _ in range(cfg.n_ranks)]) for _ in range(n_calls)]


def run_calls(world, inputs, seed):
    """Each of ``inputs`` one checked call of ``world`` (``world_checks.run_checked``: with
    ``ep_prod_reserve``, the reference's block starts exactly)."""
    run_checked(world, inputs, seed)


# ---- pure rules ----------------------------------------------------------------------------------
def test_assign_devices_default_is_one_gpu_per_rank():
    assert assign_devices(4, None, 8) == (0, 1, 2, 3)
    assert assign_devices(1, None, 1) == (0,)


def test_assign_devices_refuses_too_few_gpus():
    with pytest.raises(ValueError, match=r"n_ranks=8 needs 8 GPUs \(one per rank\), this "
                                         r"machine has 2"):
        assign_devices(8, None, 2)
    with pytest.raises(CudaUnavailableError, match="no usable CUDA GPU"):
        assign_devices(1, None, 0)


def test_assign_devices_explicit():
    assert assign_devices(4, [3, 2, 1, 0], 4) == (3, 2, 1, 0)
    assert assign_devices(4, (0, 0, 1, 1), 2) == (0, 0, 1, 1)      # ranks may share a GPU
    assert assign_devices(2, [np.int64(1), 0], 2) == (1, 0)
    with pytest.raises(ValueError, match=r"devices\[1\] = 2 is not a GPU of this machine "
                                         r"\(ordinals 0..1\)"):
        assign_devices(2, [0, 2], 2)
    with pytest.raises(ValueError, match=r"devices\[0\] = -1"):
        assign_devices(2, [-1, 0], 2)
    with pytest.raises(ValueError, match="devices has 3 entries, one per rank is 2"):
        assign_devices(2, [0, 1, 1], 2)
    for bad in (True, "0", 1.0, None):
        with pytest.raises(ValueError, match=r"devices\[0\] = .* is not a GPU ordinal"):
            assign_devices(1, [bad], 2)


def test_p2p_groups_and_peer_pairs():
    # p2p_world_size < n_ranks (with use_shmem) is a valid EPConfig, so the group rules can
    # be checked on it
    cfg = make_cfg(4, 8, 16, 2, 3, 64, 6, p2p=2, use_shmem=True)
    assert [list(p2p_group(cfg, r)) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert peer_pairs(cfg, (0, 1, 2, 3)) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert peers_of(cfg, (0, 1, 2, 3)) == {0: [1], 1: [0], 2: [3], 3: [2]}
    full = make_cfg(4, 8, 16, 2, 3, 64, 6)
    assert [list(p2p_group(full, r)) for r in range(4)] == [[0, 1, 2, 3]] * 4
    assert len(peer_pairs(full, (0, 1, 2, 3))) == 12
    assert peers_of(full, (4, 5, 6, 7))[6] == [4, 5, 7]
    # ranks sharing a GPU need no peer access between themselves
    assert peer_pairs(full, (0, 0, 1, 1)) == [(0, 1), (1, 0)]
    assert peer_pairs(full, (0, 0, 0, 0)) == []
    assert peers_of(full, (0, 0, 0, 0)) == {0: []}


def test_peer_access_error_names_every_unreachable_pair():
    cfg = make_cfg(4, 8, 16, 2, 3, 64, 6)
    check_peer_access(cfg, (0, 1, 2, 3), lambda a, b: True)
    blocked = {(1, 2), (2, 1)}
    with pytest.raises(PeerAccessError) as info:
        check_peer_access(cfg, (0, 1, 2, 3), lambda a, b: (a, b) not in blocked)
    msg = str(info.value)
    assert "GPU 1 (rank 1) cannot access the memory of GPU 2 (rank 2)" in msg
    assert "GPU 2 (rank 2) cannot access the memory of GPU 1 (rank 1)" in msg
    assert "GPU 0" not in msg and "nvidia-smi topo -m" in msg
    with pytest.raises(PeerAccessError, match=r"GPU 0 \(ranks 0, 1\) cannot access the memory "
                                              r"of GPU 1 \(ranks 2, 3\)"):
        check_peer_access(cfg, (0, 0, 1, 1), lambda a, b: False)


def test_residency_problems():
    cfg = make_cfg(4, 8, 16, 2, 3, 64, 6)          # n_sms = 6
    per_sm = {("a", 0): 1, ("w", 0): 2, ("a", 1): 1, ("w", 1): 2}

    def bps(name, d):
        return per_sm[name, d]

    sms = {0: 6, 1: 5}.__getitem__
    # three ranks on GPU 0 (18 blocks > 6 x 1 and > 6 x 2), one on GPU 1: 6 blocks of "a"
    # do not fit 5 SMs x 1, 6 of "w" fit 5 x 2
    problems = residency_problems(cfg, gpu_shares((0, 0, 0, 1)), ("a", "w"), bps, sms)
    assert len(problems) == 3, problems
    assert problems[0].startswith("GPU 0: 3 ranks (0, 1, 2) x n_sms=6 blocks of a need 18 "
                                  "co-resident blocks, but the GPU holds 6 (1 per SM x 6 SMs")
    assert "lower n_sms to at most 2 or num_threads, or put fewer ranks on it" in problems[0]
    assert problems[1].startswith("GPU 0: 3 ranks (0, 1, 2) x n_sms=6 blocks of w need 18")
    assert problems[2].startswith("GPU 1: rank 3 x n_sms=6 blocks of a need 6 co-resident "
                                  "blocks, but the GPU holds 5")
    assert "put fewer ranks" not in problems[2]
    assert residency_problems(cfg, gpu_shares((0, 1, 2, 3)), ("w",), lambda n, d: 2,
                              lambda d: 3) == []


def test_peer_access_refused_before_any_gpu_work(monkeypatch):
    """The clear error comes from backends.cuda.can_access_peer, before a module is built or
    a byte allocated."""
    from backends import cuda
    cfg = make_cfg(*SHAPES["R4-E8"])
    calls = []
    monkeypatch.setattr(cuda, "device_count", lambda: 4)
    monkeypatch.setattr(cuda, "can_access_peer",
                        lambda a, b: calls.append((a, b)) or {a, b} != {0, 3})
    monkeypatch.setattr(cuda, "enable_peer_access", lambda a, b: pytest.fail("enabled"))
    monkeypatch.setattr(p2p_mod, "build_module", lambda cfg: pytest.fail("built"))
    with pytest.raises(PeerAccessError) as info:
        epgen.P2PWorld(cfg)
    assert "GPU 0 (rank 0) cannot access the memory of GPU 3 (rank 3)" in str(info.value)
    assert "GPU 3 (rank 3) cannot access the memory of GPU 0 (rank 0)" in str(info.value)
    assert len(calls) == 12


def test_too_few_gpus_is_refused(monkeypatch):
    from backends import cuda
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        epgen.P2PWorld(make_cfg(*SHAPES["R4-E8"]))


def test_configs_needing_shmem_are_refused_on_cuda():
    # NVSHMEM needs one process per PE: a one-process world on the cuda backend refuses
    cfg = make_cfg(4, 8, 16, 2, 3, 64, 6, p2p=2, use_shmem=True)
    for world in (epgen.P2PWorld, epgen.EmulatedWorld):
        with pytest.raises(ValueError, match="p2p_world_size=2 < n_ranks=4") as info:
            world(cfg)
        assert "one process per PE" in str(info.value) and "ShmemWorld" in str(info.value)


def test_fused_rules_are_the_emulated_worlds():
    with pytest.raises(ValueError, match="P2PWorld: fused=False with fused_shared_expert"):
        epgen.P2PWorld(make_cfg(*SHAPES["R2-E4"], fused_shared_expert=True), fused=False)
    with pytest.raises(ValueError, match="P2PWorld: fused=True with ep_final_layout"):
        epgen.P2PWorld(make_cfg(*SHAPES["R2-E4"], ep_final_layout=True), fused=True)


def test_lazy_export():
    assert epgen.P2PWorld is p2p_mod.P2PWorld
    assert "P2PWorld" in epgen.__all__
    assert issubclass(epgen.P2PWorld, RankWorld)
    assert issubclass(epgen.EmulatedWorld, RankWorld)


# ---- the world on fake GPUs ------------------------------------------------------------------
CASES = [(s, f) for s in SHAPES for f in FLAGS]


@pytest.mark.parametrize("shape,flags", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_round_trips_match_reference(shape, flags, seed):
    cfg = make_cfg(*SHAPES[shape], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed, **world_kwargs(FLAGS[flags])) as world:
        run_calls(world, random_inputs(rng, cfg, 2), seed)
        assert world.devices == tuple(range(cfg.n_ranks))
        launched = {(x.device, x.rank) for x in world.gpus.log}
        assert launched == {(r, r) for r in range(cfg.n_ranks)}   # rank r ran on GPU r


FORMAT_CASES = [(f, h, fl) for f, h in format_cases.sim_cases()
                for fl in ("staged", "final_layout", "prod_reserve")]


@pytest.mark.parametrize("fmt,H,flags", FORMAT_CASES,
                         ids=[f"{f}-{fl}" for f, _h, fl in FORMAT_CASES])
def test_formats_with_flags(fmt, H, flags, seed):
    """The quantising formats on fake GPUs: with the final layout the sender writes each
    row's scales into the destination GPU's output scales (through ``scales_ptrs``, every
    pointer on its owner's GPU); the combination failed on two H200s before that table
    existed (docs/gpu-results.md)."""
    from epgen.formats import make_format
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags]).replace(token_fmt=make_format(fmt, H, 2))
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed) as world:
        run_calls(world, random_inputs(rng, cfg, 2), seed)


@pytest.mark.parametrize("flags", ["staged", "prod_reserve"])
def test_edge_cases(flags, seed):
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    inputs = [routing.edge_case(rng, cfg, case) for case in routing.EDGE_CASES]
    with sim_p2p_world(cfg, seed) as world:
        run_calls(world, inputs, seed)


def test_one_rank(seed):
    """n_ranks=1 (the one-GPU case of the GPU tests): no peers, no peer access."""
    cfg = make_cfg(1, 4, 16, 2, 4, 64, 5)
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed) as world:
        run_calls(world, random_inputs(rng, cfg, 3), seed)
        assert world.gpus.enabled == set()
        assert [p.peers for p in world.gpus.pools] == [frozenset()]


@pytest.mark.parametrize("devices", [(0, 0, 1, 1), (1, 0, 1, 0), (2, 2, 2, 2), (3, 1, 2, 0)])
def test_explicit_placement(devices, seed):
    """Ranks placed by ``devices=`` (sharing GPUs, out of order): each launches on its GPU,
    peer access exactly between GPUs whose ranks talk, one program and error buffer per
    GPU."""
    cfg = make_cfg(*SHAPES["R4-E8"], **FLAGS["prod_reserve"])
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed, n_gpus=4, devices=list(devices)) as world:
        run_calls(world, random_inputs(rng, cfg, 2), seed)
        used = sorted(set(devices))
        assert world.device_ids == used
        assert sorted(world.programs) == used and sorted(world.errs) == used
        assert {(x.device, x.rank) for x in world.gpus.log} == set(
            (d, r) for r, d in enumerate(devices))
        assert world.gpus.enabled == {(a, b) for a in used for b in used if a != b}
        assert {p.device: sorted(p.peers) for p in world.gpus.pools} == {
            d: [e for e in used if e != d] for d in used}
        assert len({world.errs[d].ptr for d in used}) == len(used)


def test_one_module_loaded_on_every_gpu(seed):
    """One IR module built and loaded once per GPU; the simulator runs the IR, so nothing is
    lowered to PTX (lowering once per architecture is the GPU path's, with the same code)."""
    cfg = make_cfg(*SHAPES["R4-E8"])
    with sim_p2p_world(cfg, seed) as world:
        assert len({id(p.module) for p in world.programs.values()}) == 1
        assert [p.loaded.device for p in world.programs.values()] == [0, 1, 2, 3]
        assert all(p.ptx is None for p in world.programs.values())
        assert world.program is world.programs[0] and world.device == 0


def test_capacity_is_checked_per_gpu(seed, monkeypatch):
    from sim_p2p import PlacementMachine
    cfg = make_cfg(*SHAPES["R4-E8"])        # n_sms = 6 per rank; fake GPUs have 132 SMs
    monkeypatch.setattr(PlacementMachine, "blocks_per_sm", 0)
    with pytest.raises(CapacityError, match=r"P2PWorld: GPU 0: rank 0 x n_sms=6 blocks of "
                                            r"ep_dispatch_async need 6 co-resident blocks, "
                                            r"but the GPU holds 0"):
        with sim_p2p_world(cfg, seed):
            pass
    monkeypatch.setattr(PlacementMachine, "blocks_per_sm", 1)
    with sim_p2p_world(cfg, seed, n_gpus=1, devices=[0, 0, 0, 0]) as world:   # 24 <= 132
        assert world.devices == (0, 0, 0, 0)


def test_unreachable_gpus_are_refused_before_allocating(seed):
    cfg = make_cfg(*SHAPES["R4-E8"])
    with fake_gpus(4, seed, reach=lambda a, b: {a, b} != {1, 2}) as gpus:
        with pytest.raises(PeerAccessError, match=r"GPU 1 \(rank 1\) cannot access the memory "
                                                  r"of GPU 2 \(rank 2\)"):
            p2p_mod.P2PWorld(cfg, backend=gpus)
        assert gpus.allocs == [] and gpus.enabled == set()
    # placed so that GPUs 1 and 2 never talk, the same machine works
    with sim_p2p_world(cfg, seed, n_gpus=4, reach=lambda a, b: {a, b} != {1, 2},
                       devices=[0, 0, 1, 1]) as world:
        run_calls(world, random_inputs(np.random.default_rng(seed), cfg, 1), seed)


def test_next_call_waits_for_every_ranks_previous_wait(seed):
    """Cross-GPU ordering: each rank's dispatch_async of call 2 waits on the dispatch_wait of
    call 1 of every rank (its own through stream order, the others through events)."""
    for flags in ("staged", "fused"):
        cfg = make_cfg(*SHAPES["R4-E8"], **FLAGS[flags])
        rng = np.random.default_rng(seed)
        with sim_p2p_world(cfg, seed, **world_kwargs(FLAGS[flags])) as world:
            run_calls(world, random_inputs(rng, cfg, 2), seed)
            log = world.gpus.log
            first = "ep_dispatch" if flags == "fused" else "ep_dispatch_async"
            last = "ep_dispatch" if flags == "fused" else "ep_dispatch_wait"
            n = cfg.n_ranks
            call1_ends = {x.launch for x in log[:len(log) // 2] if x.kernel == last}
            assert len(call1_ends) == n
            for x in log[len(log) // 2:]:
                if x.kernel == first:
                    assert call1_ends <= set(x.deps), f"{flags}: rank {x.rank}"
                    assert len({d for d in x.deps}) >= n


def test_device_arrays_must_be_on_their_ranks_gpu(seed):
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, 2)

    class OnGpu:
        def __init__(self, array, device):
            self.array, self.device = array, device
            self.shape, self.dtype = array.shape, array.dtype
            self.__cuda_array_interface__ = {"shape": array.shape, "typestr": "<u2",
                                             "data": (1, False), "version": 3}

    with sim_p2p_world(cfg, seed) as world:
        with pytest.raises(ValueError, match=r"tokens\[1\] is in the memory of GPU 0, but rank "
                                             r"1 runs on GPU 1"):
            world.dispatch([toks[0], OnGpu(toks[1], 0)], ids)
        assert world.gpus.log == []                        # nothing launched
        run_calls(world, [(toks, ids)], seed)


# ---- timeouts: one error buffer per GPU ------------------------------------------------------
def test_missing_rank_times_out_then_recovers(seed):
    """Only rank 0 runs: its waits expire into GPU 0's buffer; the world raises with them,
    re-arms every buffer, and then works again."""
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed, max_spins=300, timeouts=True) as world:
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        world.load_inputs(toks, ids)
        err = run_only(world, {0})
        kinds = {(r.kernel, r.role, r.buffer) for r in err.records}
        assert ("ep_dispatch_wait", "aux", "recv_count") in kinds, kinds
        assert {r.rank for r in err.records} == {0}
        for d in world.device_ids:
            assert not world.errs[d].array.to_host().any(), f"GPU {d} buffer re-armed"
        world.reset()
        run_calls(world, random_inputs(rng, cfg, 2), seed)


def test_timeouts_of_several_gpus_are_reported_together(seed):
    """Ranks 0 and 1 run, 2 and 3 do not: both running ranks, on two GPUs with their own
    error buffers (the abort word of one does not reach the other), give up on their own
    deadlines; one EPTimeoutError holds the records of both GPUs."""
    cfg = make_cfg(*SHAPES["R4-E8"])
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed, max_spins=300, timeouts=True) as world:
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        world.load_inputs(toks, ids)
        err = run_only(world, {0, 1})
        assert {r.rank for r in err.records} == {0, 1}, err
        world.reset()
        run_calls(world, random_inputs(rng, cfg, 1), seed)


def test_missing_peer_without_deadline_hangs_in_the_simulator(seed):
    """Without timeouts (the simulator's stand-in for timeout_ns=0) a missing peer is a hang:
    the check above really depends on the deadlines."""
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed, max_spins=300) as world:
        world.load_inputs(*routing.routing(rng, cfg, cfg.max_tokens_per_rank))
        with pytest.raises(SimHang):
            run_only(world, {0})


# ---- what the placement checks catch -------------------------------------------------------------
def _no_pools(mp):
    real = RankBuffers.__init__

    def init(self, cuda, cfg, rank, device, peer_memory=None):
        real(self, cuda, cfg, rank, device)                      # default allocations
    mp.setattr(RankBuffers, "__init__", init)


def _tables_on_gpu0(mp):
    def table(self, i, peers, buffers):
        ptrs = [buffers[self.rank_ids.index(q)].ptr for q in peers]
        return self.cuda.to_device(np.array(ptrs, np.uint64), device=0)
    mp.setattr(RankWorld, "pointer_table", table)


MUTATIONS = {
    # every buffer from the device's default pool: peers cannot map it
    "no_peer_pools": (_no_pools, "not a peer-accessible pool"),
    # every table on GPU 0: the other ranks' kernels would read another GPU's memory
    "tables_on_gpu0": (_tables_on_gpu0, "argument recv_buf_ptrs is in the memory of GPU 0"),
    # one error buffer for all: GPU 0's, written by every GPU
    "shared_err_buf": (lambda mp: mp.setattr(p2p_mod.P2PWorld, "err_of",
                                             lambda self, rk: self.errs[0]),
                       "argument err_buf is in the memory of GPU 0"),
    # peer access never enabled
    "no_enable": (lambda mp: mp.setattr(PlacementMachine, "enable_peer_access",
                                        lambda self, a, b: False), "cannot access"),
    # every rank launched through GPU 0's program
    "one_program": (lambda mp: mp.setattr(p2p_mod.P2PWorld, "program_of",
                                          lambda self, rk: self.programs[0]),
                    "launched on a stream of GPU 1"),
}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=list(MUTATIONS))
def test_broken_placement_is_caught(mutation, monkeypatch, seed):
    apply, message = MUTATIONS[mutation]
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS["final_layout"])
    rng = np.random.default_rng(seed)
    with fake_gpus(2, seed) as gpus:
        apply(monkeypatch)
        world = p2p_mod.P2PWorld(cfg, backend=gpus)
        with pytest.raises(PlacementError, match=message):
            run_calls(world, random_inputs(rng, cfg, 1), seed)
        assert gpus.sim is not None


# ---- epgen run --world p2p -------------------------------------------------------------------
TINY_SETS = ["--set", "n_experts=4", "--set", "hid_dim=16", "--set", "top_k=2",
             "--set", "max_tokens_per_rank=4", "--set", "num_threads=64", "--set", "n_sms=4"]


def test_cli_run_p2p_on_the_simulator(capsys, seed):
    from epgen import cli
    status = cli.main(["run", "--preset", "small", *TINY_SETS, "--world", "p2p",
                       "--backend", "sim", "--calls", "2", "--seed", str(seed)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("2 ranks on GPUs 0,1 (P2P), 4 tokens/rank")
    assert out.count("matches the reference") == 2


def test_cli_run_p2p_devices(capsys, seed):
    from epgen import cli
    status = cli.main(["run", "--preset", "small", *TINY_SETS, "--world", "p2p",
                       "--backend", "sim", "--devices", "0,0", "--calls", "1",
                       "--seed", str(seed)])
    out = capsys.readouterr().out
    assert status == 0 and "2 ranks on GPUs 0,0 (P2P)" in out, out


@pytest.mark.parametrize("argv,message", [
    (["--devices", "0,1"], "argument --devices: only with --world p2p"),
    (["--world", "p2p", "--devices", "0,x"], "expected GPU ordinals like 0,1,2,3"),
    (["--world", "p2p", "--devices", "0"], "expected 2 GPU ordinals >= 0 (one per rank)"),
    (["--world", "p2p", "--devices", "0,-1"], "expected 2 GPU ordinals"),
    (["--world", "nccl"], "invalid choice: 'nccl'"),
])
def test_cli_run_world_usage_errors(argv, message, capsys):
    from epgen import cli
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--preset", "small", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_run_p2p_without_gpus_is_a_clear_error(capsys):
    from backends import cuda
    from epgen import cli
    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    status = cli.main(["run", "--preset", "small", "--world", "p2p"])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("epgen: error: P2PWorld: no usable CUDA GPU here"), err


def test_gpu_test_configurations_are_valid():
    """Every configuration tests/gpu/test_p2p_gpu.py builds is a valid EPConfig (so a GPU run
    fails only on the GPU's account)."""
    import test_p2p_gpu as G
    n_cfgs = 0
    for n in G.GPU_COUNTS:
        for shape in (G.SHAPES, G.STRESS):
            for fmt in G.FORMATS:
                for flags in G.FLAGS.values():
                    cfg = G.make_cfg(n, shape, fmt, **flags)
                    assert cfg.n_ranks == cfg.p2p_world_size == n
                    assert not cfg.needs_shmem
                    n_cfgs += 1
    assert n_cfgs == 4 * 2 * len(G.FORMATS) * len(G.FLAGS)


def test_multigpu_marker_skips_with_the_gpu_count(monkeypatch):
    """``multigpu(n)`` on a machine with fewer than n GPUs: skipped, "needs n GPUs"."""
    import conftest

    class Item:
        def __init__(self, *marks):
            self.marks, self.added = {m.name: m for m in marks}, []

        def get_closest_marker(self, name):
            return self.marks.get(name)

        def add_marker(self, mark):
            self.added.append(mark)

    gpu, multi = pytest.mark.gpu.mark, pytest.mark.multigpu
    items = [Item(gpu), Item(gpu, multi(2).mark), Item(gpu, multi(4).mark), Item(multi(8).mark)]
    monkeypatch.setattr(conftest, "_gpu_state", {"reason": None, "count": 2})
    conftest.pytest_collection_modifyitems(None, items)
    reasons = [[m.kwargs["reason"] for m in it.added] for it in items]
    assert reasons == [[], [], ["needs 4 GPUs (this machine has 2)"], []]
    monkeypatch.setattr(conftest, "_gpu_state", {"reason": "no GPU"})
    items = [Item(gpu, multi(2).mark)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [m.kwargs["reason"] for m in items[0].added] == ["gpu test: no GPU"]
