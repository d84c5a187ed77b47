"""``epgen.reference.combine``: every dispatched row back to its (source, token, slot), the
weighted top-k sum in its stated order, the unreduced form, the shared expert, the residual,
the BF16 rounding, and the refusal of an out-of-range ``src_info`` row.

The arithmetic is checked against an independent model (``combine_arith_model``: exact
rational arithmetic rounded by hand at the stated steps) on crafted tokens where the
summation order, fma against multiply-then-add, the single rounding of the fma, the final
rounding and the NaN handling each change the result (every run, whatever the seed), and on
random inputs mixing NaN, infinities, signed zeros and subnormals."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.errors import EPInputError
from epgen.formats import make_format
from epgen.reference_combine import bf16_to_f32, f32_to_bf16, source_of_rows

import combine_arith_model as model
from combine_special_checks import special_bf16, special_weights


def cfg_of(R=2, E=8, H=64, K=4, T=16, **flags):
    return epgen.EPConfig(num_threads=256, n_sms=9, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format("BF16", H, K), **flags)


def dispatched(cfg, rng, counts):
    toks, ids = routing.routing(rng, cfg, counts)
    return toks, ids, reference.dispatch(cfg, toks, ids)


@pytest.mark.parametrize("flags", [{}, {"ep_final_layout": True},
                                   {"ep_final_layout": True, "ep_prod_reserve": True}],
                         ids=["staged", "final", "final+prod"])
def test_unreduced_rows_come_back_to_their_slots(flags, seed):
    cfg = cfg_of(**flags)
    rng = np.random.default_rng(seed)
    toks, ids, res = dispatched(cfg, rng, [16, 5])
    back = reference.combine(cfg, res, [r.out_tokens for r in res],
                             n_tokens=[len(t) for t in toks])
    for s in range(cfg.n_ranks):
        assert back[s].shape == (len(toks[s]), 4, 64)
        # every top-k slot received its own token back (identity experts)
        np.testing.assert_array_equal(back[s], np.repeat(toks[s][:, None, :], 4, axis=1),
                                      err_msg=f"source {s}")


def test_weighted_sum_with_exact_values(seed):
    """Powers-of-two weights and small-integer rows: every float32 partial sum is exact, so
    the result is the plain weighted sum, rounded once to BF16, whatever the order."""
    cfg = cfg_of()
    rng = np.random.default_rng(seed)
    toks, ids, res = dispatched(cfg, rng, [16, 16])
    small = [f32_to_bf16(rng.integers(-8, 9, size=(len(r.src_info), 64)).astype(np.float32))
             for r in res]
    weights = [np.float32(2.0) ** rng.integers(-3, 3, size=(len(t), 4)).astype(np.float32)
               for t in toks]
    out = reference.combine(cfg, res, small, weights)
    for s in range(cfg.n_ranks):
        want = np.zeros((len(toks[s]), 64), np.float64)
        for d, r in enumerate(res):
            src = source_of_rows(r)
            for row in np.nonzero(src == s)[0]:
                t, k = r.src_info[row]
                want[t] += weights[s][t, k] * bf16_to_f32(small[d][row]).astype(np.float64)
        np.testing.assert_array_equal(out[s], f32_to_bf16(want.astype(np.float32)),
                                      err_msg=f"seed {seed}, source {s}")


def test_residual_and_shared_expert(seed):
    cfg = cfg_of(fused_shared_expert=True)
    rng = np.random.default_rng(seed)
    toks, ids, res = dispatched(cfg, rng, [16, 16])
    ones = [f32_to_bf16(np.ones((len(r.src_info), 64), np.float32)) for r in res]
    w = [np.full((16, 4), 0.25, np.float32) for _ in toks]
    resid = [f32_to_bf16(np.full((16, 64), 2.0, np.float32)) for _ in toks]
    out = reference.combine(cfg, res, ones, w, residual=resid)
    for s, r in enumerate(res):
        got = bf16_to_f32(out[s])
        se = np.zeros(16, bool)
        se[r.se_token_start:r.se_token_start + r.se_tokens] = True
        # 4 x 0.25 x 1 from the routed experts, + 1 from the shared expert, + 2 residual
        assert (got[se] == 4.0).all() and (got[~se] == 3.0).all(), (s, r.se_tokens)


def test_shared_expert_comes_after_the_slots_and_before_the_residual():
    """Slot y = 2^24 (weight 1), shared expert 1, residual -2^24: slots, then the shared
    expert, then the residual gives 0 (2^24 + 1 rounds to 2^24); the residual before the
    shared expert would give 1."""
    cfg = cfg_of(R=1, E=4, K=1, T=1, fused_shared_expert=True)
    res = reference.dispatch(cfg, [np.zeros((1, 64), np.uint16)], [np.array([[2]], np.int32)])
    r = res[0]
    assert r.se_tokens == 1
    y = np.zeros((len(r.src_info), 64), np.float32)
    y[:1] = 1.0                                          # the shared expert's row (group 0)
    y[int(np.nonzero(r.src_info[:, 0] == 0)[0][0])] = 2.0 ** 24
    out = reference.combine(cfg, res, [f32_to_bf16(y)], [np.ones((1, 1), np.float32)],
                            residual=[f32_to_bf16(np.full((1, 64), -2.0 ** 24, np.float32))])
    assert (bf16_to_f32(out[0]) == 0).all()


def test_skip_a2a_slots_that_stay_elsewhere_add_nothing(seed):
    cfg = epgen.EPConfig(num_threads=256, n_sms=9, n_experts=4, n_ranks=1,
                         max_tokens_per_rank=8, p2p_world_size=1, use_shmem=False,
                         skip_a2a=True, token_fmt=make_format("BF16", 64, 2))
    rng = np.random.default_rng(seed)
    ids = [rng.permuted(np.tile(np.arange(8, dtype=np.int32), (8, 1)), axis=1)[:, :2]
           for _ in range(2)]
    toks = [routing.random_tokens(rng, 8, 64) for _ in range(2)]
    res = reference.dispatch(cfg, toks, ids)
    ones = [f32_to_bf16(np.ones((len(r.src_info), 64), np.float32)) for r in res]
    out = reference.combine(cfg, res, ones, [np.ones((8, 2), np.float32)] * 2)
    for d in range(2):
        local = ((ids[d] // 4) == d).sum(axis=1)          # slots this device's experts got
        np.testing.assert_array_equal(bf16_to_f32(out[d])[:, 0], local.astype(np.float32))


@pytest.mark.parametrize("edge", ["t=-1", "t=T", "k=-1", "k=K"])
def test_out_of_range_src_info_is_refused(edge, seed):
    """A ``src_info`` row just outside ``[0, T) x [0, K)`` on each of its four edges is
    refused by name (numpy would wrap ``-1`` silently into another slot)."""
    cfg = cfg_of()
    rng = np.random.default_rng(seed)
    toks, ids, res = dispatched(cfg, rng, [16, 16])
    bad = res[1].src_info.copy()
    row = int(rng.choice(np.nonzero(source_of_rows(res[1]) == 0)[0]))
    t, k = (int(v) for v in bad[row])
    t, k = {"t=-1": (-1, k), "t=T": (16, k), "k=-1": (t, -1), "k=K": (t, 4)}[edge]
    bad[row] = (t, k)                                    # source 0 has tokens 0..15, K = 4
    res[1] = attrs.evolve(res[1], src_info=bad)
    with pytest.raises(EPInputError, match=rf"dispatch_results\[1\]\.src_info\[{row}\] = "
                                           rf"\({t}, {k}\) is out of range for source 0"):
        reference.combine(cfg, res, [r.out_tokens for r in res],
                          [np.ones((16, 4), np.float32)] * 2)


@pytest.mark.parametrize("x, bits", [(1.0, 0x3F80), (1.0 + 2 ** -8, 0x3F80),      # tie: even
                                     (1.0 + 3 * 2 ** -8, 0x3F82), (-0.0, 0x8000),   # tie: up
                                     (np.inf, 0x7F80), (3.4e38, 0x7F80),            # overflow
                                     (3.3895314e38, 0x7F7F)])                      # max
def test_bf16_rounding(x, bits):
    assert int(f32_to_bf16(np.array([x], np.float32))[0]) == bits


def test_bf16_nan_stays_nan():
    nan = np.array([0x7F800001, 0xFFC00000], np.uint32).view(np.float32)
    out = f32_to_bf16(nan)
    assert ((out & 0x7F80) == 0x7F80).all() and ((out & 0x7F) != 0).all()
    assert out[1] >> 15 == 1


def test_sources_computes_only_those(seed):
    """``sources=``: the chosen sources' results are those of the whole computation, the
    others None."""
    from epgen import reference, routing
    from epgen.presets import load_preset
    cfg = load_preset("small")
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    res = reference.dispatch(cfg, toks, ids)
    ys = [r.out_tokens for r in res]
    w = [rng.random((len(i), cfg.token_fmt.top_k), dtype=np.float32) for i in ids]
    full = reference.combine(cfg, res, ys, w)
    part = reference.combine(cfg, res, ys, w, sources=[1])
    assert part[0] is None and np.array_equal(part[1], full[1]), f"seed {seed}"


@pytest.mark.parametrize("form", ["plain", "unreduced", "fp8", "partial", "shared_residual"])
def test_tokens_computes_those_rows_of_the_whole_result(form, seed):
    """``tokens=``: each chosen token's row is that of the whole computation, in the order
    asked (a shuffled subset, tokens inside and outside the shared-expert slice), with
    every form of the sum; a source without an entry is computed whole, one not computed
    is None; a repeated or out-of-range index or a source not computed is refused."""
    flags = {"partial": {"ep_rank_dedup": True},
             "shared_residual": {"fused_shared_expert": True}}.get(form, {})
    cfg = cfg_of(R=2, E=8, H=128, K=4, T=16, **flags)
    rng = np.random.default_rng(seed)
    toks, ids, res = dispatched(cfg, rng, [16, 11])
    ys = [rng.integers(0, 1 << 16, size=(len(r.src_info), 128), dtype=np.uint16)
          & np.uint16(0xBFFF) for r in res]
    w = None if form == "unreduced" else \
        [rng.random((len(t), 4), dtype=np.float32) for t in toks]
    kw = {"fp8": form == "fp8", "partial_reduce": form == "partial",
          "n_tokens": [len(t) for t in toks]}
    if form == "shared_residual":
        kw["residual"] = [rng.integers(0, 1 << 16, size=(len(t), 128), dtype=np.uint16)
                          & np.uint16(0xBFFF) for t in toks]
    full = reference.combine(cfg, res, ys, w, **kw)
    pick = {0: rng.permutation(16)[:7], 1: np.array([10, 0, 5])}
    part = reference.combine(cfg, res, ys, w, tokens=pick, **kw)
    for s, idx in pick.items():
        np.testing.assert_array_equal(part[s], full[s][idx], err_msg=f"seed {seed}, {s}")
    one = reference.combine(cfg, res, ys, w, sources=[1], tokens={1: [3]}, **kw)
    assert one[0] is None and np.array_equal(one[1], full[1][[3]])
    whole = reference.combine(cfg, res, ys, w, tokens={1: [3]}, **kw)
    assert np.array_equal(whole[0], full[0])
    for bad, why in [({0: [1, 1]}, "distinct"), ({1: [11]}, r"\[0, 11\)"),
                     ({0: [-1]}, "distinct")]:
        with pytest.raises(ValueError, match=why):
            reference.combine(cfg, res, ys, w, tokens=bad, **kw)
    with pytest.raises(ValueError, match=r"sources \[0\] that are not computed"):
        reference.combine(cfg, res, ys, w, sources=[1], tokens={0: [1]}, **kw)


# ---- the arithmetic against the independent model -------------------------------------------
def test_the_model_rounds_as_numpy_and_ml_dtypes_do(seed):
    """The model's hand rounding agrees with the float64 -> float32 cast (nearest even,
    subnormals, overflow) and with ml_dtypes' float32 -> bfloat16 on random values."""
    import ml_dtypes
    from fractions import Fraction
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(2000) * 2.0 ** rng.integers(-160, 140, 2000)
    with np.errstate(over="ignore"):
        want32 = x.astype(np.float32)
    for v, w in zip(x, want32):
        assert model.round_binary(Fraction(float(v)), 24) == float(w), (v, w)
    f = want32[np.isfinite(want32)]
    want16 = f.astype(ml_dtypes.bfloat16).view(np.uint16)
    for v, w in zip(f, want16):
        assert model.bf16_bits_of(float(v)) == int(w), (v, hex(int(w)))


def test_each_crafted_case_tells_its_variants_from_the_model():
    """Every crafted token gives the model's stated result, each variant (one step done
    wrong) differs on exactly the cases that name it, and every variant is told by a case."""
    told = set()
    for case in model.CASES:
        assert model.combine_one(case.w, case.y, case.r) == case.want, case.name
        differs = {n for n, v in model.VARIANTS.items() if v(case.w, case.y, case.r) != case.want}
        assert differs == set(case.tells), (case.name, differs)
        told |= differs
    assert told == set(model.VARIANTS)


def _one_rank(T: int, H: int = 64):
    """One rank, experts 0..3 for every token (every slot receives a row), and its dispatch."""
    cfg = cfg_of(R=1, E=4, H=H, K=model.K, T=T)
    topk = [np.tile(np.arange(model.K, dtype=np.int32), (T, 1))]
    res = reference.dispatch(cfg, [np.zeros((T, H), np.uint16)], topk)
    return cfg, res


def _rows_of(res, slots):
    """The expert outputs of a destination whose slot ``(t, k)`` row is ``slots[t, k]``."""
    y = np.zeros((len(res.src_info), slots.shape[-1]), np.uint16)
    for row, (t, k) in enumerate(res.src_info):
        if t >= 0:
            y[row] = slots[t, k]
    return y


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_crafted_cases_match_the_model(with_residual):
    """The crafted tokens (summation order, fma, its single rounding, ties, overflow, NaN,
    infinities, signed zeros, subnormals), one token each: the reference equals the model."""
    cases = model.CASES
    cfg, res = _one_rank(len(cases))
    slots = np.array([[[c.y[k]] * 64 for k in range(model.K)] for c in cases], np.uint16)
    w = np.array([c.w for c in cases], np.float32)
    r = np.array([[c.r] * 64 for c in cases], np.uint16) if with_residual else None
    out = reference.combine(cfg, res, [_rows_of(res[0], slots)], [w],
                            residual=None if r is None else [r])[0]
    for t, c in enumerate(cases):
        want = model.combine_one(c.w, c.y, c.r if with_residual else model.RESIDUAL_NONE)
        assert np.all(out[t] == want), \
            f"{c.name}: {sorted({hex(int(v)) for v in out[t]})}, the model {want:#06x}"


def test_random_special_values_match_the_model(seed):
    """Random weights, rows and residuals with NaN, +-inf, +-0, subnormals and huge values
    (a quarter of them) among ordinary ones: every element equals the model."""
    rng = np.random.default_rng(seed)
    T, H = 16, 64
    cfg, res = _one_rank(T, H)
    slots = special_bf16(rng, (T, model.K, H))
    w = special_weights(rng, (T, model.K))
    r = special_bf16(rng, (T, H))
    out = reference.combine(cfg, res, [_rows_of(res[0], slots)], [w], residual=[r])[0]
    for t in range(T):
        for h in range(H):
            want = model.combine_one(tuple(float(v) for v in w[t]), tuple(slots[t, :, h]),
                                     int(r[t, h]))
            assert out[t, h] == want, (f"seed {seed} token {t} element {h}: "
                                       f"{int(out[t, h]):#06x}, the model {want:#06x}")
