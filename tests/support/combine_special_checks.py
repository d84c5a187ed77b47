"""Combine through its arithmetic edges, on any world (simulator and GPU tests): the crafted
tokens of ``combine_arith_model.CASES`` (summation order, fma, final rounding, NaN, infinities,
signed zeros, subnormals) and random tokens whose expert outputs, weights and residuals mix
those special values with ordinary ones, through the weighted reduce with and without a
residual and through the unreduced copy, each against ``epgen.reference.combine`` bit for bit
and the crafted tokens also against the independent model."""

from __future__ import annotations

import numpy as np

from epgen import reference, routing
from epgen.reference_combine import source_of_rows

from combine_arith_model import CASES, K, RESIDUAL_NONE, combine_one

#: BF16 special values: +-inf, quiet and signalling NaNs of both signs with payloads, +-0,
#: the smallest and largest subnormals, the largest finite values
SPECIAL_BF16 = np.array([0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0xFF8F, 0x0000, 0x8000,
                         0x0001, 0x807F, 0x007F, 0x7F7F, 0xFF7F], np.uint16)
#: float32 special weights: +-0, +-inf, NaNs with payloads, subnormals, huge and tiny values
SPECIAL_F32 = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001,
                        0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x0D800000],
                       np.uint32).view(np.float32)


def special_bf16(rng, shape) -> np.ndarray:
    """BF16 bits: a quarter drawn from ``SPECIAL_BF16``, the rest random finite values."""
    ordinary = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF)
    special = SPECIAL_BF16[rng.integers(0, len(SPECIAL_BF16), size=shape)]
    return np.where(rng.random(shape) < 0.25, special, ordinary)


def special_weights(rng, shape) -> np.ndarray:
    """float32 weights: a quarter drawn from ``SPECIAL_F32``, the rest standard normal."""
    ordinary = rng.standard_normal(shape).astype(np.float32)
    special = SPECIAL_F32[rng.integers(0, len(SPECIAL_F32), size=shape)]
    return np.where(rng.random(shape) < 0.25, special, ordinary)


def _inputs(rng, cfg, results, n_src: int, T: int):
    """The expert outputs (per destination), weights and residuals (per source) of one call:
    case ``i`` of ``CASES`` is token ``i // n_src`` of source ``i % n_src`` (every element of
    its rows the case's value), every other token random with special values. Returns them
    and ``{(source, token): case}``."""
    H = cfg.token_fmt.hid_dim
    slots = [special_bf16(rng, (T, K, H)) for _ in range(n_src)]
    w = [special_weights(rng, (T, K)) for _ in range(n_src)]
    res = [special_bf16(rng, (T, H)) for _ in range(n_src)]
    placed = {}
    for i, case in enumerate(CASES):
        s, t = i % n_src, i // n_src
        assert t < T, "more crafted cases than tokens"
        placed[(s, t)] = case
        slots[s][t] = np.array(case.y, np.uint16)[:, None]
        w[s][t] = np.array(case.w, np.float32)
        res[s][t] = case.r
    ys = []
    for d, r in enumerate(results):
        y = special_bf16(rng, (len(r.src_info), H))         # rows no source sent: anything
        src = source_of_rows(r)
        for row in np.nonzero(src >= 0)[0]:
            t, k = r.src_info[row]
            y[row] = slots[src[row]][t, k]
        ys.append(y)
    return ys, w, res, placed


def special_values_check(world, rng, seed):
    """One full dispatch, then three combines of the same inputs (``_inputs``): weighted with
    a residual, weighted without, unreduced; each equals ``reference.combine`` bit for bit
    and every crafted token equals the model (the message names the case)."""
    cfg = world.cfg
    T, n_src = cfg.max_tokens_per_rank, cfg.n_ranks
    assert cfg.token_fmt.top_k == K and not cfg.skip_a2a
    toks, ids = routing.routing(rng, cfg, T)
    results = world.dispatch(toks, ids)
    ys, w, res, placed = _inputs(rng, cfg, results, n_src, T)
    for form, wt, rr in [("weighted+residual", w, res), ("weighted", w, None),
                         ("unreduced", None, None)]:
        got = world.combine(ys, wt, residual=rr)
        want = reference.combine(cfg, results, ys, wt, residual=rr, n_tokens=[T] * n_src)
        for s, (g, r) in enumerate(zip(got, want)):
            diff = np.argwhere(g != r)
            assert g.shape == r.shape and not len(diff), (
                f"seed {seed} {form} source {s}: {len(diff)} elements differ from the "
                f"reference, first at {tuple(diff[0])}: {int(g[tuple(diff[0])]):#06x} != "
                f"{int(r[tuple(diff[0])]):#06x}")
        if wt is None:
            continue
        for (s, t), case in placed.items():
            model = combine_one(case.w, case.y, case.r if rr is not None else RESIDUAL_NONE)
            row = got[s][t]
            assert np.all(row == model), (
                f"seed {seed} {form}: case {case.name} (source {s}, token {t}) gives "
                f"{sorted({hex(int(v)) for v in row})}, the model {model:#06x}")
