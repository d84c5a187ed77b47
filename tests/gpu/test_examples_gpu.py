"""``examples/moe_layer.py`` on a GPU, against a dense single-device MoE: the default one-GPU
mode and ``--world shmem`` under ``epgen launch``. On the CPU (the simulator mode, its pieces,
usage errors): tests/sim/test_examples.py.
"""

from __future__ import annotations

import os
import sys

import pytest

from example_runs import SCRIPT, assert_passes, run_example


def _needs_torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


@pytest.mark.gpu
def test_one_gpu_torch_mode_passes(seed):
    """``python examples/moe_layer.py``: EmulatedWorld on one GPU (the decode preset, 8
    ranks), torch BF16 experts."""
    _needs_torch_cuda()
    proc, text = run_example(["--seed", str(seed)], timeout=600)
    assert_passes(proc, text, n_ranks=8)
    proc, text = run_example(["--seed", str(seed), "--plant", "wrong-expert"], timeout=600)
    assert proc.returncode == 1 and "FAIL" in proc.stdout, text[-4000:]


@pytest.mark.gpu
def test_shmem_mode_passes_under_the_launcher(seed):
    """``epgen launch -n 2 -- python examples/moe_layer.py --world shmem --preset small``."""
    _needs_torch_cuda()
    from backends.cuda import nvshmem_host
    try:
        nvshmem_host.find_host_library()
    except nvshmem_host.NvshmemUnavailableError as e:
        pytest.skip(str(e))
    env = {k: os.environ.get(k, v) for k, v in
           (("NVSHMEM_REMOTE_TRANSPORT", "none"), ("NVSHMEM_DISABLE_NVLS", "1"))}
    cmd = [sys.executable, "-m", "epgen", "launch", "-n", "2", "--timeout", "300", "--",
           sys.executable, SCRIPT, "--world", "shmem", "--preset", "small", "--seed",
           str(seed)]
    proc, text = run_example(None, timeout=400, cmd=cmd, env=env)
    assert_passes(proc, text, n_ranks=2)
