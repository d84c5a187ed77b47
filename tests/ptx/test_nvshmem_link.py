"""The NVSHMEM link step (backends/nvptx/nvshmem.py): finding the device bitcode, linking it
into a kernel that calls every function of ``ir.nvshmem``, pruning, the on-disk cache, ptxas
on the result; and the header facts ``ir.nvshmem`` relies on.

The tests that link need the ``shmem`` extra (``nvidia-nvshmem-cu13``); they are skipped with
the reason when its bitcode is not installed. Parsing the bitcode takes ~10 s once per
process: every linking test is in this file (one xdist worker, ``--dist loadfile``).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

import epgen
import epgen.kernels
from backends.nvptx import (NvshmemLinkError, Target, assemble, check_ptx, emit_linked_ptx, emit_ptx,
                            find_bitcode, find_ptxas, uses_nvshmem)
from backends.nvptx import nvshmem as link
from epgen import cli, goldens, inspection, presets
from ir import KernelBuilder, Scope, Sem, nvshmem
from ir import nodes as N
from ir import types as T
from nvshmem_kernel import shmem_kernel as _shared_kernel


def shmem_kernel(name="shmem_k"):
    """One call of each function of ``ir.nvshmem.FUNCTIONS``."""
    return _shared_kernel(name, nvshmem.SIGNAL_ADD)


def plain_kernel():
    kb = KernelBuilder("plain", block_threads=64)
    out = kb.param("out", T.ptr_global)
    with kb.role("main") as r:
        r.store(out, 1, sem=Sem.RELEASE, scope=Scope.SYS)
    return kb.build()


def _bitcode():
    try:
        return find_bitcode("sm_90")
    except NvshmemLinkError as e:
        pytest.skip(f"NVSHMEM's device bitcode is not installed (the shmem extra): {e}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPGEN_CACHE_DIR", str(tmp_path / "cubin"))
    return tmp_path / "cubin" / "linked-ptx"


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    """(linked PTX, seconds of the first link, seconds of the link with the library parsed)."""
    _bitcode()
    mp = pytest.MonkeyPatch()
    mp.setenv("EPGEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        start = time.perf_counter()
        ptx = emit_linked_ptx(shmem_kernel(), "sm_90", use_cache=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        again = emit_linked_ptx(shmem_kernel(), "sm_90", use_cache=False)
        second = time.perf_counter() - start
    finally:
        mp.undo()
    assert again == ptx, "the link is not deterministic"
    return ptx, first, second


# ---------------------------------------------------------------------------------------------
# Header facts


def _include_dir() -> Path:
    lib = _bitcode()
    inc = lib.parent.parent / "include"
    if not inc.is_dir():
        pytest.skip(f"no NVSHMEM headers next to {lib}")
    return inc


def test_signal_op_values_match_the_headers():
    text = (_include_dir() / "device_host_transport" / "nvshmem_common_transport.h").read_text()
    m = re.search(r"typedef enum \{([^}]*)\} nvshmemx_signal_op_t;", text)
    assert m, "nvshmemx_signal_op_t not found"
    values = dict(re.findall(r"(NVSHMEM_SIGNAL_\w+)\s*=\s*(\d+)", m.group(1)))
    assert int(values["NVSHMEM_SIGNAL_SET"]) == nvshmem.SIGNAL_SET
    assert int(values["NVSHMEM_SIGNAL_ADD"]) == nvshmem.SIGNAL_ADD


C_TYPES = {"void *": T.ptr_generic, "const void *": T.ptr_generic, "size_t": T.u64,
           "uint64_t *": T.ptr_generic,
           "uint64_t": T.u64, "int": T.s32}


def _declaration(text: str, name: str):
    """``(return type, parameter text)`` of ``name``'s declaration in the API headers: a
    plain one (``NVSHMEMI_HOSTDEVICE_PREFIX`` or ``__device__``), or one a scope macro
    declares (``#define M(SCOPE, SC_SUFFIX, SC_PREFIX) ... base##SC_SUFFIX(...);``
    instantiated as ``M(warp, _warp, x)``); None if there is none."""
    m = re.search(r"(?:NVSHMEMI_HOSTDEVICE_PREFIX|__device__)\s+(\w+)\s+" + name
                  + r"\(([^)]*)\);", text)
    if m:
        return m.group(1), m.group(2)
    base, _, scope = name.rpartition("_")
    for macro, body in re.findall(r"#define (\w+)\(SCOPE, SC_SUFFIX, SC_PREFIX\)(.*?)\n\n",
                                  text, re.S):
        if not re.search(rf"^{macro}\({scope}, _{scope}, x\)", text, re.M):
            continue
        body = body.replace("\\\n", " ")
        d = re.search(r"__device__\s+(\w+)\s+" + base + r"##SC_SUFFIX\(([^)]*)\);", body)
        if d:
            return d.group(1), d.group(2)
    return None


@pytest.mark.parametrize("name", sorted(nvshmem.FUNCTIONS))
def test_signatures_match_the_headers(name):
    inc = _include_dir()
    text = (inc / "host" / "nvshmem_api.h").read_text() + (inc / "host" / "nvshmemx_api.h").read_text()
    m = _declaration(text, name)
    assert m, f"{name} is not declared in the host API headers"
    ret, params = m[0], [" ".join(p.split()) for p in m[1].split(",") if p.strip()]
    params = [] if params == ["void"] else params
    f = nvshmem.FUNCTIONS[name]
    assert (ret == "void") == (f.ret is None)
    if f.ret is not None:
        assert C_TYPES[ret] == f.ret
    types = [C_TYPES[re.sub(r"\s*\w+$", "", p).replace("*", " *").replace("  ", " ").strip()]
             for p in params]
    assert tuple(types) == f.params


# ---------------------------------------------------------------------------------------------
# Finding the bitcode


def test_uses_nvshmem():
    assert uses_nvshmem(shmem_kernel())
    assert not uses_nvshmem(plain_kernel())
    kb = KernelBuilder("other_extern", block_threads=32)
    with kb.role("main") as r:
        r.call("some_device_function", ())
    assert not uses_nvshmem(kb.build())
    assert [c.name for _, _, c in link.nvshmem_calls(shmem_kernel())] == [
        "nvshmem_my_pe", "nvshmem_putmem_nbi", "nvshmemx_putmem_nbi_warp",
        "nvshmemx_putmem_signal_nbi_warp", "nvshmem_fence", "nvshmemx_signal_op",
        "nvshmem_quiet", "nvshmem_signal_wait_until"]


def test_a_module_without_nvshmem_calls_is_not_linked(monkeypatch):
    monkeypatch.setattr(link, "find_bitcode", lambda arch: pytest.fail("looked for bitcode"))
    assert emit_linked_ptx(plain_kernel()) == emit_ptx(plain_kernel())


def test_missing_bitcode_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.delenv(link.ENV_BITCODE, raising=False)
    monkeypatch.setattr(link, "_wheel_lib_dirs", lambda: [tmp_path])
    with pytest.raises(NvshmemLinkError, match=re.escape("pip install 'epgen[shmem]'")):
        find_bitcode("sm_90")
    with pytest.raises(NvshmemLinkError, match="epgen\\[shmem\\]"):
        emit_linked_ptx(shmem_kernel())


def test_bitcode_per_architecture_then_generic(monkeypatch, tmp_path):
    monkeypatch.delenv(link.ENV_BITCODE, raising=False)
    monkeypatch.setattr(link, "_wheel_lib_dirs", lambda: [tmp_path])
    (tmp_path / "libnvshmem_device.bc").write_bytes(b"generic")
    assert find_bitcode("sm_90") == tmp_path / "libnvshmem_device.bc"
    (tmp_path / "libnvshmem_device_sm_90.bc").write_bytes(b"sm_90")
    assert find_bitcode("sm_90") == tmp_path / "libnvshmem_device_sm_90.bc"
    assert find_bitcode("sm_80") == tmp_path / "libnvshmem_device.bc"


def test_environment_overrides_the_bitcode(monkeypatch, tmp_path):
    bc = tmp_path / "mine.bc"
    bc.write_bytes(b"x")
    monkeypatch.setenv(link.ENV_BITCODE, str(bc))
    assert find_bitcode("sm_90") == bc
    monkeypatch.setenv(link.ENV_BITCODE, str(tmp_path / "absent.bc"))
    with pytest.raises(NvshmemLinkError, match="EPGEN_NVSHMEM_BITCODE"):
        find_bitcode("sm_90")


def test_unparseable_bitcode_is_a_link_error(monkeypatch, tmp_path, cache):
    bc = tmp_path / "bad.bc"
    bc.write_bytes(b"not bitcode")
    monkeypatch.setenv(link.ENV_BITCODE, str(bc))
    with pytest.raises(NvshmemLinkError, match="cannot parse NVSHMEM's device bitcode"):
        emit_linked_ptx(shmem_kernel())


# ---------------------------------------------------------------------------------------------
# The link


def test_linked_ptx_defines_every_nvshmem_function(linked):
    ptx, first, second = linked
    print(f"link: first {first:.1f} s (parse + prune + link), again {second:.2f} s, "
          f"{len(ptx)} bytes")
    assert re.search(r"^\.visible \.entry shmem_k\(", ptx, re.M)
    for name in nvshmem.FUNCTIONS:
        assert re.search(rf"^\.func\s+(?:\([^)]*\)\s*)?{name}\(", ptx, re.M), name
    externs = set(re.findall(r"^\.extern \.func\s+(?:\([^)]*\)\s*)?(\w+)", ptx, re.M))
    assert externs <= {"vprintf", "__assertfail"}
    # the device state the host library fills stays visible
    assert re.search(r"^\.visible \.const .* nvshmemi_device_state_d\[", ptx, re.M)
    # pruned: a few dozen functions of the library's thousands
    assert len(re.findall(r"^\.func ", ptx, re.M)) < 100


def test_linked_ptx_keeps_our_code_and_passes_the_checker(linked):
    ptx, _, _ = linked
    k = shmem_kernel()
    ours = emit_ptx(k)
    assert ".extern .func nvshmem_quiet" in ours
    # every call stays direct (a prototype call would mean a signature differs from the
    # bitcode's definition)
    assert "prototype" not in ptx.split(".visible .entry shmem_k(")[1]
    report = check_ptx(k, ptx)
    assert report.found == check_ptx(k, ours).found
    assert report.found[("shmem_k", "call.uni nvshmem_putmem_nbi")] == 1


def test_only_the_called_functions_are_linked(cache):
    _bitcode()
    kb = KernelBuilder("quiet_only", block_threads=32)
    with kb.role("main") as r:
        nvshmem.quiet(r)
    ptx = emit_linked_ptx(kb.build())
    assert re.search(r"^\.func nvshmem_quiet\(", ptx, re.M)
    assert "nvshmem_putmem_nbi" not in ptx and "nvshmemx_signal_op" not in ptx


def test_linked_ptx_is_cached_on_disk(cache, monkeypatch):
    _bitcode()
    k = shmem_kernel("cached_k")
    first = emit_linked_ptx(k)
    files = list(cache.rglob("*.ptx"))
    assert len(files) == 1 and files[0].read_text() == first

    def no_link(*a, **kw):
        raise AssertionError("linked again instead of reading the cache")

    monkeypatch.setattr(link, "link_module", no_link)
    start = time.perf_counter()
    assert emit_linked_ptx(k) == first
    print(f"cached link: {time.perf_counter() - start:.3f} s")
    # another kernel is another key
    with pytest.raises(AssertionError, match="linked again"):
        emit_linked_ptx(shmem_kernel("other_k"))
    # a corrupt entry is linked again
    files[0].write_text("garbage")
    with pytest.raises(AssertionError, match="linked again"):
        emit_linked_ptx(k)


def test_cache_key_covers_ir_bitcode_and_target():
    t90, t100 = Target("sm_90"), Target("sm_100")
    base = link.cache_key("ir", "bc", t90)
    assert base == link.cache_key("ir", "bc", Target("sm_90"))
    assert len({base, link.cache_key("ir2", "bc", t90), link.cache_key("ir", "bc2", t90),
                link.cache_key("ir", "bc", t100),
                link.cache_key("ir", "bc", Target("sm_90", ptx=87))}) == 5


def test_linked_ptx_assembles_with_ptxas(linked):
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("no ptxas (pip install nvidia-cuda-nvcc)")
    ptx, _, _ = linked
    start = time.perf_counter()
    report = assemble(ptx, "sm_90")
    print(f"ptxas: {time.perf_counter() - start:.1f} s")
    assert "shmem_k" in report.kernels
    assert report.kernels["shmem_k"].registers > 0


# ---------------------------------------------------------------------------------------------
# Where the link is used


def test_goldens_stay_unlinked(monkeypatch):
    monkeypatch.setattr(link, "find_bitcode", lambda arch: pytest.fail("goldens must not link"))
    ptx = goldens.emit_ptx(shmem_kernel())
    assert ".extern .func nvshmem_putmem_nbi" in ptx


def test_epgen_emit_ptx_links_modules_that_call_nvshmem(monkeypatch, cache):
    _bitcode()
    k = shmem_kernel("epgen_k")
    monkeypatch.setattr(epgen, "build_module", lambda cfg: k)
    linked_ptx = epgen.emit_ptx(None)
    assert re.search(r"^\.func nvshmem_putmem_nbi\(", linked_ptx, re.M)
    assert epgen.emit_ptx(None, link=False) == emit_ptx(k)


def test_cli_ptx_links_unless_no_link(monkeypatch, cache, capsys):
    _bitcode()
    k = shmem_kernel("cli_k")
    monkeypatch.setattr(epgen.kernels, "build_module", lambda cfg: k)
    assert cli.main(["ptx"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\.func nvshmem_quiet\(", out, re.M)
    assert cli.main(["ptx", "--no-link"]) == 0
    out = capsys.readouterr().out
    assert out == emit_ptx(k)
    assert ".extern .func nvshmem_quiet" in out


def test_cli_missing_bitcode_is_a_clean_error(monkeypatch, cache, capsys, tmp_path):
    monkeypatch.delenv(link.ENV_BITCODE, raising=False)
    monkeypatch.setattr(link, "_wheel_lib_dirs", lambda: [tmp_path])
    monkeypatch.setattr(epgen.kernels, "build_module", lambda cfg: shmem_kernel("cli_k"))
    assert cli.main(["ptx"]) == 1
    assert "pip install 'epgen[shmem]'" in capsys.readouterr().err
    assert cli.main(["ptx", "--no-link"]) == 0


# ---------------------------------------------------------------------------------------------
# epgen inspect


def test_inspect_lists_nvshmem_calls_by_role(monkeypatch, cache):
    _bitcode()
    module = N.Module("m", (shmem_kernel("inspect_k"), plain_kernel()))
    monkeypatch.setattr(epgen.kernels, "build_module", lambda cfg: module)
    report = inspection.inspect_config(presets.load_preset("small"), ptxas=False)
    kernels = {k["name"]: k for k in report["kernels"]}
    assert kernels["inspect_k"]["nvshmem_calls"] == [
        {"role": "send", "function": "nvshmem_my_pe", "kind": "query", "calls": 1},
        {"role": "send", "function": "nvshmem_putmem_nbi", "kind": "put", "calls": 1},
        {"role": "send", "function": "nvshmemx_putmem_nbi_warp", "kind": "put", "calls": 1},
        {"role": "send", "function": "nvshmemx_putmem_signal_nbi_warp", "kind": "put_signal",
         "calls": 1},
        {"role": "send", "function": "nvshmem_fence", "kind": "fence", "calls": 1},
        {"role": "send", "function": "nvshmemx_signal_op", "kind": "signal", "calls": 1},
        {"role": "send", "function": "nvshmem_quiet", "kind": "quiet", "calls": 1},
        {"role": "send", "function": "nvshmem_signal_wait_until", "kind": "wait", "calls": 1},
    ]
    assert kernels["plain"]["nvshmem_calls"] == []
    assert report["nvshmem_link"] == {"needed": True, "error": None}
    ops = {o["instruction"]: o for o in kernels["inspect_k"]["ordered_ops"]}
    assert ops["call.uni nvshmem_quiet"] == {"instruction": "call.uni nvshmem_quiet",
                                             "roles": ["send"], "ir": 1, "ptx": 1}
    assert json.loads(json.dumps(report)) == report
    text = inspection.format_text(report)
    assert re.search(r"^  NVSHMEM calls\n    role +function +kind +calls\n"
                     r"    send +nvshmem_my_pe +query +1\n"
                     r"    send +nvshmem_putmem_nbi +put +1\n", text, re.M)
    assert re.search(r"^    send +nvshmemx_signal_op +signal +1$", text, re.M)
    assert "kernel plain:" in text and text.count("    (none)") >= 1
    assert "NVSHMEM: device bitcode linked into the PTX" in text


def test_inspect_without_bitcode_checks_our_ptx_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(link.ENV_BITCODE, raising=False)
    monkeypatch.setattr(link, "_wheel_lib_dirs", lambda: [tmp_path])
    module = N.Module("m", (shmem_kernel("inspect_k"),))
    monkeypatch.setattr(epgen.kernels, "build_module", lambda cfg: module)
    report = inspection.inspect_config(presets.load_preset("small"), ptxas=True)
    assert "epgen[shmem]" in report["nvshmem_link"]["error"]
    assert report["ptxas"]["error"].startswith("not assembled: NVSHMEM is not linked")
    assert "checked on our PTX only" in inspection.format_text(report)
    assert cli.main(["inspect"]) == 1
