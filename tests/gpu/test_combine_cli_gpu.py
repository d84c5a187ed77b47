"""``epgen run --combine`` on the GPU: the small preset on streams, as a CUDA graph and as the
fused launch, each call's combine checked against the reference. The simulator's runs and
the refusals: tests/sim/test_combine_cli.py."""

from __future__ import annotations

import pytest

from cli_runs import run_cli


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["--graph"], ["--fused"]], ids=["stream", "graph", "fused"])
def test_run_combine_on_the_gpu(capsys, extra, seed):
    status, out, err = run_cli(capsys, "run", "--preset", "small", "--calls", "3",
                               "--combine", "--seed", str(seed), *extra)
    assert status == 0, f"seed {seed}: {out}{err}"
    assert out.count("  combine: matches the reference") == 3, out
