"""epgen: a code generator for the expert-parallel MoE dispatch kernels (the reference
``EPDispatchKernel`` family).

Importing the package costs nothing: every name below is loaded on first use (PEP 562).
``EPConfig``, the formats and ``reference`` need numpy, attrs and ml_dtypes; ``emit_ptx``
loads llvmlite; ``EmulatedWorld``, ``P2PWorld`` and ``ShmemWorld`` load cuda.core. Every
registered token format class is exported under its class name (``epgen.BF16Format``,
``epgen.MXFP4Format``, ...: ``epgen.formats.FORMATS``).
"""

from __future__ import annotations

import importlib

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "reference": ("epgen.reference", None),
    "EPConfig": ("epgen.config", "EPConfig"),
    "EPConfigError": ("epgen.config", "EPConfigError"),
    "EPTimeoutError": ("epgen.errors", "EPTimeoutError"),
    "TokenFormat": ("epgen.formats", "TokenFormat"),
    "Layout": ("epgen.layout", "Layout"),
    "Tuning": ("epgen.tuning", "Tuning"),
    "TuningError": ("epgen.tuning", "TuningError"),
    "EmulatedWorld": ("epgen.runtime.world", "EmulatedWorld"),
    "P2PWorld": ("epgen.runtime.p2p_world", "P2PWorld"),
    "ShmemWorld": ("epgen.runtime.shmem_world", "ShmemWorld"),
    "ShmemSession": ("epgen.runtime.shmem_session", "ShmemSession"),
}


def build_module(cfg):
    """The IR module of ``cfg``'s dispatch kernels (``dispatch_async``, ``dispatch_wait`` and
    the fused single launch ``ep_dispatch``; only ``ep_dispatch`` with fused_shared_expert)."""
    from .kernels import build_module as _build
    return _build(cfg)


def emit_ptx(cfg, arch: str = "sm_90", link: bool = True) -> str:
    """PTX of ``cfg``'s dispatch entry points (``build_module``), one module. When the kernels
    call NVSHMEM (the ``use_shmem`` transport) NVSHMEM's device functions are linked in
    (``backends.nvptx.emit_linked_ptx``; the ``shmem`` extra); ``link=False`` gives our code
    alone, the NVSHMEM functions left ``.extern .func`` declarations."""
    from backends.nvptx import emit_linked_ptx, emit_ptx as _emit
    module = build_module(cfg)
    return emit_linked_ptx(module, arch=arch) if link else _emit(module, arch=arch)


def _format_classes() -> dict[str, type]:
    """The registered token format classes by class name (each ends in ``Format``)."""
    from .formats import FORMATS
    return {cls.__name__: cls for cls in FORMATS.values()}


_STATIC_ALL = ["EPConfig", "EPConfigError", "EPTimeoutError", "TokenFormat", "Layout", "Tuning",
               "TuningError", "reference", "build_module", "emit_ptx", "EmulatedWorld",
               "P2PWorld", "ShmemWorld", "ShmemSession"]


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
        globals()[name] = value
        return value
    if name == "__all__":       # computed, as it names the registered formats
        return _STATIC_ALL + sorted(_format_classes())
    if name.endswith("Format") and name in _format_classes():
        globals()[name] = _format_classes()[name]
        return globals()[name]
    raise AttributeError(f"module 'epgen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_format_classes()))
