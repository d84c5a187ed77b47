"""The FP8 combine (``fp8=True``; docs/combine.md, "FP8 combine") on the GPU at realistic
sizes (H = 7168, top-8, 8 ranks): the split and the fused kernels against
``epgen.reference.combine(..., fp8=True)`` bit for bit (weighted with a residual, weighted,
unreduced; masked slots; each call followed by a BF16 combine of the same dispatch), the torch
API (``EPBuffer.combine(fp8=True)``) and the DeepEP API
(``Buffer.low_latency_combine(use_fp8=True)``, DeepEP's combine properties with the FP8
bound), and a BlockwiseFP8 dispatch combined in FP8.

    PYTHONPATH=. python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_combine_fp8_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference

from combine_checks import check_torch_combine_option, round_trip_inputs
from combine_fp8_checks import check_fp8_round_trips
from world_checks import make_cfg

pytestmark = pytest.mark.gpu

SHAPES = {
    # R, E, H, K, T, threads, sms
    "decode": (8, 256, 7168, 8, 128, 512, 33),
    "small": (8, 64, 1024, 4, 32, 256, 9),
}

_worlds = {}


def _world(name, fmt="BF16", **kw):
    key = (name, fmt, tuple(sorted(kw.items())))
    if key not in _worlds:
        _worlds[key] = epgen.EmulatedWorld(make_cfg(*SHAPES[name], fmt), **kw)
    return _worlds[key]


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_decode_shape_matches_the_reference(fused, seed):
    rng = np.random.default_rng(seed)
    world = _world("decode", fused=fused)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, world.cfg, 3),
                          f"decode fused={fused}")


def test_blockwise_fp8_dispatch_then_fp8_combine(seed):
    rng = np.random.default_rng(seed)
    world = _world("small", "BlockwiseFP8")
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, world.cfg, 3),
                          "BlockwiseFP8 dispatch", alternate=False)


def test_100_calls_alternating(seed):
    """100 dispatch + combine calls, odd ones FP8, a seeded sample of them checked."""
    rng = np.random.default_rng(seed)
    world = _world("small")
    cfg = world.cfg
    check = set(rng.choice(100, size=10, replace=False).tolist())
    for call in range(100):
        (toks, ids), = round_trip_inputs(rng, cfg, 1)
        results = world.dispatch(toks, ids)
        ys = [rng.integers(0, 1 << 16, size=(len(r.src_info), cfg.token_fmt.hid_dim),
                           dtype=np.uint16) & np.uint16(0xBFFF) for r in results]
        w = [rng.random((len(i), cfg.token_fmt.top_k), dtype=np.float32) for i in ids]
        got = world.combine(ys, w, fp8=bool(call % 2))
        if call in check:
            want = reference.combine(cfg, results, ys, w, fp8=bool(call % 2))
            for s, (g, r) in enumerate(zip(got, want)):
                assert np.array_equal(g, r), f"seed {seed} call {call} rank {s}"


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_torch_api(fused, seed):
    """``EPBuffer.combine(fp8=True)`` after ``EPBuffer.dispatch`` at H = 7168, then a BF16
    combine of the same dispatch, each against the reference."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    check_torch_combine_option(_world("decode", fused=fused), seed, "fp8")


@pytest.mark.parametrize("dispatch_fp8", [False, True], ids=["bf16_dispatch", "fp8_dispatch"])
def test_deepep_api(dispatch_fp8, seed):
    """``low_latency_combine(use_fp8=True)`` at DeepEP's decode shape scaled to one GPU (4
    ranks, 64 experts, 128 tokens, H = 7168, top-8): DeepEP's combine properties (no NaN,
    ``calc_diff`` within the FP8 bound), plain and zero-copy with a hook."""
    torch = pytest.importorskip("torch")
    import epgen.deepep as deep_ep
    from deepep_checks import LLCase, rank_inputs, rank_rounds
    case = LLCase(n_ranks=4, num_experts=64, tokens=128, hidden=7168, top_k=8, masked=10)
    group = deep_ep.EmulatedGroup(case.n_ranks, backend="cuda")
    inputs = rank_inputs(torch, case, seed)
    group.run(lambda rank: rank_rounds(
        torch, deep_ep.Buffer(group.rank(rank), low_latency_mode=True), rank, case, inputs,
        "fp8" if dispatch_fp8 else "bf16",
        rounds=((False, False, 1), (True, True, 2), (True, False, 1)), device="cuda",
        combine_fp8=True))


def test_bench_combine_fp8(tmp_path, capsys):
    """``epgen bench --op combine --combine-fp8``, small and quick: both combines checked
    before and after their timing, both figures and their ratio in the JSON."""
    import json

    from epgen import cli
    js = tmp_path / "fp8.json"
    status = cli.main(["bench", "--preset", "small", "--tokens", "32", "--iters", "5",
                       "--warmup", "2", "--copy-mib", "64", "--copy-iters", "3", "--op",
                       "combine", "--combine-fp8", "--variant", "default", "--variant",
                       "fused", "--json", str(js)])
    _, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    data = json.loads(js.read_text())
    assert data["failures"] == [] and data["plan"]["combine_fp8"] is True
    for v in data["shapes"][0]["variants"]:
        assert v["check"] == v["post_check"] == v["post_check_fp8"] == "ok", v
        m = v["combine_fp8"]
        assert m["median_ms"] > 0 and m["bytes"] == v["bytes"]["combine_fp8"]["total"]
        assert v["fp8_speedup_vs_bf16"] == pytest.approx(
            v["combine"]["median_ms"] / m["median_ms"])
        assert v["bytes"]["combine_fp8"]["link_ratio"] == pytest.approx(272 / 512)
    assert "combine_fp8" in err
