"""The test tiers (docs/testing.md, "Tiers"): every test module lives in tests/unit,
tests/ptx, tests/sim or tests/gpu and none in tests/support or at the top of tests/; and the
conftest check that turns a module with tests in the wrong tier into a collection error
(``conftest.tier_errors``) names each kind: a test module outside the four folders, a ``gpu``
test outside tests/gpu, a test in tests/gpu without the marker."""

from __future__ import annotations

from pathlib import Path

import pytest

import conftest

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_is_in_a_tier_folder():
    modules = sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")
                     if "__pycache__" not in p.parts)
    assert modules, f"no test module under {TESTS}"
    outside = [str(p) for p in modules if len(p.parts) != 2 or p.parts[0] not in conftest.TIERS]
    assert not outside, f"test modules outside tests/{{{','.join(conftest.TIERS)}}}/: {outside}"
    assert {p.parts[0] for p in modules} == set(conftest.TIERS)


def test_the_tier_folders_hold_no_conftest_or_helper_of_their_own():
    """Helpers shared between test modules go to tests/support (one import name each)."""
    for tier in conftest.TIERS:
        others = sorted(p.name for p in (TESTS / tier).glob("*.py")
                        if not p.name.startswith("test_"))
        assert not others, f"tests/{tier}/ holds non-test modules {others}: use tests/support/"


class FakeItem:
    """What ``tier_errors`` reads of a collected test: its path, node id and markers."""

    def __init__(self, rel: str, gpu: bool):
        self.path = TESTS / rel
        self.nodeid = f"tests/{rel}::test_x"
        self.gpu = gpu

    def get_closest_marker(self, name):
        return pytest.mark.gpu.mark if name == "gpu" and self.gpu else None


def test_tier_errors_pass_a_good_layout():
    items = [FakeItem("unit/test_a.py", False), FakeItem("ptx/test_b.py", False),
             FakeItem("sim/test_c.py", False), FakeItem("gpu/test_d_gpu.py", True)]
    assert conftest.tier_errors(items, TESTS) == []


BROKEN = [
    ("test_flat.py", False, "must live in one of tests/unit/, tests/ptx/, tests/sim/, tests/gpu/"),
    ("support/test_helper.py", False, "must live in one of"),
    ("extra/test_x.py", False, "must live in one of"),
    ("sim/test_x.py", True, "marked gpu, so it belongs in tests/gpu/"),
    ("unit/test_x.py", True, "marked gpu, so it belongs in tests/gpu/"),
    ("gpu/test_x_gpu.py", False, "in tests/gpu/ without the gpu marker"),
]


@pytest.mark.parametrize("rel, gpu, says", BROKEN,
                         ids=[f"{rel}-{'gpu' if gpu else 'unmarked'}" for rel, gpu, _ in BROKEN])
def test_tier_errors_name_each_broken_rule(rel, gpu, says):
    item = FakeItem(rel, gpu)
    errors = conftest.tier_errors([FakeItem("unit/test_ok.py", False), item], TESTS)
    assert len(errors) == 1 and errors[0].startswith(item.nodeid + ": ") and says in errors[0]


def test_tier_errors_leave_other_directories_alone(tmp_path):
    item = FakeItem("unit/test_x.py", True)
    item.path = tmp_path / "test_x.py"
    assert conftest.tier_errors([item], TESTS) == []
