"""One ``compute-sanitizer --tool memcheck`` run of ``epgen run`` on the GPU (the ``small`` run
of ``benchmarks/sanitizer_runs.py``), where the tool is on the PATH; ``benchmarks/gpu_session.sh
sanitizer`` runs them all. The session script's checks with a fake tool:
tests/unit/test_sanitizer_session.py."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import sanitizer_runs  # noqa: E402


@pytest.mark.gpu
def test_small_run_is_sanitizer_clean():
    """One memcheck run where compute-sanitizer exists (the session mode runs them all)."""
    import shutil

    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("no compute-sanitizer on PATH")
    args = dict(sanitizer_runs.runs())["small"]
    proc = subprocess.run([exe, "--tool", "memcheck", sys.executable, "-m", "epgen", "run",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, proc.stdout[-4000:]
