"""Without a GPU every entry point raises one error type, ``CudaUnavailableError`` (exit 1 on
the command line), and a bad argument is reported first, as a ``ValueError`` naming it (exit
2 on the command line), whether a GPU is there or not. The machine is made GPU-less here by
the driver probe, so the tests mean the same on a GPU machine."""

from __future__ import annotations

import re

import pytest

import epgen
from backends import cuda
from backends.cuda import stream
from backends.cuda.errors import CudaUnavailableError
from epgen import cli, presets
from epgen.runtime import shmem_world as sw
from epgen.runtime.p2p_world import P2PWorld
from epgen.runtime.world import EmulatedWorld


@pytest.fixture
def no_gpu(monkeypatch):
    stream._reset_probe()
    monkeypatch.setattr(stream, "_probe", lambda: (False, "no GPU in this test"))
    yield
    stream._reset_probe()


@pytest.fixture
def cfg():
    return presets.load_preset("small")


def test_every_world_without_a_gpu_raises_cuda_unavailable(no_gpu, cfg):
    for make in (lambda: EmulatedWorld(cfg), lambda: P2PWorld(cfg),
                 lambda: P2PWorld(cfg, devices=[0, 0])):
        with pytest.raises(CudaUnavailableError, match="no usable CUDA GPU"):
            make()
    with pytest.raises(CudaUnavailableError, match="ShmemWorld: no usable CUDA GPU"):
        sw.resolve_device(None, cuda.device_count(), 0)


@pytest.mark.parametrize("world", [EmulatedWorld, P2PWorld])
@pytest.mark.parametrize("timeout_ns", [-1, 1 << 64, 1.5, True, "2"])
def test_bad_timeout_before_the_gpu(no_gpu, cfg, world, timeout_ns):
    with pytest.raises(ValueError, match=rf"{world.__name__}: timeout_ns must be None .*"
                                         rf"got {re.escape(repr(timeout_ns))}"):
        world(cfg, timeout_ns=timeout_ns)


@pytest.mark.parametrize("device", [-1, "0", 1.0, True])
def test_bad_device_before_the_gpu(no_gpu, cfg, device):
    with pytest.raises(ValueError, match=r"EmulatedWorld: device = .* is not a GPU ordinal"):
        EmulatedWorld(cfg, device=device)
    with pytest.raises(ValueError, match=r"ShmemWorld: device = .* is not a GPU ordinal"):
        sw.resolve_device(device, 0, 0)


@pytest.mark.parametrize("devices, message", [
    (["x", 0], r"devices\[0\] = 'x' is not a GPU ordinal"),
    ([0, -1], r"devices\[1\] = -1 is not a GPU ordinal"),
    ([0], "devices has 1 entries, one per rank is 2"),
    (7, "devices = 7 is not a sequence of GPU ordinals"),
])
def test_bad_devices_before_the_gpu(no_gpu, cfg, devices, message):
    with pytest.raises(ValueError, match=message):
        P2PWorld(cfg, devices=devices)


def test_other_world_arguments_before_the_gpu(no_gpu, cfg):
    with pytest.raises(ValueError, match="batched must be a bool"):
        EmulatedWorld(cfg, batched="yes")
    with pytest.raises(ValueError, match="backend must be one of"):
        P2PWorld(cfg, backend="gpu")
    with pytest.raises(ValueError, match="input_scale"):
        EmulatedWorld(cfg.replace(token_fmt=epgen.NVFP4Format(256, 4)), input_scale=0.0)


def test_the_benchmarks_without_a_gpu(no_gpu, cfg):
    from epgen.bench import driver, options, p2p

    parser = cli.build_parser()
    for argv in (["bench", "--preset", "small"], ["bench", "--world", "p2p"]):
        args = parser.parse_args(argv)
        plan = options.plan_from_args(args.parser, args, cfg, [cfg.max_tokens_per_rank])
        with pytest.raises(CudaUnavailableError, match="no usable CUDA GPU"):
            (p2p if args.world == "p2p" else driver).run(plan, lambda *a, **k: None)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "33"], "argument --tokens: must be in [0, max_tokens_per_rank=32], got 33"),
    (["--calls", "0"], "argument --calls: must be >= 1, got 0"),
    (["--tokens", "0", "--calls", "-2"], "argument --calls: must be >= 1, got -2"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--world", "p2p", "--calls", "0"], "argument --calls"),
    (["--world", "shmem", "--calls", "0"], "argument --calls"),
    (["--world", "p2p", "--devices", "0"], "argument --devices"),
    (["--set", "format=NVFP4", "--input-scale", "0"], "argument --input-scale"),
])
def test_cli_run_reports_the_bad_argument_not_the_gpu(no_gpu, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--preset", "small", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "GPU" not in err.replace("GPU ordinals", ""), err


@pytest.mark.parametrize("world", ["emulated", "p2p"])
def test_cli_run_without_a_gpu_is_exit_1(no_gpu, capsys, world):
    assert cli.main(["run", "--preset", "small", "--tokens", "0", "--world", world]) == 1
    err = capsys.readouterr().err
    assert err.startswith("epgen: error: ") and "no usable CUDA GPU" in err, err

