"""``pe_programs.die``, the death of a PE in the rank-mask and shrink GPU tests, on a machine
without a GPU: a fake ``nvidia-cuda-mps-control`` on the PATH records what it is asked and a
fake ``cuda.bindings.driver`` records the synchronise. Under MPS the PE asks the daemon for
its servers, terminates itself as a client of each, waits for that, then dies by SIGKILL;
without MPS it only dies."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pe_programs

CONTROL = """#!/bin/sh
read line
echo "$line" >> "{log}"
case "$line" in get_server_list) echo 4242; echo 4343 ;; esac
"""
DRIVER = """def cuCtxSynchronize():
    with open({log!r}, "a") as f:
        f.write("synchronise\\n")
    return (0,)
"""


def _die_in_a_child(tmp_path: Path, mps: bool):
    log = tmp_path / "asked.log"
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(CONTROL.format(log=log))
    control.chmod(control.stat().st_mode | stat.S_IEXEC)
    (fake / "cuda" / "bindings").mkdir(parents=True)
    (fake / "cuda" / "__init__.py").write_text("")
    (fake / "cuda" / "bindings" / "__init__.py").write_text("")
    (fake / "cuda" / "bindings" / "driver.py").write_text(DRIVER.format(log=str(log)))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(fake), os.path.dirname(pe_programs.__file__)])
    if mps:
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(tmp_path / "pipe")
    code = "import os, pe_programs; print(os.getpid(), flush=True); pe_programs.die(3, 'here')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    asked = log.read_text().splitlines() if log.exists() else []
    return proc, asked


def test_under_mps_the_pe_is_terminated_as_a_client_then_killed(tmp_path):
    proc, asked = _die_in_a_child(tmp_path, mps=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = proc.stdout.split()[0]
    assert asked == ["get_server_list", f"terminate_client 4242 {pid}",
                     f"terminate_client 4343 {pid}", "synchronise"], asked
    assert "rank 3: killed here" in proc.stdout


def test_without_mps_the_pe_is_only_killed(tmp_path):
    proc, asked = _die_in_a_child(tmp_path, mps=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert asked == []
