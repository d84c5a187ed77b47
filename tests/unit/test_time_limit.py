"""Every test runs under a time limit (pytest-timeout, pyproject.toml; docs/testing.md): a
test that hangs fails by name, with the stack of where it hung, and the run goes on, serially
and under pytest-xdist; a test marked ``@pytest.mark.timeout(S)`` gets S seconds instead.
The scratch sessions below use this repository's method with a 1 s limit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: the slowest CPU test measured (test_shmem_sim.py::test_inspect_shmem_config, 52 s on a
#: loaded two-core machine): the default limit must leave it room
SLOWEST_CPU_TEST_S = 52

HANG = """
import time

def test_hangs():
    while True:
        time.sleep(0.01)

def test_after_the_hang():
    assert True
"""


def _ini() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]


def test_the_suite_has_a_default_limit_above_its_slowest_test():
    ini = _ini()
    assert int(ini["timeout"]) >= 4 * SLOWEST_CPU_TEST_S
    assert ini["timeout_method"] == "signal"      # fail the test, keep the run going
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("pytest-timeout") for req in extras["test"])


@pytest.fixture
def scratch(pytester):
    """A scratch session with this repository's time-limit method and a 1 s limit."""
    pytest.importorskip("pytest_timeout")
    pytester.makepyprojecttoml(f"""
        [tool.pytest.ini_options]
        timeout = 1
        timeout_method = "{_ini()['timeout_method']}"
    """)
    pytester.makepyfile(test_hang=HANG)
    return pytester


@pytest.mark.parametrize("workers", [None, 2], ids=["serial", "xdist"])
def test_a_hanging_test_fails_by_name_and_the_run_goes_on(scratch, workers):
    args = ["-p", "no:cacheprovider", "-rf"]
    if workers:
        pytest.importorskip("xdist")
        args += ["-n", str(workers)]
    else:
        args += ["-p", "no:xdist"]
    result = scratch.runpytest_subprocess(*args)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*Timeout (>1.0s)*", "FAILED test_hang.py::test_hangs*"])


def test_a_marked_test_gets_its_own_limit(scratch):
    scratch.makepyfile(test_slow="""
        import time
        import pytest

        @pytest.mark.timeout(10)
        def test_slow_but_within_its_limit():
            time.sleep(1.5)
    """)
    result = scratch.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist",
                                          "test_slow.py")
    result.assert_outcomes(passed=1)
