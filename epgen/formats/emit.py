"""``DeviceEmitter``: the device side of a token format, the IR its steps emit into the kernel
builders' roles.

- ``emit_copy_token_to_send_buf`` (``copy_token_to_send_buf``): every thread of the CTA takes
  part and writes payload plus scales into one send-buffer message (the header is the
  kernel's); ``emit_copy_token_to_send_buf_split`` the same under the copy/publisher role
  split; ``emit_stage_loads`` its first half for the pipelined block-staged send;
- ``emit_broadcast_token``: the warp send path, one warp reads a token once and stores its
  payload and scales at every top-k destination;
- ``emit_copy_msg_to_output`` (``copy_msg_to_output_tensor``): one warp copies one message
  into one output row, or into each live row of a ``fanout.RowFan`` (``ep_rank_dedup``'s
  message-major receive: address it with ``fanout.each_row``, store with ``fanout.store`` or
  ``epgen.primitives``' copies); ``emit_copy_tile_scales`` the tile-wide scale copy;
- ``emit_pad_expert_offsets`` (``pad_expert_offsets``).

``emit_send``/``emit_receive`` are aliases. An emitter reads its format's layout from
``self.fmt``. A format whose steps need launch arguments of their own declares them while
building (``quant_ir.kernel_param``): ``input_scale`` (f32, dispatch_async, NVFP4),
``output_scales`` (pointer, dispatch_wait) and ``output_scales_rows`` (u32, transposed
scales); the runtime passes each parameter a kernel declares.
"""

from __future__ import annotations


def dst_address(d):
    """A destination of ``emit_broadcast_token``'s ``dsts``: the expression itself, or what a
    callable entry emits (its load, at the point of use)."""
    return d() if callable(d) else d


class DeviceEmitter:
    """The IR of one format's device steps (``fmt``, a ``TokenFormat``). The stubs below name
    the contract; a format's emitter defines what its kernels use."""

    def __init__(self, fmt):
        self.fmt = fmt

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fmt!r})"

    def _missing(self, what: str):
        return NotImplementedError(f"{type(self.fmt).__name__}.{what} is not implemented "
                                   f"(by its emitter, {type(self).__name__})")

    def emit_copy_token_to_send_buf(self, *args, **kwargs):
        """IR of ``copy_token_to_send_buf`` (payload and scales into one send_buf row)."""
        raise self._missing("emit_copy_token_to_send_buf")

    def emit_copy_token_to_send_buf_split(self, r, src_row, msg, tid, split):
        """IR of ``copy_token_to_send_buf`` under the copy/publisher role split
        (``ep_copy_role_split``, ``split`` an enabled ``EPRoleSplit``): only threads ``tid <
        split.n_copy_threads`` copy, items ``tid + j * n_copy_threads`` for ``j <
        split.n_trips``. This default keeps the stock CTA-wide copy (every item is still
        written once, so the publisher split alone stays correct); formats with a split copy
        override it."""
        return self.emit_copy_token_to_send_buf(r, src_row, msg, tid, split.block_size)

    #: ``emit_stage_loads`` exists: the pipelined block-staged send may issue a token's input
    #: loads before the current token's broadcast and store them to shared memory after it
    #: (``send_staged.broadcast_tokens_pipelined``)
    splits_staging = False

    def emit_stage_loads(self, r, src_row, first, stride: int):
        """IR of the first half of ``emit_copy_token_to_send_buf`` (``splits_staging``): this
        thread's input loads, issued now; returns ``store(msg)``, which emits their stores
        into the staged message ``msg`` where it is called."""
        raise self._missing("emit_stage_loads (splits_staging is False)")

    #: ``emit_broadcast_token`` takes ``scale_dsts``: the payload to output rows, the scales
    #: to the same slots' rows of the output scales (``ep_final_layout`` on the warp send
    #: path)
    broadcasts_final_rows = False

    def emit_broadcast_token(self, r, src_row, dsts, part=None, tuning=None):
        """IR of the warp send path: the calling warp reads token ``src_row`` once
        (lane-strided) and stores its payload and scales, as ``copy_token_to_send_buf`` lays
        them out, at every message address of ``dsts`` (one per top-k slot, 0 = send
        nothing: u64 expressions, or callables that emit the address's load at each use,
        ``dst_address``). The header is the kernel's. ``part = (index, count)`` (a
        warp-uniform u32 expression and a power of two): ``count`` warps share the token and
        this one moves share ``index`` of it; together they move it all, once. ``tuning``
        (an ``epgen.Tuning``, default its defaults) carries the code-generation choices of
        formats whose send has any (the quantising ones)."""
        raise self._missing("emit_broadcast_token")

    def emit_copy_msg_to_output(self, *args, **kwargs):
        """IR of ``copy_msg_to_output_tensor`` (one warp, one message, one output row or a
        ``fanout.RowFan`` of them)."""
        raise self._missing("emit_copy_msg_to_output")

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
        raise self._missing("emit_copy_tile_scales")

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups):
        """IR of ``pad_expert_offsets`` (the whole dispatch_wait aux block, after the prefix
        sum; its barriers are the role's, ``comm_sync(r)``). Default: no padding."""

    def emit_send(self, *args, **kwargs):
        """Alias of ``emit_copy_token_to_send_buf``."""
        return self.emit_copy_token_to_send_buf(*args, **kwargs)

    def emit_receive(self, *args, **kwargs):
        """Alias of ``emit_copy_msg_to_output``."""
        return self.emit_copy_msg_to_output(*args, **kwargs)
