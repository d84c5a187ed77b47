"""Exceptions of epgen's public API."""

from __future__ import annotations


class EPTimeoutError(RuntimeError):
    """A bounded wait on the GPU expired. ``records`` holds the decoded diagnostic records
    (``ir.diag.TimeoutRecord``): which kernel, role, rank, block and thread waited on which
    buffer word, what it expected and what it last saw."""

    def __init__(self, records, context: str = ""):
        self.records = list(records)
        head = f"{len(self.records)} bounded wait(s) expired" + (f" during {context}" if context else "")
        lines = [head] + [f"  - {rec}" for rec in self.records]
        super().__init__("\n".join(lines))


class EPInputError(ValueError):
    """Invalid dispatch or combine inputs (raised before anything is launched or written)."""
