"""Normalise PTX text so that two versions of a kernel can be compared line by line.

LLVM numbers virtual registers (``%r12``, ``%rd5``, ``%p3``, ...) and basic-block labels
(``$L__BB0_12``) in the order its passes create them, so a change that adds one instruction
near the top of a kernel renames most registers and labels below it, and a plain diff of
the two PTX texts shows the renaming rather than the change. ``normalize_ptx`` renumbers,
per function (each ``.entry`` or ``.func``), every register of each class in order of first
appearance (``%r1``, ``%r2``, ... separately for ``%r``, ``%rd``, ``%p``, ...) and every
block label likewise (``$L__BB<function>_<n>``, ``n`` from 1). The ``.reg`` declarations
(``.reg .b32 %r<113>;``) keep their counts: how many registers a kernel declares is part of
what changed. Special registers (``%tid.x``, ``%ctaid.x``, ``%globaltimer``, ``%clock64``)
are left alone: only the virtual-register prefixes below are renumbered.

Renumbering alone does not survive an inserted instruction: every register first seen after
it still moves up by one. ``comparable_lines`` therefore also gives each line a comparison key
with the register and label numbers masked (``%r``, ``$L__BB``), so that a line-based diff
(``difflib``) pairs lines that differ only in which register they name and reports the
instructions, declarations and operands that really changed; the lines it prints are still
the renumbered ones. A change only of register dataflow (an operand now names another
register of the same class) is the one thing the masked comparison hides: diff without
``--normalize`` to see it.

Used by ``epgen diff --normalize``; the output is for reading, not for ``ptxas`` (it is still
valid PTX, but nothing relies on that).
"""

from __future__ import annotations

import re

__all__ = ["REGISTER_CLASSES", "comparable_lines", "normalize_ptx"]

REGISTER_CLASSES = ("p", "rs", "r", "rd", "rq", "f", "fd", "h", "hh")
"""The virtual-register prefixes LLVM's NVPTX backend emits (predicate, 16/32/64/128-bit
integer, f32, f64, f16, f16x2)."""

_REG = re.compile(r"%(" + "|".join(sorted(REGISTER_CLASSES, key=len, reverse=True))
                  + r")(\d+)\b")
_LABEL = re.compile(r"\$L__BB(\d+)_(\d+)\b")
_FUNCTION = re.compile(r"^\s*(?:\.\w+\s+)*\.(?:entry|func)\b")


def normalize_ptx(text: str) -> str:
    """``text`` with registers and block labels renumbered per function in order of first
    appearance (see the module docstring). Idempotent; lines outside functions (the header,
    module-scope declarations) only have their labels and registers renumbered as one more
    scope."""
    out: list[str] = []
    regs: dict[tuple[str, str], str] = {}
    counts: dict[str, int] = {}
    labels: dict[str, str] = {}
    function = -1

    def reg(m: re.Match[str]) -> str:
        key = (m.group(1), m.group(2))
        if key not in regs:
            counts[key[0]] = counts.get(key[0], 0) + 1
            regs[key] = f"%{key[0]}{counts[key[0]]}"
        return regs[key]

    def label(m: re.Match[str]) -> str:
        if m.group(0) not in labels:
            labels[m.group(0)] = f"$L__BB{max(function, 0)}_{len(labels) + 1}"
        return labels[m.group(0)]

    for line in text.splitlines(keepends=True):
        if _FUNCTION.match(line):
            function += 1
            regs.clear()
            counts.clear()
            labels.clear()
        if ".reg" in line and "<" in line:
            out.append(line)  # a declaration: %r<113> keeps its count
            continue
        out.append(_LABEL.sub(label, _REG.sub(reg, line)))
    return "".join(out)


class _Line(str):
    """A line of PTX that compares (and hashes) by its masked key, prints as itself."""

    __slots__ = ("key",)
    key: str

    def __eq__(self, other: object) -> bool:
        return self.key == (other.key if isinstance(other, _Line) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.key)


def _mask(line: str) -> str:
    return _LABEL.sub("$L__BB", _REG.sub(lambda m: "%" + m.group(1), line))


def comparable_lines(text: str) -> list[str]:
    """The lines of ``normalize_ptx(text)`` (ends kept), each equal to any other line that
    differs from it only in register or block-label numbers; for ``difflib``."""
    lines = []
    for line in normalize_ptx(text).splitlines(keepends=True):
        item = _Line(line)
        item.key = _mask(line)
        lines.append(item)
    return lines
