"""epgen: a code generator for the expert-parallel MoE dispatch kernels (the reference
``EPDispatchKernel`` family).

Importing the package costs nothing: every name below is loaded on first use (PEP 562).
``EPConfig``, the formats and ``reference`` need numpy, attrs and ml_dtypes; ``emit_ptx``
loads llvmlite; ``EmulatedWorld``, ``P2PWorld`` and ``ShmemWorld`` load cuda.core.
"""

from __future__ import annotations

import importlib

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "reference": ("epgen.reference", None),
    "EPConfig": ("epgen.config", "EPConfig"),
    "EPConfigError": ("epgen.config", "EPConfigError"),
    "EPTimeoutError": ("epgen.errors", "EPTimeoutError"),
    "BF16Format": ("epgen.formats", "BF16Format"),
    "BlockwiseFP8Format": ("epgen.formats", "BlockwiseFP8Format"),
    "MXFP8Format": ("epgen.formats", "MXFP8Format"),
    "NVFP4Format": ("epgen.formats", "NVFP4Format"),
    "TokenFormat": ("epgen.formats", "TokenFormat"),
    "Layout": ("epgen.layout", "Layout"),
    "Tuning": ("epgen.tuning", "Tuning"),
    "TuningError": ("epgen.tuning", "TuningError"),
    "EmulatedWorld": ("epgen.runtime.world", "EmulatedWorld"),
    "P2PWorld": ("epgen.runtime.p2p_world", "P2PWorld"),
    "ShmemWorld": ("epgen.runtime.shmem_world", "ShmemWorld"),
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


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epgen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["EPConfig", "EPConfigError", "EPTimeoutError", "BF16Format", "BlockwiseFP8Format",
           "NVFP4Format", "MXFP8Format", "TokenFormat", "Layout", "Tuning", "TuningError", "reference", "build_module",
           "emit_ptx", "EmulatedWorld", "P2PWorld", "ShmemWorld"]
