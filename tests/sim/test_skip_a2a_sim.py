"""``skip_a2a`` with the reference's parameters (``n_ranks = R``, ``n_experts = E`` global,
``L = E // R`` experts per device) on the CPU simulator: ``EmulatedWorld(cfg, devices=D)``
runs ``D`` independent devices, device ``d`` (``my_rank = d``) keeping its tokens routed to
experts ``[L * d, L * d + L)``; dispatch equals ``reference.dispatch`` and the combine
``reference.combine``, bit for bit, over the staged, ORD-R, fused and shared-expert builds,
``p2p_world_size`` 1 and ``R``, a quantising format, and fewer devices than ranks."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from epgen.runtime.world import EmulatedWorld

from combine_checks import check_round_trips, round_trip_inputs


def _cfg(R=3, P=None, fmt="BF16", H=64, K=2, **flags):
    """A tiny reference-form skip_a2a grid: 64 threads x 5 blocks, 2 experts per device."""
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=2 * R, n_ranks=R,
                          max_tokens_per_rank=4, p2p_world_size=R if P is None else P,
                          use_shmem=False, token_fmt=make_format(fmt, H, K), skip_a2a=True,
                          **flags)


def _inputs(rng, cfg, devices, n_calls=2):
    """Per call one input per device, ids over all ``E`` global experts (those of a device
    that is not running are dropped), the first call full."""
    out = []
    for call in range(n_calls):
        counts = [cfg.max_tokens_per_rank if call == 0 else
                  int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(devices)]
        toks = [routing.random_tokens(rng, c, cfg.token_fmt.hid_dim) for c in counts]
        ids = [routing.random_topk(rng, c, cfg.n_experts, cfg.token_fmt.top_k)
               for c in counts]
        out.append((toks, ids))
    return out


def _check_dispatch(world, inputs, seed, what):
    cfg = world.cfg
    for call, (toks, ids) in enumerate(inputs):
        got = world.dispatch(toks, ids)
        want = reference.dispatch(cfg, toks, ids, input_scale=world.input_scale)
        for d, (x, g) in enumerate(zip(want, got)):
            diffs = reference.compare(cfg, x, g)
            assert not diffs, f"seed {seed} {what} call {call} device {d}: {diffs}"
            # the device's own source sits at rank coordinate 0; the others are empty
            assert not np.asarray(g.counts)[:, 1:].any(), (seed, what, call, d)


FLAGS = {"staged": {}, "ord_r": {"ep_ord_r": True, "has_rank_flag": True},
         "fused": {"fused": True}, "fused_se": {"fused_shared_expert": True}}


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("P", [1, None], ids=["P1", "PR"])
def test_dispatch_and_combine_match_the_reference(flags, P, seed):
    rng = np.random.default_rng(seed)
    f = dict(FLAGS[flags])
    fused = f.pop("fused", None)
    cfg = _cfg(P=P, **f)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=cfg.n_ranks, fused=fused)
    _check_dispatch(world, _inputs(rng, cfg, cfg.n_ranks), seed, flags)
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2, devices=cfg.n_ranks),
                      f"skip_a2a R={cfg.n_ranks} {flags}")


def test_quantising_format(seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(R=2, fmt="NVFP4", H=64)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=2)
    _check_dispatch(world, _inputs(rng, cfg, 2), seed, "NVFP4")


def test_fewer_devices_than_ranks(seed):
    """Two devices of R = 4: my_rank picks each one's slice; the tokens routed to the
    experts of ranks 2 and 3 stay nowhere."""
    rng = np.random.default_rng(seed)
    cfg = _cfg(R=4, K=3)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=2)
    inputs = _inputs(rng, cfg, 2)
    _check_dispatch(world, inputs, seed, "2 of 4")
    toks, ids = inputs[0]
    got = world.dispatch(toks, ids)
    for d, res in enumerate(got):
        L = cfg.layout.n_local_experts
        assert int(np.asarray(res.counts).sum()) == int(((ids[d] >= d * L)
                                                         & (ids[d] < d * L + L)).sum())



def test_one_gpu_per_device(seed):
    """``P2PWorld``: the R devices of the global form on R simulated GPUs (rank ``r`` is
    device ``r``; no peer access needed, every table holds the device's own buffers)."""
    from epgen.runtime.p2p_world import P2PWorld
    rng = np.random.default_rng(seed)
    cfg = _cfg(R=3)
    world = P2PWorld(cfg, backend="sim", sim_seed=seed)
    _check_dispatch(world, _inputs(rng, cfg, 3), seed, "P2PWorld")
    check_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2, devices=3), "P2PWorld")


def test_p2p_world_size_changes_nothing():
    """The kernels of the global form are the same for every ``p2p_world_size``: under
    skip_a2a every pointer table is read at entry 0 and every P2P coordinate is 0."""
    from epgen.goldens import print_ir
    from epgen.kernels import build_combine_module, build_module
    texts = {P: (print_ir(build_module(_cfg(R=4, P=P))),
                 print_ir(build_combine_module(_cfg(R=4, P=P)))) for P in (1, 2, 4)}
    assert texts[1] == texts[2] == texts[4]
