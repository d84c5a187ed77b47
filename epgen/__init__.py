"""epgen: a code generator for the expert-parallel MoE dispatch kernels (the reference
``EPDispatchKernel`` family).

Importing the package is light: numpy and attrs only. ``emit_ptx`` loads llvmlite and
``EmulatedWorld`` and ``P2PWorld`` load cuda.core when first used.
"""

from . import reference
from .config import EPConfig, EPConfigError
from .errors import EPTimeoutError
from .formats import BF16Format, BlockwiseFP8Format, MXFP8Format, NVFP4Format, TokenFormat
from .layout import Layout
from .tuning import Tuning, TuningError


def build_module(cfg):
    """The IR module of ``cfg``'s dispatch kernels (``dispatch_async``, ``dispatch_wait`` and
    the fused single launch ``ep_dispatch``; only ``ep_dispatch`` with fused_shared_expert)."""
    from .kernels import build_module as _build
    return _build(cfg)


def emit_ptx(cfg, arch: str = "sm_90") -> str:
    """PTX of ``cfg``'s dispatch entry points (``build_module``), one module."""
    from backends.nvptx import emit_ptx as _emit
    return _emit(build_module(cfg), arch=arch)


def __getattr__(name):
    if name == "EmulatedWorld":
        from .runtime.world import EmulatedWorld
        return EmulatedWorld
    if name == "P2PWorld":
        from .runtime.p2p_world import P2PWorld
        return P2PWorld
    raise AttributeError(f"module 'epgen' has no attribute {name!r}")


__all__ = ["EPConfig", "EPConfigError", "EPTimeoutError", "BF16Format", "BlockwiseFP8Format",
           "NVFP4Format", "MXFP8Format", "TokenFormat", "Layout", "Tuning", "TuningError", "reference", "build_module",
           "emit_ptx", "EmulatedWorld", "P2PWorld"]
