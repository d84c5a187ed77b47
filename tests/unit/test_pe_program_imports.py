"""The PE program of the SHMEM GPU tests (``tests/gpu/test_shmem_gpu.py`` run as a script by
``epgen launch``) starts on a machine without a GPU as far as its imports go: run with no
arguments it prints its usage and exits, which it can only do once every module it imports
(the support modules among them) was found on the path the GPU tests give it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import test_shmem_gpu

SCRIPT = Path(test_shmem_gpu.__file__).resolve()


def test_pe_program_imports_on_the_path_the_gpu_tests_give_it():
    env = {**os.environ, "PYTHONPATH": test_shmem_gpu.PE_PYTHONPATH}
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=test_shmem_gpu.REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "usage: test_shmem_gpu.py combine" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
