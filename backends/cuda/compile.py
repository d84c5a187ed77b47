"""PTX -> cubin through cuda.core's ``Program``, with an on-disk cubin cache.

The cache key is sha256 over (PTX text, arch, driver version, extra toolchain facts such as the
nvJitLink version and ptxas options). Files live under ``$EPGEN_CACHE_DIR`` or
``~/.cache/epgen/cubin`` as ``<key[:2]>/<key>.cubin``; they are written atomically, and a
corrupt or unreadable entry is recompiled. :func:`cache_key`, :func:`cache_path` and
:func:`default_cache_dir` are pure and need no GPU.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from ..cachefile import write_atomic
from . import compat
from .errors import CompileError, CudaUnavailableError, cuda_errors, translate_exception
from .stream import arch as device_arch
from .stream import driver_version

__all__ = ["compile_ptx", "cache_key", "cache_path", "default_cache_dir", "normalize_arch",
           "cache_info", "CacheInfo"]

_KEY_SCHEMA = b"epgen-cubin-v1"
_ELF_MAGIC = b"\x7fELF"


class CacheInfo(NamedTuple):
    """Counters of :func:`compile_ptx` in this process."""

    hits: int
    misses: int


_hits = 0
_misses = 0


def cache_info() -> CacheInfo:
    """How many :func:`compile_ptx` calls were served from the disk cache / compiled."""
    return CacheInfo(_hits, _misses)


def normalize_arch(arch: str | int) -> str:
    """``"sm_90"``, ``"90"`` or ``90`` -> ``"sm_90"`` (suffixes such as ``sm_90a`` are kept)."""
    text = str(arch).strip().lower()
    if text.startswith("sm_"):
        text = text[3:]
    if not text or not text[0].isdigit():
        raise ValueError(f"not a CUDA architecture: {arch!r} (expected e.g. 'sm_90')")
    return f"sm_{text}"


def default_cache_dir() -> Path:
    """``$EPGEN_CACHE_DIR`` if set and non-empty, else ``~/.cache/epgen/cubin``."""
    env = os.environ.get("EPGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "epgen" / "cubin"


def cache_key(ptx: str | bytes, arch: str, driver_version: int,
              extra: Sequence[str] = ()) -> str:
    """Hex sha256 identifying the cubin of ``ptx`` for ``arch`` under ``driver_version``;
    ``extra`` adds toolchain facts (nvJitLink version, ptxas options)."""
    digest = hashlib.sha256()
    fields = [_KEY_SCHEMA, normalize_arch(arch).encode(), str(int(driver_version)).encode()]
    fields += [str(item).encode() for item in extra]
    for field in fields:
        digest.update(len(field).to_bytes(8, "little"))
        digest.update(field)
    body = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    digest.update(len(body).to_bytes(8, "little"))
    digest.update(body)
    return digest.hexdigest()


def cache_path(cache_dir: str | os.PathLike, key: str) -> Path:
    """Where the cubin with ``key`` lives under ``cache_dir``."""
    return Path(cache_dir) / key[:2] / f"{key}.cubin"


def _nvjitlink_version() -> str:
    try:
        from cuda.bindings import nvjitlink

        return "nvjitlink-" + ".".join(str(v) for v in nvjitlink.version())
    except Exception:  # noqa: BLE001 - no nvJitLink: cuda.core uses the driver's linker
        return "nvjitlink-none"


def _read_cache(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if data.startswith(_ELF_MAGIC) else None


def _write_cache(path: Path, data: bytes) -> None:
    write_atomic(path, data, ".cubin")


def compile_ptx(ptx: str | bytes, arch: str | None = None, cache_dir=None, *,
                use_cache: bool = True, ptxas_options: Sequence[str] | None = None,
                name: str = "epgen"):
    """Compile PTX text to a cubin ``ObjectCode`` for ``arch`` (default: the current device).

    Uses ``Program(ptx, code_type="ptx", options=ProgramOptions(arch=...)).compile("cubin")``
    (nvJitLink when available). With ``use_cache`` the cubin is looked up in / stored to
    ``cache_dir`` (default :func:`default_cache_dir`) and a hit is loaded with
    ``ObjectCode.from_cubin``. Raises :class:`CompileError` with the compiler log on bad PTX and
    :class:`CudaUnavailableError` without a driver.
    """
    global _hits, _misses
    text = ptx.decode() if isinstance(ptx, bytes | bytearray) else str(ptx)
    target = normalize_arch(arch) if arch is not None else device_arch()
    options = list(ptxas_options or ())
    path = None
    if use_cache:
        extra = [_nvjitlink_version(), "ptxas:" + " ".join(options)]
        key = cache_key(text, target, driver_version(), extra)
        path = cache_path(cache_dir if cache_dir is not None else default_cache_dir(), key)
        cubin = _read_cache(path)
        if cubin is not None:
            with cuda_errors(f"loading cached cubin {path}"):
                obj = compat.core().ObjectCode.from_cubin(cubin, name=name)
            _hits += 1
            return obj

    core = compat.core()
    program_options = core.ProgramOptions(name=name, arch=target,
                                          ptxas_options=options or None)
    program = None
    try:
        program = core.Program(text, code_type="ptx", options=program_options)
        obj = program.compile("cubin")
    except Exception as exc:
        translated = translate_exception(exc, f"compiling PTX for {target}")
        if translated is None:
            raise
        if isinstance(translated, CudaUnavailableError):
            raise translated from exc
        raise CompileError(str(translated), log=str(exc), name=translated.name,
                           code=translated.code, call=translated.call) from exc
    finally:
        if program is not None and hasattr(program, "close"):
            program.close()
    _misses += 1
    if path is not None:
        _write_cache(path, bytes(obj.code))
    return obj
