"""The partial-reduce combine (``ep_rank_dedup``, ``combine(partial_reduce=True)``;
docs/combine.md, "Partial reduce") on the GPU at realistic sizes (H = 7168, top-8, 256
experts on 8 ranks): the split and the fused kernels against
``epgen.reference.combine(..., partial_reduce=True)`` bit for bit (with and without a
residual; masked slots on odd calls; each call followed by a plain BF16 combine of the same
dispatch), 100 calls alternating with the plain combine, and the torch API
(``EPBuffer.combine(partial_reduce=True)``).

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_partial_reduce_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference

from combine_checks import check_torch_combine_option, round_trip_inputs
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

SHAPES = {
    # R, E, H, K, T, threads, sms
    "decode": (8, 256, 7168, 8, 128, 512, 33),
    "small": (8, 64, 1024, 4, 32, 256, 9),
}

_worlds = {}


def _world(name, **kw):
    key = (name, tuple(sorted(kw.items())))
    if key not in _worlds:
        _worlds[key] = epgen.EmulatedWorld(make_cfg(*SHAPES[name], ep_rank_dedup=True), **kw)
    return _worlds[key]


def _rows(rng, cfg, results):
    return [rng.integers(0, 1 << 16, size=(len(r.src_info), cfg.token_fmt.hid_dim),
                         dtype=np.uint16) & np.uint16(0xBFFF) for r in results]


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_decode_shape_matches_the_reference(fused, seed):
    rng = np.random.default_rng(seed)
    world = _world("decode", fused=fused)
    cfg = world.cfg
    for call, (toks, ids) in enumerate(round_trip_inputs(rng, cfg, 3)):
        w = [rng.random((len(i), cfg.token_fmt.top_k), dtype=np.float32) for i in ids]
        results = world.dispatch(toks, ids, topk_weights=w)
        ys = _rows(rng, cfg, results)
        res = [rng.integers(0, 1 << 16, size=(len(i), cfg.token_fmt.hid_dim),
                            dtype=np.uint16) & np.uint16(0xBFFF) for i in ids] \
            if call % 2 else None
        got = world.combine(ys, residual=res, partial_reduce=True)
        want = reference.combine(cfg, results, ys, w, residual=res, partial_reduce=True)
        for s, (g, e) in enumerate(zip(got, want)):
            assert np.array_equal(g, e), f"seed {seed} call {call} rank {s} fused={fused}"
        got = world.combine(ys, w)
        want = reference.combine(cfg, results, ys, w)
        for s, (g, e) in enumerate(zip(got, want)):
            assert np.array_equal(g, e), f"seed {seed} call {call} rank {s}: plain after"


def test_100_calls_alternating(seed):
    """100 dispatch + combine calls, odd ones the partial reduce, a seeded sample checked."""
    rng = np.random.default_rng(seed)
    world = _world("small")
    cfg = world.cfg
    check = set(rng.choice(100, size=10, replace=False).tolist())
    for call in range(100):
        (toks, ids), = round_trip_inputs(rng, cfg, 1)
        w = [rng.random((len(i), cfg.token_fmt.top_k), dtype=np.float32) for i in ids]
        results = world.dispatch(toks, ids, topk_weights=w)
        ys = _rows(rng, cfg, results)
        partial = bool(call % 2)
        got = world.combine(ys, partial_reduce=True) if partial else world.combine(ys, w)
        if call in check:
            want = reference.combine(cfg, results, ys, w, partial_reduce=partial)
            for s, (g, e) in enumerate(zip(got, want)):
                assert np.array_equal(g, e), f"seed {seed} call {call} rank {s}"


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_torch_api(fused, seed):
    """``EPBuffer.dispatch`` with weights, then ``EPBuffer.combine(partial_reduce=True)``
    and a plain combine of the same dispatch, at H = 7168, each against the reference."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    check_torch_combine_option(_world("decode", fused=fused), seed, "partial_reduce")
