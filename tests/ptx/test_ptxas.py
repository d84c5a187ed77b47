"""ptxas: discovery order, assembling generated kernels, parsing the resource report.
Without a ptxas the assembling tests skip, except under CI where they fail."""

from __future__ import annotations

import stat

import pytest

from backends.nvptx import (ARCHES, PtxasError, assemble, check_ptx, emit_ptx, find_ptxas)
from backends.nvptx import ptxas as ptxas_module
from backends.nvptx.ptxas import _wheel_ptxas, parse_report
from ir import AtomOp, CacheHint, CmpOp, KernelBuilder, Scope, Sem
from ir import types as T


def _fake_exe(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_discovery_order(tmp_path, monkeypatch):
    on_path = _fake_exe(tmp_path / "path" / "ptxas")
    in_cuda_home = _fake_exe(tmp_path / "cuda" / "bin" / "ptxas")
    explicit = tmp_path / "explicit-ptxas"
    monkeypatch.setenv("EPGEN_PTXAS", str(explicit))
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert find_ptxas() == explicit
    monkeypatch.delenv("EPGEN_PTXAS")
    assert find_ptxas() == on_path
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_ptxas() == in_cuda_home
    monkeypatch.delenv("CUDA_HOME")
    assert find_ptxas() == _wheel_ptxas()


def test_wheel_layout():
    wheel = _wheel_ptxas()
    if wheel is None:
        pytest.skip("nvidia-cuda-nvcc wheel not installed")
    assert wheel.name == "ptxas" and wheel.parent.name == "bin"
    assert wheel.parent.parent.parent.name == "nvidia"


LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'first' for 'sm_90'
ptxas info    : Function properties for first
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 4 barriers, 2048 bytes smem, 380 bytes cmem[0]
ptxas info    : Compile time = 2.1 ms
ptxas info    : Compiling entry function 'second' for 'sm_90'
ptxas info    : Function properties for second
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 6 registers, used 0 barriers
"""


def test_parse_report():
    report = parse_report(LOG, "sm_90")
    first, second = report.kernels["first"], report.kernels["second"]
    assert (first.registers, first.barriers, first.smem, first.cmem) == (40, 4, 2048, 380)
    assert (first.stack_frame, first.spill_stores, first.spill_loads) == (16, 8, 4)
    assert (second.registers, second.barriers, second.smem, second.spill_stores) == (6, 0, 0, 0)
    assert report.arch == "sm_90" and report.log == LOG


def pipeline_kernel(cluster=True):
    """Two roles on named barriers, a bounded wait, shared staging and scoped atomics."""
    kb = KernelBuilder("pipeline", block_threads=256, min_blocks_per_sm=1)
    src, dst, flags = (kb.param(n, T.ptr_global) for n in ("src", "dst", "flags"))
    n = kb.param("n", T.u64)
    stage = kb.shared_buffer("stage", 4096)
    kb.diagnostics(rank=kb.param("rank", T.u32))
    with kb.role("load", threads=(0, 128)) as r:
        full = r.named_barrier("full", 1, 256)
        i = r.let("i", r.tid.cast(T.u64))
        with r.while_(i < n):
            v = r.load(src + i * 16, T.vec(T.u32, 4), cache=CacheHint.NC)
            r.store(stage + (i % 256) * 16, v)
            r.assign(i, i + 128)
        r.bar_arrive(full)
    with kb.role("store", threads=(128, 128)) as r:
        full = r.named_barrier("full", 1, 256)
        r.bar_sync(full)
        r.spin_wait(flags, T.u64, CmpOp.GE, 1, buffer="flags", index=r.block, sem=Sem.ACQUIRE,
                    scope=Scope.SYS, backoff_ns=64)
        v = r.load(stage + r.tid.cast(T.u64) * 16, T.vec(T.u32, 4))
        r.store(dst + r.tid.cast(T.u64) * 16, v)
        r.fence(Sem.RELEASE, Scope.SYS)
        r.red(AtomOp.ADD, flags + 8, 1, sem=Sem.RELEASE, scope=Scope.SYS)
        if cluster:
            r.red(AtomOp.ADD, flags + 12, 1, sem=Sem.RELAXED, scope=Scope.CLUSTER)
        r.syncthreads()
    return kb.build()


def test_assemble_pipeline_for_sm90(ptxas):
    k = pipeline_kernel()
    ptx = emit_ptx(k)
    check_ptx(k, ptx)
    report = assemble(ptx, "sm_90", ptxas=ptxas)
    res = report.kernels["pipeline"]
    assert 0 < res.registers <= 255
    assert res.barriers == 2                       # ids 0 and 1
    assert res.smem == 4096
    assert res.spill_stores == 0 and res.stack_frame == 0
    assert "Compiling entry function 'pipeline' for 'sm_90'" in report.log


@pytest.mark.parametrize("arch", ARCHES)
def test_assemble_every_arch(ptxas, arch):
    ptx = emit_ptx(pipeline_kernel(cluster=arch != "sm_80"), arch)
    assert assemble(ptx, arch, ptxas=ptxas).kernels["pipeline"].registers > 0


def test_assemble_every_atomic_form(ptxas):
    """Every atom/red/cas line of the matrix is valid PTX for sm_90."""
    from backends.nvptx.atomics import CAS_TYPES, RMW_TYPES, SEMS

    kb = KernelBuilder("atomics", block_threads=32)
    g = kb.param("g", T.ptr_global)
    with kb.role("all") as r:
        for op, types in RMW_TYPES.items():
            for t in types:
                for sem in SEMS:
                    for scope in Scope:
                        dtype = T.SCALARS[t]
                        r.atomic(op, g, 1, sem, scope, dtype)
                        r.red(op, g, 1, sem, scope, dtype)
        for t in CAS_TYPES:
            for sem in SEMS:
                r.cas(g, 0, 1, sem, Scope.SYS, T.SCALARS[t])
    assemble(emit_ptx(kb.build()), "sm_90", ptxas=ptxas)


def test_assembler_errors_carry_its_output(ptxas):
    bad = emit_ptx(pipeline_kernel()).replace("bar.sync \t1, 256;", "bar.sync \t1, 257x;")
    with pytest.raises(PtxasError, match=r"ptxas -arch=sm_90 failed[\s\S]*(error|fatal)"):
        assemble(bad, "sm_90", ptxas=ptxas)


def test_missing_ptxas_raises(tmp_path, monkeypatch):
    with pytest.raises(PtxasError, match="cannot run"):
        assemble(".version 8.6\n", ptxas=tmp_path / "no-ptxas")
    monkeypatch.setattr(ptxas_module, "find_ptxas", lambda: None)
    with pytest.raises(PtxasError, match="ptxas not found"):
        assemble(".version 8.6\n")


def test_spawn_retries_transient_errors_only(tmp_path, monkeypatch):
    """A spawn failing with a transient errno (EFAULT was seen in CI) is retried; a lasting
    or a non-transient failure is a PtxasError naming the executable."""
    import errno
    import subprocess
    from backends.nvptx import ptxas as px
    calls = []
    real_run = subprocess.run

    def flaky(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 1:
            raise OSError(errno.EFAULT, "Bad address")
        return real_run(["true"], **kw)
    monkeypatch.setattr(px.subprocess, "run", flaky)
    monkeypatch.setattr(px, "parse_report", lambda log, arch: "parsed")
    monkeypatch.setattr(px, "splits_compile", lambda exe: False)     # no --help spawn
    assert px.assemble("// ptx", ptxas=tmp_path / "ptxas") == "parsed" and len(calls) == 2

    def always(err):
        def run(cmd, **kw):
            calls.append(cmd)
            raise OSError(err, "boom")
        return run
    for err, attempts in ((errno.EFAULT, px.SPAWN_ATTEMPTS), (errno.ENOENT, 1)):
        calls.clear()
        monkeypatch.setattr(px.subprocess, "run", always(err))
        with pytest.raises(px.PtxasError, match="cannot run ptxas at .*ptxas"):
            px.assemble("// ptx", ptxas=tmp_path / "ptxas")
        assert len(calls) == attempts


@pytest.mark.parametrize("listed", [True, False])
def test_split_compile_only_where_ptxas_lists_it(tmp_path, listed):
    """``--split-compile 0`` is passed exactly when the executable's ``--help`` lists it."""
    from backends.nvptx import ptxas as px
    args = tmp_path / "args"
    exe = tmp_path / "ptxas"
    help_text = "--split-compile <N>" if listed else "--verbose"
    exe.write_text(f"#!/bin/sh\nif [ \"$1\" = --help ]; then echo '{help_text}'; exit 0; fi\n"
                   f"echo \"$@\" > {args}\n")
    exe.chmod(0o755)
    px.assemble("// ptx", ptxas=exe)
    assert ("--split-compile 0" in args.read_text()) is listed
    assert px.splits_compile(str(exe)) is listed
