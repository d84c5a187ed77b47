"""The link-byte model (``epgen.bench.link_bytes``) against what the kernels write, measured by
the simulator's traffic counter (``Machine.count_traffic``, backends/sim/traffic.py): an
``EmulatedWorld`` on the simulator, each rank owning its stream and its buffers, one
dispatch and one combine of a seeded routing with ``-1`` slots; the bytes each rank's
threads write (peer stores) or put (NVSHMEM) into another rank's payload buffers equal the
model's link bytes exactly, and the signals of the puts its signal bytes, on 2 and 4 ranks,
BF16 and quantising formats, both layouts, the P2P and the SHMEM transport, ``skip_a2a`` (nothing crosses), and under
the weak memory model. The same for ``ep_rank_dedup`` (``link_bytes(dedup=True)``: its
message area and index table, on the warp path, the block-staged broadcast and the
send-buffer path, P2P, all-SHMEM and mixed groups, routings with ``-1`` slots and several of
a token's experts on one rank) and for the FP8 combine (``fp8=True``, ``link_bytes(fp8=True)``:
the FP8 receive buffer). Then the counter's own rules: off by default, reset, owners by GPU."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from backends import sim as sim_backend
from backends.sim.memory import DeviceArray, SimError
from epgen import routing
from epgen.bench import link_bytes as lb
from epgen.formats import make_format
from epgen.runtime.world import EmulatedWorld

import test_rank_dedup_shmem_sim as dedup_shmem
import test_rank_dedup_sim as dedup_p2p
from combine_checks import expert_outputs, weights

DISPATCH_PAYLOAD = {"staged": ("recv_buf",), "final": ("out_tokens", "out_scales", "hdr_buf")}
"""The buffers a dispatch's messages land in, by layout (the rest are count words)."""
COMBINE_PAYLOAD = ("combine.recv", "combine.fp8_recv")
DATA = ("store", "put")
SIGNALS = ("put_signal",)


def make_cfg(R=2, fmt="BF16", H=256, P=None, prefill=False, **flags):
    """A tiny configuration; ``prefill``: one that takes the block-staged broadcast (every
    block at least one token)."""
    flags.setdefault("use_shmem", False)
    if prefill:
        flags["tuning"] = epgen.Tuning(block_broadcast_min_tokens_per_block=1)
    return epgen.EPConfig(num_threads=64, n_sms=R + 2, n_experts=2 * R, n_ranks=R,
                          max_tokens_per_rank=R + 2 if prefill else 4, p2p_world_size=P or R,
                          token_fmt=make_format(fmt, H, 2), **flags)


def own_buffers(world, i: int) -> dict:
    """Rank ``i``'s device buffers by name: its dispatch buffers, its combine buffers
    (``combine.<name>``) and, once made, its FP8 combine receive buffer
    (``combine.fp8_recv``)."""
    def arrays(obj, prefix=""):
        return {prefix + k: v for k, v in vars(obj).items()
                if isinstance(v, DeviceArray) and not k.startswith("_")}
    combiner = world.combiner()
    fp8 = {} if combiner.fp8_side is None else {"combine.fp8_recv": combiner.fp8_side.recv[i]}
    return {**arrays(world.ranks[i]), **arrays(combiner.bufs[i], "combine."), **fp8}


def counted_world(cfg, seed, memory="sc", fp8=False):
    """An ``EmulatedWorld`` of ``cfg`` on the simulator (``memory``: its memory model),
    counting traffic with each rank the owner of its stream and buffers (``fp8``: the FP8
    combine's buffers made first, so that they are counted too)."""
    world = EmulatedWorld(cfg, backend=sim_backend.Machine(seed, memory=memory))
    machine = world.cuda
    if fp8:
        world.combiner().prepare_fp8()
    machine.count_traffic()
    for i, rk in enumerate(world.ranks):
        machine.assign_traffic_owner(i, streams=[rk.stream], buffers=own_buffers(world, i))
    return world, machine


CASES = {
    "R2-bf16": dict(R=2),
    "R4-bf16": dict(R=4),
    "R2-mxfp8": dict(R=2, fmt="MXFP8", H=256),
    "R4-blockwise_fp8": dict(R=4, fmt="BlockwiseFP8", H=384),
    "R2-final-bf16": dict(R=2, ep_final_layout=True),
    "R4-final-nvfp4": dict(R=4, fmt="NVFP4", H=256, ep_final_layout=True),
    "R2-final-blockwise_fp8": dict(R=2, fmt="BlockwiseFP8", H=384, ep_final_layout=True),
    "R2-final-mxfp4": dict(R=2, fmt="MXFP4", H=256, ep_final_layout=True),
    "R4-blockwise_fp8-block_broadcast": dict(R=4, fmt="BlockwiseFP8", H=384, prefill=True),
    "R2-skip_a2a": dict(R=2, skip_a2a=True),
    "R2-bf16-weak_memory": dict(R=2, memory="weak"),
    "R2-shmem": dict(R=2, P=1, use_shmem=True),
    "R4-shmem-mixed-mxfp8": dict(R=4, P=2, use_shmem=True, fmt="MXFP8", H=256),
}


def check_call(cfg, world, machine, rng, toks, ids, where, *, dedup=False, fp8=False):
    """One dispatch and one combine of ``(toks, ids)``: the bytes the simulator counted
    equal ``link_bytes(cfg, ids, dedup=dedup, fp8=fp8)``, field by field."""
    layout = "final" if cfg.ep_final_layout else "staged"
    want = lb.link_bytes(cfg, ids, dedup=dedup, fp8=fp8)
    machine.link_traffic(reset=True)
    results = world.dispatch(toks, ids)
    got = machine.link_traffic(reset=True)
    assert got.total(kinds=DATA, buffers=DISPATCH_PAYLOAD[layout]) == want.dispatch_link, where
    assert got.total(kinds=SIGNALS, buffers=("recv_count",)) == want.dispatch_signal, where
    if layout == "staged":
        assert got.total(kinds=DATA, buffers=("recv_buf",), remote=False) == \
            want.dispatch_local, where
    ys = expert_outputs(rng, cfg, results)
    world.combine(ys, weights(rng, cfg, ids), fp8=fp8)
    got = machine.link_traffic(reset=True)
    assert got.total(kinds=DATA, buffers=COMBINE_PAYLOAD) == want.combine_link, where
    assert got.total(kinds=SIGNALS, buffers=("combine.arrival",)) == want.combine_signal, where
    assert got.total(kinds=DATA, buffers=COMBINE_PAYLOAD, remote=False) == \
        want.combine_local, where


@pytest.mark.parametrize("case", list(CASES))
def test_counted_link_bytes_equal_the_model(case, seed):
    case_args = dict(CASES[case])
    memory = case_args.pop("memory", "sc")
    cfg = make_cfg(**case_args)
    rng = np.random.default_rng(seed)
    world, machine = counted_world(cfg, seed, memory)
    for call in range(2):
        toks, ids = routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank, fraction=0.25) \
            if call else routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        check_call(cfg, world, machine, rng, toks, ids, f"{case} seed {seed} call {call}")


DEDUP_CASES = {
    # P2P: the three send paths (test_rank_dedup_sim.make_cfg forces and checks each)
    "R2-bf16-warp": dict(R=2, path="warp"),
    "R4-bf16-warp_split": dict(R=4, path="warp_split"),
    "R2-nvfp4-warp_split": dict(R=2, fmt="NVFP4", H=256, path="warp_split"),
    "R4-mxfp8-block": dict(R=4, fmt="MXFP8", H=256, path="block"),
    "R2-bf16-block": dict(R=2, path="block"),
    "R2-blockwise_fp8-buffer": dict(R=2, fmt="BlockwiseFP8", H=384, path="buffer"),
    "R4-bf16-buffer": dict(R=4, path="buffer"),
    # SHMEM (the send-buffer path's puts): every peer remote, and mixed groups
    "R2-shmem-bf16": dict(R=2, P=1, shmem=True),
    "R4-shmem-mixed-mxfp8": dict(R=4, P=2, fmt="MXFP8", H=256, shmem=True),
    "R4-shmem-mixed-nvfp4": dict(R=4, P=2, fmt="NVFP4", H=256, shmem=True),
}
"""``ep_rank_dedup`` configurations: top-3 over ranks of 3 experts, so that a token can have
one, two or three slots on a rank."""


def dedup_cfg(R, fmt="BF16", H=64, path="warp_split", P=None, shmem=False):
    if shmem:
        return dedup_shmem.make_cfg(fmt, H, R=R, P=P, K=3, L=3, T=6)
    return dedup_p2p.make_cfg(fmt, H, R=R, K=3, L=3, T=16 if path == "warp" else 6,
                              path=path)


@pytest.mark.parametrize("case", list(DEDUP_CASES))
def test_counted_dedup_link_bytes_equal_the_model(case, seed):
    """Two calls: a uniform routing with ``-1`` slots, then the edge routings (all of a
    token's experts on one rank, several on each of two ranks, only ``-1``)."""
    cfg = dedup_cfg(**DEDUP_CASES[case])
    rng = np.random.default_rng(seed)
    world, machine = counted_world(cfg, seed)
    calls = [routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank, fraction=0.25),
             dedup_p2p._edge_calls(cfg, seed, n_calls=1)[0]]
    for call, (toks, ids) in enumerate(calls):
        check_call(cfg, world, machine, rng, toks, ids, f"{case} seed {seed} call {call}",
                   dedup=True)


FP8_CASES = {
    "R2-bf16": dict(R=2),
    "R4-mxfp8": dict(R=4, fmt="MXFP8"),
    "R2-final-bf16": dict(R=2, ep_final_layout=True),
    "R2-shmem": dict(R=2, P=1, use_shmem=True),
    "R4-shmem-mixed": dict(R=4, P=2, use_shmem=True),
}
"""FP8 combine configurations (``hid_dim`` a multiple of 128: 256 and 640, whose scales
are not a whole 16-byte vector)."""


@pytest.mark.parametrize("H", [256, 640])
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_counted_fp8_combine_link_bytes_equal_the_model(case, H, seed):
    cfg = make_cfg(H=H, **FP8_CASES[case])
    rng = np.random.default_rng(seed)
    world, machine = counted_world(cfg, seed, fp8=True)
    for call in range(2):
        toks, ids = routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank, fraction=0.25) \
            if call else routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        check_call(cfg, world, machine, rng, toks, ids, f"{case} H={H} seed {seed} call {call}",
                   fp8=True)


def test_counted_dedup_and_fp8_link_bytes_equal_the_model(seed):
    """The deduplicated dispatch and the FP8 combine in one world (mixed groups)."""
    cfg = dedup_shmem.make_cfg("BF16", 256, R=4, P=2, K=3, L=3, T=6)
    rng = np.random.default_rng(seed)
    world, machine = counted_world(cfg, seed, fp8=True)
    for call, (toks, ids) in enumerate(dedup_p2p._edge_calls(cfg, seed, n_calls=2)):
        check_call(cfg, world, machine, rng, toks, ids, f"seed {seed} call {call}", dedup=True,
                   fp8=True)


def test_the_counter_is_off_by_default_and_says_so():
    machine = sim_backend.Machine(0)
    assert machine.sim.traffic is None
    with pytest.raises(SimError, match="link_traffic: the traffic counter is off"):
        machine.link_traffic()
    with pytest.raises(SimError, match="assign_traffic_owner: the traffic counter is off"):
        machine.assign_traffic_owner(0, streams=[machine.create_stream(0)])


def test_owners_default_to_gpus_and_reset_zeroes(seed):
    """Without assigned owners a write's source is its stream's GPU and its destination the
    allocation's GPU: a P2P world's peer stores cross GPUs."""
    cfg = make_cfg(R=2)
    rng = np.random.default_rng(seed)
    world = epgen.P2PWorld(cfg, backend="sim", sim_seed=seed)
    machine = world.cuda
    machine.count_traffic()
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    world.dispatch(toks, ids)
    got = machine.link_traffic(reset=True)
    want = lb.link_bytes(cfg, ids)
    assert got.total(kinds=("store",), remote=True) >= want.dispatch_link > 0
    assert set(got.by_pair(kinds=("store",), remote=True)) <= {(0, 1), (1, 0)}
    assert machine.link_traffic().records == {}
    machine.count_traffic(on=False)
    assert machine.sim.traffic is None
