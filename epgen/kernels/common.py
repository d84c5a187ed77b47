"""IR building blocks of the EP kernel builders: lowest-set-bit, device pointer tables, the
abort check, the ready flag's wait and lowering, the signals' scope and the sentinel of the
receive-count words. The generic ones
the formats' device emitters use too (vector copies, scans, ``word``) live in
``epgen.primitives`` and are imported here, so kernel modules keep importing them from
``.common``."""

from __future__ import annotations

import ir
from ir import AtomOp, CacheHint, CmpOp, Scope, Sem, diag
from ir import types as T

from ..primitives import (VEC, VEC_BYTES, block_inclusive_scan,  # noqa: F401
                          comm_sync, copy_vectors, issue_vector_loads, store_vector_loads,
                          warp_copy, warp_copy_segments, warp_copy_unroll,
                          warp_inclusive_scan, word)

SENTINEL = (1 << 64) - 1       # receive-count word "not yet published" (UInt64.MAX_FINITE)
DATA_READY_FLAG = 1024         # EP_DATA_READY_FLAG
#: ``ep_rank_mask``: the ready flag's deadline in kernel deadlines (``wait_ready_flag``)
READY_FLAG_DEADLINES = 3


def lowest_set_bit(r: ir.RoleBuilder, mask, name: str = "lsb") -> ir.Var:
    """Index of the lowest set bit of a non-zero u32 (``popc((m & -m) - 1)``)."""
    m = ir.as_expr(mask)
    return r.let(name, ir.UnOp(ir.UnOpKind.POPC, (m & (~m + 1)) - 1))


def load_pointer(r: ir.RoleBuilder, table, index, name: str, peer: bool = True) -> ir.Var:
    """Entry ``index`` of a device table of 64-bit addresses (``ld.global.nc.b64``), as a
    global pointer; ``peer`` marks the memory as visible to other ranks."""
    raw = r.load(table + ir.as_expr(index).cast(T.u64) * 8, T.u64, cache=CacheHint.NC,
                 name=f"{name}_raw")
    return r.let(name, ir.Cast(T.ptr_global, raw), peer=peer)


def exit_if_aborted(r: ir.RoleBuilder, err_buf):
    """After the barrier that follows a bounded wait: every thread leaves the kernel together
    if any wait of the launch group has expired (``ld.relaxed.sys`` of the abort word)."""
    flag = r.load(word(err_buf, diag.ABORT_WORD), T.u32, Sem.RELAXED, Scope.SYS, name="aborted")
    with r.if_(flag.ne(0)):
        r.return_()


def wait_ready_flag(r: ir.RoleBuilder, cfg, ctr, err_buf):
    """A dispatch_wait copy block's start: thread 0 waits (bounded, ``ld.acquire.gpu``, 32 ns
    back-off) for the aux block's ready flag (Region E of ``ctr``), the role's barrier
    (``comm_sync``), then every thread leaves together if a wait has expired
    (``exit_if_aborted``). With ``ep_rank_mask`` the wait's deadline is
    ``READY_FLAG_DEADLINES`` times the kernel's: the aux block raises the flag only after its
    own waits, which may each run a whole deadline before masking a rank (shrink)."""
    lay = cfg.layout
    deadline = None
    if cfg.ep_rank_mask:    # the aux block may spend a whole deadline on a rank it masks
        deadline = r.kb.diag["timeout_ns"] * READY_FLAG_DEADLINES
    with r.if_(r.tid.eq(0)):
        r.spin_wait(word(ctr, lay.ready_flag_offset), T.u32, CmpOp.EQ, DATA_READY_FLAG,
                    buffer="ready_flag", index=lay.ready_flag_offset, sem=Sem.ACQUIRE,
                    scope=Scope.GPU, backoff_ns=32, timeout_ns=deadline)
    comm_sync(r)
    exit_if_aborted(r, err_buf)


def lower_ready_flag_if_last(r: ir.RoleBuilder, cfg, ctr):
    """One reader of the ready flag is done (``atom.relaxed.gpu.add`` of -1 on Region D); the
    last one lowers the flag (Region E) for the next call."""
    lay = cfg.layout
    old = r.atomic(AtomOp.ADD, word(ctr, lay.cleanup_counter_offset), 0xFFFFFFFF,
                   Sem.RELAXED, Scope.GPU, name="cleanup_old")
    with r.if_(old.eq(1)):
        r.store(word(ctr, lay.ready_flag_offset), 0)


def signal_scope(cfg) -> Scope:
    """Scope of the count-word and rank-flag signals and their waits: ``sys``; ``gpu`` where
    no other device writes this one's receive-count words (``layout.crosses_devices`` false:
    ``skip_a2a``)."""
    return Scope.SYS if cfg.layout.crosses_devices else Scope.GPU


def send_sm(r: ir.RoleBuilder, first_block: int, sm_id=None, n_active_send_sms=None):
    """``(sm_id, n_active_send_sms)`` of a sending block (reference ``copy_and_send_tokens``'
    SM arguments): its index among the sending blocks and their count, as u32 expressions.
    Defaults: ``block - first_block`` and ``grid - first_block`` (the sending blocks are
    ``[first_block, grid)``); a fused kernel that sends from remapped blocks passes both
    (ids ``0 .. n_active_send_sms - 1``, each on one block)."""
    sm = r.block - first_block if sm_id is None else ir.as_expr(sm_id)
    n = r.n_blocks - first_block if n_active_send_sms is None else ir.as_expr(n_active_send_sms)
    return sm, n


def published_count_word(cfg, w):
    """Whether count word ``w = e * R + src`` is one a source publishes: ``w < E`` whose
    source ``src < n_sources``. Under ``skip_a2a`` with ``n_ranks > 1`` only the rank-0
    column ``w % R == 0`` is (the rank coordinate is forced to 0); the other words stay
    the sentinel and count 0."""
    lay = cfg.layout
    cond = w < cfg.n_experts
    if lay.n_sources < cfg.n_ranks:
        cond = cond & ((w % cfg.n_ranks) < lay.n_sources)
    return cond
