"""Token formats: how one token is serialized for dispatch (protocol section 3), and the
registry of formats by name (``format = "BF16"`` in presets and ``epgen --set``): ``BF16``,
``BlockwiseFP8``, ``NVFP4``, ``MXFP8`` (docs/formats.md)."""

from .base import VECTOR_BYTES, TokenFormat, align_up
from .bf16 import BF16Format, bf16_bits
from .blockscaled import BlockScaledFormat
from .fp8 import BlockwiseFP8Format
from .mxfp8 import MXFP8Format
from .nvfp4 import NVFP4Format
from .registry import FORMATS, format_class, format_names, make_format, register_format

__all__ = ["TokenFormat", "BF16Format", "BlockScaledFormat", "BlockwiseFP8Format",
           "NVFP4Format", "MXFP8Format", "align_up", "bf16_bits", "VECTOR_BYTES", "FORMATS",
           "format_class", "format_names", "make_format", "register_format"]
