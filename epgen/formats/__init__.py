"""Token formats: how one token is serialized for dispatch, and the registry of formats by
name (``format = "BF16"`` in presets and ``epgen --set``; ``format_names()`` lists them,
docs/formats.md describes them).

``BF16`` is a format class with its host codec (``bf16_codec.py``: numpy; ``ml_dtypes`` only
on first use) and device emitter (``bf16_emit.py``: IR). A quantising format is a declaration
(``BlockScaledFormat``: element encoding, scale rule, group size; ``scaling.py``) from which
the shared codec and emitter (``blockscaled*.py``) derive; their numpy steps are in
``quant_host.py``, their IR twins in ``quant_ir.py``, fixed numeric facts in ``elements.py``.
A format's module registers it; importing it here is what adds a format.
"""

from .base import VECTOR_BYTES, TokenFormat, align_up
from .bf16 import BF16Format
from .bf16_codec import bf16_bits
from .blockscaled import BlockScaledFormat
from .codec import HostCodec
from .emit import DeviceEmitter
from .fp8 import BlockwiseFP8Format
from .fp8_pow2 import BlockwiseFP8Pow2Format
from .mxfp4 import MXFP4Format
from .mxfp8 import MXFP8Format
from .nvfp4 import NVFP4Format
from .registry import FORMATS, format_class, format_names, make_format, register_format

__all__ = ["TokenFormat", "BlockScaledFormat", "HostCodec", "DeviceEmitter", "align_up",
           "bf16_bits", "VECTOR_BYTES", "FORMATS", "format_class", "format_names",
           "make_format", "register_format"] + [cls.__name__ for cls in FORMATS.values()]
