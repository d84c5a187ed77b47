"""Helpers of the rank-mask tests (``ep_rank_mask``; simulator and GPU): inputs with ranks
sitting a call out, and the survivors' dispatch and combine checked against
``epgen.reference`` with the masked ranks removed (``reference.mask_ranks``)."""

from __future__ import annotations

import numpy as np

from epgen import reference, routing

from combine_checks import expert_outputs, weights


def mask_cfg(R=4, final: bool = False, **change):
    """A small configuration with the rank mask: ``R`` ranks of 2 experts each, top-2, 4
    tokens of H=16, 64 threads, ``R + 2`` blocks; ``final``: the capacity-strided final
    layout (the DeepEP API's)."""
    from world_checks import make_cfg
    return make_cfg(R, 2 * R, 16, 2, 4, 64, R + 2, ep_rank_mask=True,
                    ep_final_layout=final, **change)


def draw(rng, cfg, absent=()):
    """Random full-size inputs of every rank; the ranks of ``absent`` get None tokens and
    ids (they make no call). Returns ``(tokens, ids)`` as given to the world, and the
    complete inputs ``(full_tokens, full_ids)`` (the absent ranks' as empty arrays)."""
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    toks, ids = list(toks), list(ids)
    full_t, full_i = list(toks), list(ids)
    for r in absent:
        toks[r] = ids[r] = None
        full_t[r] = np.zeros((0, cfg.token_fmt.hid_dim), np.uint16)
        full_i[r] = np.zeros((0, cfg.token_fmt.top_k), np.int32)
    return (toks, ids), (full_t, full_i)


def expected(cfg, tokens, ids, masked):
    """``reference.dispatch`` of the inputs as the ranks outside ``masked`` see them."""
    return reference.dispatch(cfg, *reference.mask_ranks(cfg, tokens, ids, masked))


def assert_survivors(cfg, results, tokens, ids, masked, *, absent=()):
    """Every rank outside ``masked`` received what the reference with ``masked`` removed
    gives; the ranks of ``absent`` (sitting the call out) have no result."""
    exp = expected(cfg, tokens, ids, masked)
    for r, (e, a) in enumerate(zip(exp, results)):
        if r in absent:
            assert a is None, f"rank {r} sat the call out, but has a result"
            continue
        if r in masked:
            continue
        assert a is not None, f"rank {r} took part, but has no result"
        reference.assert_match(cfg, e, a)


def combine_and_check(world, rng, results, tokens, ids, masked, *, absent=(), fp8=False):
    """``world.combine`` of random expert outputs and weights for the ranks that called;
    each survivor's rows equal ``reference.combine`` of the kernels' own dispatch results
    (rows within a block are in reservation order) for the survivors and of the reference
    with ``masked`` removed for the masked ranks (a rank masked during the combine returns
    nothing), with ``masked`` removed from the weights' ids; ``fp8``: the FP8 combine,
    against the reference's. Returns the ranks the combine masked."""
    cfg = world.cfg
    K = cfg.token_fmt.top_k
    _, masked_ids = reference.mask_ranks(cfg, tokens, ids, masked)
    exp_d = expected(cfg, tokens, ids, masked)
    kernel_rows = [e if a is None else a for e, a in zip(exp_d, results)]
    ref_rows = [e if r in masked else a for r, (e, a) in enumerate(zip(exp_d, kernel_rows))]
    ys = expert_outputs(rng, cfg, kernel_rows)
    # a masked rank that still called has its own tokens' weights
    ws = weights(rng, cfg, [ids[r] if r in masked and r not in absent else masked_ids[r]
                            for r in range(cfg.n_ranks)])
    given_ys = [None if r in absent else y for r, y in enumerate(ys)]
    given_ws = [None if r in absent else w for r, w in enumerate(ws)]
    # the kernels see the unmasked ids: a slot of a masked rank must weigh nothing even
    # though its weight is a number (NaN only where the id was -1 before masking)
    for r in range(cfg.n_ranks):
        if r not in absent and r not in masked:
            given_ws[r] = ws[r].copy()
            dropped = (np.asarray(masked_ids[r]) == -1) & (np.asarray(ids[r]) != -1)
            given_ws[r][dropped] = 1e30
    out = world.combine(given_ys, given_ws, fp8=fp8)
    ref_ws = [np.zeros((0, K), np.float32) if r in absent else w for r, w in enumerate(ws)]
    exp = reference.combine(cfg, ref_rows, ys, ref_ws, fp8=fp8)
    for r in range(cfg.n_ranks):
        if r in absent:
            assert out[r] is None
            continue
        if r in masked:
            continue
        assert np.array_equal(np.asarray(out[r]), np.asarray(exp[r])), \
            f"rank {r}: combine differs from the reference without ranks {sorted(masked)}"
    return world.last_masked


__all__ = ["mask_cfg", "draw", "expected", "assert_survivors", "combine_and_check"]
