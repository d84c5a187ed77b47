"""The combine kernels at their edges, on the CPU simulator (docs/combine.md):

- the send's bounds check at each of its four edges, ``t = -1``, ``t = max_tokens_per_rank``,
  ``k = -1`` and ``k = top_k``, in one call (split kernels, ``small`` preset; and the fused
  ``ep_combine``): every refused row is recorded and named, none is written, the guard bytes
  after every receive buffer stay intact (``combine_checks.corrupted_row_check``);
- the reduce's arithmetic: the crafted tokens of ``combine_arith_model`` (summation order,
  fma, the final rounding, NaN, infinities, signed zeros, subnormals) and random NaN, +-inf,
  -0 and subnormal expert outputs, weights and residuals, weighted with and without a
  residual and unreduced, against ``reference.combine`` bit for bit and the crafted tokens
  against the independent model (``combine_special_checks``);
- the simulator's f32 arithmetic returns the canonical NaN, as the GPU does."""

from __future__ import annotations

import numpy as np

import epgen
from backends.sim.numerics import CANONICAL_NAN_F32, add_f32, fma_f32
from epgen.formats import make_format
from epgen.presets import load_preset
from epgen.runtime.world import EmulatedWorld

from combine_checks import corrupted_row_check
from combine_special_checks import special_values_check


def _tiny(T=4):
    """A grid the simulator runs quickly: 2 ranks, 64 threads x 5 blocks, ``T`` tokens per
    rank, top-4 of 8 experts."""
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=8, n_ranks=2,
                          max_tokens_per_rank=T, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format("BF16", 64, 4))


def test_bounds_edges_are_recorded_and_write_nothing(seed):
    world = EmulatedWorld(load_preset("small"), backend="sim", sim_seed=seed)
    corrupted_row_check(world, np.random.default_rng(seed), edges=True)


def test_bounds_edges_in_the_fused_kernel(seed):
    world = EmulatedWorld(_tiny(), backend="sim", sim_seed=seed, fused=True)
    corrupted_row_check(world, np.random.default_rng(seed), edges=True)


def test_special_values_and_crafted_sums_match_the_reference_and_the_model(seed):
    world = EmulatedWorld(load_preset("small"), backend="sim", sim_seed=seed)
    special_values_check(world, np.random.default_rng(seed), seed)


def test_special_values_in_the_fused_kernel(seed):
    """``ep_combine`` shares the reduce: the same checks on a grid of 2 x 16 tokens."""
    cfg = _tiny(T=16)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=True)
    special_values_check(world, np.random.default_rng(seed), seed)


def test_f32_arithmetic_returns_the_canonical_nan():
    """Any NaN that ``add``/``fma`` produce is ``0x7fffffff`` (no payload, no sign): NaN
    operands of either sign, ``inf - inf``, ``0 * inf``."""
    bits = lambda x: np.asarray(x, np.float32).view(np.uint32)   # noqa: E731
    neg_nan = np.array(0xFFC00001, np.uint32).view(np.float32)
    inf = np.float32(np.inf)
    for got in (fma_f32(neg_nan, 1, 0), fma_f32(1, 1, neg_nan), fma_f32(inf, 0, 1),
                fma_f32(inf, 1, -inf), add_f32(neg_nan, 1), add_f32(inf, -inf)):
        assert int(bits(got)) == CANONICAL_NAN_F32, hex(int(bits(got)))
    assert float(fma_f32(2, 3, 1)) == 7.0 and float(add_f32(inf, 1)) == np.inf
