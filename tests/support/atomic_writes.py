"""How the file bootstrap publishes a file, recorded: every ``os.replace`` (the rename that
makes a written file appear whole) with whether its target already existed."""

from __future__ import annotations

import os


def record_replaces(monkeypatch) -> list:
    """A list that gets ``(basename of the source, target existed)`` for every ``os.replace``
    made from now on (the rename still happens)."""
    seen = []
    real = os.replace

    def replace(src, dst):
        seen.append((os.path.basename(src), os.path.exists(dst)))
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    return seen
