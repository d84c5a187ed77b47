"""``Config``: DeepEP's normal-mode tuning record, which engines import with ``Buffer`` and
size their buffers from even when they use only the low-latency mode.

epgen's normal mode is not available yet, and epgen sizes its own buffers, so a ``Config``
only carries its values: its size hints are 0 bytes (nothing for the caller to provide),
which makes an engine's ``max(low-latency hint, normal-mode hint)`` the low-latency one.
"""

from __future__ import annotations

import attrs


@attrs.define
class Config:
    """DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens,
    num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
    num_max_rdma_chunked_recv_tokens)``, positional or by keyword."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: epgen allocates its buffers itself (module docstring)."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: epgen allocates its buffers itself (module docstring)."""
        return 0


__all__ = ["Config"]
