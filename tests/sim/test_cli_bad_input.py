"""The ``epgen`` command line on bad input: every file option refused before any work (a usage
error naming the option, no traceback), a command that is not executable, ``--input-scale``
that is not finite and positive, the simulator seed's range (the API and ``--seed`` agree),
a write that fails anyway; and ``epgen variants``' lines as the README describes them."""

from __future__ import annotations

import pytest

from cli_runs import run_cli

from epgen import goldens, variants
from epgen.commands import run_options

SIM_TINY = ["--backend", "sim", "--preset", "small", "--set", "n_experts=4", "--set",
            "hid_dim=16", "--set", "top_k=2", "--set", "max_tokens_per_rank=4", "--set",
            "num_threads=64", "--set", "n_sms=4"]


@pytest.fixture
def no_world(monkeypatch):
    """Building a world fails the test: the command must stop before it."""
    monkeypatch.setattr(run_options, "make_world",
                        lambda *a, **k: pytest.fail("built a world"))


def test_run_trace_into_a_missing_directory_is_refused_before_running(capsys, no_world):
    status, out, err = run_cli(capsys, "run", "--backend", "sim", "--preset", "small",
                               "--trace", "/nonexistent/dir/t.json")
    assert status == 2, err
    assert "argument --trace" in err and "/nonexistent/dir" in err
    assert "Traceback" not in err and out == ""


# every option naming a file a command writes, with the arguments that reach it
FILE_OPTIONS = {
    "ptx -o": (["ptx", "--preset", "small", "-o"], "-o/--output"),
    "ptx --variant -o": (["ptx", "--variant", "demo/copy16", "-o"], "-o/--output"),
    "inspect -o": (["inspect", "--preset", "small", "-o"], "-o/--output"),
    "run --trace": (["run", *SIM_TINY, "--trace"], "--trace"),
    "bench --json": (["bench", "--json"], "--json"),
    "bench --plot": (["bench", "--plot"], "--plot"),
    "check-ordering --json": (["check-ordering", "ep/small", "--json"], "--json"),
}


@pytest.mark.parametrize("where", ["missing_dir", "a_directory"])
@pytest.mark.parametrize("name", FILE_OPTIONS, ids=list(FILE_OPTIONS))
def test_every_file_option_is_checked_before_any_work(capsys, tmp_path, no_world, name, where):
    argv, option = FILE_OPTIONS[name]
    path = tmp_path / "no_such_dir" / "out.file" if where == "missing_dir" else tmp_path
    status, out, err = run_cli(capsys, *argv, str(path))
    assert status == 2, err
    assert f"argument {option}: cannot write {path}" in err, err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "no_such_dir").exists()


def test_launch_of_a_missing_command_is_a_usage_error(capsys):
    status, _, err = run_cli(capsys, "launch", "-n", "1", "--", "/nonexistent/cmd")
    assert status == 2
    assert "argument CMD" in err and "/nonexistent/cmd" in err and "Traceback" not in err


def test_a_write_that_fails_after_the_check_is_one_error_line(capsys, tmp_path, monkeypatch):
    """A path that passes the up-front check but fails when written (here: the trace export
    raising PermissionError) ends in ``epgen: error: cannot write ...``, exit 1."""
    from epgen.runtime import trace_export

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(trace_export, "write", refuse)
    monkeypatch.delenv("EPGEN_TRACEBACK", raising=False)
    path = tmp_path / "t.json"
    status, _, err = run_cli(capsys, "run", *SIM_TINY, "--calls", "1", "--seed", "0",
                             "--trace", str(path))
    assert status == 1
    assert err.splitlines()[-1] == f"epgen: error: cannot write {path}: Permission denied"


@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
@pytest.mark.parametrize("scale", ["-1", "0", "nan", "inf", "-inf"])
def test_input_scale_must_be_finite_and_positive(capsys, no_world, fmt, scale):
    status, _, err = run_cli(capsys, "run", "--backend", "sim", "--preset", "small", "--set",
                             f"format={fmt}", "--set", "hid_dim=64", f"--input-scale={scale}")
    assert status == 2, err
    assert "argument --input-scale" in err and "Traceback" not in err


def test_batched_needs_every_rank_on_one_gpu(capsys, no_world):
    status, _, err = run_cli(capsys, "run", *SIM_TINY, "--world", "p2p", "--batched")
    assert status == 2 and "argument --batched" in err and "--world emulated" in err


def test_combine_graph_needs_a_world_that_captures_it(capsys, no_world):
    """``--combine --graph`` replays one graph of dispatch and combine
    (``world.capture_moe``): on a world without one it is a usage error naming ``--graph``,
    before any world is built."""
    from epgen.runtime.p2p_world import P2PWorld

    if hasattr(P2PWorld, "capture_moe"):
        pytest.skip("P2PWorld captures dispatch + combine graphs")
    status, _, err = run_cli(capsys, "run", *SIM_TINY, "--world", "p2p", "--combine",
                             "--graph")
    assert status == 2 and "argument --graph" in err and "capture_moe" in err


def test_sim_seed_range_is_the_same_in_the_api_and_the_cli(capsys, no_world):
    """A negative simulator seed would repeat the run of its absolute value (Python's
    ``random.Random``): the worlds refuse it as ``epgen run --seed`` does."""
    from epgen.presets import load_preset
    from epgen.runtime.p2p_world import P2PWorld
    from epgen.runtime.world import EmulatedWorld

    cfg = load_preset("small")
    for world in (EmulatedWorld, P2PWorld):
        with pytest.raises(ValueError, match=r"sim_seed must be >= 0, got -1"):
            world(cfg, backend="sim", sim_seed=-1)
    status, _, err = run_cli(capsys, "run", "--backend", "sim", "--preset", "small",
                             "--seed", "-1")
    assert status == 2 and "argument --seed: must be >= 0" in err


def test_every_variant_built_from_a_configuration_says_whether_combine_builds(capsys):
    """The README: one line per variant with what it sets; the line of every ``ep/`` and
    ``combine/`` variant (the test kernels aside) ends in ``[combine: ...]``; no line lists
    empty changes (``+ :``)."""
    status, out, _ = run_cli(capsys, "variants")
    assert status == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert set(lines) == set(goldens.names())
    test_kernels = {"ep/fused_roles", "ep/sm_remap", "ep/sm_remap_se"}
    for name, line in lines.items():
        assert " + :" not in line and "+ :" not in line, line
        tagged = name.split("/")[0] in ("ep", "combine") and name not in test_kernels
        assert ("[combine: " in line) == tagged, line
        assert (variants.variant_config(name) is not None) == tagged, name
    assert lines["combine/fused"].split(None, 1)[1] == \
        "preset small: the fused kernel ep_combine [combine: yes]"
