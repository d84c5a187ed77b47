"""Trace points (``epgen.kernels.trace``, ``epgen.runtime.trace``) on the simulator: off, the
kernels are those of the goldens; on, every role of every rank's blocks is stamped, the
results still match the reference, and the stamps respect the protocol's hand-offs (the
simulator's clock is one counter for every thread, as ``%globaltimer`` is one clock for the
GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import routing
from epgen.kernels import build_module, trace
from epgen.runtime import trace as runtime_trace

from sim_world import sim_world
from test_final_layout_sim import FLAGS, SHAPES, make_cfg
from world_checks import checked_calls

POINT = {p: i for i, p in enumerate(trace.POINTS)}


def traced(cfg):
    """``cfg`` built with trace points (``tuning.trace``)."""
    return cfg.replace(tuning=cfg.tuning.replace(trace=True))


def params(cfg):
    return {k.name: [p.name for p in k.params] for k in build_module(cfg).kernels}


def test_off_declares_nothing():
    cfg = make_cfg(*SHAPES["R2-E4"])
    assert all(trace.PARAM not in names for names in params(cfg).values())


def test_on_declares_the_buffer_on_every_kernel():
    cfg = traced(make_cfg(*SHAPES["R2-E4"]))
    assert all(trace.PARAM in names for names in params(cfg).values())


def test_unknown_point_is_refused():
    import ir
    kb = ir.KernelBuilder("k", 32)
    with kb.role("copy") as r:
        with pytest.raises(ValueError, match="trace.POINTS"):
            trace.stamp(r, "copy.nowhere")


def first(stamps, point):
    return stamps[..., POINT[point], 0].astype(np.int64)


def last(stamps, point):
    return stamps[..., POINT[point], 1].astype(np.int64)


def reached(stamps, point):
    return stamps[..., POINT[point], 0] != runtime_trace.UNSTAMPED


def check_roles_stamped(world, tl, msg):
    """Every role of every kernel the call ran: each rank's blocks of it began and ended it,
    and each block's first warp began before its last warp ended."""
    kernels = {k.name: k for k in world.program.module.kernels}
    for name, s in tl.stamps.items():
        for role in kernels[name].roles:
            hit = reached(s, f"{role.name}.begin")
            assert hit.sum(axis=1).min() > 0, (msg, name, role.name)
            assert (hit == reached(s, f"{role.name}.end")).all(), (msg, role.name)
            assert (first(s, f"{role.name}.begin")[hit]
                    <= last(s, f"{role.name}.end")[hit]).all(), (msg, role.name)


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
@pytest.mark.parametrize("flags", ["staged", "ord_r"])
def test_every_role_stamped_in_protocol_order(fused, flags, graph, seed):
    cfg = traced(make_cfg(*SHAPES["R2-E4"], **FLAGS[flags]))
    rng = np.random.default_rng(seed)
    grid, last_block = cfg.n_sms, cfg.n_sms - 1
    with sim_world(cfg, seed, fused=fused) as world:
        runtime_trace.arm(world)
        # graph: the buffers exist before the capture, which may not allocate
        for call in checked_calls(world, rng, seed, cfg.max_tokens_per_rank, 2, graph):
            tl = runtime_trace.read(world)
            runtime_trace.arm(world)
            msg = f"seed {seed}, call {call}"
            assert set(tl.stamps) == ({"ep_dispatch"} if fused else
                                      {"ep_dispatch_async", "ep_dispatch_wait"}), msg
            check_roles_stamped(world, tl, msg)
            wait = tl.stamps["ep_dispatch" if fused else "ep_dispatch_wait"]
            # the aux block is the last one; it raises the flag after seeing every count
            assert reached(wait, "aux.flag_raised")[:, last_block].all(), msg
            assert (first(wait, "aux.counts_seen")[:, last_block]
                    < first(wait, "aux.flag_raised")[:, last_block]).all(), msg
            # no copy block passes the flag before its rank's aux block raised it
            seen = reached(wait, "copy.flag_seen")
            assert seen[:, :last_block].all() and not seen[:, last_block].any(), msg
            raised = first(wait, "aux.flag_raised")[:, last_block:]
            assert (first(wait, "copy.flag_seen")[:, :last_block] > raised).all(), msg
            tiles = reached(wait, "copy.tile")[:, :last_block]
            assert (first(wait, "copy.tile")[:, :last_block][tiles]
                    > first(wait, "copy.flag_seen")[:, :last_block][tiles]).all(), msg
            rows = tl.rows()
            assert rows[0][2] == 0.0 and all(r[3] >= r[2] for r in rows), msg
            assert grid == wait.shape[1]


def test_median_rows_and_table(seed):
    cfg = traced(make_cfg(*SHAPES["R2-E4"]))
    rng = np.random.default_rng(seed)
    timelines = []
    with sim_world(cfg, seed) as world:
        for _ in range(3):
            runtime_trace.arm(world)
            world.dispatch(*routing.routing(rng, cfg, cfg.max_tokens_per_rank))
            timelines.append(runtime_trace.read(world))
    rows = runtime_trace.median_rows(timelines)
    points = {(k, p) for k, p, *_ in rows}
    assert ("ep_dispatch_wait", "copy.flag_seen") in points
    assert ("ep_dispatch_async", "monitor.begin") in points
    for kernel, point, f, l, blocks in rows:
        calls = [r for tl in timelines for r in tl.rows() if r[:2] == (kernel, point)]
        assert f == sorted(c[2] for c in calls)[1] and l == sorted(c[3] for c in calls)[1]
        assert blocks == max(c[4] for c in calls)
    text = runtime_trace.format_rows(rows, "title")
    assert text.splitlines()[0] == "title" and "copy.flag_seen" in text
