"""CPU tests of benchmarks/dispatch_bench.py, the wrapper of ``epgen.bench`` that keeps the
script's options: the configuration it builds, ``--flag`` as a variant, usage errors, a light
import, the error without a GPU. The benchmark itself is tested in test_bench.py."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from world_checks import assert_imports_light

from epgen import presets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_PATH = os.path.join(REPO, "benchmarks", "dispatch_bench.py")


def _load():
    name = "epgen_dispatch_bench_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH_PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


bench = _load()


def test_defaults_are_the_decode_preset_at_decode_and_prefill():
    p, args = bench.parse_args([])
    assert p.base == presets.load_preset("decode")
    assert p.tokens == (128, 4096)
    assert [v.label for v in p.variants] == ["default"] and p.arch is None
    assert args.json is None and args.plot is None


def test_size_options_and_flags():
    p, args = bench.parse_args(
        ["--ranks", "4", "--hidden", "2048", "--topk", "4", "--experts", "64", "--tokens",
         "256,1024", "--threads", "256", "--sms", "17", "--iters", "7", "--warmup", "0",
         "--json", "x.json", "--routing", "zipf", "--zipf-s", "1.2", "--block-capacity", "256",
         "--sets", "4", "--flag", "ep_prod_reserve", "--flag", "ep_final_layout", "--no-gate"])
    b = p.base
    assert (b.n_ranks, b.p2p_world_size, b.token_fmt.hid_dim, b.token_fmt.top_k) == (4, 4, 2048, 4)
    assert (b.n_experts, b.num_threads, b.n_sms) == (64, 256, 17)
    assert p.tokens == (256, 1024) and (p.iters, p.warmup, p.sets) == (7, 0, 4)
    assert (p.routing, p.zipf_s, p.block_capacity, p.gate) == ("zipf", 1.2, 256, False)
    assert args.json == "x.json"
    (v,) = p.variants
    assert v.label == "ep_final_layout,ep_prod_reserve"
    assert dict(v.overrides) == {"ep_final_layout": True, "ep_prod_reserve": True}
    assert bench.parse_args(["--tokens", "128", "4096"])[0].tokens == (128, 4096)
    p, _ = bench.parse_args(["--variant", "default", "--variant", "f=ep_final_layout"])
    assert [v.label for v in p.variants] == ["default", "f"]


@pytest.mark.parametrize("argv", [
    ["--routing", "skewed"], ["--tokens", "0"], ["--tokens", "x"], ["--block-capacity", "big"],
    ["--block-capacity", "0"], ["--experts", "100"], ["--iters", "0"], ["--warmup", "-1"],
    ["--mem-fraction", "1.5"], ["--check-rank", "8"], ["--flag", "no_such_flag"],
    ["--threads", "100"], ["--zipf-s", "0"], ["--flag", "ep_prod_reserve"],
    ["--flag", "ep_final_layout", "--variant", "default"],
])
def test_rejects(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2
    assert "dispatch_bench: error:" in capsys.readouterr().err


def test_import_is_light():
    assert_imports_light("import importlib.util, sys; "
                         f"spec = importlib.util.spec_from_file_location('b', {BENCH_PATH!r}); "
                         "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m; "
                         "spec.loader.exec_module(m); m.build_parser()", REPO)


def test_main_without_gpu_says_so():
    from backends import cuda
    if cuda.gpu_available():
        pytest.skip("a GPU is available here")
    with pytest.raises(SystemExit) as info:
        bench.main(["--tokens", "128"])
    assert "no usable CUDA GPU" in str(info.value.code)
