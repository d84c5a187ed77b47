"""The mutation list (tests/mutants/*.toml, run by tools/run_mutants.py, docs/testing.md
"Mutation list") cannot rot silently: every mutant file is well formed, names no golden
comparison as its killer, its ``find`` text still occurs exactly once in its file, and every
test it names still exists (the file, and the function of a ``::name`` id), so a moved or
renamed test cannot leave a mutant unguarded. The runner itself is checked on a scratch tree:
a killed, a surviving and a stale mutant, and a test id that names nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("run_mutants", ROOT / "tools" / "run_mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_mutants", mod)
    spec.loader.exec_module(mod)
    return mod


run_mutants = _runner()
MUTANTS = run_mutants.load_mutants(ROOT)


def test_the_list_is_not_empty():
    assert len(MUTANTS) >= 27


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_find_text_occurs_exactly_once(mutant):
    n = run_mutants.find_count(ROOT, mutant)
    assert n == 1, (f"{mutant.source.name}: 'find' occurs {n} times in {mutant.file} "
                    f"(-1: no such file); re-anchor it on the code it means to change")


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_named_test_exists(mutant):
    missing = run_mutants.missing_tests(ROOT, mutant)
    assert not missing, (f"{mutant.source.name}: no such test: {missing}; point 'tests' at "
                         f"the semantic tests that kill it now")


def test_test_ids_are_checked_down_to_the_function(tmp_path):
    _write(tmp_path / "tests" / "unit" / "test_a.py",
           "import pytest\n\n\n@pytest.mark.parametrize('x', [1])\ndef test_f(x):\n"
           "    pass\n\n\nclass TestC:\n    def test_m(self):\n        pass\n")
    exists = lambda t: run_mutants.node_exists(tmp_path, t)     # noqa: E731
    assert exists("tests/unit/test_a.py") and exists("tests/unit")
    assert exists("tests/unit/test_a.py::test_f") and exists("tests/unit/test_a.py::test_f[1]")
    assert exists("tests/unit/test_a.py::TestC::test_m")
    assert not exists("tests/unit/test_b.py") and not exists("tests/unit/test_a.py::test_g")
    assert not exists("tests/unit/test_a.py::test_m")          # a method is not top level
    assert not exists("tests/unit/test_a.py::TestC::test_f")
    assert not exists("tests/unit::test_f")                    # a directory has no functions


@pytest.mark.parametrize("test,golden", [("tests/ptx/test_golden.py::test_x", True),
                                         ("tests/ptx/test_fused_ptx.py", True),
                                         ("tests/sim/test_combine_sim.py::test_y", False)])
def test_golden_tests_are_recognised(test, golden):
    assert run_mutants.is_golden_test(test) is golden


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _mutant(root: Path, stem: str, find: str, replace: str, **extra) -> None:
    fields = {"name": stem, "file": "pkg/mod.py", "find": find, "replace": replace,
              "tests": ["tests/test_mod.py"], "why": "a test of the runner", **extra}
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]     # JSON is TOML here
    _write(root / "tests" / "mutants" / f"{stem}.toml", "\n".join(lines) + "\n")


def test_malformed_mutants_are_refused(tmp_path):
    _mutant(tmp_path, "golden", "a", "b", tests=["tests/ptx/test_golden.py"])
    with pytest.raises(run_mutants.MutantError, match="golden comparisons cannot count"):
        run_mutants.load_mutants(tmp_path)
    (tmp_path / "tests" / "mutants" / "golden.toml").unlink()
    _mutant(tmp_path, "other_name", "a", "b", name="not_the_stem")
    with pytest.raises(run_mutants.MutantError, match="must be the file's stem"):
        run_mutants.load_mutants(tmp_path)
    (tmp_path / "tests" / "mutants" / "other_name.toml").unlink()
    _write(tmp_path / "tests" / "mutants" / "no_tests.toml",
           'name = "no_tests"\nfile = "x.py"\nfind = "a"\nreplace = "b"\nwhy = "w"\n')
    with pytest.raises(run_mutants.MutantError, match="'tests' is missing"):
        run_mutants.load_mutants(tmp_path)


def test_the_runner_tells_killed_survived_and_stale(tmp_path, capsys):
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "mod.py", "def add(a, b):\n    return a + b\n")
    _write(tmp_path / "tests" / "test_mod.py",
           "from pkg.mod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    _mutant(tmp_path, "killed", "a + b", "a - b")
    _mutant(tmp_path, "survived", "def add(a, b):", "def add(b, a):")
    _mutant(tmp_path, "stale", "a * b", "a + b")
    _mutant(tmp_path, "moved", "a + b", "a - b", tests=["tests/test_mod.py::test_sum"])
    rc = run_mutants.main(["--root", str(tmp_path)])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:-1]}
    assert rows == {"killed": "killed", "moved": "error", "stale": "stale",
                    "survived": "survived"}, out
    assert "no such test: tests/test_mod.py::test_sum" in out
    assert "tests/test_mod.py::test_add" in out and rc == 1
    # the tree itself is never written
    assert (tmp_path / "pkg" / "mod.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert run_mutants.main(["--root", str(tmp_path), "--only", "killed"]) == 0
