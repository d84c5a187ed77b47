"""The ``epgen`` command line: help, subcommand table, ``ptx``, ``inspect``, ``variants``,
``diff``, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import epgen
import golden_util
import ir
from epgen import cli, goldens, presets
from epgen.commands import common
from epgen.commands import diff as diff_command
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
    for name in ("ptx", "inspect", "variants", "diff", "run", "bench", "launch"):
        assert name in cli.COMMANDS
        assert f"    {name} " in out, f"{name} missing from epgen --help:\n{out}"
    assert set(cli.COMMANDS) == {"ptx", "inspect", "variants", "diff", "run", "bench", "launch",
                                 "check-ordering"}


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
    listed = [line.split()[0] for line in out.splitlines()]
    assert listed == sorted(goldens.GOLDENS)
    assert set(tiny_variants) <= set(listed)


def test_variants_describe_what_they_set(capsys):
    """One line per variant: the name, then what it sets (preset + flags or format); every
    registered variant has a description."""
    from epgen.ep_goldens import FLAG_VARIANTS, GOLDEN_FORMATS
    status, out, _ = run_cli(capsys, "variants")
    assert status == 0
    about = dict(re.sub(r" \[combine: [^]]*\]$", "", line).split(None, 1)
                 for line in out.splitlines())
    assert set(about) == set(goldens.names())
    assert all(text.strip() for text in about.values())
    for name, (preset, changes) in FLAG_VARIANTS.items():
        text = about[f"ep/{name}"]
        assert text.startswith(f"preset {preset} + ")
        for key, value in changes.items():
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            assert f"{key}={shown}" in text, (name, text)
    for preset, suffix, fmt in GOLDEN_FORMATS:
        assert about[f"ep/{preset}_{suffix}"] == f"preset {preset} + format={fmt}"
    assert about["ep/small"].startswith("preset small (") and "no flags" in about["ep/small"]
    assert about["demo/copy16"].startswith("demo: ")
    assert goldens.describe("ep/send_join_named") == about["ep/send_join_named"]


def test_variants_matrix(capsys):
    """``--matrix``: every flag combination once; legal ones with the arguments that build
    them, illegal ones with the flags of the rules they break."""
    from epgen import variants
    status, out, _ = run_cli(capsys, "variants", "--matrix")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("# 10 flags on preset small, use_shmem=false: 72 legal, 952 "
                               "illegal of 1024")
    rows = [line.split(None, 2) for line in lines[1:]]
    assert len(rows) == 1024 and sum(kind == "legal" for kind, _, _ in rows) == 72
    combine = {rest.split(": ", 1)[0]: comb for _, comb, rest in rows}
    by_name = {rest.split(": ", 1)[0]: (kind, rest.split(": ", 1)[1]) for kind, _, rest in rows}
    for c in variants.combinations():
        assert combine[c.name] == ("-" if not c.legal else "combine=yes"
                                   if c.combine_error is None else "combine=no"), c.name
    n_combine = sum(v == "combine=yes" for v in combine.values())
    assert 0 < n_combine <= 72 and f"the combine kernels build for {n_combine} " in lines[0]
    assert combine["stock"] == "combine=yes"
    assert set(by_name) == {c.name for c in variants.combinations()}
    assert by_name["skip_a2a"] == ("legal", "--preset small --set n_ranks=1 --set "
                                            "p2p_world_size=1 --set n_experts=8 --set "
                                            "skip_a2a=true")
    kind, why = by_name["has_rank_flag"]
    assert kind == "illegal" and "has_rank_flag, ep_ord_r:" in why
    kind, why = by_name["ep_prod_reserve+ep_send_join_named"]
    assert kind == "illegal" and "ep_prod_reserve, ep_final_layout:" in why


def test_matrix_line_feeds_ptx(capsys):
    """The arguments ``variants --matrix`` prints for a combination work with ``epgen ptx``."""
    _, out, _ = run_cli(capsys, "variants", "--matrix")
    line = next(x for x in out.splitlines()
                if re.match(r"legal +combine=\w+ +skip_a2a\+has_rank_flag\+ep_ord_r: ", x))
    status, ptx, err = run_cli(capsys, "ptx", "--ir", *line.split(": ", 1)[1].split())
    assert status == 0, err
    assert "ep_dispatch_async" in ptx


def test_default_preset_exists_and_has_a_golden():
    assert common.DEFAULT_PRESET in presets.preset_names()
    assert f"ep/{common.DEFAULT_PRESET}" in goldens.names()


def test_ptx_prints_an_entry(capsys, tiny_variants):
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY)
    assert status == 0, err
    assert ".entry tiny" in out
    assert ".target sm_90" in out
    assert "st.release.sys" in out


@pytest.mark.parametrize("arch", common.ARCHS)
def test_ptx_arch(capsys, tiny_variants, arch):
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY, "--arch", arch)
    assert status == 0, err
    assert f".target {arch}" in out


def test_ptx_without_arguments_is_the_default_preset(capsys):
    status, out, err = run_cli(capsys, "ptx")
    assert status == 0, err
    assert ".entry ep_dispatch_async(" in out
    assert ".entry ep_dispatch_wait(" in out
    assert ".target sm_90" in out
    assert out == epgen.emit_ptx(presets.load_preset("default"), arch="sm_90")


def test_ptx_no_link_is_the_same_without_nvshmem_calls(capsys):
    status, out, err = run_cli(capsys, "ptx", "--preset", "small", "--no-link")
    assert status == 0, err
    assert out == epgen.emit_ptx(presets.load_preset("small"), arch="sm_90")
    assert out == epgen.emit_ptx(presets.load_preset("small"), arch="sm_90", link=False)


def test_ptx_preset_set_and_arch(capsys):
    status, out, err = run_cli(capsys, "ptx", "--preset", "small", "--set", "n_sms=20",
                               "--arch", "sm_80")
    assert status == 0, err
    assert ".target sm_80" in out
    assert ".entry ep_dispatch_async(" in out and ".entry ep_dispatch_wait(" in out
    cfg = presets.load_preset("small").replace(n_sms=20)
    assert out == epgen.emit_ptx(cfg, arch="sm_80")


def test_ptx_set_flag_and_format(capsys):
    status, out, err = run_cli(capsys, "ptx", "--preset", "small", "--set", "format=bf16",
                               "--set", "hid_dim=512", "--set", "top_k=2",
                               "--set", "fused_shared_expert=false", "--set", "timeout_ns=0")
    assert status == 0, err
    assert ".entry ep_dispatch_async(" in out


@pytest.mark.parametrize("option", [["--preset", "small"], ["--set", "n_sms=20"],
                                    ["--batched"], ["--trace"], ["--tune", "trace=true"]])
def test_variant_excludes_preset_and_set(capsys, option):
    status, out, err = run_cli(capsys, "ptx", "--variant", "demo/copy16", *option)
    assert status == 2 and out == ""
    assert "--variant" in err and "not allowed with --preset, --set, --tune, --batched" in err


def test_ptx_batched_and_traced(capsys):
    cfg = presets.load_preset("small")
    plain = run_cli(capsys, "ptx", "--preset", "small")[1]
    status, batched, err = run_cli(capsys, "ptx", "--preset", "small", "--batched")
    assert status == 0, err
    n = len(epgen.build_module(cfg).kernel("ep_dispatch_async").params)
    assert f".param .align 8 .b8 ep_dispatch_async_param_0[{cfg.n_ranks * n * 8}]" in batched
    assert "ep_dispatch_async_param_1" in plain and "ep_dispatch_async_param_1" not in batched
    status, text, err = run_cli(capsys, "ptx", "--preset", "small", "--batched", "--ir")
    assert f"batch_ranks={cfg.n_ranks} batch_blocks={cfg.n_sms}" in text
    status, traced, err = run_cli(capsys, "ptx", "--preset", "small", "--trace")
    assert status == 0, err
    # each trace stamp reads the clock and claims a ring slot
    for op in ("%globaltimer", "atom.relaxed.gpu.global.add.u32"):
        assert traced.count(op) > plain.count(op), op
    assert run_cli(capsys, "ptx", "--preset", "small", "--tune", "trace=true")[1] == traced


def test_ptx_tune_changes_the_generated_code(capsys):
    """``--tune send_warps_per_token_max=1``: decode's warps no longer share tokens, so the
    token groups' barriers (``bar.sync 4.., 128``) go from its PTX."""
    status, plain, err = run_cli(capsys, "ptx", "--preset", "decode")
    assert status == 0, err
    status, tuned, err = run_cli(capsys, "ptx", "--preset", "decode", "--tune",
                                 "send_warps_per_token_max=1")
    assert status == 0, err
    group_sync = r"\bbar\.sync\s+[4-9],\s*128;"
    assert re.search(group_sync, plain) and not re.search(group_sync, tuned)


def test_a_flag_without_effect_is_said_on_stderr_and_in_inspect(capsys):
    """ep_copy_role_split on the small preset's geometry builds the stock kernels: the CLI
    warns once on stderr (``ptx`` builds, the build's own warning is not repeated) and
    ``inspect`` lists it under the effective flags."""
    status, out, err = run_cli(capsys, "ptx", "--preset", "small", "--ir", "--set",
                               "ep_copy_role_split=true")
    assert status == 0, err
    assert err.count("ep_copy_role_split: no effect") == 1, err
    assert err.startswith("warning: ep_copy_role_split: no effect"), err
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--set",
                               "ep_copy_role_split=true")
    assert status in (0, 1), err
    assert "warning: ep_copy_role_split: no effect" in err
    flags = out.split("effective flags", 1)[1]
    assert re.search(r"ep_copy_role_split +no effect", flags), out
    status, out, err = run_cli(capsys, "inspect", "--preset", "small")
    assert "ep_copy_role_split" not in err and "no effect" not in out


def test_inspect_shows_the_tuning(capsys):
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--tune",
                               "send_warps_per_token_max=1")
    assert status in (0, 1), err
    assert out.splitlines()[0].startswith("preset small, tuned send_warps_per_token_max=1")
    assert re.search(r"tuning\.send_warps_per_token_max +1\n", out)


@pytest.mark.parametrize("tune,match", [
    ("no_such_field=1", "tuning.no_such_field: unknown field"),
    ("send_warps_per_token_max=3", "tuning.send_warps_per_token_max: must be a power of two"),
    ("trace=maybe", "tuning.trace: must be true or false"),
    ("send_warps_per_token_max", "KEY=VALUE"),
])
def test_ptx_bad_tune_is_a_usage_error(capsys, tune, match):
    with pytest.raises(SystemExit) as info:
        cli.main(["ptx", "--preset", "small", "--tune", tune])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--tune" in err and match in err


def test_ptx_ir_text_of_a_preset(capsys):
    status, out, err = run_cli(capsys, "ptx", "--preset", "small", "--ir")
    assert status == 0, err
    assert out.startswith("module ep_dispatch {")
    assert "kernel ep_dispatch_async " in out and "kernel ep_dispatch_wait " in out
    assert ".entry" not in out


@pytest.mark.parametrize("argv, names", [
    (["--set", "n_ranks=3"], ["n_experts", "n_ranks"]),
    (["--set", "bogus=1"], ["bogus", "unknown parameter"]),
    (["--set", "n_sms=many"], ["n_sms", "must be an integer"]),
    (["--set", "use_shmem=maybe"], ["use_shmem"]),
    (["--set", "num_threads=100"], ["num_threads", "warp size"]),
    (["--set", "format=NOPE"], ["format", "NOPE", "BF16"]),
    (["--set", "hid_dim=100"], ["hid_dim"]),
    (["--set", "p2p_world_size=4"], ["p2p_world_size", "SHMEM"]),
    (["--set", "n_sms"], ["--set", "KEY=VALUE"]),
    (["--preset", "defalt"], ["--preset", "did you mean 'default'"]),
])
@pytest.mark.parametrize("command", ["ptx", "inspect"])
def test_bad_configuration_is_a_usage_error(capsys, command, argv, names):
    status, out, err = run_cli(capsys, command, *argv)
    assert status == 2, err
    assert out == "" and "Traceback" not in err
    assert f"usage: epgen {command}" in err
    for name in names:
        assert name in err, err


def test_ptx_to_file(capsys, tiny_variants, tmp_path):
    path = tmp_path / "tiny.ptx"
    status, out, err = run_cli(capsys, "ptx", "--variant", TINY, "-o", str(path))
    assert status == 0, err
    assert out == ""
    assert ".entry tiny" in path.read_text()


def test_ptx_ir_text(capsys, tiny_variants):
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
    status, out, err = run_cli(capsys, "diff", TINY, TINY)
    assert (status, out) == (0, ""), err


def test_diff_of_two_variants(capsys, tiny_variants):
    status, out, err = run_cli(capsys, "diff", TINY, TINY2)
    assert status == 1, err
    assert out.startswith(f"--- {TINY}.ptx\n+++ {TINY2}.ptx\n")
    lines = out.splitlines()
    assert any(x.startswith("-") and "st.release.sys" in x for x in lines), out
    assert any(x.startswith("+") and "st.relaxed.gpu" in x for x in lines), out


def _diff_lines(out: str, sign: str, pattern: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith(sign) and not x.startswith(sign * 3)
            and re.search(pattern, x)]


def test_diff_send_join_named(capsys):
    """ep/small vs ep/send_join_named: the flag swaps the warp send path (no block-wide join)
    for the block-staged broadcast whose joins are ``bar.sync 3, 256``, in ep_dispatch_async
    and in the fused ep_dispatch: per kernel two with the two-buffer pipeline (after the
    first token's staging, then one per token); the warp path's token-group barriers go."""
    from epgen.kernels import send_policy
    from epgen.presets import load_preset
    status, out, err = run_cli(capsys, "diff", "ep/small", "ep/send_join_named")
    assert status == 1, err
    assert out.startswith("--- ep/small.ptx\n+++ ep/send_join_named.ptx\n")
    named = r"\bbar\.sync\s+3,\s*256;"
    assert len(_diff_lines(out, "+", named)) == 2 * 2 and not _diff_lines(out, "-", named)
    # the diff may move other barriers' lines, but adds or removes none of them
    cta = r"\bbar\.sync\s+0;"
    # the warp path's monitor role counts through a block histogram (two bar.sync 0 per
    # kernel); the named path's monitor role does the same
    assert len(_diff_lines(out, "+", cta)) == len(_diff_lines(out, "-", cta))
    # the warp path's bar.warp.sync per kernel (its comm role covers every block): after the
    # round's destinations reach shared memory (a token-group barrier
    # instead when warps share tokens), before its release
    n = send_policy.send_warps_per_token(load_preset("small"))
    assert len(_diff_lines(out, "-", r"\bbar\.warp\.sync\b")) == (2 if n > 1 else 4)
    # the token groups' barriers: each group's twice per round, in both kernels
    groups = load_preset("small").num_threads // 32 // n if n > 1 else 0
    group_syncs = _diff_lines(out, "-", rf"\bbar\.sync\s+\d+,\s*{32 * n};")
    assert len(group_syncs) == 2 * 2 * groups and not _diff_lines(out, "+", r"\bbar\.sync\s+[4-9]")


def test_diff_skip_a2a_shows_the_scope_change(capsys):
    """ep/small vs ep/skip_a2a: the sys-scope count-word release and its acquire become gpu
    scope."""
    status, out, err = run_cli(capsys, "diff", "ep/small", "ep/skip_a2a")
    assert status == 1, err
    for op in ("st.release", "ld.acquire"):
        assert _diff_lines(out, "-", rf"\b{re.escape(op)}\.sys\."), op
        assert _diff_lines(out, "+", rf"\b{re.escape(op)}\.gpu\."), op
    assert not _diff_lines(out, "+", r"\b(?:st\.release|ld\.acquire)\.sys\.")


def test_diff_ir_of_ord_r(capsys):
    status, out, err = run_cli(capsys, "diff", "--ir", "ep/send_join_named", "ep/ord_r_named")
    assert status == 1, err
    assert out.startswith("--- ep/send_join_named.ir\n+++ ep/ord_r_named.ir\n")
    assert _diff_lines(out, "+", r"rank_flag")


def test_diff_every_pair_of_named_variants(capsys, monkeypatch):
    """``epgen diff A B`` works for every pair of registered variants (IR text; each variant
    built once): exit 1 and a unified diff, since no two named variants are the same; ``diff A
    A`` is empty."""
    import functools
    import itertools
    monkeypatch.setattr(diff_command, "variant_text", functools.lru_cache(maxsize=None)(
        diff_command.variant_text))
    names = goldens.names()
    for a, b in itertools.combinations(names, 2):
        status, out, err = run_cli(capsys, "diff", "--ir", a, b)
        assert status == 1 and err == "", (a, b, err)
        assert out.startswith(f"--- {a}.ir\n+++ {b}.ir\n@@ "), (a, b)
    status, out, err = run_cli(capsys, "diff", "--ir", names[-1], names[-1])
    assert (status, out, err) == (0, "", "")


def test_diff_unknown_variant(capsys, tiny_variants):
    status, _, err = run_cli(capsys, "diff", TINY, "test/nope")
    assert status == 2
    assert "test/nope" in err


def test_run_without_gpu_is_a_clear_error(capsys):
    from backends import cuda
    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    status, out, err = run_cli(capsys, "run", "--preset", "small")
    assert status == 1
    assert err.startswith("epgen: error:") and "GPU" in err


def test_run_fused_with_final_layout_is_refused_before_any_gpu_work(capsys):
    status, _, err = run_cli(capsys, "run", "--preset", "small", "--set",
                             "ep_final_layout=true", "--fused", "--trace")
    assert status == 1
    assert "fused=True with ep_final_layout=True" in err


def test_run_rejects_bad_token_count(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--preset", "small", "--tokens", "33"])
    assert info.value.code == 2
    assert "--tokens" in capsys.readouterr().err


def test_command_errors_have_no_traceback(capsys, monkeypatch):
    def broken():
        raise ValueError("bad configuration: n_ranks must be a power of two")

    monkeypatch.setitem(goldens.GOLDENS, "test/broken", broken)
    status, _, err = run_cli(capsys, "ptx", "--variant", "test/broken")
    assert status == 1
    assert err == "epgen: error: bad configuration: n_ranks must be a power of two\n"


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_default(capsys):
    status, out, err = run_cli(capsys, "inspect")
    assert status == 0, err
    cfg = presets.load_preset("default")
    lines = out.splitlines()
    assert lines[0] == "preset default, arch sm_90"
    for name in cfg.layout.members():
        assert any(line.split()[:1] == [name] or line.strip().startswith(name + ".")
                   for line in lines), f"layout member {name} missing"
    for name in cfg.layout.counter_regions():
        assert any(line.split()[:1] == [name] for line in lines), f"region {name} missing"
    module = epgen.build_module(cfg)
    for kernel in module.kernels:
        assert f"kernel {kernel.name}: grid 132 blocks x 1024 threads (32 warps)" in out
        for role in kernel.roles:
            assert any(line.split()[:1] == [role.name] and "[0, 32)" in line for line in lines), \
                f"role {role.name} of {kernel.name} missing"
    assert "    monitor  [0, 8)    [0, 1024)  [0, 32)" in out
    assert "    aux   [131, 132)  [0, 1024)  [0, 32)" in out
    assert out.count("  named barriers") == 3   # async, wait, fused
    # the async comm role (the warp send path) has no block-wide barrier; the wait copy does
    assert any(line.split()[:4] == ["copy", "cta", "0", "1024"] for line in lines)
    assert not any(line.split()[:4] == ["comm", "cta", "0", "1024"] for line in lines)
    scope_headers = [i for i, line in enumerate(lines) if line.split() == ["cta", "cluster",
                                                                          "gpu", "sys"]]
    assert len(scope_headers) == 3
    for i in scope_headers:
        assert [lines[i + j].split()[0] for j in (1, 2, 3)] == ["atomics", "releases",
                                                                "acquires"]
    # dispatch_async publishes each count with one st.release.sys
    async_releases = lines[scope_headers[0] + 2].split()
    assert async_releases[4] != "0", lines[scope_headers[0] + 2]
    assert "st.release.sys.global.b64" in out
    # the P2P transport calls no NVSHMEM function: nothing linked
    assert out.count("  NVSHMEM calls\n    (none)\n") == 3
    assert "NVSHMEM:" not in out


def test_inspect_json(capsys):
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--set", "n_sms=12",
                               "--json")
    assert status == 0, err
    report = json.loads(out)
    cfg = presets.load_preset("small").replace(n_sms=12)
    assert report["preset"] == "small" and report["overrides"] == {"n_sms": 12}
    assert report["parameters"] == json.loads(json.dumps(cfg.describe()))
    assert set(report["layout"]) == set(cfg.layout.members())
    assert report["sizes"] == json.loads(json.dumps(cfg.layout.sizes()))
    assert [r["name"] for r in report["counter_regions"]] == list(cfg.layout.counter_regions())
    kernels = {k["name"]: k for k in report["kernels"]}
    assert set(kernels) == {"ep_dispatch_async", "ep_dispatch_wait", "ep_dispatch"}
    n_sig = cfg.layout.n_signal_sms
    roles = {r["name"]: r for r in kernels["ep_dispatch_async"]["roles"]}
    # the warp send path: monitor (count, reserve), comm over every block, signal
    assert roles["monitor"]["blocks"] == [0, n_sig] and roles["comm"]["blocks"] == [0, 12]
    assert roles["signal"]["blocks"] == [0, n_sig]
    assert roles["comm"]["warps"] == [0, cfg.num_threads // 32]
    roles = {r["name"]: r for r in kernels["ep_dispatch_wait"]["roles"]}
    assert roles["copy"]["blocks"] == [0, 11] and roles["aux"]["blocks"] == [11, 12]
    assert kernels["ep_dispatch_async"]["by_scope"]["releases"]["sys"] >= 1
    assert kernels["ep_dispatch_wait"]["by_scope"]["acquires"]["sys"] >= 1
    ops = {o["instruction"]: o for o in kernels["ep_dispatch_async"]["ordered_ops"]}
    assert ops["st.release.sys.global.b64"]["roles"] == ["signal"]   # the count word
    assert all(o["ptx"] >= o["ir"] for k in kernels.values() for o in k["ordered_ops"])
    assert all(k["nvshmem_calls"] == [] for k in kernels.values())
    assert report["nvshmem_link"] == {"needed": False, "error": None}
    if report["ptxas"]["found"]:
        assert report["ptxas"]["error"] is None
        assert all(k["ptxas"]["registers"] > 0 for k in kernels.values())


def test_inspect_ptxas_resources_or_not_found(capsys, monkeypatch):
    from backends import nvptx

    status, out, err = run_cli(capsys, "inspect", "--preset", "small")
    assert status == 0, err
    if nvptx.find_ptxas() is not None:
        assert out.count("  ptxas (sm_90): registers ") == 3
    monkeypatch.setattr(nvptx, "find_ptxas", lambda: None)
    status, out, err = run_cli(capsys, "inspect", "--preset", "small")
    assert status == 0, err
    assert "ptxas: not found" in out and "registers" not in out


def test_inspect_to_file(capsys, tmp_path):
    path = tmp_path / "report.json"
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--json", "-o", str(path))
    assert (status, out) == (0, ""), err
    assert json.loads(path.read_text())["preset"] == "small"


def test_variants_say_whether_combine_builds(capsys):
    """Each variant with a configuration ends in ``[combine: yes]`` or ``[combine: no: why]``,
    as ``runtime.combine.check_supported`` decides; the demos say nothing."""
    from epgen import variants
    from epgen.runtime.combine import check_supported
    status, out, _ = run_cli(capsys, "variants")
    assert status == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["ep/small"].endswith("[combine: yes]")
    assert lines["ep/final_layout"].endswith("[combine: no: ep_final_layout (not yet)]") \
        or lines["ep/final_layout"].endswith("[combine: yes]")
    assert "[combine" not in lines["demo/copy16"]
    for name, line in lines.items():
        cfg = variants.variant_config(name)
        if cfg is None:
            continue
        try:
            check_supported(cfg)
            ok = True
        except ValueError:
            ok = False
        assert line.endswith("[combine: yes]") == ok, name


def test_inspect_combine(capsys):
    """``inspect --op combine``: the combine kernels and the combine buffers; JSON too; a
    configuration combine does not take is a usage error naming the reason."""
    from epgen.combine_layout import CombineLayout
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--op", "combine")
    assert status == 0, err
    assert "combine kernels" in out.splitlines()[0]
    assert "kernel ep_combine_async:" in out and "kernel ep_combine_wait:" in out
    assert "kernel ep_dispatch_async:" not in out
    cfg = presets.load_preset("small")
    assert re.search(rf"combine_recv_buf +{CombineLayout(cfg).recv_bytes}\n", out)
    assert "combine_arrival_words" in out
    status, out, err = run_cli(capsys, "inspect", "--preset", "small", "--op", "all", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["op"] == "all"
    assert {k["name"] for k in report["kernels"]} >= {"ep_dispatch_async", "ep_combine_async",
                                                      "ep_combine_wait"}
    assert report["combine_buffers"]["layout"] == CombineLayout(cfg).describe()
    T, K, H = 32, 4, 256
    assert report["combine_buffers"]["bytes_per_rank"]["combine_out"] == T * K * H * 2
    status, out, _ = run_cli(capsys, "inspect", "--preset", "small", "--json")
    assert json.loads(out)["combine_buffers"] is None

def test_inspect_combine_refuses_what_combine_does_not_take(capsys, monkeypatch):
    from epgen.runtime import combine as combine_mod

    def refuse(cfg):
        raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(combine_mod, "check_supported", refuse)
    status, _, err = run_cli(capsys, "inspect", "--preset", "small", "--op", "combine")
    assert status == 2 and "argument --op" in err and "testing" in err


def test_variants_show_the_reason_combine_does_not_build(capsys, monkeypatch):
    from epgen import variants

    def refuse(cfg):
        if cfg.ep_final_layout:
            raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(variants, "check_supported", refuse)
    status, out, _ = run_cli(capsys, "variants")
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["ep/final_layout"].endswith("[combine: no: testing]")
    assert lines["ep/small"].endswith("[combine: yes]")
    variants.combinations.cache_clear()
    try:
        status, out, _ = run_cli(capsys, "variants", "--matrix")
        rows = {line.split(None, 2)[2].split(": ")[0]: line.split()[1]
                for line in out.splitlines()[1:]}
        assert rows["ep_final_layout"] == "combine=no" and rows["stock"] == "combine=yes"
    finally:
        variants.combinations.cache_clear()


def test_bench_api_torch_only_on_the_emulated_world(capsys):
    """``bench --api torch`` measures ``epgen.torch.EPBuffer`` on an EmulatedWorld: with
    another world it is a usage error naming the option."""
    status, _, err = run_cli(capsys, "bench", "--api", "torch", "--world", "p2p")
    assert status == 2 and "--api torch" in err
    status, _, err = run_cli(capsys, "bench", "--api", "deepep", "--world", "shmem")
    assert status == 2 and "--api deepep: only with --world emulated" in err
