"""Golden IR text and PTX of every registered variant (``epgen.goldens``), the PTX checker on
each, ptxas on each (sm_90), and no stale files under golden/.

Regenerate with ``pytest --update-golden`` (then review ``git diff golden/``).
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import pytest

import golden_util
from backends import nvptx
from epgen import goldens

NAMES = goldens.names()
ARCH = goldens.DEFAULT_ARCH
EXTENSIONS = ("ir", "ptx")

by_name = pytest.mark.parametrize("name", NAMES, ids=NAMES)


@functools.lru_cache(maxsize=None)
def _module(name: str):
    return goldens.build_module(name)


@functools.lru_cache(maxsize=None)
def _ir_text(name: str) -> str:
    return goldens.print_ir(_module(name))


@functools.lru_cache(maxsize=None)
def _ptx(name: str) -> str:
    return nvptx.emit_ptx(_module(name), arch=ARCH)


def test_registry_has_the_demos():
    assert {"demo/copy16", "demo/producer_consumer", "demo/handshake"} <= set(NAMES)


@by_name
def test_ir_golden(name, golden):
    golden.check(name, "ir", _ir_text(name))


@by_name
def test_ptx_golden(name, golden):
    ptx = _ptx(name)
    golden.require_ptx_toolchain()
    golden.check(name, "ptx", ptx)


@by_name
def test_ptx_checker(name):
    """Every ordered IR operation appears in the PTX with its exact qualifiers (check_ptx
    raises PtxCheckError naming what is missing)."""
    module, ptx = _module(name), _ptx(name)
    for kernel in module.kernels:
        assert f".entry {kernel.name}(" in ptx, f"{name}: no .entry {kernel.name} in the PTX"
    nvptx.check_ptx(module, ptx)


@by_name
def test_ptxas_assembles(name):
    """The variant's PTX (equal to its golden when test_ptx_golden passes) assembles for sm_90."""
    if nvptx.find_ptxas() is None:
        message = ("ptxas not found (PATH, CUDA_HOME or the nvidia-cuda-nvcc wheel of the "
                   "'test' extra)")
        if golden_util.is_ci():
            pytest.fail(f"{message}; CI must assemble every golden", pytrace=False)
        pytest.skip(message)
    if _calls_nvshmem(name):
        _assemble_relocatable(nvptx, name)
        return
    report = nvptx.assemble(_ptx(name), arch=ARCH)
    assert {k.name for k in _module(name).kernels} <= set(report.kernels), report.log


def _calls_nvshmem(name: str) -> bool:
    """Whether the variant's PTX declares NVSHMEM device functions (``.extern .func``)."""
    return ".extern .func nvshmem" in _ptx(name)


def _assemble_relocatable(nvptx, name: str) -> None:
    """An unlinked variant (NVSHMEM functions left ``.extern``): ``ptxas -c`` (a relocatable
    object; the externs are resolved when NVSHMEM's device library is linked in)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(_ptx(name))
        out = subprocess.run([str(nvptx.find_ptxas()), "-c", f"-arch={ARCH}", str(src), "-o",
                              str(Path(tmp) / "k.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_stale_goldens():
    stale = golden_util.stale_golden_files(set(NAMES), EXTENSIONS)
    if stale:
        rel = [str(p.relative_to(golden_util.REPO_ROOT)) for p in stale]
        pytest.fail("golden files that belong to no registered variant (epgen.goldens) or have "
                    f"an extension other than {', '.join(EXTENSIONS)}: delete them "
                    f"(git rm {' '.join(rel)}) or register the variant:\n  " + "\n  ".join(rel),
                    pytrace=False)


def test_manifest_matches_llvmlite_pin(golden_manifest):
    """golden/MANIFEST exists once there are goldens, and names the arch the goldens use."""
    if not NAMES:
        pytest.skip("no golden variants registered")
    if golden_manifest is None:
        pytest.fail(f"missing {golden_util.MANIFEST.relative_to(golden_util.REPO_ROOT)}: run "
                    "'pytest --update-golden' on a developer machine and commit it",
                    pytrace=False)
    assert golden_manifest.get("default_arch") == ARCH
    assert {"llvmlite", "llvm"} <= set(golden_manifest)
