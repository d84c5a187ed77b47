"""``examples/moe_layer.py`` run as a script from the repository root, for its tests on the
simulator and on the GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "moe_layer.py")


def run_example(args, timeout=300, cmd=None, env=None):
    """The example with ``args`` (or the command ``cmd``), ``PYTHONPATH`` the repository:
    (the completed process, its stdout and stderr as one text)."""
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    proc = subprocess.run(cmd or [sys.executable, SCRIPT, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr


def assert_passes(proc, text, n_ranks=2):
    """The run exited 0 and every one of ``n_ranks`` ranks printed its PASS line."""
    assert proc.returncode == 0, text[-4000:]
    for r in range(n_ranks):
        assert re.search(rf"^(\[rank {r}\] )?rank {r}: max abs error \S+, max rel error \S+ "
                         rf"PASS$", proc.stdout, re.M), text[-4000:]
    assert "FAIL" not in proc.stdout, text[-4000:]
