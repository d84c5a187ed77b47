"""Helpers of the FP8 combine tests (simulator and GPU): round trips whose combines alternate
between the FP8 and the BF16 combine, each against ``reference.combine`` bit for bit, and the
special rows (zero, NaN, infinities) the FP8 combine's behaviour is stated for."""

from __future__ import annotations

import numpy as np

from epgen import reference

from combine_checks import expert_outputs, residuals, weights

#: BF16 bits of the special values the special-row checks plant
BF16_NAN, BF16_INF, BF16_NEG_INF, BF16_NEG_ZERO = 0x7FC0, 0x7F80, 0xFF80, 0x8000


def assert_same(got, want, what: str) -> None:
    """Per source, the same shape and bits (the error names ``what`` and the source)."""
    assert len(got) == len(want), what
    for s, (g, r) in enumerate(zip(got, want)):
        if r is None:
            assert g is None, f"{what} source {s}: a result where none is expected"
            continue
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"{what} source {s}: {np.count_nonzero(g != r)} elements differ"


def check_fp8_round_trips(world, rng, seed, inputs, what: str = "", forms=None,
                          alternate: bool = True):
    """For each ``(tokens, topk_ids)`` of ``inputs``: dispatch, then the FP8 combine with
    weights and a residual, with weights alone and unreduced (``forms``: a subset of
    ``"weighted+residual"``, ``"weighted"``, ``"unreduced"``), and with ``alternate`` the
    BF16 combine with weights after each FP8 one, every result against ``reference.combine``
    (``fp8=True`` / ``False``) bit for bit."""
    cfg = world.cfg
    forms = forms or ("weighted+residual", "weighted", "unreduced")
    for call, (toks, ids) in enumerate(inputs):
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        n_tok = [len(i) for i in ids]
        res = residuals(rng, cfg, ids)
        args = {"weighted+residual": (w, res), "weighted": (w, None),
                "unreduced": (None, None)}
        for form in forms:
            wt, rs = args[form]
            got = world.combine(ys, wt, residual=rs, fp8=True)
            want = reference.combine(cfg, results, ys, wt, residual=rs, n_tokens=n_tok,
                                     fp8=True)
            assert_same(got, want, f"seed {seed} {what} call {call} fp8 {form}")
            if alternate:
                got = world.combine(ys, w)
                assert_same(got, reference.combine(cfg, results, ys, w),
                            f"seed {seed} {what} call {call} bf16 after fp8 {form}")


def plant_special_rows(rng, ys) -> list[tuple[int, int, str]]:
    """Overwrite some rows of each destination's expert outputs ``ys`` (in place) with the
    special cases: an all-zero row, an all -0 row, a row with one NaN, one with one +inf,
    one with one -inf, one of subnormals. Returns ``(destination, row, case)``."""
    planted = []
    cases = ("zero", "neg_zero", "nan", "inf", "neg_inf", "subnormal")
    for d, y in enumerate(ys):
        n, H = y.shape
        rows = rng.choice(n, size=min(n, len(cases)), replace=False)
        for row, case in zip(rows, cases):
            col = int(rng.integers(0, H))
            if case == "zero":
                y[row] = 0
            elif case == "neg_zero":
                y[row] = BF16_NEG_ZERO
            elif case == "subnormal":
                y[row] = rng.integers(1, 0x80, size=H, dtype=np.uint16)   # |x| < 2^-126
            else:
                y[row, col] = {"nan": BF16_NAN, "inf": BF16_INF, "neg_inf": BF16_NEG_INF}[case]
            planted.append((d, int(row), case))
    return planted
