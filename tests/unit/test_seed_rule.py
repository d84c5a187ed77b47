"""Every random draw of a test comes from the ``seed`` fixture (tests/conftest.py), so
``EPGEN_SEED=N`` replays any failing test (docs/testing.md, "Seeds"): no test module seeds
from ``os.urandom``, the clock, or numpy's / Python's global generators."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: calls that draw a seed, or random numbers, from outside the seed fixture
UNSEEDED = {
    ("os", "urandom"): "os.urandom",
    ("random", "seed"): "random.seed",
    ("np.random", "seed"): "np.random.seed",
    ("numpy.random", "seed"): "numpy.random.seed",
    ("time", "time"): "time.time",
    ("time", "time_ns"): "time.time_ns",
}
#: numpy.random's module-level draws (the global generator)
GLOBAL_DRAWS = {"rand", "randn", "randint", "random", "choice", "permutation", "shuffle",
                "normal", "uniform", "integers"}


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def unseeded_draws(source: str) -> list[str]:
    """``line: call`` of each draw in ``source`` that does not come from a seeded generator:
    the calls of ``UNSEEDED``, ``np.random.<draw>`` (the global generator) and
    ``np.random.default_rng()`` / ``random.Random()`` without a seed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None or "." not in name:
            continue
        base, attr = name.rsplit(".", 1)
        if (base, attr) in UNSEEDED:
            found.append(f"{node.lineno}: {UNSEEDED[base, attr]}")
        elif base in ("np.random", "numpy.random") and attr in GLOBAL_DRAWS:
            found.append(f"{node.lineno}: {name} (numpy's global generator)")
        elif name in ("np.random.default_rng", "numpy.random.default_rng", "random.Random") \
                and not node.args and not node.keywords:
            found.append(f"{node.lineno}: {name}() without a seed")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_checker_finds_each_kind_of_unseeded_draw():
    source = "\n".join([
        "import os, random, time", "import numpy as np",
        "a = int.from_bytes(os.urandom(4), 'little')",
        "np.random.seed(1)", "x = np.random.rand(3)", "g = np.random.default_rng()",
        "r = random.Random()", "t = time.time()",
        "ok = np.random.default_rng(seed)", "ok2 = random.Random(seed)",
    ])
    assert [f.split(":")[0] for f in unseeded_draws(source)] == \
        ["3", "4", "5", "6", "7", "8"]


def test_no_test_draws_outside_the_seed_fixture():
    bad = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "conftest.py" or path == Path(__file__).resolve():
            continue           # the fixture itself; this file's own examples
        found = unseeded_draws(path.read_text())
        if found:
            bad[str(path.relative_to(TESTS))] = found
    assert not bad, f"draw through the seed fixture (or rng) instead: {bad}"
