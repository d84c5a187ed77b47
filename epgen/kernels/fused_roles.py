"""``ep_fused_roles``: a test kernel for the fused-megakernel role parameters, as the reference page lists them.

It is dispatch_wait with a second role sharing the copy blocks, the way a fused MoE kernel
would place its FFN next to the dispatch's comm role:

    blocks [0, grid-1), threads [0, X)          ffn   consumes the L1 arrival counters
    blocks [0, grid-1), threads [X, block)      copy  copy_received_tokens_to_output in a
                                                      role with threads (X, block - X),
                                                      barrier_id 1, smem_base FFN_SMEM_BYTES
                                                      (the reference's comm_thread_base,
                                                      n_comm_threads, comm_barrier_id,
                                                      comm_smem_base), with an L1Release
    block grid-1, all threads                   aux   wait_for_arrivals_and_compute_offsets

The comm role comes after the ffn role in kernel order and shares no thread, barrier id or
shared byte with it: the ffn owns named barrier 2 and dynamic shared memory ``[0,
FFN_SMEM_BYTES)``, the comm role barrier 1 and the bytes from its ``smem_base``.

The ffn role of block ``b`` consumes local experts ``b, b + grid - 1, ...``: thread 0 waits
(bounded, ``ld.acquire.gpu``) for the ready flag (then counts itself done with it, so the flag
stays raised until every reader saw it: the aux block counts two readers per copy block), reads
the expert's token count (region B) and first row, and waits (bounded, ``ld.acquire.gpu``)
until the expert's L1 arrival counter reaches ``delta * ceil(count / token_block)``; after its
barrier each ffn warp checksums rows ``w, w + n_ffn_warps, ...`` of the expert into
``ffn_out[row]`` (``row_checksums`` is the numpy model). Rows read before they land would give
another checksum, so the test poisons the output first.
"""

from __future__ import annotations

import attrs
import numpy as np

import ir
from ir import CmpOp, ReduxOp, Scope, Sem
from ir import types as T

from . import trace
from .common import DATA_READY_FLAG, VEC, VEC_BYTES, exit_if_aborted, lower_ready_flag_if_last
from .common import word as _word
from .dispatch_wait import (copy_received_tokens_to_output, copy_scratch_bytes, declare_params,
                            wait_for_arrivals_and_compute_offsets)
from .staged_copy import L1Release

KERNEL_NAME = "ep_fused_roles"
FFN_SMEM_BYTES = 64


@attrs.frozen
class FusedRolesSpec:
    """Shape of the test kernel: the ffn role's threads (a multiple of 32, leaving at least one
    warp to the comm role), the barrier ids and the L1 release parameters."""

    ffn_threads: int = 64
    comm_barrier_id: int = 1
    ffn_barrier_id: int = 2
    l1_release_token_block: int = 16
    l1_release_atomic_pad: int = 32
    l1_release_delta: int = 3

    def check(self, cfg) -> None:
        X, n = self.ffn_threads, cfg.num_threads
        if X <= 0 or X % 32 or X >= n:
            raise ValueError(f"ffn_threads must be a positive multiple of 32 below num_threads="
                             f"{n} (the comm role takes the rest), got {X}")
        if cfg.n_ranks > 32:
            raise ValueError("the comm role's rank prefixes need n_ranks <= 32")
        if self.comm_barrier_id == self.ffn_barrier_id or 0 in (self.comm_barrier_id,
                                                               self.ffn_barrier_id):
            raise ValueError(f"comm_barrier_id and ffn_barrier_id must be distinct non-zero "
                             f"ids (the roles run at once in one block), got "
                             f"{self.comm_barrier_id} and {self.ffn_barrier_id}")

    def l1_release(self, arrival_ptr) -> L1Release:
        """The comm role's ``L1Release`` on the counters at ``arrival_ptr``."""
        return L1Release(arrival_ptr, self.l1_release_token_block, self.l1_release_atomic_pad,
                         self.l1_release_delta)

    def expected_counters(self, cfg, expert_counts) -> np.ndarray:
        """Final L1 arrival counter words (u32 [L * atomic_pad]) for per-expert counts."""
        c = np.asarray(expert_counts, dtype=np.int64)
        words = np.zeros(cfg.layout.n_local_experts * self.l1_release_atomic_pad, np.uint32)
        tb = self.l1_release_token_block
        words[::self.l1_release_atomic_pad] = (self.l1_release_delta * ((c + tb - 1) // tb)) \
            .astype(np.uint32)
        return words


def dynamic_smem_bytes(cfg, spec: FusedRolesSpec = FusedRolesSpec()) -> int:
    """Dynamic shared memory the test kernel is launched with: the ffn role's bytes, then the
    comm role's scratch."""
    return FFN_SMEM_BYTES + copy_scratch_bytes(cfg, cfg.num_threads - spec.ffn_threads)


def row_checksums(rows) -> np.ndarray:
    """Numpy model of the ffn checksum: for each row, the sum of its u32 words ``w_i`` times
    ``2i + 1`` modulo 2**32 (rows as uint16 BF16 bit patterns or any little-endian bytes)."""
    rows = np.ascontiguousarray(rows)
    n_words = rows.nbytes // 4 // rows.shape[0] if rows.shape[0] else 0
    words = rows.view("<u4").reshape(rows.shape[0], n_words).astype(np.uint64)
    weights = 2 * np.arange(n_words, dtype=np.uint64) + 1
    return ((words * weights) % 2**32).sum(axis=1, dtype=np.uint64).astype(np.uint32)


def ffn_consume_l1_arrivals(r: ir.RoleBuilder, cfg, p, spec: FusedRolesSpec, smem, l1_arrival,
                            ffn_out):
    """The ffn role (module docstring): ready flag, then per expert the L1 arrival counter,
    then a checksum of each of the expert's rows into ``ffn_out``."""
    lay = cfg.layout
    L, R = lay.n_local_experts, cfg.n_ranks
    ctr = p.atomic_counter
    bar = r.named_barrier("ffn", spec.ffn_barrier_id)
    row_bytes = cfg.token_fmt.out_row_bytes
    n_words = row_bytes // 4
    with r.if_(r.tid.eq(0)):
        r.spin_wait(_word(ctr, lay.ready_flag_offset), T.u32, CmpOp.EQ, DATA_READY_FLAG,
                    buffer="ready_flag", index=lay.ready_flag_offset, sem=Sem.ACQUIRE,
                    scope=Scope.GPU, backoff_ns=64)
        lower_ready_flag_if_last(r, cfg, ctr)
    r.bar_sync(bar)
    exit_if_aborted(r, p.err_buf)
    with r.for_range("ffn_e", r.block, L, r.n_blocks - 1) as e:
        with r.if_(r.tid.eq(0)):
            total = r.load(_word(ctr, lay.rank_prefix_offset + e * R + (R - 1)), T.u32,
                           name="ffn_total")
            tb = spec.l1_release_token_block
            blocks = (total + (tb - 1)) // tb if tb > 1 else total
            r.spin_wait(_word(l1_arrival, e * spec.l1_release_atomic_pad), T.u32, CmpOp.GE,
                        blocks * spec.l1_release_delta, buffer="l1_arrival",
                        index=e * spec.l1_release_atomic_pad, sem=Sem.ACQUIRE, scope=Scope.GPU,
                        backoff_ns=64)
            trace.stamp(r, "ffn.l1_seen", e, leader=False)
            r.store(smem, r.load(_word(p.row_offsets, e), T.u32, name="ffn_start"))
            r.store(smem + 4, total)
        r.bar_sync(bar)
        exit_if_aborted(r, p.err_buf)
        start = r.let("ffn_start_s", r.load(smem, T.u32, name="ffn_start_ld"))
        total = r.let("ffn_total_s", r.load(smem + 4, T.u32, name="ffn_total_ld"))
        with r.for_range("ffn_j", r.warp, total, r.n_threads // 32) as j:
            row = r.let("ffn_row", start + j)
            src = r.let("ffn_src", p.output_tokens + row.cast(T.u64) * row_bytes)
            acc = r.var("ffn_acc", T.u32, 0)
            with r.for_range("ffn_v", r.lane, n_words // 4, 32) as v:
                vec = r.load(src + v.cast(T.u64) * VEC_BYTES, VEC, name="ffn_vec")
                for k in range(4):
                    r.assign(acc, acc + ir.Extract(vec, k) * (v * 8 + (2 * k + 1)))
            total_sum = r.redux(ReduxOp.ADD, acc, name="ffn_sum")
            with r.if_(r.lane.eq(0)):
                r.store(_word(ffn_out, row), total_sum)
        r.bar_sync(bar)


def build_fused_roles(cfg, spec: FusedRolesSpec = FusedRolesSpec()) -> ir.Kernel:
    """The ``ep_fused_roles`` entry point (module docstring): dispatch_wait's parameters plus
    ``l1_arrival_ptr`` (u32 ``[L * l1_release_atomic_pad]``, zero at launch) and ``ffn_out``
    (u32 per output row); launch with ``dynamic_smem_bytes(cfg)`` of dynamic shared memory."""
    spec.check(cfg)
    if cfg.fused_shared_expert:
        raise ValueError("ep_fused_roles is a dispatch_wait variant: fused_shared_expert is "
                         "not taken (only the fused dispatch kernel packs the shared expert)")
    if (cfg.token_fmt.out_row_bytes // 4) % 4:
        raise ValueError("the ffn checksum reads output rows as 16-byte vectors")
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb, cfg)
    l1_arrival = kb.param("l1_arrival_ptr", T.ptr_global)
    ffn_out = kb.param("ffn_out", T.ptr_global)
    trace.instrument(kb, cfg, p.my_rank, role_rings={"ffn": 1, "copy": 0})
    X = spec.ffn_threads
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1
    smem = kb.dynamic_shared_memory()
    with kb.role("ffn", blocks=(0, last), threads=(0, X)) as r:
        ffn_consume_l1_arrivals(r, cfg, p, spec, smem, l1_arrival, ffn_out)
    with kb.role("copy", blocks=(0, last), threads=(X, cfg.num_threads - X),
                 barrier_id=spec.comm_barrier_id, smem_base=FFN_SMEM_BYTES) as r:
        copy_received_tokens_to_output(r, cfg, p, l1_release=spec.l1_release(l1_arrival),
                                       copy_trace=trace.copy_trace(kb))
    with kb.role("aux", blocks=(last, None)) as r:
        wait_for_arrivals_and_compute_offsets(r, cfg, p, flag_readers_per_block=2)
    return kb.build()


__all__ = ["build_fused_roles", "FusedRolesSpec", "dynamic_smem_bytes", "row_checksums",
           "ffn_consume_l1_arrivals", "KERNEL_NAME", "FFN_SMEM_BYTES"]
