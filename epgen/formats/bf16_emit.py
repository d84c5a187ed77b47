"""``BF16Emitter``: the IR of BF16's device steps, 16-byte vector copies of the unchanged
payload (the send's CTA-wide copy, the warp send path's broadcast, the role-split copy, the
receive's warp copy); no padding of the row offsets."""

from __future__ import annotations

import ir
from ir import types as T

from .. import fanout
from ..primitives import VEC, copy_vectors, issue_vector_loads, store_vector_loads, warp_copy
from .base import VECTOR_BYTES
from .emit import DeviceEmitter, dst_address


class BF16Emitter(DeviceEmitter):
    """Device steps of ``BF16Format``."""

    def emit_copy_token_to_send_buf(self, r, src_row, msg, first, stride):
        """``copy_token_to_send_buf``: the CTA copies the ``2H`` payload bytes as 16-byte
        vectors (``ld.global.nc.v4.b32`` / ``st.global.v4.b32``), thread ``first`` taking
        vectors ``first, first + stride, ...``."""
        f = self.fmt
        copy_vectors(r, msg, src_row, 2 * f.hid_dim // VECTOR_BYTES, first, stride, nc=True,
                     tag="stage")

    splits_staging = True

    def emit_stage_loads(self, r, src_row, first, stride: int):
        """The pipelined block-staged send's first half of ``emit_copy_token_to_send_buf``
        (``send_staged.broadcast_tokens_pipelined``): this thread issues its
        ``ld.global.nc.v4.b32`` of vectors ``first, first + stride, ...`` now (past the
        payload's end it loads the last vector again) and returns ``store(msg)``, which emits
        their ``st.shared.v4.b32`` (those past the end skipped) where it is called."""
        f = self.fmt
        n_vec = 2 * f.hid_dim // VECTOR_BYTES
        loads = issue_vector_loads(r, src_row, n_vec, first, stride - 1, stride,
                                   -(-n_vec // stride), nc=True, tag="pf")

        def store(msg):
            store_vector_loads(r, loads, n_vec,
                               lambda u, i: msg + i.cast(T.u64) * VECTOR_BYTES)
        return store

    def emit_broadcast_token(self, r, src_row, dsts, part=None, tuning=None, unroll: int = 2):
        """The warp send path: lane ``l`` loads vectors ``l, l + 32, ...`` of the payload,
        ``unroll`` in flight (``ld.global.nc.v4.b32``), and stores each to every non-zero
        destination of ``dsts`` (``st.global.v4.b32``, ``K`` per load). Two in flight: on the
        H200 2, 4, 7 and 8 moved the same bytes per second (benchmarks/experiments/
        broadcast_bw.py --unroll-sweep: the writes bound it), and 2 keeps the code small.
        With ``part = (index, count)`` the warp takes the ``index``-th of ``count`` equal runs
        of vectors (``ceil(n / count)`` each; the last may be shorter), lane-strided the same
        way. BF16's send has no tuning choice: ``tuning`` is accepted and unused."""
        f = self.fmt
        n_vec = 2 * f.hid_dim // VECTOR_BYTES
        if part is None:
            i, end = r.var("bc_i", T.u32, r.lane), n_vec
        else:
            share = -(-n_vec // part[1])
            first = r.let("bc_first", part[0] * share)
            i = r.var("bc_i", T.u32, first + r.lane)
            end = r.let("bc_end", (first + share).min(n_vec))

        def body(n):
            if part is None:
                offs = [(i + 32 * u).cast(T.u64) * VECTOR_BYTES for u in range(n)]
            else:      # u64 offsets: LLVM folds the unrolled vectors' into the address
                base = i.cast(T.u64) * VECTOR_BYTES
                offs = [base + 32 * u * VECTOR_BYTES if u else base for u in range(n)]
            vals = [r.load(src_row + o, VEC, cache=ir.CacheHint.NC, name="bc_v") for o in offs]
            for o, v in zip(offs, vals):
                for d in dsts:
                    d = dst_address(d)
                    with r.if_(d.ne(ir.Const(0, T.u64))):
                        r.store(ir.Cast(T.ptr_global, d + o), v)
            r.assign(i, i + 32 * n)

        if unroll > 1:
            with r.while_(i + 32 * (unroll - 1) < end):
                body(unroll)
        if part is not None or n_vec % (32 * unroll):   # a tail when the lanes' share is uneven
            with r.while_(i < end):
                body(1)

    def emit_copy_token_to_send_buf_split(self, r, src_row, msg, tid, split):
        """``copy_token_to_send_buf`` with the role split (``ep_copy_role_split``): a copy
        item is 8 elements, one 16-byte vector (so ``n_items = H/8`` vectors), and thread
        ``tid < split.n_copy_threads`` moves items ``tid + j * n_copy_threads``, ``j <
        n_trips``: all its ``ld.global.nc.v4.b32`` issued before its ``st.global.v4.b32``.
        Publisher warps copy nothing."""
        f = self.fmt
        n_items = 2 * f.hid_dim // VECTOR_BYTES
        if n_items != split.n_trips * split.n_copy_threads:
            raise ValueError(f"BF16Format: the role-split copy needs hid_dim/8 = {n_items} == "
                             f"n_trips * n_copy_threads = "
                             f"{split.n_trips * split.n_copy_threads}")
        with r.if_(tid < split.n_copy_threads):
            offs = [(tid + j * split.n_copy_threads).cast(T.u64) * VECTOR_BYTES
                    for j in range(split.n_trips)]
            vals = [r.load(src_row + o, VEC, cache=ir.CacheHint.NC, name="split_v") for o in offs]
            for o, v in zip(offs, vals):
                r.store(msg + o, v)

    def emit_copy_msg_to_output(self, r, msg, row, output_tokens):
        """``copy_msg_to_output_tensor``: one warp copies the payload of ``msg`` into output
        row ``row`` (lane-strided 16-byte vectors, ``common.warp_copy``); ``row`` may be a
        ``fanout.RowFan`` (each vector loaded once, stored into every live row)."""
        f = self.fmt
        dst = fanout.each_row(row, lambda x: output_tokens + x.cast(T.u64) * f.out_row_bytes)
        warp_copy(r, dst, msg, f.payload_vectors, tag="recv")

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups):
        """``pad_expert_offsets``: BF16 rows are not padded (no code)."""
