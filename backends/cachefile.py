"""Atomic writes of cache files, shared by the backends' on-disk caches (the cubin cache and
the linked-PTX cache): a reader sees the whole file or none."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, suffix: str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a
    rename; a failure to cache is not an error (the caller computes the value again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=suffix)
        try:
            with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        pass
