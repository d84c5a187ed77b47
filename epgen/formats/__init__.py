"""Token formats: how one token is serialized for dispatch (protocol section 3)."""

from .base import VECTOR_BYTES, TokenFormat, align_up
from .bf16 import BF16Format, bf16_bits

__all__ = ["TokenFormat", "BF16Format", "align_up", "bf16_bits", "VECTOR_BYTES"]
