"""Host side of epgen: compiled programs, diagnostic buffers and the worlds that run the EP
kernels (``EmulatedWorld`` in ``world``: every rank on one GPU; ``P2PWorld`` in
``p2p_world``: one GPU per rank; ``ShmemWorld`` in ``shmem_world``: one process per rank),
all ``RankWorld``s (``rank_world``: the shared part and the placement interface) placed by
the rules of ``placement``. Importing this package needs no GPU; creating a world does."""

from .diagnostics import DiagBuffer
from .program import Program

__all__ = ["DiagBuffer", "Program"]
