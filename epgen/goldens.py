"""The registry of golden variants: named IR modules whose IR text and PTX are pinned in
``golden/<kernel_dir>/<variant>.{ir,ptx}``.

A builder registers itself with the ``golden`` decorator::

    @golden("demo/copy16")
    def copy16_module() -> ir.Module:
        '''demo: grid-stride copy of 16-byte vectors (...)'''
        return ir.Module("copy16", (build_copy16(),))

``describe(name)`` is the variant's one-line description (``epgen variants`` prints it): the
decorator's ``description=`` when given (the EP variants say their preset and what they set),
else the first paragraph of the builder's docstring.

``load_all()`` imports the modules that register variants (the demo kernels, the EP kernels
of some presets), so the registry is complete; ``golden_outputs(name)`` builds a variant and
returns its IR text and its PTX. The golden tests (``tests/ptx/test_golden.py``) and the CLI
(``epgen ptx --variant NAME``, ``epgen variants``) read the registry through these functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from typing import Callable

import ir

DEFAULT_ARCH = "sm_90"

GOLDENS: dict[str, Callable[[], ir.Module]] = {}
"""Registered variants: ``"<kernel_dir>/<variant>"`` -> a function building its module."""

DESCRIPTIONS: dict[str, str] = {}
"""``description=`` of the variants registered with one (see ``describe``)."""

# Modules whose import registers variants; load_all() imports those that exist.
_REGISTERING_MODULES = ("epgen.demos", "epgen.ep_goldens")

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_\-]*/[a-z0-9][a-z0-9_\-]*")


class GoldenError(Exception):
    """A golden variant cannot be produced: unknown name, bad builder, missing component."""


def golden(name: str, description: str | None = None):
    """Register the decorated zero-argument function as the builder of variant ``name``
    (``"<kernel_dir>/<variant>"``, lower case, e.g. ``"demo/copy16"``). It returns an
    ``ir.Module`` (an ``ir.Kernel`` is wrapped in a one-kernel module). ``description``: one
    line saying what the variant is (default: the builder's docstring, see ``describe``)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"golden name {name!r} must look like '<kernel_dir>/<variant>' "
                         "(lower-case letters, digits, '_' and '-'; exactly one '/')")

    def register(builder: Callable[[], ir.Module]):
        old = GOLDENS.get(name)
        if old is not None and _qualname(old) != _qualname(builder):
            raise ValueError(f"golden {name!r} is registered twice: by {_qualname(old)} "
                             f"and by {_qualname(builder)}")
        GOLDENS[name] = builder
        if description is None:
            DESCRIPTIONS.pop(name, None)
        else:
            DESCRIPTIONS[name] = " ".join(description.split())
        return builder

    return register


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def load_all() -> dict[str, Callable[[], ir.Module]]:
    """Import every module that registers golden variants (those that exist yet) and return
    the registry. An error inside such a module propagates: it is a bug, not an absence."""
    for mod in _REGISTERING_MODULES:
        if importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod)
    return GOLDENS


def names() -> list[str]:
    """Sorted names of the registered variants (after ``load_all()``)."""
    return sorted(load_all())


def describe(name: str) -> str:
    """One line describing the registered variant ``name``: its ``description=``, else the
    first paragraph of its builder's docstring (whitespace collapsed), else ``""``."""
    load_all()
    if name not in GOLDENS:
        raise GoldenError(f"unknown variant {name!r} (known: {', '.join(sorted(GOLDENS))})")
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    doc = inspect.getdoc(GOLDENS[name]) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def build_module(name: str) -> ir.Module:
    """Build the module of the registered variant ``name``."""
    load_all()
    try:
        builder = GOLDENS[name]
    except KeyError:
        known = ", ".join(sorted(GOLDENS)) or "none registered"
        raise GoldenError(f"unknown variant {name!r} (known: {known})") from None
    module = builder()
    if isinstance(module, ir.Kernel):
        module = ir.Module(module.name, (module,))
    if not isinstance(module, ir.Module):
        raise GoldenError(f"the builder of {name!r} ({_qualname(builder)}) returned "
                          f"{type(module).__name__}, not an ir.Module")
    return module


def print_ir(module: ir.Module) -> str:
    """The module's deterministic IR text (``ir.print_module``)."""
    printer = getattr(ir, "print_module", None)
    if printer is None:
        try:
            from ir.printer import print_module as printer
        except ImportError as e:
            raise GoldenError("the IR printer is not available yet: ir.print_module "
                              f"(ir/printer.py) could not be imported ({e})") from e
    return printer(module)


def emit_ptx(module: ir.Module, arch: str = DEFAULT_ARCH) -> str:
    """The module's PTX for ``arch`` (``backends.nvptx.emit_ptx``)."""
    try:
        from backends.nvptx import emit_ptx as _emit_ptx
    except ImportError as e:
        raise GoldenError("the NVPTX backend is not available: backends.nvptx.emit_ptx "
                          f"could not be imported ({e})") from e
    return _emit_ptx(module, arch=arch)


def golden_outputs(name: str, arch: str = DEFAULT_ARCH) -> dict[str, str]:
    """``{"ir": IR text, "ptx": PTX for arch}`` of the registered variant ``name``."""
    module = build_module(name)
    return {"ir": print_ir(module), "ptx": emit_ptx(module, arch=arch)}
