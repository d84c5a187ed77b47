"""Dry run of tests/gpu/test_formats_gpu.py on the CPU: every GPU test body runs with the world
replaced by ``FakeWorld``, which answers with the reference model the way the kernels write
(output rows and scales in the device layouts, padding rows untouched, rows shuffled inside
each (expert, source) block). It checks the GPU tests themselves (their shapes, inputs, edge
cases and assertions), not the kernels; a ``broken`` fake shows they can fail."""

from __future__ import annotations

import numpy as np
import pytest

import test_formats_gpu as G
from epgen import reference
from epgen.runtime.world import EmulatedWorld


class HostArray:
    """The part of a DeviceArray the GPU tests use, on the host."""

    def __init__(self, shape, dtype):
        self.a = np.zeros(shape, dtype)

    def fill_bytes(self, value):
        self.a.view(np.uint8)[...] = value

    def to_host(self):
        return self.a.copy()


class FakeRank:
    def __init__(self, cfg):
        lay, fmt = cfg.layout, cfg.token_fmt
        self.out_tokens = HostArray((lay.max_out_rows, *fmt.out_row_shape), fmt.host_dtype)
        self.out_scales = HostArray(fmt.out_scales_shape(lay.max_out_rows),
                                    fmt.scales_host_dtype)


class FakeWorld:
    input_scale = EmulatedWorld.input_scale            # the real property (validation)
    broken = False
    fused = batched = False

    def __init__(self, cfg, arch=None, input_scale=1.0, **kw):
        self.cfg = cfg
        self.input_scale = input_scale
        self.ranks = [FakeRank(cfg) for _ in range(cfg.n_ranks)]
        self.rng = np.random.default_rng(0)

    def synchronize(self):
        pass

    def dispatch(self, tokens, topk_ids, input_scale=None):
        if input_scale is not None:
            self.input_scale = input_scale
        cfg, fmt = self.cfg, self.cfg.token_fmt
        out = []
        for res, rk in zip(reference.dispatch(cfg, tokens, topk_ids,
                                              input_scale=self.input_scale), self.ranks):
            n = res.n_rows
            dev = rk.out_scales.a
            for e, s, start, c in res.blocks():          # the kernels' slot order is free
                perm = start + self.rng.permutation(c)
                rows = np.arange(start, start + c)
                for a in (res.out_tokens, res.src_info, res.out_scales):
                    a[rows] = a[perm]
                rk.out_tokens.a[rows] = res.out_tokens[rows]
                sc = res.out_scales[rows]
                if fmt.scales_transposed:
                    dev[:, rows] = sc.T
                else:
                    dev[rows] = sc
            if self.broken and res.counts.sum():
                row = int(np.flatnonzero(res.routed_rows_mask())[0])
                rk.out_tokens.a[row, 0] ^= 1
            scales = fmt.scales_from_device(dev, n)
            out.append(reference.RankResult.from_outputs(
                cfg, res.rank, rk.out_tokens.a[:n].copy(), res.row_offsets, res.expert_ids,
                res.src_info, res.counts, out_scales=scales))
        return out


@pytest.fixture(autouse=True)
def fake_world(monkeypatch):
    import epgen.runtime.world as world_mod
    monkeypatch.setattr(G, "world_for", lambda cfg: G._worlds.setdefault(cfg, FakeWorld(cfg)))
    monkeypatch.setattr(world_mod, "EmulatedWorld", FakeWorld)
    G._worlds.clear()
    yield
    G._worlds.clear()


# every format on the small shapes, one format each on the large ones (time)
ROUTING_CASES = [(shape, fmt) for shape in (G.SMALL, G.ONE_RANK) for fmt in G.FORMATS] + \
    [(G.WIDE, "NVFP4"), (G.MANY, "BlockwiseFP8")]


@pytest.mark.parametrize("shape,fmt", ROUTING_CASES, ids=lambda v: v if isinstance(v, str)
                         else G.shape_id(v))
def test_random_routing(shape, fmt, seed):
    G.test_random_routing(shape, fmt, {}, seed)


@pytest.mark.parametrize("case", G.routing.EDGE_CASES)
@pytest.mark.parametrize("shape,fmt", [(G.SMALL, f) for f in G.FORMATS] + [(G.MANY, "MXFP8")],
                         ids=lambda v: v if isinstance(v, str) else G.shape_id(v))
def test_edge_cases(shape, case, fmt, seed):
    G.test_edge_cases(shape, case, fmt, {}, seed)


@pytest.mark.parametrize("shape,fmt", [(G.SMALL, f) for f in G.FORMATS] + [(G.WIDE, "NVFP4")],
                         ids=lambda v: v if isinstance(v, str) else G.shape_id(v))
def test_value_edge_cases(shape, fmt, seed):
    G.test_value_edge_cases(shape, fmt, seed)


@G.by_format
def test_nonfinite_inputs(fmt, seed):
    G.test_nonfinite_inputs(fmt, seed)


def test_nvfp4_input_scales(seed):
    G.test_nvfp4_input_scales(seed)


def test_fp8_padding_rows_are_never_written(seed):
    G.test_fp8_padding_rows_are_never_written(seed)


def test_back_to_back_a_few_calls(seed):
    cfg = G.make_cfg((4, 32, 256, 4, 32, 256, 9), "NVFP4")
    rng = np.random.default_rng(seed)
    for _ in range(3):
        toks, ids = G.routing.routing(rng, cfg, [5, 0, 32, 17])
        G.run_and_compare(cfg, toks, ids, seed)


@G.by_format
def test_cli_run(fmt, capsys, seed):
    G.test_cli_run(fmt, capsys, seed)


@G.by_format
def test_the_gpu_tests_can_fail(fmt, monkeypatch, seed):
    monkeypatch.setattr(FakeWorld, "broken", True)
    with pytest.raises(AssertionError, match=f"seed {seed}"):
        G.test_random_routing(G.SMALL, fmt, {}, seed)
    monkeypatch.setattr(FakeWorld, "broken", False)
    cfg = G.make_cfg(G.SMALL, fmt)
    toks, ids = G.special_routing(np.random.default_rng(seed), cfg)
    got = G.world_for(cfg).dispatch(toks, ids)
    f32 = cfg.token_fmt.scales_host_dtype == np.float32     # else uint8 codes
    for r in got:
        r.out_scales[...] = r.out_scales * 2 if f32 else r.out_scales + 1
    with pytest.raises(AssertionError, match="tolerance"):
        G.assert_within_tolerance(cfg, toks, got, seed)


def test_flag_sets_shape_adaptation():
    cfg = G.make_cfg(G.MANY, "MXFP8", skip_a2a=True)
    assert (cfg.n_ranks, cfg.n_experts, cfg.skip_a2a) == (1, 32, True)
    assert G.flags_id({}) == "plain"
    assert G.flags_id(dict(ep_ord_r=True, has_rank_flag=True)) == "ep_ord_r+has_rank_flag"
