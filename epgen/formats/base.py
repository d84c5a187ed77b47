"""The ``TokenFormat`` contract (reference: the ``TokenFormat`` trait, protocol section 3.1).

A token format fixes how one token travels: its payload (the token itself, possibly quantized,
plus scales), followed by the header the kernel writes (source token index, top-k expert ids).
Every field starts at a multiple of ``alignment`` bytes::

    [0, token_size)                         payload (format-specific, itself aligned)
    [src_info_offset, +src_info_size)       int32 source token index, rest of the field padding
    [topk_info_offset, +topk_info_size)     uint16 global expert id of each top-k slot
    msg_size() = token_size + align_up(4, A) + align_up(2 * top_k, A)

A format also carries a numpy reference of its device steps (``encode_payload`` for the send
side's ``copy_token_to_send_buf``, ``decode_payload`` for the receive side's
``copy_msg_to_output_tensor``), which ``epgen.reference`` and the tests use.

Extension point for the kernel builders: a format defines the device side of its two steps,
``emit_copy_token_to_send_buf(...)`` (the IR of ``copy_token_to_send_buf``: every thread of the
CTA takes part and writes payload plus scales; the header is written by the kernel) and
``emit_copy_msg_to_output(...)`` (the IR of ``copy_msg_to_output_tensor``: one warp copies one
message into one output row), next to its numpy reference, and
``emit_pad_expert_offsets(...)`` (``pad_expert_offsets``). ``emit_send``/``emit_receive`` are
aliases. The stubs below name that contract. A format whose steps need launch arguments of
their own declares them while building (``quant_ir.kernel_param``): ``input_scale`` (f32,
dispatch_async, NVFP4), ``output_scales`` (pointer, dispatch_wait) and ``output_scales_rows``
(u32, transposed scales); the runtime passes each parameter a kernel declares.
"""

from __future__ import annotations

import numbers

import attrs
import numpy as np

#: Width in bytes of the widest single vector access (``SIMD[uint8, W]`` on the reference's
#: targets, ``v4.u32`` in PTX). The P2P copy moves messages in units of this many bytes.
VECTOR_BYTES = 16


def dst_address(d):
    """A destination of ``emit_broadcast_token``'s ``dsts``: the expression itself, or what a
    callable entry emits (its load, at the point of use)."""
    return d() if callable(d) else d


def align_up(x: int, a: int) -> int:
    """Smallest multiple of ``a`` that is ``>= x``."""
    return (x + a - 1) // a * a


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
    """Base of every token format (reference trait ``TokenFormat``).

    Subclasses define ``token_size`` (payload bytes, a multiple of ``alignment``),
    ``name``, ``input_dtype``, ``out_dtype`` and the numpy reference
    ``encode_payload``/``decode_payload``; everything else derives from those.
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

    @property
    def type_name(self) -> str:
        """Reference ``get_type_name()``: distinguishes formats in kernel symbols."""
        return f"{self.name}_H{self.hid_dim}_K{self.top_k}_A{self.alignment}"

    # ---- compile-time members of the trait ---------------------------------------------
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
        """Reference ``msg_size()``: bytes of one serialized token message."""
        return self.token_size + self.src_info_size + self.topk_info_size

    #: Reference ``dispatch_wait_tile_shape = (tile_tokens, k_splits)``.
    dispatch_wait_tile_shape = (128, 1)
    #: Reference ``dispatch_smem_size``: dynamic shared memory bytes dispatch_wait needs.
    dispatch_smem_size = 0
    #: Reference ``expert_m_padding``: each group's row count is rounded up to a multiple of
    #: this in ``row_offsets`` (``pad_expert_offsets``); 1 means no padding.
    expert_m_padding = 1

    #: Bytes of one input element (the row stride of the input tokens is
    #: ``input_row_bytes``).
    input_elem_bytes = 1

    @property
    def input_row_bytes(self) -> int:
        """Bytes of one input token row (``hid_dim`` elements of ``input_dtype``)."""
        return self.hid_dim * self.input_elem_bytes

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

    def check_config(self, cfg) -> list[tuple[tuple[str, ...], str]]:
        """Constraints this format puts on a kernel configuration, as ``(parameters, rule)``
        pairs that ``EPConfig`` reports as violations. The default has none."""
        return []

    # ---- numpy reference of the device steps ----------------------------------------------
    def as_host_tokens(self, tokens) -> np.ndarray:
        """``tokens`` [T, H] as an array of ``host_dtype`` (no copy when possible)."""
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
        p = self.expert_m_padding
        padded = (counts + p - 1) // p * p
        return np.concatenate([[0], np.cumsum(padded)]).astype(np.uint32)

    def pack_messages(self, tokens, src_idx, topk_ids) -> np.ndarray:
        """Serialize ``T`` tokens: uint8 [T, msg_size] (padding bytes zero)."""
        payload = self.encode_payload(tokens)
        t = payload.shape[0]
        src = np.asarray(src_idx, dtype=np.int64).reshape(t)
        ids = np.asarray(topk_ids, dtype=np.int64).reshape(t, self.top_k)
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFF):
            raise ValueError("top-k expert ids travel as uint16: each must be in [0, 65536)")
        if src.size and (src.min() < -2**31 or src.max() >= 2**31):
            raise ValueError("the source token index travels as int32")
        msg = np.zeros((t, self.msg_size()), dtype=np.uint8)
        msg[:, :self.token_size] = payload
        so, ko = self.src_info_offset, self.topk_info_offset
        msg[:, so:so + 4] = src.astype("<i4").view(np.uint8).reshape(t, 4)
        msg[:, ko:ko + 2 * self.top_k] = ids.astype("<u2").view(np.uint8).reshape(t, 2 * self.top_k)
        return msg

    def unpack_messages(self, msgs):
        """Inverse of ``pack_messages``: (output rows, scales or None, int32 src index [T],
        int32 global expert ids [T, K])."""
        msgs = np.ascontiguousarray(msgs, dtype=np.uint8).reshape(-1, self.msg_size())
        rows, scales = self.decode_payload(msgs[:, :self.token_size])
        so, ko = self.src_info_offset, self.topk_info_offset
        src = np.ascontiguousarray(msgs[:, so:so + 4]).view("<i4").reshape(-1).astype(np.int32)
        ids = np.ascontiguousarray(msgs[:, ko:ko + 2 * self.top_k]).view("<u2")
        return rows, scales, src, ids.reshape(-1, self.top_k).astype(np.int32)

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

    # ---- device steps (the kernel builders fill these in) ---------------------------------
    def emit_copy_token_to_send_buf(self, *args, **kwargs):
        """IR of ``copy_token_to_send_buf`` (payload and scales into one send_buf row)."""
        raise NotImplementedError(
            f"{type(self).__name__}.emit_copy_token_to_send_buf is not implemented")

    def emit_copy_token_to_send_buf_split(self, r, src_row, msg, tid, split):
        """IR of ``copy_token_to_send_buf`` under the copy/publisher role split
        (``ep_copy_role_split``, ``split`` an enabled ``EPRoleSplit``): only threads ``tid <
        split.n_copy_threads`` copy, items ``tid + j * n_copy_threads`` for ``j <
        split.n_trips``. This default keeps the stock CTA-wide copy (every item is still
        written once, so the publisher split alone stays correct, protocol 7.7); formats with
        a split copy override it."""
        return self.emit_copy_token_to_send_buf(r, src_row, msg, tid, split.block_size)

    #: ``emit_stage_loads`` exists: the pipelined block-staged send may issue a token's input
    #: loads before the current token's broadcast and store them to shared memory after it
    #: (``dispatch_async.SEND_JOIN_PREFETCH``)
    splits_staging = False

    def emit_stage_loads(self, r, src_row, first, stride: int):
        """IR of the first half of ``emit_copy_token_to_send_buf`` (``splits_staging``): this
        thread's input loads, issued now; returns ``store(msg)``, which emits their stores
        into the staged message ``msg`` where it is called."""
        raise NotImplementedError(
            f"{type(self).__name__}.emit_stage_loads is not implemented (splits_staging is "
            f"False)")

    #: the message payload is the output row byte for byte (no scales), so the warp send path
    #: can write ``ep_final_layout`` output rows with ``emit_broadcast_token``
    payload_is_output_row = False
    #: ``emit_broadcast_token`` takes ``scale_dsts``: the payload to output rows, the scales
    #: to the same slots' rows of the output scales (``ep_final_layout`` on the warp send
    #: path, ``dispatch_async.WARP_FINAL_ROWS_WITH_SCALES``)
    broadcasts_final_rows = False

    def emit_broadcast_token(self, r, src_row, dsts, part=None):
        """IR of the warp send path: the calling warp reads token ``src_row`` once
        (lane-strided) and stores its payload and scales, as ``copy_token_to_send_buf`` lays
        them out, at every message address of ``dsts`` (one per top-k slot, 0 = send
        nothing: u64 expressions, or callables that emit the address's load at each use,
        ``dst_address``). The header is the kernel's. ``part = (index, count)`` (a
        warp-uniform u32 expression and a power of two): ``count`` warps share the token and
        this one moves share ``index`` of it; together they move it all, once."""
        raise NotImplementedError(
            f"{type(self).__name__}.emit_broadcast_token is not implemented")

    @property
    def payload_vectors(self) -> int:
        """16-byte vectors of the payload, which sits at message byte 0 and is copied verbatim
        to output row byte 0."""
        raise NotImplementedError(f"{type(self).__name__}.payload_vectors is not implemented")

    def emit_copy_msg_to_output(self, *args, **kwargs):
        """IR of ``copy_msg_to_output_tensor`` (one warp, one message, one output row)."""
        raise NotImplementedError(
            f"{type(self).__name__}.emit_copy_msg_to_output is not implemented")

    #: True: dispatch_wait copies the scales of a whole tile at once, after its messages'
    #: payloads (``emit_copy_tile_scales``), and ``emit_copy_msg_to_output`` takes
    #: ``scales=False``; the message addresses of the tile wait in shared memory
    #: (``tile_smem_bytes``)
    copies_scales_per_tile = False

    def tile_smem_bytes(self, tile_tokens: int) -> int:
        """Shared bytes dispatch_wait keeps per tile for ``emit_copy_tile_scales``: one u64
        message address per tile token, or 0."""
        return 8 * tile_tokens if self.copies_scales_per_tile else 0

    def emit_copy_tile_scales(self, r, tile_msgs, row0, n_rows, tile_tokens, first, stride):
        """IR of the tile-wide scale copy (``copies_scales_per_tile``): the tile's ``n_rows``
        messages (u64 addresses at ``tile_msgs``, shared) land in output rows ``row0 + j``;
        this thread takes work items ``first, first + stride, ...``."""
        raise NotImplementedError(
            f"{type(self).__name__}.emit_copy_tile_scales is not implemented")

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups, comm_barrier_id=-1):
        """IR of ``pad_expert_offsets`` (the whole dispatch_wait aux block, after the prefix
        sum; ``comm_barrier_id`` as the caller's ``comm_sync``). Default: no padding."""

    def emit_send(self, *args, **kwargs):
        """Alias of ``emit_copy_token_to_send_buf``."""
        return self.emit_copy_token_to_send_buf(*args, **kwargs)

    def emit_receive(self, *args, **kwargs):
        """Alias of ``emit_copy_msg_to_output``."""
        return self.emit_copy_msg_to_output(*args, **kwargs)
