"""``TokenFormat``: the user-facing, hashable description of how one token travels, and what
every format shares.

A token format fixes a message: its payload (the token itself, possibly quantized, plus
scales), followed by the header the kernel writes (source token index, top-k expert ids).
Every field starts at a multiple of ``alignment`` bytes::

    [0, token_size)                         payload (format-specific, itself aligned)
    [src_info_offset, +src_info_size)       int32 source token index, rest of the field padding
    [topk_info_offset, +topk_info_size)     uint16 global expert id of each top-k slot
    msg_size() = token_size + align_up(4, A) + align_up(2 * top_k, A)

The format class holds that layout, the output description, the constraints it puts on a
kernel configuration (``check_config``) and the properties the kernel builders' policies ask
(``prefers_block_staged_broadcast``). It composes two parts, each in a module of its own:

- ``fmt.codec`` (a ``codec.HostCodec``): numpy encode/decode of the device steps, for
  ``epgen.reference``, the worlds and the tests;
- ``fmt.emitter`` (an ``emit.DeviceEmitter``): the IR of the device steps, for the kernel
  builders.

The parts' public methods are reachable on the format too (``fmt.encode_payload`` is
``fmt.codec.encode_payload``, ``fmt.emit_send`` is ``fmt.emitter.emit_send``): the names each
format class forwards are listed with ``forward``.
"""

from __future__ import annotations

import numbers

import attrs
import numpy as np

from .codec import HostCodec
from .emit import DeviceEmitter

#: Width in bytes of the widest single vector access (``v4.u32`` in PTX). The P2P copy moves
#: messages in units of this many bytes.
VECTOR_BYTES = 16


def align_up(x: int, a: int) -> int:
    """Smallest multiple of ``a`` that is ``>= x``."""
    return (x + a - 1) // a * a


def forward(part: str, name: str):
    """A read-only attribute of the format that is ``getattr(self.<part>, name)`` (``part``
    ``"codec"`` or ``"emitter"``), looked up at each use."""
    return property(lambda self: getattr(getattr(self, part), name),
                    doc=f"``self.{part}.{name}``")


class class_property:
    """A read-only attribute computed from the class (``fn(cls)``), alike on the class and on
    its instances: what a format derives from its declaration (``BlockScaledFormat``'s
    ``uses_input_scale`` from its scale rule). A subclass may set the name to a plain value
    instead."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, inst, owner):
        return self.fn(owner)


def _positive_int(name):
    def check(inst, attribute, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"{type(inst).__name__}: {name} must be a positive integer, "
                             f"got {value!r}")
    return check


def _int(value):
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) \
        else value


def _check_alignment(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < VECTOR_BYTES or value & (value - 1):
        raise ValueError(
            f"{type(inst).__name__}: alignment must be a power of two >= {VECTOR_BYTES} "
            f"(every message field is moved with {VECTOR_BYTES}-byte vector accesses), "
            f"got {value!r}")


@attrs.frozen
class TokenFormat:
    """Base of every token format.

    Subclasses define ``token_size`` (payload bytes, a multiple of ``alignment``), ``name``,
    ``input_dtype``, ``out_dtype``, ``codec_class`` and ``emitter_class``; everything else
    derives from those.
    """

    hid_dim: int = attrs.field(converter=_int, validator=_positive_int("hid_dim"))
    top_k: int = attrs.field(converter=_int, validator=_positive_int("top_k"))
    alignment: int = attrs.field(default=VECTOR_BYTES, converter=_int, kw_only=True,
                                 validator=_check_alignment)

    # ---- identity -----------------------------------------------------------------------
    #: Short format name (``"BF16"``); used in kernel symbols and the CLI.
    name = "abstract"
    #: PTX type name of one input element (``ir.types.parse_type`` understands it).
    input_dtype = "b8"
    #: PTX type name of one output element (the grouped output tensor's dtype).
    out_dtype = "b8"
    #: numpy dtype of the host-side input and output (bit patterns for non-numpy types).
    host_dtype = np.uint8
    #: Element dtype names accepted for input tokens (numpy/ml_dtypes/torch spellings).
    accepted_input_dtypes = ()

    @class_property
    def golden_suffix(cls) -> str:
        """Suffix of the format's golden variants (``ep/default_<suffix>``,
        ``ep/shmem_p2p1_<suffix>``; ``epgen.ep_goldens``): the lower-case name."""
        return cls.name.lower()

    #: Substrings the PTX of the send kernel (``ep_dispatch_async``) must contain, and must
    #: not contain, with this format: the instructions its bit-exactness relies on
    #: (tests/ptx/test_formats_kernels.py checks them).
    ptx_must_contain = ()
    ptx_must_not_contain = ()

    # ---- parts --------------------------------------------------------------------------
    #: ``HostCodec`` subclass of the format (numpy encode/decode)
    codec_class = HostCodec
    #: ``DeviceEmitter`` subclass of the format (the IR of its device steps)
    emitter_class = DeviceEmitter

    @property
    def codec(self) -> HostCodec:
        """The format's host codec (numpy encode/decode)."""
        return self.codec_class(self)

    @property
    def emitter(self) -> DeviceEmitter:
        """The format's device emitter (the IR of its steps)."""
        return self.emitter_class(self)

    @property
    def type_name(self) -> str:
        """Distinguishes formats in kernel symbols."""
        return f"{self.name}_H{self.hid_dim}_K{self.top_k}_A{self.alignment}"

    # ---- message layout -----------------------------------------------------------------
    @property
    def token_size(self) -> int:
        """Payload bytes of one token (format-specific, a multiple of ``alignment``)."""
        raise NotImplementedError

    @property
    def src_info_offset(self) -> int:
        """Byte offset of the int32 source token index inside a message."""
        return self.token_size

    @property
    def src_info_size(self) -> int:
        return align_up(4, self.alignment)

    @property
    def topk_info_offset(self) -> int:
        """Byte offset of the uint16 top-k global expert ids inside a message."""
        return self.src_info_offset + self.src_info_size

    @property
    def topk_info_size(self) -> int:
        return align_up(2 * self.top_k, self.alignment)

    def msg_size(self) -> int:
        """Bytes of one serialized token message."""
        return self.token_size + self.src_info_size + self.topk_info_size

    #: ``(tile_tokens, k_splits)`` of dispatch_wait's tiles.
    dispatch_wait_tile_shape = (128, 1)
    #: Dynamic shared memory bytes dispatch_wait needs.
    dispatch_smem_size = 0
    #: Each group's row count is rounded up to a multiple of this in ``row_offsets``
    #: (``pad_expert_offsets``); 1 means no padding.
    expert_m_padding = 1

    #: Bytes of one input element (the row stride of the input tokens is
    #: ``input_row_bytes``).
    input_elem_bytes = 1

    @property
    def input_row_bytes(self) -> int:
        """Bytes of one input token row (``hid_dim`` elements of ``input_dtype``)."""
        return self.hid_dim * self.input_elem_bytes

    #: the message payload is the output row byte for byte (no scales), so the warp send path
    #: can write ``ep_final_layout`` output rows with ``emit_broadcast_token``
    payload_is_output_row = False

    @property
    def payload_vectors(self) -> int:
        """16-byte vectors of the payload, which sits at message byte 0 and is copied verbatim
        to output row byte 0."""
        raise NotImplementedError(f"{type(self).__name__}.payload_vectors is not implemented")

    # ---- output description ---------------------------------------------------------------
    @property
    def out_row_shape(self) -> tuple[int, ...]:
        """Shape of one row of the grouped output tensor (host dtype ``host_dtype``)."""
        return (self.hid_dim,)

    @property
    def out_scales(self):
        """Description of the output scales tensor, or None when the format has none."""
        return None

    def describe(self) -> dict:
        """Plain-data summary for the CLI and reports."""
        return {
            "name": self.name, "type_name": self.type_name, "hid_dim": self.hid_dim,
            "top_k": self.top_k, "alignment": self.alignment, "token_size": self.token_size,
            "src_info_offset": self.src_info_offset, "topk_info_offset": self.topk_info_offset,
            "msg_size": self.msg_size(), "input_dtype": self.input_dtype,
            "input_row_bytes": self.input_row_bytes,
            "out_dtype": self.out_dtype, "out_row_shape": list(self.out_row_shape),
            "out_scales": self.out_scales, "expert_m_padding": self.expert_m_padding,
            "dispatch_wait_tile_shape": list(self.dispatch_wait_tile_shape),
            "dispatch_smem_size": self.dispatch_smem_size,
        }

    # ---- configuration and send policy ---------------------------------------------------
    def check_config(self, cfg) -> list[tuple[tuple[str, ...], str]]:
        """Constraints this format puts on a kernel configuration, as ``(parameters, rule)``
        pairs that ``EPConfig`` reports as violations. The default has none."""
        return []

    #: The staged variants' send policy: True when, at prefill-sized calls, the block-staged
    #: broadcast (every block copies its tokens into a staged message in shared memory and
    #: writes it to the destinations) moves the call faster than the warp send path for this
    #: format. Measured on the H200 at prefill, default variant, round trip as a fraction of
    #: copy, block-staged / warp path (docs/PERF.md's tuning table): BF16 0.898 / 0.882,
    #: MXFP8 0.880 / 0.846, BlockwiseFP8 0.869 / 0.835 (True for those three); NVFP4 0.828 /
    #: 0.848 (False).
    prefers_block_staged_broadcast = False

    # ---- the codec's and the emitter's methods, on the format -----------------------------
    as_host_tokens = forward("codec", "as_host_tokens")
    encode_payload = forward("codec", "encode_payload")
    decode_payload = forward("codec", "decode_payload")
    pad_row_offsets = forward("codec", "pad_row_offsets")
    pack_messages = forward("codec", "pack_messages")
    unpack_messages = forward("codec", "unpack_messages")
    pack_message = forward("codec", "pack_message")
    unpack_message = forward("codec", "unpack_message")

    emit_copy_token_to_send_buf = forward("emitter", "emit_copy_token_to_send_buf")
    emit_copy_token_to_send_buf_split = forward("emitter", "emit_copy_token_to_send_buf_split")
    splits_staging = forward("emitter", "splits_staging")
    emit_stage_loads = forward("emitter", "emit_stage_loads")
    broadcasts_final_rows = forward("emitter", "broadcasts_final_rows")
    emit_broadcast_token = forward("emitter", "emit_broadcast_token")
    emit_copy_msg_to_output = forward("emitter", "emit_copy_msg_to_output")
    copies_scales_per_tile = forward("emitter", "copies_scales_per_tile")
    tile_smem_bytes = forward("emitter", "tile_smem_bytes")
    emit_copy_tile_scales = forward("emitter", "emit_copy_tile_scales")
    emit_pad_expert_offsets = forward("emitter", "emit_pad_expert_offsets")
    emit_send = forward("emitter", "emit_send")
    emit_receive = forward("emitter", "emit_receive")
