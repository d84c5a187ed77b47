"""The NVSHMEM link step: our kernels' module + NVSHMEM's device bitcode -> one PTX module.

A kernel of the ``use_shmem`` transport calls NVSHMEM device functions (``ir.nvshmem``); our
lowering leaves them ``.extern .func`` declarations, which nothing can resolve at load time
(NVSHMEM ships its device code as LLVM bitcode, not as a device library the CUDA linker
takes). This module resolves them at the LLVM level:

1. **Find** the bitcode of the installed ``nvidia-nvshmem-cu13`` wheel (the ``shmem`` extra):
   ``nvidia/nvshmem/lib/libnvshmem_device_sm_<NN>.bc`` for the target's architecture, else
   the generic ``libnvshmem_device.bc``; ``$EPGEN_NVSHMEM_BITCODE`` names a file instead.
2. **Parse** it once per process (``llvm.parse_bitcode``, ~10 s) and prune it right away to
   the functions of ``ir.nvshmem.FUNCTIONS`` and what they reach: every other defined function
   becomes internal and global DCE drops it (the 2,800 functions become a few dozen).
3. **Link**: a clone of that pruned library takes our O2-optimised module (``link_in``), so
   the library's globals keep their order and the PTX is deterministic; then every defined
   function but our entry kernels is internal and global DCE runs again, which removes the
   NVSHMEM functions our kernels do not call. Globals stay as they are: NVSHMEM's
   ``nvshmemi_device_state_d`` and the transports' ``*_device_state_d`` must stay external
   (visible), the host library fills them when it initialises the loaded module.
4. **Emit** the PTX with a fresh target machine and cache it on disk, keyed by our optimised
   LLVM IR, the bitcode's sha256, the llvmlite/LLVM version and the target: a second link of
   the same kernels (another process, another world) reads the file.

PTX Mapping: the linked PTX is our PTX (same entries, same instructions) where each
``.extern .func <name>`` declaration has become a ``.func <name>`` definition from NVSHMEM,
followed by the functions those reach, NVSHMEM's ``.visible .const`` device-state globals and
its string constants; ``call.uni <name>`` lines are unchanged (nothing is inlined after the
link), so ``check_ptx`` checks linked and unlinked PTX alike. Only ``vprintf`` and
``__assertfail`` stay ``.extern`` (ptxas resolves them). Entry points must carry the
``ptx_kernel`` calling convention (``lower.py`` gives it to every kernel): a kernel marked only
through ``nvvm.annotations`` is not an entry for LLVM 22, and global DCE would delete it.

A module that calls no NVSHMEM function is not linked: ``emit_linked_ptx`` returns exactly
``emit_ptx``'s text. The goldens are always the unlinked PTX.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import time
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from ir import nodes as N
from ir import nvshmem as ir_nvshmem

from .emit import _module, _target, emit_ptx, normalize, optimized_module
from .errors import LoweringError
from ..cachefile import write_atomic
from .target import Target

ENV_BITCODE = "EPGEN_NVSHMEM_BITCODE"
INSTALL_HINT = "pip install 'epgen[shmem]'"
CACHE_SUBDIR = "linked-ptx"
_KEY_SCHEMA = b"epgen-linked-ptx-v1"


class NvshmemLinkError(LoweringError, RuntimeError):
    """NVSHMEM's device bitcode is missing, unreadable, or does not link with our module (a
    RuntimeError too: what is missing is the environment's, not the kernel's)."""


# ---------------------------------------------------------------------------------------------
# What a module calls


def nvshmem_calls(m: N.Module | N.Kernel) -> list[tuple[str, str, N.Call]]:
    """Every call of an ``ir.nvshmem`` function, as ``(kernel, role, call)`` in IR order."""
    out = []
    for kernel in _module(m).kernels:
        for role in kernel.roles:
            for node in N.walk(role.body):
                if isinstance(node, N.Call) and ir_nvshmem.is_nvshmem(node.name):
                    out.append((kernel.name, role.name, node))
    return out


def uses_nvshmem(m: N.Module | N.Kernel) -> bool:
    """Whether any kernel of ``m`` calls an NVSHMEM device function (then its PTX needs the
    link step)."""
    return bool(nvshmem_calls(m))


# ---------------------------------------------------------------------------------------------
# The bitcode


def _wheel_lib_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or ()) if spec else ()
    return [Path(root) / "nvshmem" / "lib" for root in roots]


def find_bitcode(arch: str = "sm_90") -> Path:
    """The NVSHMEM device bitcode for ``arch``: ``$EPGEN_NVSHMEM_BITCODE``, else the installed
    wheel's ``libnvshmem_device_sm_<NN>.bc``, else its ``libnvshmem_device.bc``; raises
    NvshmemLinkError naming the ``shmem`` extra when there is none."""
    env = os.environ.get(ENV_BITCODE)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise NvshmemLinkError(f"${ENV_BITCODE}={env!r} is not a file")
        return path
    names = (f"libnvshmem_device_{arch}.bc", "libnvshmem_device.bc")
    searched = []
    for lib in _wheel_lib_dirs():
        for name in names:
            if (lib / name).is_file():
                return lib / name
        searched.append(str(lib))
    where = f" (searched {', '.join(searched)})" if searched else ""
    raise NvshmemLinkError(
        f"NVSHMEM's device bitcode ({' or '.join(names)}) is not installed{where}: kernels "
        f"that call NVSHMEM need it; install it with `{INSTALL_HINT}` or set ${ENV_BITCODE}")


_lock = threading.RLock()
_hashes: dict[tuple, str] = {}
_pruned: dict[str, llvm.ModuleRef] = {}
_parse_seconds: dict[str, float] = {}


def bitcode_sha256(path: Path) -> str:
    """Hex sha256 of the bitcode file (cached per path, size and mtime)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key not in _hashes:
            _hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        return _hashes[key]


def _dce(mod: llvm.ModuleRef, target: Target) -> None:
    pm = llvm.create_new_module_pass_manager()
    pm.add_global_dead_code_eliminate_pass()
    pb = llvm.create_pass_builder(target.machine, llvm.create_pipeline_tuning_options(0))
    pm.run(mod, pb)


def _internalize_except(mod: llvm.ModuleRef, keep) -> None:
    for fn in mod.functions:
        if not fn.is_declaration and fn.name not in keep:
            fn.linkage = "internal"


def pruned_library(path: Path, target: Target) -> llvm.ModuleRef:
    """The parsed bitcode at ``path``, pruned to ``ir.nvshmem.FUNCTIONS`` and their callees;
    parsed once per process and file content (do not modify it: link a clone)."""
    digest = bitcode_sha256(path)
    with _lock:
        lib = _pruned.get(digest)
        if lib is not None:
            return lib
        start = time.perf_counter()
        try:
            lib = llvm.parse_bitcode(path.read_bytes())
        except (OSError, RuntimeError) as e:
            raise NvshmemLinkError(f"cannot parse NVSHMEM's device bitcode {path} with "
                                   f"llvmlite {llvmlite.__version__} (LLVM "
                                   f"{'.'.join(map(str, llvm.llvm_version_info))}): {e}") from e
        defined = {fn.name for fn in lib.functions if not fn.is_declaration}
        missing = sorted(set(ir_nvshmem.FUNCTIONS) - defined)
        if missing:
            raise NvshmemLinkError(f"{path} defines no {', '.join(missing)} (ir.nvshmem."
                                   "FUNCTIONS): not NVSHMEM's device bitcode, or another API")
        _internalize_except(lib, ir_nvshmem.FUNCTIONS)
        _dce(lib, target)
        _pruned[digest] = lib
        _parse_seconds[digest] = time.perf_counter() - start
        return lib


# ---------------------------------------------------------------------------------------------
# The disk cache


def cache_dir() -> Path:
    """``linked-ptx/`` under the cubin cache directory (``$EPGEN_CACHE_DIR``, else
    ``~/.cache/epgen/cubin``): ``<key[:2]>/<key>.ptx``."""
    base = os.environ.get("EPGEN_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "epgen" / "cubin"
    return root / CACHE_SUBDIR


def cache_key(llvm_ir: str, bitcode_hash: str, target: Target) -> str:
    """Hex sha256 of what the linked PTX depends on: our optimised LLVM IR, the bitcode's
    sha256, the llvmlite and LLVM versions, the architecture and PTX version."""
    digest = hashlib.sha256()
    fields = [_KEY_SCHEMA, llvmlite.__version__, ".".join(map(str, llvm.llvm_version_info)),
              target.arch, str(target.ptx), bitcode_hash, llvm_ir]
    for field in fields:
        data = field if isinstance(field, bytes) else field.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _cache_path(key: str) -> Path:
    return cache_dir() / key[:2] / f"{key}.ptx"


def _read_cache(path: Path) -> str | None:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.startswith(".version") and text.endswith("\n") else None


def _write_cache(path: Path, text: str) -> None:
    write_atomic(path, text, ".ptx")


# ---------------------------------------------------------------------------------------------
# The link


def link_module(mod: llvm.ModuleRef, kernels, path: Path, target: Target) -> llvm.ModuleRef:
    """A new module: a clone of the pruned library with ``mod`` (our optimised module, which
    the link consumes) linked in, every function but ``kernels`` internal, dead code gone."""
    linked = pruned_library(path, target).clone()
    try:
        linked.link_in(mod)
    except RuntimeError as e:
        raise NvshmemLinkError(f"linking NVSHMEM's device bitcode {path} failed: {e}") from e
    _internalize_except(linked, set(kernels))
    _dce(linked, target)
    lost = sorted(set(kernels) - {fn.name for fn in linked.functions if not fn.is_declaration})
    if lost:
        raise NvshmemLinkError(f"the link lost the entry kernels {', '.join(lost)}: they must "
                               "use the ptx_kernel calling convention")
    try:
        linked.verify()
    except RuntimeError as e:
        raise NvshmemLinkError(f"the linked module does not verify: {e}") from e
    return linked


def emit_linked_ptx(m: N.Module | N.Kernel, arch: str | Target = "sm_90",
                    use_cache: bool = True) -> str:
    """PTX of ``m`` with NVSHMEM's device functions linked in (module docstring); exactly
    ``emit_ptx(m, arch)`` when ``m`` calls no NVSHMEM function. The result is cached on disk
    (``cache_dir``) unless ``use_cache`` is False."""
    if not uses_nvshmem(m):
        return emit_ptx(m, arch)
    target = _target(arch)
    module = _module(m)
    path = find_bitcode(target.arch)
    mod = optimized_module(module, target)
    key = cache_key(str(mod), bitcode_sha256(path), target)
    if use_cache:
        cached = _read_cache(_cache_path(key))
        if cached is not None:
            return cached
    linked = link_module(mod, [k.name for k in module.kernels], path, target)
    # a fresh target machine: the NVPTX printer numbers call sequences per machine
    ptx = normalize(Target(target.arch, target.ptx).machine.emit_assembly(linked))
    if use_cache:
        _write_cache(_cache_path(key), ptx)
    return ptx


def parse_seconds() -> dict[str, float]:
    """Seconds each bitcode (by sha256) took to parse and prune in this process."""
    with _lock:
        return dict(_parse_seconds)


__all__ = ["ENV_BITCODE", "INSTALL_HINT", "NvshmemLinkError", "bitcode_sha256", "cache_dir",
           "cache_key", "emit_linked_ptx", "find_bitcode", "link_module", "nvshmem_calls",
           "parse_seconds", "pruned_library", "uses_nvshmem"]
