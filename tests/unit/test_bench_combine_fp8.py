"""``epgen bench --op combine --combine-fp8`` (the FP8 combine timed next to the BF16 one,
docs/combine.md "FP8 combine"): its argument handling and its bytes, on the host."""

from __future__ import annotations

import re

import pytest

from epgen.bench import combine

from test_bench import bench_args, tiny_cfg, usage_error
from test_bench_shmem import SMALL_SHMEM, shmem_plan


def test_the_flag_reaches_the_plan():
    p = bench_args("--op", "combine", "--combine-fp8")
    assert p.op == "combine" and p.combine_fp8 is True
    assert p.describe()["combine_fp8"] is True
    assert bench_args("--op", "combine").combine_fp8 is False


@pytest.mark.parametrize("argv, match", [
    (["--combine-fp8"], "with --op combine on --world emulated or shmem, not --op dispatch"),
    (["--op", "moe", "--combine-fp8"], "not --op moe"),
    (["--op", "combine", "--world", "p2p", "--combine-fp8"], "--world p2p"),
    (["--op", "combine", "--combine-fp8", "--preset", "small", "--set", "hid_dim=64"],
     r"hid_dim to be a multiple of 128.*hid_dim=64"),
])
def test_refusals_name_the_option(argv, match, capsys):
    err = usage_error(capsys, *argv)
    assert "argument --combine-fp8" in err and re.search(match, err), err


def test_the_shmem_benchmark_takes_it_with_the_combine_only(capsys):
    p = shmem_plan(*SMALL_SHMEM, "--op", "combine", "--combine-fp8")
    assert p.combine_fp8 and p.arms == (combine.FP8_ARM,) and p.describe()["combine_fp8"]
    err = usage_error(capsys, *SMALL_SHMEM, "--op", "moe", "--combine-fp8")
    assert "argument --combine-fp8: times an extra combine next to the plain one: with " \
           "--op combine, not --op moe" in err, err


def test_fp8_combine_bytes_by_hand():
    cfg = tiny_cfg(T=8, H=256, K=2, R=2)
    b = combine.fp8_combine_bytes(cfg, 8)
    n = 2 * 8 * 2                                 # R * T * K slots
    assert b["rows_read"] == n * 256 * 2
    assert b["slots"] == n * (256 + 16)           # codes + 2 scales padded to 16 bytes
    assert b["output"] == 2 * 8 * 256 * 2
    assert b["total"] == b["rows_read"] + 2 * b["slots"] + b["output"]
    assert b["link_ratio"] == 272 / 512


def test_measure_world_refuses_fp8_outside_the_combine():
    with pytest.raises(ValueError, match="combine_fp8 times the combine alone"):
        combine.measure_world(tiny_cfg(H=128), [], [], 1, 0, None, op="moe",
                              progress=lambda m: None, combine_fp8=True)
