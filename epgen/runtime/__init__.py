"""Host side of epgen: compiled programs, diagnostic buffers and the worlds that run the EP
kernels (``EmulatedWorld`` in ``world``: every rank on one GPU; ``P2PWorld`` in
``p2p_world``: one GPU per rank). Importing this package needs no GPU; creating a world does."""

from .diagnostics import DiagBuffer
from .program import Program

__all__ = ["DiagBuffer", "Program"]
