"""``examples/moe_layer.py``, a whole MoE layer's forward (router, dispatch, SwiGLU experts,
combine) against a dense single-device MoE.

On the CPU: the simulator mode runs as a subprocess on a tiny shape and passes; a planted
wrong expert makes it fail with exit status 1; its pieces (the tolerance check, the rows of
each expert in a dispatch result, the quantising formats' rows as BF16) are checked against
``epgen.reference.dispatch``; usage errors exit 2. With torch installed, the torch experts
run on the CPU under the simulator. On a GPU: tests/gpu/test_examples_gpu.py.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

from epgen import reference, routing
from epgen.presets import config_from_dict, preset_data
from epgen.reference_combine import source_of_rows

import format_cases
from example_runs import SCRIPT, assert_passes, run_example

TINY = ["--backend", "sim", "--tokens", "8"]
"""The simulator on the small preset (2 ranks, E=16, H=256, K=4), 8 tokens per rank."""


def _load():
    spec = importlib.util.spec_from_file_location("moe_layer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


moe = _load()


def test_sim_mode_passes(seed):
    proc, text = run_example([*TINY, "--seed", str(seed)])
    assert_passes(proc, text)
    assert re.search(r"^all 2 ranks: .* PASS$", proc.stdout, re.M), text
    assert "2^-6" in proc.stdout, "the tolerance and its reason are printed"


def test_a_planted_wrong_expert_fails(seed):
    proc, text = run_example([*TINY, "--seed", str(seed), "--plant", "wrong-expert"])
    assert proc.returncode == 1, text[-4000:]
    assert re.search(r"^all 2 ranks: .* FAIL$", proc.stdout, re.M), text[-4000:]
    # the wrong expert runs on destination rank 0: the sources whose tokens it took fail
    assert re.search(r"^rank \d: .* FAIL$", proc.stdout, re.M), text[-4000:]


def test_torch_experts_on_the_cpu_simulator(seed):
    pytest.importorskip("torch")
    proc, text = run_example([*TINY, "--experts", "torch", "--seed", str(seed)])
    assert_passes(proc, text)
    assert "torch BF16 experts" in proc.stdout


def test_final_layout_layer_passes(seed):
    proc, text = run_example([*TINY, "--set", "ep_final_layout=true", "--seed", str(seed)])
    assert_passes(proc, text)


@pytest.mark.parametrize("argv, word", [
    (["--set", "fused_shared_expert=true"], "fused_shared_expert"),
    (["--tokens", "33"], "--tokens"),
    (["--preset", "nope"], "--preset"),
    (["--set", "n_sms"], "--set"),
    (["--ffn-dim", "0"], "--ffn-dim"),
    (["--world", "shmem"], "--world shmem"),
])
def test_usage_errors_exit_2(argv, word, capsys):
    with pytest.raises(SystemExit) as exc:
        moe.main(["--backend", "sim", *argv])
    assert exc.value.code == 2
    assert word in capsys.readouterr().err


def test_the_gpu_mode_without_torch_or_cuda_exits_2_saying_why(capsys):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("torch and a CUDA device are here: the GPU mode runs")
    assert moe.main([]) == 2
    assert re.search(r"needs torch|no CUDA device", capsys.readouterr().err)


def test_shmem_mode_refuses_a_launch_of_another_size(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exc:
        moe.make_config(moe.parse_args(["--world", "shmem", "--preset", "small"]))
    assert exc.value.code == 2 and "launch -n 2" in capsys.readouterr().err
    cfg = moe.make_config(moe.parse_args(["--world", "shmem", "--preset", "small", "--set",
                                          "n_ranks=4"]))
    assert (cfg.n_ranks, cfg.p2p_world_size) == (4, 4)


class OneRankShmemWorld:
    """A stand-in for ``ShmemWorld`` with one PE on the simulator: ``dispatch`` and
    ``combine`` take this rank's arrays and return this rank's result, as ShmemWorld's do."""

    def __init__(self, cfg):
        from epgen.runtime.world import EmulatedWorld
        self.world = EmulatedWorld(cfg, backend="sim", sim_seed=0)
        self.rank, self.device_id, self.input_scale = 0, 0, 1.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def dispatch(self, tokens, topk_ids):
        assert not isinstance(tokens, list)
        return self.world.dispatch([tokens], [topk_ids])[0]

    def combine(self, expert_outputs, topk_weights):
        assert not isinstance(expert_outputs, list)
        return self.world.combine([expert_outputs], [topk_weights])[0]


@pytest.mark.parametrize("plant, ok", [(None, True), ("wrong-expert", False)])
def test_the_shmem_path_on_one_simulated_rank(plant, ok, monkeypatch, capsys, seed):
    import epgen
    monkeypatch.setattr(epgen, "ShmemWorld", OneRankShmemWorld)
    args = moe.parse_args(["--backend", "sim", "--set", "n_ranks=1", "--set", "n_experts=8",
                           "--tokens", "8",
                           "--seed", str(seed), *(["--plant", plant] if plant else [])])
    cfg = moe.make_config(args)
    args.ffn_dim = 32
    assert moe.run_shmem(args, cfg, 8) is ok
    assert re.search(rf"^rank 0: .* {'PASS' if ok else 'FAIL'}$", capsys.readouterr().out, re.M)


def test_compare_holds_the_stated_tolerance(seed):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((16, 64)).astype(np.float32)
    mag = np.abs(dense) + rng.random((16, 64)).astype(np.float32)
    got = moe.f32_to_bf16(dense)
    max_abs, max_rel, ok = moe.compare(got, dense, mag)
    assert ok and max_rel <= 2.0 ** -8, f"seed {seed}: one BF16 rounding is within 2^-8"
    # one element moved by 2^-5 of its terms' magnitude fails, and is the reported maximum
    bad = moe.bf16_to_f32(got).copy()
    bad[3, 7] = dense[3, 7] + 2.0 ** -5 * mag[3, 7]
    max_abs, max_rel, ok = moe.compare(moe.f32_to_bf16(bad), dense, mag)
    assert not ok and max_rel > moe.RTOL
    # an element whose terms are all zero must be exact; a NaN fails
    mag0, dense0, got0 = mag.copy(), dense.copy(), got.copy()
    mag0[0, 0] = dense0[0, 0] = 0.0
    got0[0, 0] = 0
    assert moe.compare(got0, dense0, mag0)[2]
    got0[0, 0] = moe.f32_to_bf16(np.array([1e-3], np.float32))[0]
    assert not moe.compare(got0, dense0, mag0)[2]
    nan = got.copy()
    nan[1, 1] = 0x7FC0
    assert not moe.compare(nan, dense, mag)[2]


def _small(**change):
    return config_from_dict({**preset_data("small"), **change})


@pytest.mark.parametrize("fmt", ["BF16", "BlockwiseFP8"])
def test_expert_groups_are_the_rows_routed_to_each_expert(fmt, seed):
    """Every row of a group is a (token, slot) routed to that group's global expert, and the
    groups cover every routed row once (BlockwiseFP8: groups padded to 4 rows)."""
    rng = np.random.default_rng(seed)
    cfg = _small(format=fmt)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = reference.dispatch(cfg, toks, ids)
    L = cfg.layout.n_local_experts
    seen = 0
    for res in results:
        groups = moe.expert_groups(cfg, res)
        assert all(res.rank * L <= e < (res.rank + 1) * L for e, _, _ in groups)
        for e, a, b in groups:
            rows = res.src_info[a:b]
            # every row's source slot names expert e, on some source rank
            assert all(any(ids[s][t, k] == e for s in range(cfg.n_ranks)) for t, k in rows), \
                f"seed {seed}: rank {res.rank} expert {e}"
            seen += b - a
    assert seen == sum(int(a.size) for a in ids), f"seed {seed}: every routed row once"


@pytest.mark.parametrize("fmt", format_cases.QUANT)
def test_quantised_rows_reach_the_experts_as_the_dense_tokens(fmt, seed):
    """A quantising format's dispatched rows, dequantised to BF16, equal the dense MoE's
    input for their source token (the same round trip through the format)."""
    rng = np.random.default_rng(seed)
    cfg = _small(format=fmt)
    toks, ids = routing.routing(rng, cfg, 8)
    f = cfg.token_fmt
    dense_in = [moe.format_round_trip(f, t) for t in toks]
    for res in reference.dispatch(cfg, toks, ids):
        rows = moe.as_bf16(f, res.out_tokens, res.out_scales)
        src = source_of_rows(res)
        for e, a, b in moe.expert_groups(cfg, res):
            for row in range(a, b):
                t = res.src_info[row, 0]
                assert np.array_equal(rows[row], dense_in[src[row]][t]), \
                    f"seed {seed}: {fmt} rank {res.rank} row {row}"
