"""Token formats: how one token is serialized for dispatch, and the registry of formats by
name (``format = "BF16"`` in presets and ``epgen --set``): ``BF16``, ``BlockwiseFP8``,
``NVFP4``, ``MXFP8`` (docs/formats.md).

Each format is three modules: ``<name>.py`` the format class (message layout, output
description, configuration rules, send-policy properties), ``<name>_codec.py`` its host codec
(numpy; ``ml_dtypes`` only on first use) and ``<name>_emit.py`` its device emitter (IR). The
quantising formats share ``blockscaled*.py``, ``elements.py`` (fixed numeric facts) and
``quant_ir.py`` (the element encoders' IR).
"""

from .base import VECTOR_BYTES, TokenFormat, align_up
from .bf16 import BF16Format
from .bf16_codec import bf16_bits
from .blockscaled import BlockScaledFormat
from .codec import HostCodec
from .emit import DeviceEmitter
from .fp8 import BlockwiseFP8Format
from .mxfp8 import MXFP8Format
from .nvfp4 import NVFP4Format
from .registry import FORMATS, format_class, format_names, make_format, register_format

__all__ = ["TokenFormat", "BF16Format", "BlockScaledFormat", "BlockwiseFP8Format",
           "NVFP4Format", "MXFP8Format", "HostCodec", "DeviceEmitter", "align_up", "bf16_bits",
           "VECTOR_BYTES", "FORMATS", "format_class", "format_names", "make_format",
           "register_format"]
