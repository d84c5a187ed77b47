"""The experiment helpers under benchmarks/experiments that run on the CPU: ``with_settings``
(module constants changed for one epgen command)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from epgen.kernels import dispatch_async

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "experiments"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("setting,match", [
    ("epgen.kernels.dispatch_async.SEND_DSTS_IN_SHARED", "MODULE.NAME=VALUE"),
    ("SEND_DSTS_IN_SHARED=True", "MODULE.NAME=VALUE"),
    ("epgen.kernels.dispatch_async.warp_broadcast_tokens=1", "upper-case NAME"),
    ("epgen.kernels.dispatch_async.NO_SUCH=1", "has no constant NO_SUCH"),
])
def test_with_settings_refuses_bad_settings(setting, match):
    with pytest.raises(ValueError, match=match):
        load("with_settings").apply(setting)


def test_with_settings_changes_the_generated_code(monkeypatch, capsys):
    monkeypatch.setattr(dispatch_async, "SEND_DSTS_IN_SHARED", False)
    monkeypatch.setattr(dispatch_async, "SEND_WARPS_PER_TOKEN_MAX", 1)   # shared tables too
    ws = load("with_settings")
    assert ws.main(["--", "ptx", "--preset", "small"]) == 0
    plain = capsys.readouterr().out
    assert ws.main(["epgen.kernels.dispatch_async.SEND_DSTS_IN_SHARED=True", "--", "ptx",
                    "--preset", "small"]) == 0
    shared = capsys.readouterr().out
    assert dispatch_async.SEND_DSTS_IN_SHARED is True
    assert "send_dsts" not in plain
    assert "send_dsts" in shared and re.search(r"ld\.shared\.(v[24]\.)?[bu]64", shared)


def test_gpu_session_settings_name_existing_constants():
    """Every ``$B.NAME=`` / ``$D.NAME=`` arm of benchmarks/gpu_session.sh names a constant
    that exists (a renamed knob would make the A/B arm fail only on the GPU machine)."""
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    modules = dict(re.findall(r"^([A-Z])=(epgen[\w.]+)$", script, re.M))
    used = set(re.findall(r"\$([A-Z])\.([A-Z][A-Z0-9_]*)=", script))
    assert used, "no settings found: the pattern no longer matches the script"
    ws = load("with_settings")
    for var, name in sorted(used):
        module = importlib.import_module(modules[var])
        assert hasattr(module, name), f"gpu_session.sh sets ${var}.{name}: no such constant"
        ws.apply(f"{modules[var]}.{name}={getattr(module, name)!r}")   # the form it accepts
