"""``BF16Format``: unquantized bfloat16 tokens.

The payload is the token's ``H`` bfloat16 values, unchanged: ``token_size = align_up(2H,
A)``, dispatch_wait tile ``(128, 1)``, no shared memory, no padding. Host codec:
``bf16_codec.BF16Codec`` (uint16 bit patterns); device emitter: ``bf16_emit.BF16Emitter``.
"""

from __future__ import annotations

import attrs
import numpy as np

from .base import VECTOR_BYTES, TokenFormat, align_up
from .bf16_codec import BF16Codec, bf16_bits  # noqa: F401  (bf16.bf16_bits, as before)
from .bf16_emit import BF16Emitter
from .registry import register_format


@register_format
@attrs.frozen
class BF16Format(TokenFormat):
    """Unquantized bfloat16 tokens. ``BF16Format(hid_dim, top_k, alignment=16)``."""

    name = "BF16"
    input_dtype = "bf16"
    input_elem_bytes = 2
    out_dtype = "bf16"
    host_dtype = np.uint16
    accepted_input_dtypes = ("bfloat16", "uint16")
    payload_is_output_row = True
    #: the block-staged broadcast wins at prefill (``TokenFormat``'s measurement)
    prefers_block_staged_broadcast = True
    #: the send copies the tokens: no conversion, no arithmetic
    ptx_must_not_contain = ("e4m3", "div.rn.f32")
    codec_class = BF16Codec
    emitter_class = BF16Emitter

    def __attrs_post_init__(self):
        # The send is a CTA-wide 16-byte vector copy and the receive stores SIMD bf16 vectors;
        # the reference silently drops a tail that is not a whole vector.
        if (2 * self.hid_dim) % VECTOR_BYTES:
            raise ValueError(
                f"BF16Format: hid_dim={self.hid_dim}: 2*hid_dim bytes must be a multiple of "
                f"the {VECTOR_BYTES}-byte vector width (hid_dim a multiple of "
                f"{VECTOR_BYTES // 2})")

    @property
    def token_size(self) -> int:
        return align_up(2 * self.hid_dim, self.alignment)

    @property
    def out_row_bytes(self) -> int:
        return 2 * self.hid_dim

    @property
    def payload_vectors(self) -> int:
        """16-byte vectors of the payload (message bytes ``[0, 2H)`` = the output row)."""
        return 2 * self.hid_dim // VECTOR_BYTES
