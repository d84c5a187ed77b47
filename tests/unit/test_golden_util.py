"""The test machinery itself: golden comparison, MANIFEST gate, seeds, the gpu marker."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import golden_util

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def golden_dir(tmp_path, monkeypatch):
    """golden_util pointed at an empty golden/ in a temporary repository."""
    monkeypatch.setattr(golden_util, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(golden_util, "GOLDEN_DIR", tmp_path / "golden")
    monkeypatch.setattr(golden_util, "MANIFEST", tmp_path / "golden" / "MANIFEST")
    monkeypatch.delenv("CI", raising=False)
    return tmp_path / "golden"


@pytest.mark.parametrize("text, expected", [
    ("a\r\nb\rc", "a\nb\nc\n"),
    ("a  \nb\t\n\n\n", "a\nb\n"),
    ("x", "x\n"),
    ("", ""),
    ("\n\n", ""),
    ("  lead\n", "  lead\n"),
])
def test_normalize(text, expected):
    assert golden_util.normalize(text) == expected


@pytest.mark.parametrize("value, ci", [("true", True), ("1", True), ("yes", True),
                                       ("", False), ("false", False), ("0", False)])
def test_is_ci(monkeypatch, value, ci):
    monkeypatch.setenv("CI", value)
    assert golden_util.is_ci() is ci


def test_missing_golden_fails_and_is_not_created(golden_dir):
    with pytest.raises(pytest.fail.Exception, match="missing golden golden/k/v.ptx"):
        golden_util.check("k/v", "ptx", "text\n")
    assert not (golden_dir / "k" / "v.ptx").exists()
    assert (golden_dir / "k" / "v.obtained.ptx").read_text() == "text\n"


def test_update_creates_then_passes(golden_dir):
    with pytest.raises(pytest.skip.Exception, match="created: regenerated; review the diff"):
        golden_util.check("k/v", "ir", "line  \r\n", update=True)
    assert (golden_dir / "k" / "v.ir").read_bytes() == b"line\n"
    golden_util.check("k/v", "ir", "line\n")                # equal: passes
    golden_util.check("k/v", "ir", "line\n", update=True)   # unchanged: passes, not skipped


def test_update_refused_under_ci(golden_dir, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="refused under CI"):
        golden_util.check("k/v", "ir", "x\n", update=True)
    assert not (golden_dir / "k" / "v.ir").exists()


def test_mismatch_prints_a_bounded_diff_and_writes_obtained(golden_dir):
    path = golden_dir / "k" / "v.ptx"
    path.parent.mkdir(parents=True)
    path.write_text("".join(f"old {i}\n" for i in range(200)))
    new = "".join(f"new {i}\n" for i in range(200))
    with pytest.raises(pytest.fail.Exception) as info:
        golden_util.check("k/v", "ptx", new)
    message = str(info.value)
    assert "--- golden/k/v.ptx" in message and "+++ golden/k/v.obtained.ptx" in message
    assert "more diff lines" in message
    diff_lines = message.split("\n", 1)[1].splitlines()
    assert len(diff_lines) <= golden_util.DIFF_LINES + 1
    obtained = golden_dir / "k" / "v.obtained.ptx"
    assert obtained.read_text() == new
    # a later pass removes the leftover .obtained file
    path.write_text(new)
    golden_util.check("k/v", "ptx", new)
    assert not obtained.exists()


def test_manifest_round_trip_and_llvm_gate(golden_dir):
    assert golden_util.read_manifest() is None
    running = golden_util.current_toolchain("sm_90")
    golden_util.write_manifest(running)
    assert golden_util.read_manifest() == running
    golden_util.require_manifest_llvm(running, running)     # same major: compared
    other = dict(running, llvm=f"{golden_util.llvm_major(running['llvm']) + 1}.0.0")
    with pytest.raises(pytest.skip.Exception, match="PTX not compared"):
        golden_util.require_manifest_llvm(other, running)
    with pytest.raises(pytest.fail.Exception, match="missing golden/MANIFEST"):
        golden_util.require_manifest_llvm(None, running)


def test_stale_goldens(golden_dir):
    for rel in ("demo/a.ir", "demo/a.ptx", "demo/a.obtained.ptx", "demo/gone.ptx",
                "demo/a.txt", "deep/er/x.ptx"):
        (golden_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (golden_dir / rel).write_text("x\n")
    (golden_dir / "MANIFEST").write_text("llvm = 22.1.0\n")
    stale = golden_util.stale_golden_files({"demo/a"}, ("ir", "ptx"))
    assert [str(p.relative_to(golden_dir)) for p in stale] == [
        "deep/er/x.ptx", "demo/a.txt", "demo/gone.ptx"]


# ---------------------------------------------------------------------------------------------
# conftest.py hooks, run in a scratch pytest session


@pytest.fixture
def scratch(pytester):
    """A scratch test directory with this suite's conftest.py and golden_util.py."""
    for path in (TESTS / "conftest.py", TESTS / "support" / "golden_util.py"):
        shutil.copy(path, pytester.path / path.name)
    return pytester


def test_failing_test_reports_its_seed(scratch, monkeypatch):
    monkeypatch.setenv("EPGEN_SEED", "12345")
    scratch.makepyfile(test_s="""
        def test_uses_seed(seed):
            assert seed == 12345
            assert False, "boom"

        def test_passes(seed):
            pass
    """)
    result = scratch.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*seed: 12345; rerun with EPGEN_SEED=12345*"])
    assert result.stdout.str().count("rerun with EPGEN_SEED") == 1


def test_failing_test_reports_its_seed_under_xdist(scratch, monkeypatch):
    """The seed section travels from the worker to the report (pytest-xdist)."""
    pytest.importorskip("xdist")
    monkeypatch.setenv("EPGEN_SEED", "4242")
    scratch.makepyfile(test_s="""
        def test_uses_seed(seed):
            assert False, "boom"

        def test_passes(seed):
            pass
    """)
    result = scratch.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*2 workers*", "*seed: 4242; rerun with EPGEN_SEED=4242*"])


def test_default_run_is_parallel(scratch):
    """In this repository a run without -n gets ``-n auto`` (where no GPU is usable); a
    scratch session (another rootdir) stays serial."""
    pytest.importorskip("xdist")
    import conftest

    scratch.makepyfile(test_p="def test_x():\n    pass\n")
    result = scratch.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "workers" not in result.stdout.str()
    if conftest.gpu_skip_reason() is None:
        pytest.skip("a GPU is usable here: the default run stays serial")
    repo = Path(conftest.__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "tests/unit/test_imports.py::test_find_cycle_finds_one"],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:]
    assert "workers [1 item]" in res.stdout, res.stdout[-2000:]


def test_loadfile_keeps_each_file_in_one_worker(scratch):
    """Under ``--dist loadfile`` (the default here) each file's tests run in one worker,
    which is what keeps a file's golden files and module fixtures to one process."""
    pytest.importorskip("xdist")
    body = ("import os\n"
            "def _mark(name):\n"
            "    with open(f'{name}.{os.environ[\"PYTEST_XDIST_WORKER\"]}', 'a') as f:\n"
            "        f.write('x')\n"
            + "".join(f"def test_{i}():\n    _mark(__name__)\n" for i in range(6)))
    scratch.makepyfile(test_a=body, test_b=body)
    result = scratch.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2",
                                          "--dist", "loadfile")
    result.assert_outcomes(passed=12)
    for name in ("test_a", "test_b"):
        workers = sorted(p.suffix for p in scratch.path.glob(f"{name}.gw*"))
        assert len(workers) == 1, (name, workers)


def test_fresh_seeds_differ(seed, request):
    assert 0 <= seed < 2**32
    assert request.node.stash[__import__("conftest").SEED_KEY] == seed


def test_gpu_marker_skips_without_a_gpu(scratch):
    scratch.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    scratch.makepyfile(test_g="""
        import pytest

        @pytest.mark.gpu
        def test_on_gpu():
            pass

        def test_on_cpu():
            pass
    """)
    import conftest

    reason = conftest.gpu_skip_reason()
    result = scratch.runpytest_inprocess("-p", "no:cacheprovider", "-ra")
    if reason is None:
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(["*SKIPPED*gpu test:*"])


def test_update_golden_refused_under_ci(scratch, monkeypatch):
    monkeypatch.setenv("CI", "true")
    scratch.makepyfile(test_u="def test_x():\n    pass\n")
    result = scratch.runpytest_inprocess("-p", "no:cacheprovider", "--update-golden")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--update-golden is refused under CI*"])
