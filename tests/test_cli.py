"""The ``epgen`` command line: help, subcommand table, ``ptx``, ``variants``, ``diff``, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import golden_util
import ir
from epgen import cli, goldens
from ir import Scope, Sem
from ir import types as T

TINY = "test/tiny"
TINY2 = "test/tiny_relaxed"


def _tiny_module(sem: Sem, scope: Scope | None) -> ir.Module:
    kb = ir.KernelBuilder("tiny", 32)
    flag = kb.param("flag", T.ptr_global)
    with kb.role("main") as r:
        with r.if_(r.tid.eq(0)):
            r.store(flag, ir.const(1), sem, scope)
    return ir.Module("tiny", (kb.build(),))


@pytest.fixture
def tiny_variants():
    """Two test-only golden variants, registered for one test."""
    goldens.load_all()
    added = {TINY: lambda: _tiny_module(Sem.RELEASE, Scope.SYS),
             TINY2: lambda: _tiny_module(Sem.RELAXED, Scope.GPU)}
    assert not set(added) & set(goldens.GOLDENS)
    goldens.GOLDENS.update(added)
    yield sorted(added)
    for name in added:
        goldens.GOLDENS.pop(name, None)


def _needs_backend():
    golden_util.import_or_skip_unwritten("backends.nvptx")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``epgen *argv`` in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main(list(argv))
    except SystemExit as e:  # argparse: --help, usage errors
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def test_help_lists_every_subcommand(capsys):
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0
    for name in ("ptx", "inspect", "variants", "diff", "run", "bench"):
        assert name in cli.COMMANDS
        assert f"    {name} " in out, f"{name} missing from epgen --help:\n{out}"
    assert set(cli.COMMANDS) == {"ptx", "inspect", "variants", "diff", "run", "bench"}


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_subcommand_help(capsys, command):
    status, out, _ = run_cli(capsys, command, "--help")
    assert status == 0
    assert f"usage: epgen {command}" in out


def test_python_m_epgen_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(golden_util.REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-m", "epgen", "--help"], capture_output=True,
                          text=True, cwd=golden_util.REPO_ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: epgen" in proc.stdout
    for name in cli.COMMANDS:
        assert name in proc.stdout
    assert proc.stderr == ""


def test_no_command_is_a_usage_error(capsys):
    status, _, err = run_cli(capsys)
    assert status == 2
    assert "usage: epgen" in err and "Traceback" not in err


def test_variants_lists_registered_names(capsys, tiny_variants):
    status, out, _ = run_cli(capsys, "variants")
    assert status == 0
    listed = out.split()
    assert listed == sorted(goldens.GOLDENS)
    assert set(tiny_variants) <= set(listed)


def test_default_variant_is_registered():
    golden_util.import_or_skip_unwritten("epgen.demos")
    assert cli.DEFAULT_VARIANT in goldens.names()


def test_ptx_prints_an_entry(capsys, tiny_variants):
    _needs_backend()
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY)
    assert status == 0, err
    assert ".entry tiny" in out
    assert ".target sm_90" in out
    assert "st.release.sys" in out


@pytest.mark.parametrize("arch", cli.ARCHS)
def test_ptx_arch(capsys, tiny_variants, arch):
    _needs_backend()
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY, "--arch", arch)
    assert status == 0, err
    assert f".target {arch}" in out


def test_ptx_default_variant(capsys):
    _needs_backend()
    golden_util.import_or_skip_unwritten("epgen.demos")
    status, out, err = run_cli(capsys, "ptx")
    assert status == 0, err
    assert ".entry" in out


def test_ptx_to_file(capsys, tiny_variants, tmp_path):
    _needs_backend()
    path = tmp_path / "tiny.ptx"
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY, "-o", str(path))
    assert status == 0, err
    assert out == ""
    assert ".entry tiny" in path.read_text()


def test_ptx_ir_text(capsys, tiny_variants):
    golden_util.import_or_skip_unwritten("ir.printer")
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY, "--ir")
    assert status == 0, err
    assert "tiny" in out
    assert ".entry" not in out


def test_bad_arch_is_a_usage_error(capsys):
    status, out, err = run_cli(capsys, "ptx", "--arch", "sm_75")
    assert status == 2
    assert "--arch" in err and "sm_75" in err
    assert "Traceback" not in err and out == ""


def test_unknown_variant_is_a_usage_error(capsys, tiny_variants):
    status, _, err = run_cli(capsys, "ptx", "--variant", "test/tinyy")
    assert status == 2
    assert "--variant" in err and "test/tinyy" in err
    assert "did you mean 'test/tiny'" in err


def test_unknown_option_is_a_usage_error(capsys):
    status, _, err = run_cli(capsys, "variants", "--bogus")
    assert status == 2
    assert "--bogus" in err


def test_diff_with_itself_is_empty(capsys, tiny_variants):
    _needs_backend()
    status, out, err = run_cli(capsys, "diff", TINY, TINY)
    assert (status, out) == (0, ""), err


def test_diff_of_two_variants(capsys, tiny_variants):
    _needs_backend()
    status, out, err = run_cli(capsys, "diff", TINY, TINY2)
    assert status == 1, err
    assert out.startswith(f"--- {TINY}.ptx\n+++ {TINY2}.ptx\n")
    lines = out.splitlines()
    assert any(x.startswith("-") and "st.release.sys" in x for x in lines), out
    assert any(x.startswith("+") and "st.relaxed.gpu" in x for x in lines), out


def test_diff_unknown_variant(capsys, tiny_variants):
    status, _, err = run_cli(capsys, "diff", TINY, "test/nope")
    assert status == 2
    assert "test/nope" in err


@pytest.mark.parametrize("command", ["inspect", "run", "bench"])
def test_unimplemented_commands_say_so(capsys, command):
    status, out, err = run_cli(capsys, command)
    assert status == 2
    assert "not implemented yet" in err and out == ""


def test_command_errors_have_no_traceback(capsys, monkeypatch):
    def broken():
        raise ValueError("bad configuration: n_ranks must be a power of two")

    monkeypatch.setitem(goldens.GOLDENS, "test/broken", broken)
    status, _, err = run_cli(capsys, "ptx", "--variant", "test/broken")
    assert status == 1
    assert err == "epgen: error: bad configuration: n_ranks must be a power of two\n"
