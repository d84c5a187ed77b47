"""``BF16Codec``: BF16 tokens on the host. A token is held as its uint16 bit patterns
(``ml_dtypes.bfloat16`` arrays are accepted and viewed as such), so comparisons are
bit-exact, NaNs included; the payload is those bits, little-endian, then zero padding."""

from __future__ import annotations

import numpy as np

from .codec import HostCodec


def bf16_bits(tokens) -> np.ndarray:
    """``tokens`` (uint16 bit patterns or ``ml_dtypes.bfloat16``) as a uint16 view."""
    arr = np.asarray(tokens)
    if arr.dtype == np.uint16:
        return arr
    if arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2:
        return arr.view(np.uint16)
    raise ValueError(f"BF16 tokens must be uint16 bit patterns or ml_dtypes.bfloat16, "
                     f"got dtype {arr.dtype}")


class BF16Codec(HostCodec):
    """Numpy encode/decode of ``BF16Format``: the payload is the input row's bits."""

    def as_host_tokens(self, tokens) -> np.ndarray:
        return bf16_bits(tokens)

    def encode_payload(self, tokens) -> np.ndarray:
        f = self.fmt
        bits = np.ascontiguousarray(self.as_host_tokens(tokens)).reshape(-1, f.hid_dim)
        out = np.zeros((bits.shape[0], f.token_size), dtype=np.uint8)
        out[:, :2 * f.hid_dim] = bits.astype("<u2").view(np.uint8)
        return out

    def decode_payload(self, payload):
        f = self.fmt
        payload = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1, f.token_size)
        rows = np.ascontiguousarray(payload[:, :2 * f.hid_dim]).view("<u2")
        return rows.astype(np.uint16), None
