"""``epgen run --combine`` on the simulator (emulated ranks, with and without ``--graph``; the
P2P world where it has a combine), its refusals, and ``epgen.combine_run`` (the per-expert
transform and the end-to-end reference). On the GPU: tests/gpu/test_combine_cli_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import cli, combine_run, reference, routing
from epgen.commands import run_options
from epgen.reference_combine import bf16_to_f32
from epgen.runtime.world import EmulatedWorld

from cli_runs import run_cli
from test_final_layout_sim import SHAPES, make_cfg

TINY = ["--preset", "small", "--set", "n_experts=4", "--set", "hid_dim=16", "--set", "top_k=2",
        "--set", "max_tokens_per_rank=4", "--set", "num_threads=64", "--set", "n_sms=4"]


@pytest.mark.parametrize("extra", [[], ["--graph"], ["--tokens", "0"], ["--tokens", "3"]],
                         ids=["stream", "graph", "no-tokens", "3-tokens"])
def test_run_combine_on_the_simulator(capsys, extra, seed):
    status, out, err = run_cli(capsys, "run", "--backend", "sim", *TINY, "--calls", "2",
                               "--combine", "--seed", str(seed), *extra)
    assert status == 0, f"seed {seed}: {out}{err}"
    assert "dispatch + combine" in out.splitlines()[0]
    assert out.count("  combine: matches the reference") == 2, out


def test_run_combine_on_the_p2p_world(capsys, seed):
    status, out, err = run_cli(capsys, "run", "--backend", "sim", "--world", "p2p", *TINY,
                               "--calls", "1", "--combine", "--seed", str(seed))
    assert status == 0, f"seed {seed}: {out}{err}"
    assert "combine: matches the reference" in out


def test_a_wrong_combine_result_fails_the_run(capsys, monkeypatch, seed):
    real = EmulatedWorld.combine

    def flipped(self, *a, **kw):
        out = real(self, *a, **kw)
        out[-1] = out[-1].copy()
        out[-1].reshape(-1)[-1] ^= np.uint16(1)
        return out
    monkeypatch.setattr(EmulatedWorld, "combine", flipped)
    status, out, err = run_cli(capsys, "run", "--backend", "sim", *TINY, "--calls", "1",
                               "--combine", "--seed", str(seed))
    assert status == 1 and "combine: MISMATCH" in out and "1 elements differ" in out
    assert f"seed {seed}" in err


def test_run_combine_refuses_what_combine_does_not_take(capsys, monkeypatch):
    """What ``runtime.combine.check_supported`` refuses (here: everything) is a usage error
    naming the reason, before any world is built."""
    from epgen.runtime import combine as combine_mod

    def refuse(cfg):
        raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(combine_mod, "check_supported", refuse)
    monkeypatch.setattr(run_options, "make_world", lambda *a, **k: pytest.fail("built a world"))
    status, _, err = run_cli(capsys, "run", "--backend", "sim", *TINY, "--combine")
    assert status == 2 and "argument --combine" in err and "testing" in err


@pytest.mark.parametrize("fmt", ["NVFP4", "MXFP8"])
def test_run_combine_with_a_quantising_format(capsys, fmt, seed):
    """The transform dequantizes each row with its own scales (``fmt.dequantize``)."""
    tiny = [a if a != "hid_dim=16" else "hid_dim=64" for a in TINY]
    status, out, err = run_cli(capsys, "run", "--backend", "sim", *tiny, "--set",
                               f"format={fmt}", "--calls", "1", "--combine", "--seed", str(seed))
    assert status == 0, f"seed {seed}: {out}{err}"
    assert "combine: matches the reference" in out


def test_the_transform_is_the_per_expert_affine_map(seed):
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    L = cfg.layout.n_local_experts
    for res in reference.dispatch(cfg, toks, ids):
        y = combine_run.expert_outputs(cfg, res)
        assert y.shape == (len(res.src_info), cfg.token_fmt.hid_dim) and y.dtype == np.uint16
        for g, e in enumerate(res.expert_ids):
            lo, hi = int(res.row_offsets[g]), int(res.row_offsets[g + 1])
            gid = res.rank * L + int(e)
            a, b = 1 + (37 * gid % 16) / 32, (gid % 9 - 4) / 64
            x = bf16_to_f32(res.out_tokens[lo:hi]).astype(np.float64)
            # exact in float64 to within one BF16 step of the float32 computation
            assert np.allclose(bf16_to_f32(y[lo:hi]), x * a + b, rtol=2 ** -7, atol=2 ** -7)


def test_the_reference_does_not_depend_on_the_row_order_within_a_block(seed):
    """Permuting the rows of every (expert, source) block (as a world may) changes nothing:
    the transform is row-wise."""
    cfg = make_cfg(*SHAPES["R2-E4"])
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    w = combine_run.router_weights(rng, cfg, ids)
    want = combine_run.expected(cfg, toks, ids, w)
    shuffled = []
    for res in reference.dispatch(cfg, toks, ids):
        perm = np.arange(len(res.src_info))
        L, R = res.counts.shape
        for e in range(L):
            for s in range(R):
                lo, n = int(res.block_starts[e, s]), int(res.counts[e, s])
                perm[lo:lo + n] = lo + rng.permutation(n)
        res.out_tokens = res.out_tokens[perm]
        res.src_info = res.src_info[perm]
        shuffled.append(res)
    got = reference.combine(cfg, shuffled, [combine_run.expert_outputs(cfg, r)
                                            for r in shuffled], w)
    assert not combine_run.differences(got, want)
    got[0] = got[0].copy()
    got[0][0, 0] ^= np.uint16(1)
    assert combine_run.differences(got, want)[0].startswith("rank 0 combine: 1 elements")


@pytest.mark.parametrize("world", ["emulated", "p2p"])
def test_run_skip_a2a_with_global_ranks(capsys, world, seed):
    """``skip_a2a`` with the preset's global ``n_ranks = 2``: one device per rank's expert
    slice, dispatch and combine against the reference."""
    status, out, err = run_cli(capsys, "run", "--backend", "sim", "--world", world, *TINY,
                               "--set", "skip_a2a=true", "--calls", "1", "--combine",
                               "--seed", str(seed))
    assert status == 0, f"seed {seed}: {out}{err}"
    assert "matches the reference" in out and "combine: matches the reference" in out
