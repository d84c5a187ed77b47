"""Shared test machinery: ``--update-golden``, the ``gpu`` marker, the ``seed`` and ``golden``
fixtures.

- ``--update-golden`` rewrites the goldens (and ``golden/MANIFEST``) instead of comparing;
  tests that rewrote a file are skipped ("regenerated; review the diff"). Refused under CI.
- ``@pytest.mark.gpu`` tests are skipped, with the reason, when ``backends.cuda`` cannot be
  imported or ``backends.cuda.gpu_available()`` is False.
- ``@pytest.mark.multigpu(n)`` (with ``gpu``) tests are skipped with the reason "needs n GPUs"
  when ``backends.cuda.device_count() < n``.
- ``seed``: a fresh random seed per test (``EPGEN_SEED=N`` fixes it); a failing test's report
  shows ``seed: N; rerun with EPGEN_SEED=N``.
- ``golden``: ``golden.check("demo/copy16", "ptx", text)``; see ``golden_util``.
- Tiers (docs/testing.md): test modules live in ``tests/unit``, ``tests/ptx``, ``tests/sim``
  and ``tests/gpu``, the shared helpers in ``tests/support`` (on the path, see pyproject.toml).
  Collecting this repository's tests fails (a collection error) for every test outside the
  four folders, every ``gpu`` test outside ``tests/gpu`` and every test in ``tests/gpu``
  without the marker.
- Per-test time limit: pytest-timeout (the ``test`` extra) with the ``timeout`` of
  pyproject.toml; without it installed the limit's settings are accepted and ignored, the
  report header says there is no limit, and under CI the run is refused (as it is without
  torch, which CI installs for the torch-path tests: the ``test-torch`` extra).
- Parallel by default: with pytest-xdist installed (the ``test`` extra), a run of this
  repository's tests without ``-n`` runs on ``-n auto`` workers with ``--dist loadfile``:
  every test file runs whole in one worker, so a file's tests, its module fixtures and the
  golden files it writes stay in one process, deterministically. Where a GPU is usable the
  default stays serial (the GPU tier's module fixtures hold device memory, and one GPU
  should see one test at a time); with an explicit ``-n`` there, GPU tests take a lock shared
  by the run's workers, so they still run one at a time. ``-n 0`` (or ``-p no:xdist``) runs
  serially; ``--update-golden`` always does (it rewrites golden/MANIFEST once).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import golden_util

pytest_plugins = ("pytester",)

SEED_KEY = pytest.StashKey[int]()
_gpu_state: dict[str, object] = {}


def pytest_addoption(parser, pluginmanager):
    group = parser.getgroup("epgen")
    group.addoption("--update-golden", action="store_true", default=False,
                    help="rewrite golden/ files (and golden/MANIFEST) from the current code "
                         "instead of comparing; review the diff before committing")
    if not pluginmanager.hasplugin("timeout"):
        # pyproject.toml's settings of pytest-timeout, known (and unused) without it
        parser.addini("timeout", "per-test limit (needs pytest-timeout)")
        parser.addini("timeout_method", "how a test is stopped (needs pytest-timeout)")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n auto --dist loadfile`` unless ``-n`` was given, xdist is absent, the run updates
    goldens, a GPU is usable here, or the session is not this repository's (a scratch
    pytester session that copied this file)."""
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("update_golden"):
        if config.pluginmanager.hasplugin("xdist"):
            config.option.numprocesses = 0
        return
    if _is_pytester_session(config):
        return
    if config.option.numprocesses is None and not getattr(config, "workerinput", None):
        if gpu_skip_reason() is None:
            return
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadfile"


def pytest_configure(config):
    if config.getoption("update_golden") and golden_util.is_ci():
        raise pytest.UsageError("--update-golden is refused under CI (CI is set): regenerate "
                                "goldens on a developer machine and commit them")
    if golden_util.is_ci() and not _is_pytester_session(config):
        _require_ci_tools(config)
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): this test's time limit "
                                           "(ignored: pytest-timeout is not installed)")


def _require_ci_tools(config) -> None:
    """Under CI the per-test time limit and the torch-path tests are not optional: refuse
    a run that would silently go without them."""
    import importlib.util

    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is not installed (CI is set): every test "
                                "runs under a time limit in CI; pip install '.[test]'")
    if importlib.util.find_spec("torch") is None:
        raise pytest.UsageError("torch is not installed (CI is set): CI runs the torch-path "
                                "tests; pip install '.[test,test-torch]'")


def _is_pytester_session(config) -> bool:
    """Whether this session is a scratch one a test started (pytester), not this
    repository's."""
    return Path(config.rootpath).resolve() != Path(__file__).resolve().parent.parent


def pytest_report_header(config):
    lines = []
    seed = os.environ.get("EPGEN_SEED")
    lines.append(f"epgen: seed {'EPGEN_SEED=' + seed if seed else 'fresh per test'}; "
                 f"CI={'yes' if golden_util.is_ci() else 'no'}"
                 + ("; --update-golden" if config.getoption("update_golden") else ""))
    if not config.pluginmanager.hasplugin("timeout"):
        lines.append("epgen: NO per-test time limit (pytest-timeout is not installed): a hang "
                     "stalls the run; pip install '.[test]'")
    return lines


# ---------------------------------------------------------------------------------------------
# GPU marker


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here (None: they can). Computed once per session."""
    if "reason" not in _gpu_state:
        reason = None
        try:
            import backends.cuda as cuda_backend
        except Exception as e:  # noqa: BLE001  any import failure means "no usable GPU runtime"
            reason = f"backends.cuda cannot be imported ({type(e).__name__}: {e})"
        else:
            try:
                if not cuda_backend.gpu_available():
                    reason = "no NVIDIA GPU available (backends.cuda.gpu_available() is False)"
            except Exception as e:  # noqa: BLE001
                reason = f"backends.cuda.gpu_available() failed ({type(e).__name__}: {e})"
        _gpu_state["reason"] = reason
    return _gpu_state["reason"]


def gpu_count() -> int:
    """``backends.cuda.device_count()`` (0 without a usable GPU), computed once."""
    if "count" not in _gpu_state:
        count = 0
        if gpu_skip_reason() is None:
            import backends.cuda as cuda_backend
            count = cuda_backend.device_count()
        _gpu_state["count"] = count
    return _gpu_state["count"]


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"gpu test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)
        return
    for item in gpu_items:
        marker = item.get_closest_marker("multigpu")
        if marker is not None and gpu_count() < int(marker.args[0]):
            item.add_marker(pytest.mark.skip(
                reason=f"needs {int(marker.args[0])} GPUs (this machine has {gpu_count()})"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a GPU test (setup, call, teardown) holds a lock file of this run: the
    workers take turns on the GPU."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None or item.get_closest_marker("gpu") is None:
        yield
        return
    import fcntl
    import tempfile

    lock = Path(tempfile.gettempdir()) / f"epgen-gpu-{workerinput['testrunuid']}.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Seeds


def _parse_seed(text: str) -> int:
    try:
        seed = int(text, 0)
    except ValueError:
        raise pytest.UsageError(f"EPGEN_SEED={text!r} is not an integer") from None
    if not 0 <= seed < 2**32:
        raise pytest.UsageError(f"EPGEN_SEED={text} is outside [0, 2**32)")
    return seed


@pytest.fixture
def seed(request) -> int:
    """A random seed for this test: fresh from os.urandom, or EPGEN_SEED when set. Shown in
    the report of a failing test."""
    env = os.environ.get("EPGEN_SEED")
    value = _parse_seed(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.stash[SEED_KEY] = value
    return value


@pytest.fixture
def rng(seed):
    """``numpy.random.Generator`` seeded with this test's ``seed``."""
    import numpy as np

    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(SEED_KEY, None)
    if seed is not None and report.failed:
        report.sections.append(("seed", f"seed: {seed}; rerun with EPGEN_SEED={seed}"))


# ---------------------------------------------------------------------------------------------
# Goldens


class Golden:
    """Compares generated text with golden files (``golden_util.check``) and knows whether
    this run updates them."""

    def __init__(self, update: bool):
        self.update = update

    def check(self, name: str, ext: str, text: str) -> None:
        golden_util.check(name, ext, text, update=self.update)

    def require_ptx_toolchain(self) -> None:
        """Skip a PTX comparison when golden/MANIFEST names another LLVM major (not when
        updating: then MANIFEST is being rewritten for the running toolchain)."""
        if not self.update:
            golden_util.require_manifest_llvm(golden_util.read_manifest(),
                                              _running_toolchain())


def _running_toolchain() -> dict[str, str]:
    from epgen.goldens import DEFAULT_ARCH

    return golden_util.current_toolchain(DEFAULT_ARCH)


@pytest.fixture(scope="session")
def golden_manifest(request) -> dict[str, str] | None:
    """golden/MANIFEST; with --update-golden first rewritten for the running toolchain."""
    if request.config.getoption("update_golden"):
        running = _running_toolchain()
        if golden_util.read_manifest() != running:
            golden_util.write_manifest(running)
    return golden_util.read_manifest()


@pytest.fixture
def golden(request, golden_manifest) -> Golden:
    return Golden(update=request.config.getoption("update_golden"))


@pytest.fixture(scope="module")
def ptxas():
    """The ptxas executable (``find_ptxas``); without one the test skips, or fails under CI."""
    from backends.nvptx import find_ptxas
    exe = find_ptxas()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("ptxas not found (CI is set): install nvidia-cuda-nvcc or set EPGEN_PTXAS")
        pytest.skip("ptxas not found")
    return exe


# ---------------------------------------------------------------------------------------------
# Tiers

TIERS = ("unit", "ptx", "sim", "gpu")
"""The folders of tests/ that hold test modules (docs/testing.md, "Tiers")."""

_TIER_ERRORS_SHOWN = 20


def tier_errors(items, tests_dir: Path) -> list[str]:
    """The tier rules that collected ``items`` break, one line per test: a test module outside
    ``tests_dir/{unit,ptx,sim,gpu}``, a ``gpu`` test outside ``tests_dir/gpu``, a test in
    ``tests_dir/gpu`` without the ``gpu`` marker. Items outside ``tests_dir`` are left alone."""
    errors = []
    for item in items:
        try:
            parts = Path(item.path).resolve().relative_to(tests_dir.resolve()).parts
        except ValueError:
            continue
        tier = parts[0] if len(parts) > 1 else None
        marked = item.get_closest_marker("gpu") is not None
        if tier not in TIERS:
            errors.append(f"{item.nodeid}: a test module must live in one of "
                          + ", ".join(f"tests/{t}/" for t in TIERS))
        elif marked and tier != "gpu":
            errors.append(f"{item.nodeid}: marked gpu, so it belongs in tests/gpu/")
        elif tier == "gpu" and not marked:
            errors.append(f"{item.nodeid}: in tests/gpu/ without the gpu marker")
    return errors


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """In a collection of this repository's tests (not a scratch pytester session that copied
    this file), a module or class with tests in the wrong tier (``tier_errors``) is a
    collection error naming each of them: the run stops before any test runs."""
    outcome = yield
    report = outcome.get_result()
    tests_dir = Path(__file__).resolve().parent
    if not report.passed or Path(collector.config.rootpath).resolve() != tests_dir.parent:
        return
    errors = tier_errors([x for x in report.result if isinstance(x, pytest.Item)], tests_dir)
    if errors:
        shown = errors[:_TIER_ERRORS_SHOWN]
        if len(errors) > len(shown):
            shown.append(f"... and {len(errors) - len(shown)} more")
        report.outcome = "failed"
        report.longrepr = ("tests outside their tier (docs/testing.md, \"Tiers\"):\n  "
                           + "\n  ".join(shown))
        report.result = []


@pytest.fixture(scope="session")
def nvshmem_wheel():
    """Skips the test, with the reason, when NVSHMEM's host library (the
    ``nvidia-nvshmem-cu13`` wheel) cannot be found."""
    from backends.cuda import nvshmem_host
    try:
        nvshmem_host.find_host_library()
    except nvshmem_host.NvshmemUnavailableError as e:
        pytest.skip(str(e))
