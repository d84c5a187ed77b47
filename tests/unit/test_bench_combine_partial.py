"""``epgen bench --op combine --combine-partial`` (the partial-reduce combine timed next to the
plain one, docs/combine.md "Partial reduce"): its argument handling and the extra-combine
arms it shares with ``--combine-fp8``, on the host."""

from __future__ import annotations

import re

import pytest

from epgen.bench import combine

from test_bench import bench_args, tiny_cfg, usage_error
from test_bench_shmem import SMALL_SHMEM, shmem_plan


def test_the_flag_reaches_the_plan():
    p = bench_args("--op", "combine", "--combine-partial", "--variant", "default",
                   "--variant", "dedup=ep_rank_dedup")
    assert p.op == "combine" and p.combine_partial is True and p.combine_fp8 is False
    assert p.describe()["combine_partial"] is True
    assert bench_args("--op", "combine").combine_partial is False


@pytest.mark.parametrize("argv, match", [
    (["--combine-partial"], "with --op combine on --world emulated or shmem, not --op "
                            "dispatch"),
    (["--op", "moe", "--combine-partial"], "not --op moe"),
    (["--op", "combine", "--world", "p2p", "--combine-partial"], "--world p2p"),
    (["--op", "combine", "--combine-partial", "--combine-fp8"],
     "not with --combine-fp8 .*kernels refuse the pair"),
])
def test_refusals_name_the_option(argv, match, capsys):
    err = usage_error(capsys, *argv)
    assert "argument --combine-partial" in err and re.search(match, err), err


def test_a_variant_without_dedup_is_not_ausage_error():
    """The plain combine of a variant without ``ep_rank_dedup`` still runs (the run reports
    why its partial combine does not, ``driver``)."""
    p = bench_args("--op", "combine", "--combine-partial")
    assert p.combine_partial and not p.config(p.tokens[0], p.variants[0]).ep_rank_dedup


def test_arms_in_order_and_their_flags():
    assert combine.extra_arms() == ()
    assert combine.extra_arms(True, True) == (combine.FP8_ARM, combine.PARTIAL_ARM)
    assert combine.FP8_ARM.key == "combine_fp8"
    assert combine.FP8_ARM.speedup_key == "fp8_speedup_vs_bf16"
    assert combine.PARTIAL_ARM.key == "combine_partial"
    assert combine.PARTIAL_ARM.speedup_key == "partial_speedup_vs_plain"
    assert combine.PARTIAL_ARM.flags == {"fp8": False, "partial_reduce": True}
    w = [object()]
    assert combine.FP8_ARM.call_weights(w) is w
    assert combine.PARTIAL_ARM.call_weights(w) is None     # the dispatched weights


def test_check_arm_names_what_is_missing():
    with pytest.raises(ValueError, match="partial_reduce: needs ep_rank_dedup=True"):
        combine.check_arm(tiny_cfg(H=128), combine.PARTIAL_ARM)
    combine.check_arm(tiny_cfg(H=128, ep_rank_dedup=True), combine.PARTIAL_ARM)
    with pytest.raises(ValueError, match="combine: fp8=True needs hid_dim"):
        combine.check_arm(tiny_cfg(H=16), combine.FP8_ARM)


def test_measure_world_refuses_partial_outside_the_combine():
    with pytest.raises(ValueError, match="combine_partial times the combine alone"):
        combine.measure_world(tiny_cfg(H=128, ep_rank_dedup=True), [], [], 1, 0, None,
                              op="moe", progress=lambda m: None, combine_partial=True)


def test_the_shmem_benchmark_takes_it_on_a_dedup_configuration(capsys):
    p = shmem_plan(*SMALL_SHMEM, "--set", "ep_rank_dedup=true", "--op", "combine",
                   "--combine-partial")
    assert p.combine_partial and p.arms == (combine.PARTIAL_ARM,)
    assert p.describe()["combine_partial"] is True


@pytest.mark.parametrize("extra, match", [
    ([], r"argument --set: p2p_world_size=\d+: --combine-partial: partial_reduce: needs "
         r"ep_rank_dedup=True"),
    (["--set", "ep_rank_dedup=true", "--combine-fp8"],
     "argument --combine-partial: not with --combine-fp8"),
])
def test_the_shmem_benchmark_refusals(extra, match, capsys):
    """One configuration per SHMEM run: without ``ep_rank_dedup`` there is nothing to time,
    a usage error naming the option and the rule."""
    err = usage_error(capsys, *SMALL_SHMEM, "--op", "combine", "--combine-partial", *extra)
    assert re.search(match, err), err


def test_the_shmem_benchmark_script_passes_combine_args_to_the_combine_only(tmp_path):
    """benchmarks/shmem_bench.sh with ``COMBINE_ARGS="--combine-partial"`` and
    ``FLAGS=ep_rank_dedup`` (a recording stand-in for python): the combine launches parse
    into plans timing the partial-reduce combine, the dispatch launches take no extra
    argument."""
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@" >> "$OUT/calls.txt"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path), "PES": "2",
           "OPS": "dispatch combine", "FLAGS": "ep_rank_dedup",
           "COMBINE_ARGS": "--combine-partial", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", os.path.join(repo, "benchmarks", "shmem_bench.sh"),
                           "decode"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = []
    for call in (tmp_path / "calls.txt").read_text().splitlines():
        p = shmem_plan(*call.split(" -- ", 1)[1].split()[4:])
        got.append((p.op, p.arms))
    assert got == [("dispatch", ()), ("combine", (combine.PARTIAL_ARM,))]
