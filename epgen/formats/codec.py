"""``HostCodec``: the numpy side of a token format, what ``epgen.reference``, the worlds and
the tests use: a token's payload encoded and decoded as the kernels' two device steps do it
(``encode_payload`` for ``copy_token_to_send_buf``, ``decode_payload`` for
``copy_msg_to_output_tensor``), whole messages packed and unpacked (payload and header), and
``pad_expert_offsets``'s row offsets.

A codec reads its format's layout (sizes, offsets, host dtypes) from ``self.fmt``. The
element dtypes of ``ml_dtypes`` (bfloat16, float8, float4) are imported on first use
(``ml_dtypes()``): importing that package takes over a second, and neither ``import epgen``
nor ``epgen ptx`` needs it.
"""

from __future__ import annotations

import numpy as np


def ml_dtypes():
    """The ``ml_dtypes`` module, imported on first use."""
    import ml_dtypes as module
    return module


class HostCodec:
    """Numpy encode/decode of one format (``fmt``, a ``TokenFormat``). Subclasses define
    ``as_host_tokens``, ``encode_payload`` and ``decode_payload``; the message packing and
    the row-offset padding derive from those and the format's layout."""

    def __init__(self, fmt):
        self.fmt = fmt

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fmt!r})"

    def as_host_tokens(self, tokens) -> np.ndarray:
        """``tokens`` [T, H] as an array of the format's ``host_dtype`` (no copy when
        possible)."""
        raise NotImplementedError

    def encode_payload(self, tokens) -> np.ndarray:
        """Reference of ``copy_token_to_send_buf``: ``tokens`` [T, H] -> uint8 [T, token_size]."""
        raise NotImplementedError

    def decode_payload(self, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Reference of ``copy_msg_to_output_tensor``: uint8 [n, token_size] -> (output rows
        [n, *out_row_shape] of ``host_dtype``, per-row scales or None)."""
        raise NotImplementedError

    def pad_row_offsets(self, group_counts) -> np.ndarray:
        """Reference of ``pad_expert_offsets``: ``row_offsets`` (uint32 [G+1]) for groups of
        ``group_counts`` rows, each group rounded up to ``expert_m_padding`` rows."""
        counts = np.asarray(group_counts, dtype=np.int64)
        p = self.fmt.expert_m_padding
        padded = (counts + p - 1) // p * p
        return np.concatenate([[0], np.cumsum(padded)]).astype(np.uint32)

    def pack_messages(self, tokens, src_idx, topk_ids) -> np.ndarray:
        """Serialize ``T`` tokens: uint8 [T, msg_size] (padding bytes zero)."""
        f = self.fmt
        payload = self.encode_payload(tokens)
        t = payload.shape[0]
        src = np.asarray(src_idx, dtype=np.int64).reshape(t)
        ids = np.asarray(topk_ids, dtype=np.int64).reshape(t, f.top_k)
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFF):
            raise ValueError("top-k expert ids travel as uint16: each must be in [0, 65536)")
        if src.size and (src.min() < -2**31 or src.max() >= 2**31):
            raise ValueError("the source token index travels as int32")
        msg = np.zeros((t, f.msg_size()), dtype=np.uint8)
        msg[:, :f.token_size] = payload
        so, ko = f.src_info_offset, f.topk_info_offset
        msg[:, so:so + 4] = src.astype("<i4").view(np.uint8).reshape(t, 4)
        msg[:, ko:ko + 2 * f.top_k] = ids.astype("<u2").view(np.uint8).reshape(t, 2 * f.top_k)
        return msg

    def unpack_messages(self, msgs):
        """Inverse of ``pack_messages``: (output rows, scales or None, int32 src index [T],
        int32 global expert ids [T, K])."""
        f = self.fmt
        msgs = np.ascontiguousarray(msgs, dtype=np.uint8).reshape(-1, f.msg_size())
        rows, scales = self.decode_payload(msgs[:, :f.token_size])
        so, ko = f.src_info_offset, f.topk_info_offset
        src = np.ascontiguousarray(msgs[:, so:so + 4]).view("<i4").reshape(-1).astype(np.int32)
        ids = np.ascontiguousarray(msgs[:, ko:ko + 2 * f.top_k]).view("<u2")
        return rows, scales, src, ids.reshape(-1, f.top_k).astype(np.int32)

    def pack_message(self, token, src_idx: int, topk_ids) -> np.ndarray:
        """Serialize one token (``token`` [H]): uint8 [msg_size]."""
        token = np.asarray(token)
        return self.pack_messages(token.reshape(1, *token.shape), [src_idx],
                                  np.asarray(topk_ids).reshape(1, -1))[0]

    def unpack_message(self, msg):
        """Inverse of ``pack_message``: (token row, src_idx, int32 top-k ids [K]); the token
        row is the decoded output row (the input bits for BF16)."""
        rows, _scales, src, ids = self.unpack_messages(np.asarray(msg).reshape(1, -1))
        return rows[0], int(src[0]), ids[0]
