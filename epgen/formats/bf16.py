"""``BF16Format`` (reference ``BF16TokenFormat[output_layout, H, K, A]``, protocol section 3.2).

The payload is the token's ``H`` bfloat16 values, unchanged: ``token_size = align_up(2H, A)``,
dispatch_wait tile ``(128, 1)``, no shared memory, no padding. On the host a BF16 token is held
as its uint16 bit patterns (``ml_dtypes.bfloat16`` arrays are accepted and viewed as such), so
comparisons are bit-exact, NaNs included.
"""

from __future__ import annotations

import attrs
import numpy as np

import ir
from ir import types as T

from ..primitives import VEC, copy_vectors, issue_vector_loads, store_vector_loads, warp_copy
from .base import VECTOR_BYTES, TokenFormat, align_up, dst_address
from .registry import register_format


def bf16_bits(tokens) -> np.ndarray:
    """``tokens`` (uint16 bit patterns or ``ml_dtypes.bfloat16``) as a uint16 view."""
    arr = np.asarray(tokens)
    if arr.dtype == np.uint16:
        return arr
    if arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2:
        return arr.view(np.uint16)
    raise ValueError(f"BF16 tokens must be uint16 bit patterns or ml_dtypes.bfloat16, "
                     f"got dtype {arr.dtype}")


@register_format
@attrs.frozen
class BF16Format(TokenFormat):
    """Unquantized bfloat16 tokens. ``BF16Format(hid_dim, top_k, alignment=16)``."""

    name = "BF16"
    input_dtype = "bf16"
    input_elem_bytes = 2
    out_dtype = "bf16"
    host_dtype = np.uint16
    accepted_input_dtypes = ("bfloat16", "uint16")
    payload_is_output_row = True

    def __attrs_post_init__(self):
        # The send is a CTA-wide 16-byte vector copy and the receive stores SIMD bf16 vectors;
        # the reference silently drops a tail that is not a whole vector.
        if (2 * self.hid_dim) % VECTOR_BYTES:
            raise ValueError(
                f"BF16Format: hid_dim={self.hid_dim}: 2*hid_dim bytes must be a multiple of "
                f"the {VECTOR_BYTES}-byte vector width (hid_dim a multiple of "
                f"{VECTOR_BYTES // 2})")

    @property
    def token_size(self) -> int:
        return align_up(2 * self.hid_dim, self.alignment)

    def as_host_tokens(self, tokens) -> np.ndarray:
        return bf16_bits(tokens)

    def encode_payload(self, tokens) -> np.ndarray:
        bits = np.ascontiguousarray(self.as_host_tokens(tokens)).reshape(-1, self.hid_dim)
        out = np.zeros((bits.shape[0], self.token_size), dtype=np.uint8)
        out[:, :2 * self.hid_dim] = bits.astype("<u2").view(np.uint8)
        return out

    def decode_payload(self, payload):
        payload = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1, self.token_size)
        rows = np.ascontiguousarray(payload[:, :2 * self.hid_dim]).view("<u2")
        return rows.astype(np.uint16), None

    # ---- device steps ------------------------------------------------------------------
    @property
    def out_row_bytes(self) -> int:
        return 2 * self.hid_dim

    def emit_copy_token_to_send_buf(self, r, src_row, msg, first, stride):
        """``copy_token_to_send_buf``: the CTA copies the ``2H`` payload bytes as 16-byte
        vectors (``ld.global.nc.v4.b32`` / ``st.global.v4.b32``), thread ``first`` taking
        vectors ``first, first + stride, ...``."""
        copy_vectors(r, msg, src_row, 2 * self.hid_dim // VECTOR_BYTES, first, stride, nc=True,
                     tag="stage")

    splits_staging = True

    def emit_stage_loads(self, r, src_row, first, stride: int):
        """The pipelined block-staged send's first half of ``emit_copy_token_to_send_buf``
        (``dispatch_async.SEND_JOIN_PREFETCH``): this thread issues its
        ``ld.global.nc.v4.b32`` of vectors ``first, first + stride, ...`` now (past the
        payload's end it loads the last vector again) and returns ``store(msg)``, which emits
        their ``st.shared.v4.b32`` (those past the end skipped) where it is called."""
        n_vec = 2 * self.hid_dim // VECTOR_BYTES
        loads = issue_vector_loads(r, src_row, n_vec, first, stride - 1, stride,
                                   -(-n_vec // stride), nc=True, tag="pf")

        def store(msg):
            store_vector_loads(r, loads, n_vec,
                               lambda u, i: msg + i.cast(T.u64) * VECTOR_BYTES)
        return store

    def emit_broadcast_token(self, r, src_row, dsts, part=None, unroll: int = 2):
        """The warp send path: lane ``l`` loads vectors ``l, l + 32, ...`` of the payload,
        ``unroll`` in flight (``ld.global.nc.v4.b32``), and stores each to every non-zero
        destination of ``dsts`` (``st.global.v4.b32``, ``K`` per load). Two in flight: on the
        H200 2, 4, 7 and 8 moved the same bytes per second (benchmarks/experiments/
        broadcast_bw.py --unroll-sweep: the writes bound it), and 2 keeps the code small.
        With ``part = (index, count)`` the warp takes the ``index``-th of ``count`` equal runs
        of vectors (``ceil(n / count)`` each; the last may be shorter), lane-strided the same
        way."""
        n_vec = 2 * self.hid_dim // VECTOR_BYTES
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
        n_items = 2 * self.hid_dim // VECTOR_BYTES
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

    @property
    def payload_vectors(self) -> int:
        """16-byte vectors of the payload (message bytes ``[0, 2H)`` = the output row)."""
        return 2 * self.hid_dim // VECTOR_BYTES

    def emit_copy_msg_to_output(self, r, msg, row, output_tokens):
        """``copy_msg_to_output_tensor``: one warp copies the payload of ``msg`` into output
        row ``row`` (lane-strided 16-byte vectors, ``common.warp_copy``)."""
        dst = output_tokens + row.cast(T.u64) * self.out_row_bytes
        warp_copy(r, dst, msg, self.payload_vectors, tag="recv")

    def emit_pad_expert_offsets(self, r, row_offsets, n_groups, comm_barrier_id=-1):
        """``pad_expert_offsets``: BF16 rows are not padded (no code)."""
