"""Rank-batched launches (``ir.RankBatch``, ``EmulatedWorld(batched=True)``) without a GPU:
the lowering (one by-value table, ``ld.param`` at the rank row, the rank-local
``%ctaid.x``/``%nctaid.x``), its limits, the IR text, the host table, and every variant's
round trips on the simulator against the reference, on streams and as graph replays."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest

import ir
from backends.nvptx import LoweringError, assemble, emit_ptx
from epgen import reference, routing
from epgen.kernels import build_module, trace
from epgen.presets import load_preset
from epgen.runtime import rank_table
from epgen.runtime import trace as runtime_trace
from ir import types as T

from sim_world import sim_world
from test_final_layout_sim import FLAGS, SHAPES, make_cfg


def batched_decode(ranks=8):
    cfg = load_preset("decode")
    return cfg, ir.batch_ranks(build_module(cfg), ranks, cfg.n_sms)


def entry(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


def test_lowering_reads_every_parameter_from_the_rank_row():
    cfg, m = batched_decode()
    ptx = emit_ptx(m, arch="sm_90")
    for k in m.kernels:
        body = entry(ptx, k.name)
        n = len(k.params)
        params = re.findall(r"\.param [^\n]*", body.split(")")[0])
        assert params == [f".param .align 8 .b8 {k.name}_param_0[{8 * n * 8}]"], params
        # every parameter load is from the table at a register address, never a named slot
        assert "mov.b64" in body and f"{k.name}_param_0;" in body
        assert not re.search(rf"ld\.param[^\n]*\[{k.name}_param_\d+", body)
        assert re.search(r"ld\.param\.b(32|64)\s+%r\w*, \[%rd\d+(\+\d+)?\]", body)
        # the rank is ctaid / n_sms, the rank-local block ctaid % n_sms; no local copy
        assert ".local" not in body
        assert "%nctaid.x" not in body
    plain = emit_ptx(build_module(cfg), arch="sm_90")
    assert "%nctaid.x" in plain       # the unbatched kernels do read it


def test_batched_module_assembles(ptxas):
    _, m = batched_decode()
    report = assemble(emit_ptx(m, arch="sm_90"), arch="sm_90", ptxas=ptxas)
    assert report.kernels


@pytest.mark.parametrize("ranks,fits", [(8, True), (64, False)])
def test_table_limit(ranks, fits):
    cfg, m = batched_decode(ranks)
    if fits:
        emit_ptx(m, arch="sm_90")
        return
    with pytest.raises(LoweringError, match=r"rank table takes \d+ bytes .* at most 4096"):
        emit_ptx(m, arch="sm_90")


def test_vector_parameter_is_refused():
    kb = ir.KernelBuilder("k", 32)
    v = kb.param("v", T.vec(T.u32, 4))
    out = kb.param("out", T.ptr_global)
    with kb.role("r") as r:
        r.store(out, v)
    m = ir.batch_ranks(ir.Module("m", (kb.build(),)), 2, 1)
    with pytest.raises(LoweringError, match="parameter v .* does not fit"):
        emit_ptx(m, arch="sm_90")


@pytest.mark.parametrize("ranks,blocks", [(0, 4), (2, 0), (True, 4), (2, 1.5)])
def test_batch_ranks_rejects(ranks, blocks):
    with pytest.raises(ValueError, match="batch_ranks: (ranks|blocks) must be a positive int"):
        ir.batch_ranks(ir.Module("m", ()), ranks, blocks)


def test_ir_text_round_trip():
    _, m = batched_decode()
    text = ir.print_module(m)
    assert "batch_ranks=8 batch_blocks=33" in text
    assert ir.parse_module(text) == m
    with pytest.raises(ir.ParseError, match="batch_ranks and batch_blocks come together"):
        ir.parse_module(text.replace(" batch_blocks=33", "", 1))


def test_table_pack_unpack(seed):
    rng = np.random.default_rng(seed)
    _, m = batched_decode(4)
    k = m.kernel("ep_dispatch")
    rows = []
    for _ in range(4):
        row = {}
        for p in k.params:
            if isinstance(p.dtype, T.PtrType):
                row[p.name] = int(rng.integers(0, 2**48))
            elif p.dtype.kind == "f":
                row[p.name] = float(np.float32(rng.uniform(0.1, 4)))
            else:
                row[p.name] = int(rng.integers(0, 2**p.dtype.bits, dtype=np.uint64))
        rows.append(row)
    table = rank_table.pack(k, rows, lambda p, v: v)
    assert table.dtype == np.uint64 and table.size == 4 * len(k.params)
    assert rank_table.unpack(k, table) == rows, f"seed {seed}"
    with pytest.raises(TypeError, match="rank row 1: missing arguments \\['my_rank'\\]"):
        rank_table.pack(k, [rows[0], {n: v for n, v in rows[1].items() if n != "my_rank"},
                            *rows[2:]], lambda p, v: v)
    with pytest.raises(ValueError, match="rank table of 3 rows, needs 4 rows"):
        rank_table.pack(k, rows[:3], lambda p, v: v)


VARIANTS = [("staged", False), ("staged", True), ("ord_r", False), ("ord_r", True),
            ("final_layout", False), ("prod_reserve", False)]


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
@pytest.mark.parametrize("flags,fused", VARIANTS,
                         ids=[f"{f}{'-fused' if u else ''}" for f, u in VARIANTS])
def test_batched_world_matches_the_reference(flags, fused, graph, seed):
    cfg = make_cfg(*SHAPES["R2-E4"], **FLAGS[flags])
    rng = np.random.default_rng(seed)
    replay = None
    with sim_world(cfg, seed, fused=fused, batched=True) as world:
        assert world.batched and all(k.rank_batch == ir.RankBatch(cfg.n_ranks, cfg.n_sms)
                                     for k in world.program.module.kernels)
        for call in range(3):
            if call != 1:      # a graph replays call 0's token counts in call 1
                counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1))
                          for _ in range(cfg.n_ranks)]
            toks, ids = routing.routing(rng, cfg, counts)
            launches = len(world.program.loaded.launched)
            if graph:                   # call 2 has new token counts: capture again
                replay, got = world.dispatch_replayed(toks, ids, None if call == 2 else replay)
            else:
                got = world.dispatch(toks, ids)
                # one launch per kernel for all ranks
                assert len(world.program.loaded.launched) - launches == (1 if fused else 2)
            try:
                reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, call {call}: {exc}") from None


def test_batched_world_traces_every_rank(seed):
    cfg = make_cfg(*SHAPES["R2-E4"])
    cfg = cfg.replace(tuning=cfg.tuning.replace(trace=True))
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed, batched=True) as world:
        runtime_trace.arm(world)
        world.dispatch(*routing.routing(rng, cfg, cfg.max_tokens_per_rank))
        tl = runtime_trace.read(world)
    wait = tl.stamps["ep_dispatch_wait"]
    seen = wait[..., trace.EVENTS.index("copy.flag_seen"), 0] != runtime_trace.UNSTAMPED
    # each rank's copy blocks stamped their own rank's rows: the table gave each its my_rank
    assert seen[:, :cfg.n_sms - 1].all() and not seen[:, cfg.n_sms - 1].any(), f"seed {seed}"


def test_unbatched_module_unchanged():
    cfg = load_preset("decode")
    m = build_module(cfg)
    assert all(k.rank_batch is None for k in m.kernels)
    assert attrs.evolve(ir.batch_ranks(m, 8, 33).kernels[0], rank_batch=None) == m.kernels[0]


@pytest.mark.parametrize("flags", ["skip_a2a", "fused_se", "final_layout"])
def test_batched_formats_and_flags(flags, seed):
    """A quantising format (an f32 parameter in the table: NVFP4's input scale), one-device
    ``skip_a2a`` (a table of one row), the shared expert's fused kernel, the final layout."""
    from test_formats_sim import FLAGS as FORMAT_FLAGS
    from test_formats_sim import make_cfg as format_cfg
    from test_formats_sim import run_calls
    cfg = format_cfg("NVFP4", 256, **FORMAT_FLAGS[flags])
    fused = True if flags == "fused_se" else None
    run_calls(cfg, seed, n_calls=2, input_scale=0.75, batched=True, fused=fused)
