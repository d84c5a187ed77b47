"""The combine module under the SHMEM transport through the NVSHMEM link step
(docs/shmem.md): ``emit_linked_ptx`` links NVSHMEM's device bitcode into ``ep_combine_async``
(``ep_combine_wait`` calls nothing), the PTX checker finds every ordered operation of our
code in the linked PTX as in ours, in IR order, ptxas assembles it, and ``epgen ptx --op
combine`` links unless ``--no-link``. Skipped without the NVSHMEM wheel (the shmem extra)."""

from __future__ import annotations

import re

import pytest

from backends.nvptx import (NvshmemLinkError, assemble, check_ptx, emit_linked_ptx, emit_ptx,
                            find_bitcode, find_ptxas)
from epgen import cli
from epgen.kernels import build_combine_module
from epgen.presets import load_preset

SHMEM_SETS = ["--preset", "small", "--set", "use_shmem=true", "--set", "p2p_world_size=1"]


def _module():
    return build_combine_module(load_preset("small").replace(use_shmem=True, p2p_world_size=1))


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    try:
        find_bitcode("sm_90")
    except NvshmemLinkError as e:
        pytest.skip(f"NVSHMEM's device bitcode is not installed (the shmem extra): {e}")
    mp = pytest.MonkeyPatch()
    mp.setenv("EPGEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield emit_linked_ptx(_module(), "sm_90")
    finally:
        mp.undo()


def test_linked_combine_passes_the_checker(linked):
    module = _module()
    ours = emit_ptx(module)
    assert ".extern .func nvshmemx_putmem_signal_nbi_warp" in ours
    externs = set(re.findall(r"^\.extern \.func\s+(?:\([^)]*\)\s*)?(\w+)", linked, re.M))
    assert externs <= {"vprintf", "__assertfail"}
    for name in ("nvshmemx_putmem_signal_nbi_warp", "nvshmem_quiet", "nvshmemx_signal_op",
                 "nvshmem_signal_wait_until"):
        assert re.search(rf"^\.func\s+(?:\([^)]*\)\s*)?{name}\(", linked, re.M), name
    for k in module.kernels:
        report = check_ptx(k, linked)
        assert report.found == check_ptx(k, ours).found, k.name
    found = check_ptx(module.kernel("ep_combine_async"), linked).found
    for call in ("nvshmemx_putmem_signal_nbi_warp", "nvshmem_quiet"):
        assert found[("ep_combine_async", f"call.uni {call}")] > 0
    assert found[("ep_combine_async", "call.uni nvshmemx_signal_op")] > 0
    # the receiver's only NVSHMEM call: the consistency step after its arrival polls
    assert {op for (_, op) in check_ptx(module.kernel("ep_combine_wait"), linked).found
            if "nvshmem" in op} == {"call.uni nvshmem_signal_wait_until"}


def test_linked_combine_assembles(linked):
    if find_ptxas() is None:
        pytest.skip("no ptxas (pip install nvidia-cuda-nvcc)")
    report = assemble(linked, "sm_90")
    assert {"ep_combine_async", "ep_combine_wait"} <= set(report.kernels)


def test_cli_ptx_op_combine_links_unless_no_link(linked, capsys):
    assert cli.main(["ptx", "--op", "combine", *SHMEM_SETS]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\.func nvshmem_quiet\(", out, re.M)
    assert cli.main(["ptx", "--op", "combine", "--no-link", *SHMEM_SETS]) == 0
    out = capsys.readouterr().out
    assert out == emit_ptx(_module())
