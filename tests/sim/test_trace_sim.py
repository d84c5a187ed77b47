"""Trace rings (``epgen.kernels.trace``, ``epgen.runtime.trace``, ``trace_export``) on the
simulator: off (``NullTrace``), the kernels are those of the goldens; on, every role of every
rank's blocks records its events, the results still match the reference, the events respect
the protocol's hand-offs (the simulator's clock is one counter for every thread, as
``%globaltimer`` is one clock for the GPU), every L1 release is an event, and the Chrome
trace-event export passes its schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ir
from epgen import cli, presets, reference, routing
from epgen.kernels import build_combine_module, build_module, trace
from epgen.kernels import dispatch_wait
from epgen.kernels.staged_copy import L1Release
from epgen.runtime import trace as runtime_trace
from epgen.runtime import trace_export
from epgen.runtime.world import EmulatedWorld

from combine_checks import combine_matches
from sim_world import launch_wait_with_l1, sim_world
from test_final_layout_sim import FLAGS, SHAPES, make_cfg
from world_checks import checked_calls

POINT = {p: i for i, p in enumerate(trace.EVENTS)}


def traced(cfg, **tuning):
    """``cfg`` built with trace rings (``tuning.trace``)."""
    return cfg.replace(tuning=cfg.tuning.replace(trace=True, **tuning))


def params(module):
    return {k.name: [p.name for p in k.params] for k in module.kernels}


def test_off_declares_nothing():
    cfg = make_cfg(*SHAPES["R2-E4"])
    for module in (build_module(cfg), build_combine_module(cfg)):
        assert all(trace.PARAM not in names for names in params(module).values())


def test_on_declares_the_buffer_on_every_kernel():
    cfg = traced(make_cfg(*SHAPES["R2-E4"]))
    for module in (build_module(cfg), build_combine_module(cfg)):
        assert all(trace.PARAM in names for names in params(module).values())


def _copy_trace(**args):
    """A ``trace.CopyTrace`` of the reference's ``trace_*`` arguments."""
    return trace.CopyTrace(**{"buf" if k == "trace_buf" else k.removeprefix("trace_"): v
                              for k, v in args.items()})


def _copy_kernel(cfg, **trace_args):
    """dispatch_wait as ``build_dispatch_wait`` makes it, with the ``CopyTrace`` of
    ``trace_args`` given to the copy role."""
    kb = ir.KernelBuilder(dispatch_wait.KERNEL_NAME, cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last)) as r:
        dispatch_wait.copy_received_tokens_to_output(r, cfg, p,
                                                     copy_trace=_copy_trace(**trace_args))
    with kb.role("aux", blocks=(last, None)) as r:
        dispatch_wait.wait_for_arrivals_and_compute_offsets(r, cfg, p)
    return kb.build()


def test_null_trace_builds_the_golden_kernel():
    """``NullTrace`` with every other trace argument set: the IR printed is that of the
    plain build (which the goldens pin), so the PTX is byte-identical."""
    cfg = presets.load_preset("small")
    plain = ir.print_kernel(dispatch_wait.build_dispatch_wait(cfg))
    null = _copy_kernel(cfg, trace_buf=trace.NullTrace(), trace_scatter_release=True,
                        trace_rings_per_cta=4, trace_ring_capacity=64, trace_comm_ring_id=3,
                        trace_ring_base=7)
    assert ir.print_kernel(null) == plain
    assert ir.print_kernel(_copy_kernel(cfg)) == plain


def test_null_trace_ptx_is_the_golden():
    """The small preset's dispatch module with dispatch_wait's copy role given ``NullTrace``
    and every other trace argument: byte for byte the PTX golden ``ep/small``."""
    from backends.nvptx import emit_ptx
    from epgen.kernels import build_dispatch_async, build_dispatch_fused
    from golden_util import golden_path, normalize
    from test_golden import ARCH
    cfg = presets.load_preset("small")
    null = _copy_kernel(cfg, trace_buf=trace.NullTrace(), trace_scatter_release=True,
                        trace_rings_per_cta=2, trace_ring_capacity=16, trace_comm_ring_id=1,
                        trace_ring_base=3)
    module = ir.Module("ep_dispatch", (build_dispatch_async(cfg), null,
                                       build_dispatch_fused(cfg)))
    assert normalize(emit_ptx(module, arch=ARCH)) == golden_path("ep/small", "ptx").read_text()


def test_ptx_of_the_traced_combine(capsys):
    """``epgen ptx --op combine --trace --ir``: every combine kernel takes ``trace_buf``."""
    assert cli.main(["ptx", "--preset", "small", "--op", "combine", "--trace", "--ir"]) == 0
    text = capsys.readouterr().out
    assert text.count(f"param ${trace.PARAM}:") == 3


def test_trace_buf_argument_stamps_the_copy_role():
    cfg = presets.load_preset("small")
    kb = ir.KernelBuilder("k", cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    sink = trace.TraceBuf(kb.param(trace.PARAM, ir.types.ptr_global), p.my_rank)
    with kb.role("copy") as r:
        dispatch_wait.copy_received_tokens_to_output(
            r, cfg, p, copy_trace=trace.CopyTrace(sink, ring_capacity=8, rings_per_cta=3,
                                                  comm_ring_id=2, ring_base=p.my_rank * 27))
    text = ir.print_kernel(kb.build())
    # ring my_rank * 27 + ctaid * 3 + 2 of 32 + 8 * 32 bytes
    assert "add(mul($my_rank, 27:u32), add(mul(@ctaid.x, 3:u32), 2:u32))" in text, text
    assert "288:u64" in text and "globaltimer" in text


@pytest.mark.parametrize("change,match", [
    ({"trace_rings_per_cta": 0}, "trace_rings_per_cta must be a positive integer"),
    ({"trace_ring_capacity": True}, "trace_ring_capacity must be a positive integer"),
    ({"trace_ring_capacity": 2**31}, "trace_ring_capacity must be below 2"),
    ({"trace_rings_per_cta": 2, "trace_comm_ring_id": 2},
     r"trace_comm_ring_id must be in \[0, trace_rings_per_cta=2\)"),
    ({"trace_ring_base": -1}, "trace_ring_base must be an integer >= 0"),
    ({"trace_buf": object()}, "trace_buf must be a trace.TraceBuf or trace.NullTrace"),
    ({"trace_scatter_release": 1}, "trace_scatter_release must be a bool"),
])
def test_bad_trace_arguments_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        _copy_kernel(presets.load_preset("small"), **change)


def test_unknown_event_is_refused():
    kb = ir.KernelBuilder("k", 32)
    with kb.role("copy") as r:
        with pytest.raises(ValueError, match="trace.EVENTS"):
            trace.stamp(r, "copy.nowhere")
        with pytest.raises(ValueError, match="trace.EVENTS"):
            trace.NullTrace().stamp(r, "copy.nowhere")


def test_tuning_fields_are_validated():
    from epgen.tuning import TuningError, parse_tune
    t = parse_tune(["trace=true", "trace_ring_capacity=64", "trace_rings_per_cta=2",
                    "trace_scatter_release=false"])
    assert (t.trace_ring_capacity, t.trace_rings_per_cta, t.trace_scatter_release) == \
        (64, 2, False)
    with pytest.raises(TuningError, match="tuning.trace_ring_capacity: must be a positive"):
        parse_tune(["trace_ring_capacity=0"])


def first(stamps, point):
    return stamps[..., POINT[point], 0].astype(np.int64)


def last(stamps, point):
    return stamps[..., POINT[point], 1].astype(np.int64)


def reached(stamps, point):
    return stamps[..., POINT[point], 0] != runtime_trace.UNSTAMPED


def check_events(world, tl, msg):
    """Each event's fields: its rank and block in range, its warp one of its role's, its
    index a known event; and no ring dropped any."""
    cfg = world.cfg
    for kernel, ev in tl.events.items():
        assert tl.dropped[kernel] == 0, (msg, kernel)
        assert (ev["rank"] < cfg.n_ranks).all() and (ev["block"] < cfg.n_sms).all(), msg
        assert (ev["event"] < len(trace.EVENTS)).all(), msg
        assert (ev["warp"] < cfg.num_threads // 32).all(), msg
        assert (ev["t"] > 0).all(), msg


def check_roles_stamped(world, tl, msg, kernels=None):
    """Every role of every kernel the call ran: each rank's blocks of it began and ended it,
    and each block's first warp began before its last warp ended."""
    kernels = kernels or {k.name: k for k in world.program.module.kernels}
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
            assert set(tl.events) == ({"ep_dispatch"} if fused else
                                      {"ep_dispatch_async", "ep_dispatch_wait"}), msg
            check_events(world, tl, msg)
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


def test_tile_events_name_every_claimed_tile(seed):
    """``copy.tile``'s payloads, over every block of a rank: each of its experts' tiles
    claimed exactly once (``expert << 32 | tile``)."""
    cfg = traced(make_cfg(*SHAPES["R4-E8"]))
    rng = np.random.default_rng(seed)
    L, TT = cfg.layout.n_local_experts, cfg.token_fmt.dispatch_wait_tile_shape[0]
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        runtime_trace.arm(world)
        world.dispatch(toks, ids)
        ev = runtime_trace.read(world).events["ep_dispatch_wait"]
        want = reference.dispatch(cfg, toks, ids)
        tiles = ev[ev["event"] == POINT["copy.tile"]]
        for r in range(cfg.n_ranks):
            mine = tiles[tiles["rank"] == r]["payload"]
            got = sorted((int(p) >> 32, int(p) & 0xFFFFFFFF) for p in mine)
            counts = want[r].counts.sum(axis=1)
            expect = sorted((e, t) for e in range(L) for t in range(-(-int(counts[e]) // TT)))
            assert got == expect, f"seed {seed}, rank {r}"


def test_rings_drop_past_their_capacity(seed):
    """A ring of 2 events keeps 2 per block (every warp of a block records more) and counts
    the rest as dropped."""
    cfg = traced(make_cfg(*SHAPES["R2-E4"]), trace_ring_capacity=2)
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        runtime_trace.arm(world)
        world.dispatch(*routing.routing(rng, cfg, cfg.max_tokens_per_rank))
        tl = runtime_trace.read(world)
    for kernel, ev in tl.events.items():
        blocks, per_block = np.unique(ev[["rank", "block"]], return_counts=True)
        assert len(blocks) == cfg.n_ranks * cfg.n_sms and (per_block == 2).all(), kernel
        assert tl.dropped[kernel] > 0, kernel


def test_combine_phases_are_stamped(seed):
    cfg = traced(presets.load_preset("small"))
    rng = np.random.default_rng(seed)
    for fused in (False, True):
        world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=fused)
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        runtime_trace.arm(world)
        results = world.dispatch(toks, ids)
        combine_matches(world, rng, seed, 0, results, ids)
        tl = runtime_trace.read(world)
        msg = f"seed {seed}, fused={fused}"
        check_events(world, tl, msg)
        kernels = {k.name: k for k in world.program.module.kernels}
        kernels.update({k.name: k for k in world.combiner().program.module.kernels})
        check_roles_stamped(world, tl, msg, kernels)
        name = "ep_combine" if fused else "ep_combine_wait"
        s = tl.stamps[name]
        assert reached(s, "reduce.arrivals_seen").all(), msg
        # source q's blocks see every arrival only after every destination raised q's word
        ev = tl.events["ep_combine" if fused else "ep_combine_async"]
        raised = ev[ev["event"] == POINT["send.arrival_raised"]]
        for q in range(cfg.n_ranks):
            to_q = raised[raised["payload"] == q]
            assert sorted(to_q["rank"].tolist()) == list(range(cfg.n_ranks)), (msg, q)
            assert first(s, "reduce.arrivals_seen")[q].min() > int(to_q["t"].max()), (msg, q)
        dispatch_end = max(int(ev["t"].max()) for k, ev in tl.events.items()
                           if k.startswith("ep_dispatch"))
        assert first(s, "reduce.begin").min() > dispatch_end or fused, msg


def _l1_release_kernel(cfg, token_block: int):
    """dispatch_wait with L1 releases (``L1Release``, one u32 counter per expert) and
    the kernel's trace arguments: the copy role of a fused consumer, without the consumer,
    on ring 1 of each block (the aux role on ring 0)."""
    kb = ir.KernelBuilder(dispatch_wait.KERNEL_NAME, cfg.num_threads)
    p = dispatch_wait.declare_params(kb, cfg)
    trace.instrument(kb, cfg, p.my_rank, role_rings={"copy": 1})
    l1 = kb.param("l1_arrival_ptr", ir.types.ptr_global)
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    with kb.role("copy", blocks=(0, last)) as r:
        dispatch_wait.copy_received_tokens_to_output(
            r, cfg, p, l1_release=L1Release(l1, token_block=token_block),
            copy_trace=trace.copy_trace(kb))
    with kb.role("aux", blocks=(last, None)) as r:
        dispatch_wait.wait_for_arrivals_and_compute_offsets(r, cfg, p)
    return kb.build()


@pytest.mark.parametrize("release", [True, False], ids=["stamped", "not_stamped"])
def test_every_l1_release_is_an_event(release, seed):
    """L1 releases in place of dispatch_wait: one ``copy.l1_release`` event per release
    (``expert << 32 | token block``), naming each expert's token blocks once, each after the
    claim of its tile by its block, and the counters as many; with ``trace_scatter_release``
    off, none."""
    from epgen.runtime.program import Program
    tb = 4
    cfg = traced(make_cfg(2, 4, 16, 2, 20, 64, 4), trace_rings_per_cta=2,
                 trace_scatter_release=release)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    kernel = _l1_release_kernel(cfg, tb)
    L = cfg.layout.n_local_experts
    with sim_world(cfg, seed, fused=False) as world:
        prog = Program(ir.Module("l1", (kernel,)), device=world.device, backend=world.cuda)
        world.load_inputs(toks, ids)
        runtime_trace.arm(world)
        world.dispatch_async()
        counters = launch_wait_with_l1(world, prog, kernel, L)
        results = world.results()
        tl = runtime_trace.read(world)
    want = reference.dispatch(cfg, toks, ids)
    reference.assert_match(cfg, want, results)
    ev = tl.events[kernel.name]
    check_events(world, tl, f"seed {seed}")
    rel = ev[ev["event"] == POINT["copy.l1_release"]]
    # ring 1 of a copy block holds the copy role's events, ring 0 is empty
    rings = world.ranks[0].trace_bufs[kernel.name].to_host().view(runtime_trace.EVENT_DTYPE)
    rings = rings.reshape(cfg.n_sms, 2, -1)
    assert (rings["t"][:cfg.n_sms - 1, 0, 0] == 0).all()
    assert (rings["t"][:cfg.n_sms - 1, 1, 0] > 0).all() and (rings["t"][-1, 0, 0] > 0)
    if not release:
        assert rel.size == 0
        return
    tiles = ev[ev["event"] == POINT["copy.tile"]]
    TT = cfg.token_fmt.dispatch_wait_tile_shape[0]
    for r in range(cfg.n_ranks):
        counts = want[r].counts.sum(axis=1)
        blocks = -(-counts.astype(np.int64) // tb)
        np.testing.assert_array_equal(counters[r].to_host(), blocks, err_msg=f"seed {seed}")
        mine = rel[rel["rank"] == r]
        got = sorted((int(p) >> 32, int(p) & 0xFFFFFFFF) for p in mine["payload"])
        assert got == sorted((e, b) for e in range(L) for b in range(blocks[e])), \
            f"seed {seed}, rank {r}"
        for e_ in mine:
            e, b = int(e_["payload"]) >> 32, int(e_["payload"]) & 0xFFFFFFFF
            tile = (b * tb) // TT
            claim = tiles[(tiles["rank"] == r) & (tiles["block"] == e_["block"])
                          & (tiles["payload"] == (e << 32 | tile))]
            assert claim.size == 1 and int(claim["t"][0]) < int(e_["t"]), \
                f"seed {seed}, rank {r}, expert {e}, token block {b}"


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


# -- the Chrome trace-event export ---------------------------------------------------------

def check_chrome_trace(doc, timelines):
    """``doc`` passes ``trace_export.validate`` and has exactly one track per (rank, kernel,
    role, block) of the timelines' events, each with its role's spans, one per call."""
    assert trace_export.validate(doc) == []
    events = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    want = {(int(e["rank"]) + 1, f"{k} {trace.EVENTS[e['event']].split('.')[0]} block "
             f"{int(e['block'])}") for tl in timelines for k, ev in tl.events.items()
            for e in ev}
    assert {(pid, name) for (pid, _), name in names.items()} == want
    assert len(names) == len(want)
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {pid: f"rank {pid - 1}" for pid, _ in want}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(want) * len(timelines)
    for e in spans:
        assert names[(e["pid"], e["tid"])].split()[1] == e["name"]


def test_export_passes_its_schema(seed):
    cfg = traced(make_cfg(*SHAPES["R2-E4"]))
    rng = np.random.default_rng(seed)
    timelines = []
    with sim_world(cfg, seed) as world:
        for _ in range(2):
            runtime_trace.arm(world)
            world.dispatch(*routing.routing(rng, cfg, cfg.max_tokens_per_rank))
            timelines.append(runtime_trace.read(world))
    doc = trace_export.chrome_trace(timelines)
    check_chrome_trace(doc, timelines)
    tile = next(e for e in doc["traceEvents"] if e["name"] == "copy.tile")
    assert tile["args"]["payload"] == tile["args"]["expert"] << 32 | tile["args"]["tile"]


@pytest.mark.parametrize("breakage,words", [
    (lambda d: d.pop("traceEvents"), "traceEvents"),
    (lambda d: d["traceEvents"][-1].update(ph="B"), "ph 'B'"),
    (lambda d: d["traceEvents"][-1].update(ts=-1.0), "ts -1.0"),
    (lambda d: d["traceEvents"][-1].update(pid="1"), "pid and tid must be integers"),
    (lambda d: d["traceEvents"][-1].update(tid=12345), "has no thread_name"),
    (lambda d: d["traceEvents"].append({**d["traceEvents"][-1], "ts": 0.0}), "before the"),
    (lambda d: [e.update(dur=None) for e in d["traceEvents"] if e["ph"] == "X"], "dur"),
    (lambda d: [e["args"].update(name="rank 0") for e in d["traceEvents"]
                if e["name"] == "thread_name"], "two tracks named"),
    (lambda d: [d["traceEvents"].remove(e) for e in list(d["traceEvents"])
                if e["name"] == "process_name"], "has no process_name"),
])
def test_schema_check_catches_broken_documents(breakage, words):
    cfg = traced(make_cfg(*SHAPES["R2-E4"]))
    with sim_world(cfg, 1) as world:
        runtime_trace.arm(world)
        world.dispatch(*routing.routing(np.random.default_rng(1), cfg, 2))
        doc = trace_export.chrome_trace([runtime_trace.read(world)])
    assert trace_export.validate(doc) == []
    breakage(doc)
    assert any(words in p for p in trace_export.validate(doc)), trace_export.validate(doc)


def test_epgen_run_trace_writes_a_perfetto_file(tmp_path, capsys):
    """``epgen run --backend sim --trace FILE.json`` (with the combine): the text timeline
    and a file that passes the schema, a track per rank, role and block of both the
    dispatch and the combine kernels."""
    path = tmp_path / "run.json"
    assert cli.main(["run", "--preset", "small", "--backend", "sim", "--calls", "2",
                     "--seed", "4", "--combine", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("combine: matches the reference") == 2
    table = out[out.index("trace events, median of 2 calls"):].splitlines()[2:-1]
    assert {"copy.flag_seen", "aux.flag_raised", "reduce.arrivals_seen"} <= \
        {line.split()[1] for line in table}
    assert f"trace: 2 calls written to {path}" in out
    doc = json.loads(path.read_text())
    assert trace_export.validate(doc) == []
    assert doc["otherData"]["calls"] == 2 and doc["otherData"]["dropped_events"] == 0
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    cfg = presets.load_preset("small")
    for kernel, role, blocks in (("ep_dispatch_wait", "aux", [cfg.n_sms - 1]),
                                 ("ep_dispatch_wait", "copy", range(cfg.n_sms - 1)),
                                 ("ep_combine_wait", "reduce", range(cfg.n_sms))):
        assert {f"{kernel} {role} block {b}" for b in blocks} <= tracks
    pids = {e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert pids == {1, 2}


def test_epgen_run_trace_without_a_file_prints_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--preset", "small", "--backend", "sim", "--calls", "1",
                     "--seed", "2", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "trace events, median of 1 calls" in out and "written to" not in out
    assert list(tmp_path.iterdir()) == []


def test_traced_kernels_assemble_and_keep_their_ordering():
    """The traced dispatch, combine and fused-roles kernels: the PTX checker finds every
    ordered operation and ptxas assembles them (sm_90)."""
    from backends.nvptx import assemble, check_ptx, emit_ptx, find_ptxas
    from epgen.kernels.fused_roles import build_fused_roles
    cfg = traced(presets.load_preset("small"), trace_rings_per_cta=2)
    for m in (build_module(cfg), build_combine_module(cfg),
              ir.Module("ep_fused_roles", (build_fused_roles(cfg),))):
        ptx = emit_ptx(m, "sm_90")
        check_ptx(m, ptx)
        assert "atom.relaxed.gpu.global.add.u32" in ptx
        if find_ptxas() is not None:
            assemble(ptx, "sm_90")


@pytest.mark.parametrize("world", [["--world", "p2p"], ["--batched"], ["--fused", "--graph"]],
                         ids=["p2p", "batched", "fused_graph"])
def test_epgen_run_trace_in_every_world(world, tmp_path, capsys):
    """Ranks on their own (simulated) GPUs, every rank in one launch (each rank's own block
    numbers), the fused kernel replayed from a graph: one track per rank, role and block."""
    path = tmp_path / "w.json"
    assert cli.main(["run", "--preset", "small", "--backend", "sim", "--calls", "2",
                     "--seed", "6", *world, "--trace", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert trace_export.validate(doc) == []
    cfg = presets.load_preset("small")
    wait = "ep_dispatch" if "--fused" in world else "ep_dispatch_wait"
    for pid in (1, 2):
        tracks = {e["args"]["name"] for e in doc["traceEvents"]
                  if e["name"] == "thread_name" and e["pid"] == pid}
        assert {f"{wait} copy block {b}" for b in range(cfg.n_sms - 1)} <= tracks
        assert f"{wait} aux block {cfg.n_sms - 1}" in tracks
        assert all(int(t.rsplit(" ", 1)[1]) < cfg.n_sms for t in tracks)
