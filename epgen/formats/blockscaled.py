"""``BlockScaledFormat``: a quantising format as a declaration: its element encoding
(``scaling.E4M3``, ``scaling.E2M1``), its scale rule (``scaling.FP32_PER_GROUP``,
``FP32_POW2_PER_GROUP``, ``E8M0_CEIL``, ``E8M0_OCP``, ``E4M3_GLOBAL``) and its group size. Everything else derives
from those: the message layout (the quantized payload, then one scale per group of
``group_size`` elements at ``scales_offset``, each field aligned), the output description
(uint8 payload rows, ``out_row_shape = (payload_bytes,)``; the output scales row-major
``[M, groups]`` or transposed ``[groups, M]``), the ``hid_dim`` rule, the host codec
(``blockscaled_codec.BlockScaledCodec``) and the device emitter
(``blockscaled_emit.BlockScaledEmitter``), both built from the two declarations.
"""

from __future__ import annotations

import attrs
import numpy as np

from .base import VECTOR_BYTES, TokenFormat, align_up, class_property, forward
from .blockscaled_codec import BlockScaledCodec
from .blockscaled_emit import BlockScaledEmitter
from .elements import ITEM_ELEMS
from .scaling import ElementEncoding, ScaleRule


@attrs.frozen
class BlockScaledFormat(TokenFormat):
    """Base of the quantising formats; a subclass declares ``name``, ``element``,
    ``scale_rule``, ``group_size`` and ``ir_prefix`` (and, where they differ from the
    defaults, the output scales' layout, the send-policy property and the emitter class)."""

    #: ``scaling.ElementEncoding`` of the payload elements
    element = None
    #: ``scaling.ScaleRule`` of the group scales
    scale_rule = None
    #: elements sharing one scale
    group_size = 0
    #: True: the output scales are ``[n_scale_groups, M]`` (transposed), else ``[M, groups]``
    scales_transposed = False
    #: prefix of the IR names of the format's quantiser (``<prefix>_scale``, ``<prefix>_q0``)
    ir_prefix = ""

    @class_property
    def ir_words(cls) -> str:
        """IR name of the quantiser's payload words: ``<ir_prefix>_<element.words_stem>``."""
        return f"{cls.ir_prefix}_{cls.element.words_stem}"

    @class_property
    def element_bits(cls) -> int:
        """Bits of one quantized element (8: one byte each; 4: two per byte, low nibble
        first)."""
        return cls.element.bits

    @class_property
    def scale_bytes(cls) -> int:
        """Bytes of one scale in the message."""
        return cls.scale_rule.scale_bytes

    @class_property
    def scales_host_dtype(cls):
        """numpy dtype of the scales on the host (float32, or uint8 bit patterns)."""
        return cls.scale_rule.host_dtype

    @class_property
    def scales_dtype_name(cls) -> str:
        """The output scales' element type, in words (``describe()``)."""
        return cls.scale_rule.dtype_name

    @class_property
    def uses_input_scale(cls) -> bool:
        """True: the send step reads the global input scale (``input_scale`` launch
        argument)."""
        return cls.scale_rule.uses_input_scale

    @class_property
    def ptx_must_contain(cls) -> tuple[str, ...]:
        """The element encoding's and the scale rule's instructions."""
        return cls.element.ptx_must_contain + cls.scale_rule.ptx_must_contain

    @class_property
    def ptx_must_not_contain(cls) -> tuple[str, ...]:
        """What the element encoding and the scale rule exclude."""
        return cls.element.ptx_must_not_contain + cls.scale_rule.ptx_must_not_contain

    input_dtype = "bf16"
    input_elem_bytes = 2
    out_dtype = "b8"
    host_dtype = np.uint8
    accepted_input_dtypes = ("bfloat16", "uint16")
    codec_class = BlockScaledCodec
    emitter_class = BlockScaledEmitter

    def __attrs_post_init__(self):
        cls = type(self)
        if not isinstance(cls.element, ElementEncoding) or \
                not isinstance(cls.scale_rule, ScaleRule) or cls.group_size <= 0:
            raise TypeError(f"{cls.__name__}: a block-scaled format declares its element "
                            f"(scaling.E4M3, ...), scale_rule (scaling.E8M0_OCP, ...) and a "
                            f"positive group_size; got {cls.element!r}, {cls.scale_rule!r}, "
                            f"{cls.group_size!r}")
        need = self.hid_dim_multiple
        if self.hid_dim % need:
            raise ValueError(
                f"{type(self).__name__}: hid_dim={self.hid_dim} must be a multiple of {need}: "
                f"of the scale group ({self.group_size} elements) and of the "
                f"{VECTOR_BYTES}-byte vector width ({self.vector_elems} elements of the "
                f"payload)")

    # ---- message layout ---------------------------------------------------------------------
    @class_property
    def vector_elems(cls) -> int:
        """Payload elements in one 16-byte vector."""
        return VECTOR_BYTES * 8 // cls.element_bits

    @class_property
    def item_out_bytes(cls) -> int:
        """Payload bytes of one 8-element input item (8 for 8-bit elements, 4 for 4-bit)."""
        return ITEM_ELEMS * cls.element_bits // 8

    @class_property
    def hid_dim_multiple(cls) -> int:
        """``hid_dim`` must be a multiple of this: of ``group_size`` and of ``vector_elems``."""
        return int(np.lcm(cls.group_size, cls.vector_elems))

    @property
    def n_scale_groups(self) -> int:
        """Scales per token: ``hid_dim // group_size``."""
        return self.hid_dim // self.group_size

    @property
    def payload_bytes(self) -> int:
        """Bytes of the quantized elements of one token (unpadded)."""
        return self.hid_dim * self.element_bits // 8

    @property
    def quant_size(self) -> int:
        """``align_up(payload_bytes, A)``: the payload field of a message."""
        return align_up(self.payload_bytes, self.alignment)

    @property
    def scales_offset(self) -> int:
        """Byte offset of the scales in a message (``= quant_size``)."""
        return self.quant_size

    @property
    def scales_size(self) -> int:
        """``align_up(n_scale_groups * scale_bytes, A)``: the scales field of a message."""
        return align_up(self.n_scale_groups * self.scale_bytes, self.alignment)

    @property
    def token_size(self) -> int:
        return self.quant_size + self.scales_size

    @property
    def payload_vectors(self) -> int:
        """16-byte vectors of the payload (message bytes ``[0, payload_bytes)`` = the output
        row)."""
        return self.payload_bytes // VECTOR_BYTES

    # ---- output description -----------------------------------------------------------------
    @property
    def out_row_shape(self) -> tuple[int, ...]:
        return (self.payload_bytes,)

    @property
    def out_row_bytes(self) -> int:
        return self.payload_bytes

    @property
    def out_scale_bytes_per_row(self) -> int:
        """Bytes of output scales per output row."""
        return self.n_scale_groups * self.scale_bytes

    def out_scales_shape(self, rows: int) -> tuple[int, int]:
        """Shape of the output scales tensor for an output of ``rows`` rows (device layout)."""
        g = self.n_scale_groups
        return (g, rows) if self.scales_transposed else (rows, g)

    @property
    def out_scales(self):
        g = self.n_scale_groups
        shape = [g, "M"] if self.scales_transposed else ["M", g]
        return {"dtype": self.scales_dtype_name, "shape": shape,
                "layout": "transposed" if self.scales_transposed else "row-major",
                "group_size": self.group_size}

    def describe(self) -> dict:
        d = super().describe()
        d.update(group_size=self.group_size, quant_size=self.quant_size,
                 scales_offset=self.scales_offset, scales_size=self.scales_size)
        return d

    # ---- the codec's and the emitter's methods, on the format -------------------------------
    to_f32 = forward("codec", "to_f32")
    check_input_scale = forward("codec", "check_input_scale")
    quantize = forward("codec", "quantize")
    dequantize_groups = forward("codec", "dequantize_groups")
    dequantize = forward("codec", "dequantize")
    element_values = forward("codec", "element_values")
    error_bound = forward("codec", "error_bound")
    scales_from_device = forward("codec", "scales_from_device")
    scales_to_device = forward("codec", "scales_to_device")

    emit_item_quant = forward("emitter", "emit_item_quant")
    out_scale_row_offset = forward("emitter", "out_scale_row_offset")
    final_scale_place = forward("emitter", "final_scale_place")
    scales_ride_with_payload = forward("emitter", "scales_ride_with_payload")
