"""``BlockScaledEmitter``: the device steps of the quantising formats (``BlockScaledFormat``);
``emit_item_quant``, the arithmetic of one 8-element item, is the format's scale rule and then
its element encoding (their IR steps, ``scaling``).

Send, per thread and 16-byte input item (8 bf16, one ``ld.global.nc.L2::256B.v4.b32``):
convert to f32, take the item's ``|x|`` maximum, combine it over the ``group_size // 8``
adjacent lanes of the scale group (``shfl.sync.bfly.b32``), then ``emit_item_quant`` gives the
payload words and the group scale; the item's payload is one ``st.global.v2.b32`` (8-bit
elements) or ``st.global.b32`` (4-bit), the first lane of each group stores the scale. The
loop runs over whole warps (the loop bound is the warp's first item), so every lane takes
part in the shuffles; lanes past the last item load a valid item and store nothing. The warp
send path (``emit_broadcast_token``) quantises a token once for all its destinations, staged
in shared memory chunk by chunk; the receive copies the payload row, then the scales in the
format's output layout (``emit_copy_msg_to_output``, ``emit_copy_tile_scales``).
"""

from __future__ import annotations

import contextlib
import math

import ir
from ir import CacheHint
from ir import types as T

from .. import fanout
from ..primitives import copy_vectors, warp_copy, warp_copy_segments
from ..tuning import Tuning
from .base import VECTOR_BYTES
from .elements import ITEM_ELEMS
from .emit import DeviceEmitter, dst_address
from .quant_ir import abs_max, bf16x8_to_f32, group_max, kernel_param

#: static shared memory one block may declare (``.shared`` without opt-in), bytes
STATIC_SMEM_LIMIT = 48 * 1024


class BlockScaledEmitter(DeviceEmitter):
    """Device steps of a ``BlockScaledFormat``."""

    def emit_item_quant(self, r: ir.RoleBuilder, xs, amax) -> tuple[list, object]:
        """IR for one 8-element item: ``xs`` the 8 f32 values, ``amax`` the group's ``|x|``
        maximum. Returns (payload u32 words, little-endian: 2 for 8-bit elements, 1 for
        4-bit; the group scale as stored: an f32 or a u32 holding a byte): the scale rule's
        ``emit_scale``, then the element encoding's ``emit_words`` of the scaled elements
        (their instructions: ``quant_ir``'s ``*_group_scale`` and ``*_words``)."""
        f = self.fmt
        scale, scaled, live = f.scale_rule.emit_scale(r, amax, f.element, f.ir_prefix)
        words = f.element.emit_words(r, [scaled(x) for x in xs], live, f.ir_prefix,
                                     f.ir_words)
        return words, scale

    #: the pipelined block-staged send issues the next token's input loads before the current
    #: token's broadcast and quantises them into the shared message after it
    #: (``emit_stage_loads``), as BF16's are
    splits_staging = True

    def emit_stage_loads(self, r, src_row, first, stride: int):
        """The pipelined block-staged send's first half of ``emit_copy_token_to_send_buf``
        (``send_staged.broadcast_tokens_pipelined``): this thread issues the
        ``ld.global.nc.L2::256B.v4.b32`` of its items ``first, first + stride, ...`` now (an
        item past the end loads the last one again) and returns ``store(msg)``, which
        quantises them (the group maximum by shuffles, as ``_quantize_item``) and stores
        their payload and scales into the staged message ``msg`` where it is called.
        ``stride`` (the role's threads) must be a multiple of 32."""
        f = self.fmt
        n_items = f.hid_dim // ITEM_ELEMS
        if stride % 32:
            raise ValueError(f"{f.name}: emit_stage_loads needs whole warps (stride "
                             f"{stride} is not a multiple of 32)")
        items = [r.let("sq_item", first + j * stride if j else first)
                 for j in range(-(-n_items // stride))]
        loaded = [r.load(src_row + item.min(n_items - 1).cast(T.u64) * VECTOR_BYTES,
                         T.vec(T.u32, 4), cache=CacheHint.NC_L2_256, name="sq_in")
                  for item in items]

        def store(msg):
            def put(off, value):
                r.store(msg + off, value)
            for item, words in zip(items, loaded):
                self._quantize_item(r, item, words, put, n_items, put)
        return store

    def emit_copy_token_to_send_buf(self, r, src_row, msg, first, stride):
        """``copy_token_to_send_buf``: quantize one token into ``msg``. Thread ``first`` takes
        items ``first, first + stride, ...``; ``first`` must be the role-local thread index
        and ``stride`` a multiple of 32 (whole warps: the group maximum is a shuffle).
        ``ld.global.nc.L2::256B.v4.b32`` per item, ``st.global.v2.b32``/``st.global.b32`` of its
        payload, ``st.global.b32``/``st.global.b8`` of the group scale by the group's first
        lane."""
        self._quantize_token(r, src_row, first, stride,
                             lambda off, value: r.store(msg + off, value))

    def emit_broadcast_token(self, r, src_row, dsts, part=None, tuning: Tuning | None = None,
                             unroll: int | None = None, stage_bytes: int | None = None,
                             scale_dsts=None,
                             scales_row_major: bool = False):
        """The warp send path: the warp quantizes the token once (lane ``l`` items ``l, l +
        32, ...``, as ``emit_copy_token_to_send_buf``; ``unroll`` items per trip, default
        ``tuning.quant_items_in_flight``) and stores each item's payload and each group
        scale to every non-zero destination of ``dsts`` (``K`` stores each). With
        ``stage_bytes`` (the preferred chunk, default ``tuning.quant_stage_bytes``; 0: no
        staging) the payload and scales go through a per-warp shared buffer instead
        (``_broadcast_staged``; the chunk used is ``stage_chunk_bytes``'s, what fits the
        static shared memory). Two items in flight with 2048-byte chunks, measured on the
        H200 at prefill (docs/PERF.md's tuning table): NVFP4's round trip 0.675 -> 0.742 of
        copy and BlockwiseFP8's 0.745 -> 0.760 against 1 item straight from registers
        (without the staging, 2 items spilled and ran slower). With ``part = (index,
        count)`` the warp takes every ``count``-th staging chunk from chunk ``index``, the
        default chunk shrunk to about a ``count``-th of the payload so that each warp has one
        (unstaged: every ``count``-th run of 32 items: groups never straddle warps).

        ``scale_dsts`` (``ep_final_layout``, ``broadcasts_final_rows``): ``dsts`` are output
        rows and ``scale_dsts`` the addresses of the same rows' first scale in the output
        scales, so the payload goes to ``dsts[k] + offset`` and a scale at message offset
        ``off`` to ``scale_dsts[k] + final_scale_place(off)`` (None: both into the message
        at ``dsts[k]``). ``scales_row_major``: the scales go row-major to ``scale_dsts``
        whatever the output's scale layout (``off - scales_offset``: the header rows'
        ``hdr_scale_bytes`` of a transposed format)."""
        f = self.fmt
        held = not any(callable(d) for d in dsts)
        live = [r.let(f"live{k}", d.ne(ir.Const(0, T.u64))) if held else None
                for k, d in enumerate(dsts)]

        def storer(targets, place=None):
            def store(off, value):
                for ok, d in zip(live, targets):
                    d = dst_address(d)
                    with r.if_(ok if held else d.ne(ir.Const(0, T.u64))):
                        r.store(ir.Cast(T.ptr_global, d + (off if place is None
                                                            else place(off))), value)
            return store

        store_all = storer(dsts)
        store_scale = None
        if scale_dsts is not None:
            if not self.broadcasts_final_rows:
                raise ValueError(f"{f.name}: scale_dsts needs output scales whose rows are "
                                 f"whole 16-byte vectors, or transposed ones "
                                 f"(broadcasts_final_rows)")
            store_scale = storer(scale_dsts, (lambda off: off - f.scales_offset)
                                 if scales_row_major else self.final_scale_place(r))
        tuning = Tuning() if tuning is None else tuning
        unroll = tuning.quant_items_in_flight if unroll is None else unroll
        preferred = tuning.quant_stage_bytes if stage_bytes is None else stage_bytes
        if preferred and part is not None:
            preferred = min(preferred, self.part_chunk_bytes(part[1]))
        stage_bytes = self.stage_chunk_bytes(preferred, r.n_threads // 32,
                                             sum(b.nbytes for b in r.kb.shared))
        if stage_bytes:
            self._broadcast_staged(r, src_row, store_all, unroll, stage_bytes, part,
                                   store_scale=store_scale,
                                   scattered_scales=scale_dsts is not None
                                   and f.scales_transposed and not scales_row_major)
        elif part is None:
            self._quantize_token(r, src_row, r.lane, 32, store_all, unroll,
                                 store_scale=store_scale)
        else:
            self._quantize_token(r, src_row, r.lane + part[0] * 32, 32 * part[1], store_all,
                                 unroll, store_scale=store_scale)

    @property
    def broadcasts_final_rows(self) -> bool:
        """``emit_broadcast_token`` can write ``ep_final_layout`` rows (``scale_dsts``):
        transposed output scales (row-major into the header rows, ``scales_row_major``, or
        one store per scale in place), or row-major ones whose rows are whole 16-byte
        vectors, so the staged scale copies (up to 16 bytes a store) stay aligned in them."""
        f = self.fmt
        return f.scales_transposed or f.out_scale_bytes_per_row % VECTOR_BYTES == 0

    def out_scale_row_offset(self, row) -> ir.Expr:
        """Byte offset of output row ``row``'s first scale in the output scales (u64):
        ``row * scale bytes per row`` row-major, ``row * scale_bytes`` transposed."""
        f = self.fmt
        per_row = f.scale_bytes if f.scales_transposed else f.out_scale_bytes_per_row
        return ir.as_expr(row).cast(T.u64) * per_row

    def final_scale_place(self, r):
        """Where a scale at message offset ``off`` (a u64 expression) lands from its output
        row's first scale: ``off - scales_offset`` row-major; transposed
        (``[groups, output_scales_rows]``), group ``g`` of the row ``g *
        output_scales_rows`` scales further."""
        f = self.fmt
        if not f.scales_transposed:
            return lambda off: off - f.scales_offset
        rows = kernel_param(r, "output_scales_rows", T.u32)
        return lambda off: ((off - f.scales_offset) // f.scale_bytes
                            * (rows.cast(T.u64) * f.scale_bytes))

    def part_chunk_bytes(self, count: int) -> int:
        """A ``count``-th of the payload, rounded up to whole 32-item trips and 16-byte
        vectors: the staging chunk that gives each of ``count`` warps sharing a token one."""
        f = self.fmt
        trip = 32 * f.item_out_bytes
        step = trip * VECTOR_BYTES // math.gcd(trip, VECTOR_BYTES)
        share = -(-f.payload_bytes // count)
        return -(-share // step) * step

    def stage_chunk_bytes(self, preferred: int, warps: int, static_used: int) -> int:
        """The staging chunk the warp send path uses by default: the largest multiple of a
        32-item trip's payload (and of 16 bytes) up to ``preferred`` whose ``warps`` copies
        (with their scales) fit the static shared memory left after
        ``static_used`` bytes; 0 (no staging) when ``preferred`` is 0 or not even one trip
        fits."""
        f = self.fmt
        if not preferred:
            return 0
        self.check_stage_bytes(preferred)
        trip = 32 * f.item_out_bytes
        step = trip * VECTOR_BYTES // math.gcd(trip, VECTOR_BYTES)
        room = (STATIC_SMEM_LIMIT - static_used) // max(warps, 1)
        # each chunk's scales beside it (rounded up to 16 bytes)
        room -= self.chunk_scale_bytes(min(preferred, room)) + VECTOR_BYTES
        return max(0, min(preferred, room) // step * step)

    def chunk_scale_bytes(self, stage_bytes: int) -> int:
        """Scale bytes of the groups of one ``stage_bytes`` payload chunk (staged beside the
        payload)."""
        f = self.fmt
        items = stage_bytes // f.item_out_bytes
        return -(-items // (f.group_size // ITEM_ELEMS)) * f.scale_bytes

    def check_stage_bytes(self, stage_bytes) -> int:
        """Items per chunk of ``_broadcast_staged``; ``ValueError`` unless ``stage_bytes``
        holds a whole number of 32-item trips and of 16-byte vectors."""
        f = self.fmt
        item_out = f.item_out_bytes
        if isinstance(stage_bytes, bool) or not isinstance(stage_bytes, int) \
                or stage_bytes <= 0 or stage_bytes % (32 * item_out) \
                or stage_bytes % VECTOR_BYTES:
            raise ValueError(f"{f.name}: the staging chunk must be a positive multiple of "
                             f"{32 * item_out} bytes (32 items of {item_out} payload bytes), "
                             f"got {stage_bytes!r}")
        return stage_bytes // item_out

    def _broadcast_staged(self, r, src_row, store_all, unroll: int, stage_bytes: int,
                          part=None, store_scale=None, scattered_scales: bool = False):
        """The token in chunks of ``stage_bytes`` payload bytes (with ``part = (index,
        count)``: chunks ``index, index + count, ...``): the warp quantizes a chunk's
        items into its slice of the shared buffer ``quant_stage`` (``st.shared``) and their
        group scales into its slice of ``quant_stage_scales``, ``bar.warp.sync``, then each
        lane copies 16-byte vectors of the chunk (``ld.shared.v4.b32``) to every destination
        (``st.global.v4.b32``): each destination gets the chunk as 512-byte warp stores, as
        BF16's broadcast writes, instead of 32 x 4 or 8 bytes per trip; the scales follow as
        wide stores (``_copy_staged_scales``) instead of one store per group from its first
        lane to each destination. The scale stores were most of the send's store instructions
        (NVFP4: 128 of 160 per 2 KB chunk and lane, FP8: 64 of 96); staged they are 8.
        Measured on the H200 at prefill (docs/PERF.md's tuning table): NVFP4 round trip
        1165.9 -> 1078.4 us (0.739 -> 0.799 of copy), BlockwiseFP8 1946.6 -> 1797.2 us
        (0.763 -> 0.826) with the scales staged. ``store_scale``:
        where the scales go, by message offset (default ``store_all``);
        ``scattered_scales``: one scale per store (not contiguous where they go)."""
        f = self.fmt
        store_scale = store_scale or store_all
        chunk_items = self.check_stage_bytes(stage_bytes)
        item_out = f.item_out_bytes
        n_items = f.hid_dim // ITEM_ELEMS
        buf = r.kb.shared_buffer("quant_stage", (r.n_threads // 32) * stage_bytes)
        lanes = f.group_size // ITEM_ELEMS
        sc_bytes = -(-self.chunk_scale_bytes(stage_bytes) // VECTOR_BYTES) * VECTOR_BYTES
        sbuf = r.kb.shared_buffer("quant_stage_scales", (r.n_threads // 32) * sc_bytes)
        static = sum(b.nbytes for b in r.kb.shared)
        if static > STATIC_SMEM_LIMIT:
            raise ValueError(f"{f.name}: a {stage_bytes}-byte staging chunk per warp "
                             f"(tuning.quant_stage_bytes) takes the kernel's static shared "
                             f"memory to {static} bytes, past the {STATIC_SMEM_LIMIT} a block "
                             f"may declare")
        mine = r.let("q_stage", buf + (r.warp * stage_bytes).cast(T.u64))
        my_scales = r.let("q_stage_sc", sbuf + (r.warp * sc_bytes).cast(T.u64))
        first, step = (0, chunk_items) if part is None else \
            (part[0] * chunk_items, part[1] * chunk_items)
        with r.for_range("q_chunk", first, n_items, step) as c0:
            c1 = r.let("q_chunk_end", (c0 + chunk_items).min(n_items))
            base = r.let("q_chunk_off", c0.cast(T.u64) * item_out)

            def to_stage(off, value):
                r.store(mine + (off - base), value)

            sc_base = r.let("q_chunk_sc", (c0 // lanes).cast(T.u64) * f.scale_bytes
                            + f.scales_offset)

            def to_scales(off, value):
                r.store(my_scales + (off - sc_base), value)

            self._quantize_token(r, src_row, r.lane, 32, to_stage, unroll, start=c0, end=c1,
                                 store_scale=to_scales)
            r.warp_sync()
            n_vec = r.let("q_chunk_vecs", (c1 - c0) * item_out // VECTOR_BYTES)
            with r.for_range("q_bc", r.lane, n_vec, 32) as v:
                off = v.cast(T.u64) * VECTOR_BYTES
                store_all(base + off, r.load(mine + off, T.vec(T.u32, 4), name="q_bc_v"))
            self._copy_staged_scales(r, my_scales, sc_base, (c1 - c0) // lanes,
                                     self.chunk_scale_bytes(stage_bytes), store_scale,
                                     one_per_store=scattered_scales)
            r.warp_sync()

    def _copy_staged_scales(self, r, staged, dst_off, n_groups, chunk_bytes: int, store_all,
                            one_per_store: bool = False):
        """The chunk's ``n_groups`` scales from the warp's shared slice
        ``staged`` to message offset ``dst_off`` of every destination, lane-strided, in units
        of the widest power of two up to 16 bytes that divides a whole chunk's ``chunk_bytes``
        (so every unit is aligned in the message), then the last partial unit's scales one by
        one (``ld.shared`` then ``K`` x ``st.global``). ``one_per_store``: one scale per
        store (the final layout's transposed scales are not contiguous)."""
        f = self.fmt
        unit = next(w for w in (16, 8, 4, 2, 1) if chunk_bytes % w == 0)
        unit = max(unit, f.scale_bytes)
        if one_per_store:
            unit = f.scale_bytes
        nbytes = r.let("q_sc_bytes", n_groups * f.scale_bytes)
        dtypes = {16: T.vec(T.u32, 4), 8: T.u64, 4: T.u32, 2: T.u16, 1: T.u8}
        n_units = r.let("q_sc_units", nbytes // unit)
        with r.for_range("q_sc", r.lane, n_units, 32) as u:
            off = u.cast(T.u64) * unit
            store_all(dst_off + off, r.load(staged + off, dtypes[unit], name="q_sc_v"))
        if unit > f.scale_bytes:
            sb = f.scale_bytes
            with r.for_range("q_sc_t", n_units * (unit // sb) + r.lane, n_groups, 32) as g:
                off = g.cast(T.u64) * sb
                store_all(dst_off + off, r.load(staged + off, dtypes[sb], name="q_sc_t"))

    def _quantize_token(self, r, src_row, first, stride, store, unroll: int = 1, *,
                        start=0, end=None, store_scale=None):
        """The quantising loop of both send paths; ``store(byte offset in the message,
        value)`` writes one payload item and, unless ``store_scale`` takes them, each group
        scale. Items ``[start, end)`` (u32 expressions; default the whole token), each trip
        loading ``unroll`` items (``first + j * stride``, ``j < unroll``) before quantising
        any of them."""
        f = self.fmt
        if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
            raise ValueError(f"{f.name}: unroll (items in flight per lane) must be a "
                             f"positive integer, got {unroll!r}")
        n_items = f.hid_dim // ITEM_ELEMS
        end = n_items if end is None else end
        vec = T.vec(T.u32, 4)
        first_warp_item = first - r.lane
        if not (isinstance(start, int) and start == 0):
            first_warp_item = first_warp_item + start
        with r.for_range("q_warp_item", first_warp_item, end, stride * unroll) as warp_item:
            items = [r.let("q_item", warp_item + r.lane + j * stride) for j in range(unroll)]
            # nc.L2::256B is inline PTX: LLVM splits a plain invariant v4 load whose lanes are
            # used one by one into scalar loads and drops the .nc on re-vectorising them
            loaded = [r.load(src_row + item.min(n_items - 1).cast(T.u64) * VECTOR_BYTES, vec,
                             cache=CacheHint.NC_L2_256, name="q_in") for item in items]
            for item, words in zip(items, loaded):
                self._quantize_item(r, item, words, store, end, store_scale or store)

    def _quantize_item(self, r, item, words, store, end, store_scale):
        """One 16-byte input item ``words`` (8 bf16) of index ``item``: its group maximum
        (``shfl.sync.bfly.b32``), the format's quantisation, and (when ``item < end``) the
        payload store and, by the group's first lane, the scale store."""
        f = self.fmt
        lanes = f.group_size // ITEM_ELEMS
        item_out = f.item_out_bytes
        xs = bf16x8_to_f32(r, words)
        amax = abs_max(r, xs)
        group_max(r, amax, lanes)
        payload, scale = self.emit_item_quant(r, xs, amax)
        with r.if_(item < end):
            store(item.cast(T.u64) * item_out,
                  payload[0] if len(payload) == 1
                  else ir.Pack(T.vec(T.u32, len(payload)), tuple(payload)))
            with r.if_((r.lane % lanes).eq(0)):
                value = scale if f.scale_bytes == 4 else ir.as_expr(scale).cast(T.u8)
                store_scale(f.scales_offset + (item // lanes).cast(T.u64) * f.scale_bytes,
                            value)

    @property
    def copies_scales_per_tile(self) -> bool:
        """Transposed scales are copied a tile at a time (``emit_copy_tile_scales``)."""
        f = self.fmt
        return f.scales_transposed

    @property
    def scales_ride_with_payload(self) -> bool:
        """Row-major output scales of whole 16-byte vectors that follow the payload in the
        message without a gap, so one run of message vectors feeds both output tensors: a
        warp copies a message's payload and its scales with every load of a trip in flight
        before the stores (``primitives.warp_copy_segments``: NVFP4's 252 vectors at H=7168
        are one trip of 8 per lane) instead of a second dependent round trip per message."""
        f = self.fmt
        return (not f.scales_transposed
                and f.scales_offset == f.payload_bytes
                and f.out_scale_bytes_per_row % VECTOR_BYTES == 0)

    def emit_copy_msg_to_output(self, r, msg, row, output_tokens, scales: bool = True,
                                out_scales=None):
        """``copy_msg_to_output_tensor``: one warp copies the payload of ``msg`` into output row
        ``row`` (lane-strided 16-byte vectors, ``common.warp_copy``) and, unless ``scales`` is
        False, the scales into ``out_scales`` (default the kernel parameter
        ``output_scales``; the final layout passes the destination rank's): transposed
        ``[groups, output_scales_rows]`` with one ``st.global.b32`` per scale, or row-major
        ``[M, groups]`` with lane-strided copies. ``row`` may be a ``fanout.RowFan``: each
        value is loaded once and stored into every live row."""
        f = self.fmt
        dst = fanout.each_row(row, lambda x: output_tokens + x.cast(T.u64) * f.out_row_bytes)
        if scales and self.scales_ride_with_payload:
            if out_scales is None:
                out_scales = kernel_param(r, "output_scales", T.ptr_global)
            nbytes = f.out_scale_bytes_per_row
            warp_copy_segments(r, msg, [(dst, f.payload_vectors),
                                        (fanout.each_row(row, lambda x: out_scales
                                                         + x.cast(T.u64) * nbytes),
                                         nbytes // VECTOR_BYTES)], tag="recv")
            return
        warp_copy(r, dst, msg, f.payload_vectors, tag="recv")
        if not scales:
            return
        if out_scales is None:
            out_scales = kernel_param(r, "output_scales", T.ptr_global)
        src = msg + f.scales_offset
        if f.scales_transposed:
            m = kernel_param(r, "output_scales_rows", T.u32)
            with r.for_range("rs_g", r.lane, f.n_scale_groups, 32) as g:
                s = r.load(src + g.cast(T.u64) * f.scale_bytes, T.u32, name="rs_v")
                fanout.store(r, fanout.each_row(
                    row, lambda x: out_scales + (g.cast(T.u64) * m.cast(T.u64) + x.cast(T.u64))
                    * f.scale_bytes), s)
            return
        nbytes = f.out_scale_bytes_per_row
        dst = fanout.each_row(row, lambda x: out_scales + x.cast(T.u64) * nbytes)
        if nbytes % VECTOR_BYTES == 0:
            copy_vectors(r, dst, src, nbytes // VECTOR_BYTES, r.lane, 32, unroll=1, tag="rs")
            return
        width = next(w for w in (8, 4, 2, 1) if nbytes % w == 0)
        dtype = T.DType("u", 8 * width)
        with r.for_range("rs_i", r.lane, nbytes // width, 32) as i:
            fanout.store(r, dst + i.cast(T.u64) * width,
                         r.load(src + i.cast(T.u64) * width, dtype, name="rs_v"))

    def emit_copy_tile_scales(self, r, tile_msgs, row0, n_rows, tile_tokens, first, stride,
                              scales_at: int | None = None):
        """The transposed scales of a whole tile, so that the stores coalesce: work item
        ``i`` is tile row ``j = i % tile_tokens`` and scale vector ``v = i // tile_tokens``
        (16 bytes: ``16 // scale_bytes`` groups). The thread loads the row's message address
        (``ld.shared.u64``) and the vector (``ld.global.v4.b32``), then stores each group
        ``g`` to ``output_scales[g, row0 + j]`` (``st.global.b32``): 32 adjacent rows of one
        group per warp store, where the per-message copy writes 32 groups ``4 *
        output_scales_rows`` bytes apart. With a constant ``stride`` the thread's items are
        unrolled: every item's two loads (past the tile's items: a clamped valid one) before
        any item's guarded stores (BlockwiseFP8 at 512 threads: 4 items), not one item's round
        trip at a time. ``scales_at``: the
        scales' byte offset from each address (default the message's ``scales_offset``; the
        final layout's header rows: ``hdr_scales_offset``)."""
        f = self.fmt
        if not f.scales_transposed or f.scale_bytes != 4:
            raise NotImplementedError(f"{f.name}: the tile-wide scale copy handles "
                                      f"transposed 4-byte scales only")
        at = f.scales_offset if scales_at is None else scales_at
        out_scales = kernel_param(r, "output_scales", T.ptr_global)
        m = kernel_param(r, "output_scales_rows", T.u32).cast(T.u64)
        per_vec = VECTOR_BYTES // f.scale_bytes
        n_vec = -(-f.n_scale_groups // per_vec)
        n_items = n_vec * tile_tokens
        ragged = f.n_scale_groups % per_vec   # the last vector holds padding

        def load_item(i, j):
            v = r.let("ts_v", i // tile_tokens)
            msg = r.load(tile_msgs + (j * 8).cast(T.u64), T.u64, name="ts_msg", peer=True)
            return v, r.load(ir.Cast(T.ptr_global, msg) + at
                             + v.cast(T.u64) * VECTOR_BYTES, T.vec(T.u32, 4), name="ts_w")

        def store_item(v, j, words):
            row = r.let("ts_row", row0 + j).cast(T.u64)
            g0 = r.let("ts_g", v * per_vec)
            for q in range(per_vec):
                g = g0 + q if q else g0
                with r.if_(g < f.n_scale_groups) if ragged else contextlib.nullcontext():
                    r.store(out_scales + (g.cast(T.u64) * m + row) * f.scale_bytes,
                            ir.Extract(words, q))

        if isinstance(stride, int):
            # every item's loads first (clamped to a valid item), then the guarded stores
            items = []
            for u in range(-(-n_items // stride)):
                i = r.let("ts_i", first + stride * u if u else first)
                ok = r.let("ts_ok", (i < n_items) & ((i % tile_tokens) < n_rows))
                i_c = i.min(n_items - 1) if (u + 1) * stride > n_items else i
                j = r.let("ts_j", (i_c % tile_tokens).min(n_rows - 1))
                items.append((ok, j) + load_item(i_c, j))
            for ok, j, v, words in items:
                with r.if_(ok):
                    store_item(v, j, words)
            return
        with r.for_range("ts_i", first, n_items, stride) as i:
            j = r.let("ts_j", i % tile_tokens)
            with r.if_(j < n_rows):
                v, words = load_item(i, j)
                store_item(v, j, words)

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups):
        """``pad_expert_offsets``: no padding (``expert_m_padding == 1``)."""
