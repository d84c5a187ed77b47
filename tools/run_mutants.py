"""Run the mutation list (tests/mutants/*.toml) and print its kill table.

Each mutant is a small realistic bug in product code: one TOML file with

- ``name``: the mutant's name (the file's stem);
- ``file``: the repo-relative path of the file it changes;
- ``find``: text that occurs exactly once in that file;
- ``replace``: what ``find`` becomes;
- ``tests``: pytest node ids or paths, the tests that must kill it (semantic tests only: no
  golden comparison, so never tests/ptx/test_golden.py or a ``*_ptx.py`` file);
- ``why``: the bug it models;
- ``timeout`` (optional): seconds its tests may take (default ``--timeout``).

The runner copies the working tree (tracked and untracked files git does not ignore) into a
temporary directory once, then for each mutant applies it to the copy, runs ``python -m
pytest -n 0 -x -q -p no:cacheprovider -k "not _ptx and not golden" <tests>`` there under a
timeout (the ``-k`` keeps golden and PTX-text comparisons from counting as a kill), and
restores the file; the working tree itself is never written. A mutant is **killed** when
its tests fail, **survived** when they pass, **stale** when its ``find`` text no longer
occurs exactly once, **timeout** when its tests outrun the limit, **error** when they could
not run (a test file or test function it names is missing, a collection error, no test
collected). Every status but killed is a failure: the exit status is 0 only when every
mutant run was killed.

    python tools/run_mutants.py                 # every mutant
    python tools/run_mutants.py --only NAME     # one (repeatable)
    python tools/run_mutants.py --list          # what the list holds
    python tools/run_mutants.py --markdown      # the table as Markdown (docs/testing.md)

It is slow (each mutant runs its tests); CI runs only tests/unit/test_mutants.py, which checks
that every mutant file is well formed, its ``find`` text still occurs exactly once and
every test it names exists.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MUTANT_DIR = Path("tests") / "mutants"
KEYS = {"name": str, "file": str, "find": str, "replace": str, "tests": list, "why": str}
OPTIONAL = {"timeout": int}
DEFAULT_TIMEOUT = 900
#: golden comparisons never count as a kill: the tests of a ``*_ptx.py`` file or named
#: ``*_ptx*`` (PTX text and structure) and anything named ``golden`` are deselected
PYTEST_ARGS = ["-n", "0", "-x", "-q", "-p", "no:cacheprovider", "-rfE",
               "-k", "not _ptx and not golden"]


class MutantError(ValueError):
    """A mutant file that is not well formed (the message names the file and the rule)."""


@dataclass(frozen=True)
class Mutant:
    """One entry of the mutation list (module docstring)."""

    name: str
    file: str
    find: str
    replace: str
    tests: tuple
    why: str
    timeout: int | None
    source: Path


@dataclass(frozen=True)
class Outcome:
    """What running one mutant gave: ``status`` (killed, survived, stale, timeout, error),
    ``by`` (the failing test, or why it is not a kill) and the seconds its tests took."""

    mutant: Mutant
    status: str
    by: str
    seconds: float


def is_golden_test(test: str) -> bool:
    """Whether a node id or path names a golden comparison (tests/ptx/test_golden.py or a
    ``*_ptx.py`` file), which may not count as a mutant's killer."""
    path = test.split("::", 1)[0]
    name = Path(path).name
    return name == "test_golden.py" or name.endswith("_ptx.py")


def parse_mutant(path: Path) -> Mutant:
    """The mutant of one TOML file, checked: every key present with its type, no other key,
    ``name`` the file's stem, a non-empty ``find`` that differs from ``replace``, a
    repo-relative ``file``, at least one test and no golden test."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise MutantError(f"{path}: not valid TOML: {e}") from None
    for key, typ in KEYS.items():
        if key not in data:
            raise MutantError(f"{path}: the key {key!r} is missing")
        if not isinstance(data[key], typ):
            raise MutantError(f"{path}: {key!r} must be a {typ.__name__}, got "
                              f"{type(data[key]).__name__}")
    for key, typ in OPTIONAL.items():
        if key in data and (not isinstance(data[key], typ) or data[key] <= 0):
            raise MutantError(f"{path}: {key!r} must be a positive {typ.__name__}")
    extra = set(data) - set(KEYS) - set(OPTIONAL)
    if extra:
        raise MutantError(f"{path}: unknown keys {sorted(extra)} (allowed: "
                          f"{sorted(KEYS) + sorted(OPTIONAL)})")
    if data["name"] != path.stem:
        raise MutantError(f"{path}: name {data['name']!r} must be the file's stem {path.stem!r}")
    if not data["find"] or data["find"] == data["replace"]:
        raise MutantError(f"{path}: 'find' must be non-empty and differ from 'replace'")
    if Path(data["file"]).is_absolute() or ".." in Path(data["file"]).parts:
        raise MutantError(f"{path}: 'file' must be a path inside the repository, got "
                          f"{data['file']!r}")
    tests = data["tests"]
    if not tests or not all(isinstance(t, str) and t for t in tests):
        raise MutantError(f"{path}: 'tests' must list at least one pytest node id or path")
    golden = [t for t in tests if is_golden_test(t)]
    if golden:
        raise MutantError(f"{path}: golden comparisons cannot count as a kill: {golden}")
    return Mutant(data["name"], data["file"], data["find"], data["replace"], tuple(tests),
                  data["why"], data.get("timeout"), path)


def load_mutants(root: Path = ROOT) -> list[Mutant]:
    """Every mutant of ``root``'s tests/mutants/, in name order (``MutantError`` on the
    first malformed file)."""
    return [parse_mutant(p) for p in sorted((root / MUTANT_DIR).glob("*.toml"))]


def find_count(root: Path, m: Mutant) -> int:
    """How often ``m.find`` occurs in ``m.file`` under ``root`` (-1: no such file)."""
    path = root / m.file
    return path.read_text().count(m.find) if path.is_file() else -1


def _defines(path: Path, names: list[str]) -> bool:
    """Whether the Python file ``path`` defines the test ``names`` (``["test_f"]``, or
    ``["TestClass", "test_m"]``): each a function or class at the top level of the file or
    of the class before it (``ast``; nothing is imported)."""
    try:
        scope = ast.parse(path.read_text()).body
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for name in names:
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.ClassDef)) and n.name == name]
        if not found:
            return False
        scope = getattr(found[0], "body", [])
    return True


def node_exists(root: Path, test: str) -> bool:
    """Whether a pytest node id or path of a mutant's ``tests`` names something under
    ``root``: the file or directory, and for ``path::name[::name]`` ids the function (or
    class and method) in that file; a parametrisation ``[...]`` is not checked."""
    path, *names = test.split("::")
    if not (root / path).exists():
        return False
    names = [re.sub(r"\[.*\]$", "", n) for n in names]
    return not names or ((root / path).is_file() and _defines(root / path, names))


def missing_tests(root: Path, m: Mutant) -> list[str]:
    """The tests of ``m`` that name nothing under ``root`` (``node_exists``)."""
    return [t for t in m.tests if not node_exists(root, t)]


def tree_files(root: Path) -> list[Path]:
    """The files of the working tree: tracked and untracked ones git does not ignore (every
    file but .git and caches when ``root`` is not a git work tree)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=root, capture_output=True, check=True)
        return [Path(p) for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache"}
        return [p.relative_to(root) for p in root.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(root).parts)]


def copy_tree(root: Path, dest: Path) -> None:
    """Copy the working tree's files (``tree_files``) under ``dest``."""
    for rel in tree_files(root):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _killer(output: str) -> str:
    """The first failing or erroring test named in pytest's short summary."""
    hit = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.MULTILINE)
    return hit.group(1) if hit else "(a failure pytest did not name)"


def run_one(copy: Path, m: Mutant, timeout: int) -> Outcome:
    """Apply ``m`` to the tree copy, run its tests, restore the file (module docstring)."""
    n = find_count(copy, m)
    if n != 1:
        where = "the file does not exist" if n < 0 else f"'find' occurs {n} times, not once"
        return Outcome(m, "stale", where, 0.0)
    missing = missing_tests(copy, m)
    if missing:
        return Outcome(m, "error", f"no such test: {', '.join(missing)}", 0.0)
    path = copy / m.file
    original = path.read_text()
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        path.write_text(original.replace(m.find, m.replace))
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *m.tests],
                                  cwd=copy, env=env, capture_output=True, text=True,
                                  timeout=m.timeout or timeout)
        except subprocess.TimeoutExpired:
            return Outcome(m, "timeout", f"its tests ran past {m.timeout or timeout} s",
                           time.monotonic() - start)
    finally:
        path.write_text(original)
    seconds = time.monotonic() - start
    out = done.stdout + done.stderr
    if done.returncode == 0:
        return Outcome(m, "survived", "every test passed", seconds)
    if done.returncode == 1:
        return Outcome(m, "killed", _killer(out), seconds)
    last = [line for line in out.splitlines() if line.strip()][-1:] or ["(no output)"]
    why = {2: "interrupted (collection error?)", 3: "pytest internal error",
           4: "pytest usage error", 5: "no test collected"}.get(done.returncode,
                                                               f"exit {done.returncode}")
    return Outcome(m, "error", f"{why}: {last[0]}", seconds)


def table(outcomes: list[Outcome], markdown: bool = False) -> str:
    """The kill table: mutant, result, killed by (or why not), seconds."""
    head = ("mutant", "result", "killed by", "seconds")
    rows = [(o.mutant.name, o.status, o.by, f"{o.seconds:.0f}") for o in outcomes]
    if markdown:
        lines = ["| mutant | result | killed by | seconds |", "|---|---|---|---:|"]
        for name, status, by, secs in rows:
            by = f"`{by}`" if status == "killed" else by
            lines.append(f"| `{name}` | {status} | {by} | {secs} |")
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {:>" + str(widths[-1]) + "}"
    return "\n".join(fmt.format(*r) for r in [head, *rows])


def summary(outcomes: list[Outcome]) -> str:
    """One line: how many mutants, how many of each status."""
    counts = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return f"{len(outcomes)} mutants: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this mutant (repeatable)")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                    help=f"seconds a mutant's tests may take (default {DEFAULT_TIMEOUT})")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = args.root.resolve()
    try:
        mutants = load_mutants(root)
    except MutantError as e:
        print(f"run_mutants: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            print(f"run_mutants: no mutant named {', '.join(sorted(unknown))} (--list)",
                  file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name}\n  {m.file}\n  tests: {' '.join(m.tests)}\n  {m.why}")
        return 0
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="epgen-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(root, copy)
        for m in mutants:
            o = run_one(copy, m, args.timeout)
            print(f"{m.name}: {o.status} ({o.by}, {o.seconds:.0f} s)", file=sys.stderr,
                  flush=True)
            outcomes.append(o)
    print(table(outcomes, args.markdown))
    print(summary(outcomes))
    return 0 if all(o.status == "killed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
