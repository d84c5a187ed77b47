"""The quantising token formats (every registered one: tests/support/format_cases.py) through
EmulatedWorld against the
numpy reference: bit-exact on the quantized bytes, the scales, row_offsets (padded for FP8) and
src_info, on random routings, the routing edge cases, value edge cases (zeros, one large value,
negatives, values at the clamp, ties, bf16 extremes, NaN/inf), NVFP4 input scales and
back-to-back calls; and the dequantised output within each format's tolerance of the input.

``FLAG_SETS``: EPConfig flags every routing test also runs with: none, ``skip_a2a`` (make_cfg
turns the shape into one device), ORD-R completion, and the fused shared expert (the world then
runs the fused single-launch kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from format_cases import QUANT as FORMATS

pytestmark = pytest.mark.gpu

FLAG_SETS = [{}, dict(skip_a2a=True), dict(ep_ord_r=True, has_rank_flag=True),
             dict(fused_shared_expert=True)]

# (R, E, H, K, max_tpr, num_threads, n_sms per rank); H a multiple of 128 (BlockwiseFP8)
SMALL = (2, 16, 256, 4, 32, 256, 9)
WIDE = (4, 64, 7168, 8, 32, 512, 17)
MANY = (8, 256, 2048, 8, 64, 512, 33)
ONE_RANK = (1, 8, 128, 2, 16, 128, 9)
SHAPES = [SMALL, WIDE, MANY, ONE_RANK]


def shape_id(c):
    return "R{}-E{}-H{}-K{}-T{}-thr{}-sm{}".format(*c)


def flags_id(flags):
    return "+".join(k for k, v in sorted(flags.items()) if v) or "plain"


by_format = pytest.mark.parametrize("fmt", FORMATS)
by_flags = pytest.mark.parametrize("flags", FLAG_SETS, ids=flags_id)


def make_cfg(shape, fmt, **flags):
    R, E, H, K, T, threads, sms = shape
    if flags.get("skip_a2a"):          # the reference's per-device instantiation
        R, E = 1, E // R
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format(fmt, H, K), **flags)


_worlds = {}


def world_for(cfg):
    if cfg not in _worlds:
        _worlds[cfg] = epgen.EmulatedWorld(cfg)
    return _worlds[cfg]


def run_and_compare(cfg, toks, ids, seed, input_scale=1.0):
    world = world_for(cfg)
    got = world.dispatch(toks, ids, input_scale=input_scale)
    want = reference.dispatch(cfg, toks, ids, input_scale=input_scale)
    try:
        reference.assert_match(cfg, want, got)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}, {cfg.token_fmt.name}, input_scale {input_scale}: "
                             f"{exc}") from None
    return got


def assert_within_tolerance(cfg, toks, results, seed, input_scale=1.0):
    """Every routed output row, dequantised, is within the format's stated tolerance of its
    source token (``fmt.error_bound``)."""
    fmt = cfg.token_fmt
    for res in results:
        blocks = [(s, start, c) for _e, s, start, c in res.blocks() if c]
        if not blocks:
            continue
        rows = np.concatenate([np.arange(start, start + c) for _s, start, c in blocks])
        src = np.concatenate([np.full(c, s) for s, _start, c in blocks])
        x = fmt.to_f32(np.stack([toks[s][t] for s, t in zip(src, res.src_info[rows, 0])]))
        deq = fmt.dequantize(res.out_tokens[rows], res.out_scales[rows], input_scale)
        bound = fmt.error_bound(x, input_scale) * (1 + 2.0 ** -16)
        err = np.abs(deq - x.astype(np.float64))
        bad = np.argwhere(err > bound)
        assert not bad.size, (f"seed {seed}: rank {res.rank} row {rows[bad[0][0]]} (source "
                              f"{src[bad[0][0]]}): error {err[tuple(bad[0])]} beyond the "
                              f"tolerance {bound[tuple(bad[0])]}")


def bf16_bits(x) -> np.ndarray:
    import ml_dtypes
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


# ---- routings --------------------------------------------------------------------------------
@by_flags
@by_format
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_random_routing(shape, fmt, flags, seed):
    cfg = make_cfg(shape, fmt, **flags)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        toks, ids = routing.routing(rng, cfg, counts)
        got = run_and_compare(cfg, toks, ids, seed)
    assert_within_tolerance(cfg, toks, got, seed)


@by_flags
@by_format
@pytest.mark.parametrize("case", routing.EDGE_CASES)
@pytest.mark.parametrize("shape", [SMALL, MANY], ids=["R2-E16", "R8-E256"])
def test_edge_cases(shape, case, fmt, flags, seed):
    cfg = make_cfg(shape, fmt, **flags)
    rng = np.random.default_rng(seed)
    toks, ids = routing.edge_case(rng, cfg, case)
    run_and_compare(cfg, toks, ids, seed)


@by_format
def test_back_to_back_200_calls(fmt, seed):
    cfg = make_cfg((4, 32, 256, 4, 32, 256, 9), fmt)
    rng = np.random.default_rng(seed)
    for call in range(200):
        counts = [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
        toks, ids = routing.routing(rng, cfg, counts)
        try:
            run_and_compare(cfg, toks, ids, seed)
        except AssertionError as exc:
            raise AssertionError(f"call {call}: {exc}") from None


# ---- values ----------------------------------------------------------------------------------
def special_tokens(rng, T, H, nonfinite=False) -> np.ndarray:
    """``[T, H]`` bf16 bits: random rows at magnitudes 2^-30 .. 2^30, and rows of zeros, one
    large value per group, negatives, the clamp value, e2m1/e4m3 ties, bf16 extremes, maxima
    at a power of two and saturating under the OCP rule."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-30, 31, size=(T, 1)).astype(np.float32)
    specials = [
        np.zeros(H),
        np.where(np.arange(H) % 16 == 3, 1000.0, 0.001),        # a single large value / group
        -np.abs(x[2]),                                          # all negative
        np.full(H, 448.0), np.full(H, -448.0),                  # at the e4m3 clamp
        np.resize([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.0, -0.0], H),
        np.resize([448.0, 1.0625, 1.1875, 2.0 ** -9, 2.0 ** -10, 432.0], H),   # e4m3 ties
        np.full(H, 2.0 ** -133), np.full(H, 3.3895314e38),      # smallest / largest bf16
        np.resize([3.3895314e38, -2.0 ** -133, 1e-30, -7.0], H),
        np.resize([4.0, -2.0, 1.0, 3.0, 0.5, -4.0, 2.0 ** -20], H),   # amax a power of two
        np.resize([7.5, -7.0, 6.5, 1.0, -0.0], H),              # MXFP4: x / 2^X in (6, 8)
    ]
    if nonfinite:
        specials += [np.resize([np.nan, 1.0, -2.0, 0.5], H), np.resize([np.inf, -1.0, 3.0], H),
                     np.resize([-np.inf, np.nan, 0.0, 5.0], H)]
    for i, row in enumerate(specials[:T]):
        x[i] = row
    return bf16_bits(x)


def special_routing(rng, cfg, nonfinite=False):
    T = cfg.max_tokens_per_rank
    toks = [special_tokens(rng, T, cfg.token_fmt.hid_dim, nonfinite) for _ in range(cfg.n_ranks)]
    ids = [routing.random_topk(rng, T, cfg.n_experts, cfg.token_fmt.top_k)
           for _ in range(cfg.n_ranks)]
    return toks, ids


@by_format
@pytest.mark.parametrize("shape", [SMALL, WIDE], ids=["H256", "H7168"])
def test_value_edge_cases(shape, fmt, seed):
    cfg = make_cfg(shape, fmt)
    rng = np.random.default_rng(seed)
    toks, ids = special_routing(rng, cfg)
    got = run_and_compare(cfg, toks, ids, seed)
    assert_within_tolerance(cfg, toks, got, seed)


@by_format
def test_nonfinite_inputs(fmt, seed):
    """NaN/inf elements: the documented policy (docs/formats.md), bit-exact with the
    reference."""
    cfg = make_cfg(SMALL, fmt)
    rng = np.random.default_rng(seed)
    toks, ids = special_routing(rng, cfg, nonfinite=True)
    run_and_compare(cfg, toks, ids, seed)


def test_nvfp4_input_scales(seed):
    cfg = make_cfg(WIDE, "NVFP4")
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank // 2)
    amax = max(float(np.abs(cfg.token_fmt.to_f32(t)).max()) for t in toks)
    for g in (1.0, 0.37, 448.0 * 6 / amax, 3000.0):     # 3000 saturates most group scales
        got = run_and_compare(cfg, toks, ids, seed, input_scale=g)
        assert_within_tolerance(cfg, toks, got, seed, input_scale=g)
    assert world_for(cfg).input_scale == np.float32(3000.0)
    with pytest.raises(ValueError, match="input_scale"):
        world_for(cfg).dispatch(toks, ids, input_scale=0.0)


def test_fp8_padding_rows_are_never_written(seed):
    """row_offsets are padded to multiples of 4 per expert; the padding rows of the output
    tokens and of the (transposed) output scales keep what was there before."""
    cfg = make_cfg(SMALL, "BlockwiseFP8")
    world = world_for(cfg)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank - 3, 5])
    for rk in world.ranks:
        rk.out_tokens.fill_bytes(0xAB)
        rk.out_scales.fill_bytes(0xAB)
    world.synchronize()
    got = run_and_compare(cfg, toks, ids, seed)
    fmt = cfg.token_fmt
    for res, rk in zip(got, world.ranks):
        sizes = np.diff(res.row_offsets.astype(np.int64))
        assert (sizes % 4 == 0).all() and (sizes - res.counts.sum(axis=1) < 4).all(), \
            f"seed {seed}: row_offsets {res.row_offsets}"
        pad = np.flatnonzero(~res.routed_rows_mask())
        out = rk.out_tokens.to_host()
        scales = rk.out_scales.to_host().view(np.uint32)
        assert pad.size or sizes.sum() == res.counts.sum()
        assert (out[pad] == 0xAB).all(), f"seed {seed}: a padding row was written"
        assert (scales[:, pad] == 0xABABABAB).all(), f"seed {seed}: a padding scale was written"
        rows = np.flatnonzero(res.routed_rows_mask())
        assert scales.shape == fmt.out_scales_shape(cfg.layout.max_out_rows)
        assert (scales[:, rows] != 0xABABABAB).all(), f"seed {seed}"


@by_format
def test_cli_run(fmt, capsys, seed):
    from epgen import cli
    assert cli.main(["run", "--preset", "small", "--set", f"format={fmt}", "--calls", "2",
                     "--seed", str(seed)]) == 0
    assert capsys.readouterr().out.count("matches the reference") == 2
