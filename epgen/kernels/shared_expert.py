"""``fused_shared_expert`` in the fused dispatch kernel: this
rank's own tokens become group 0 of the grouped output (reference page:
``pack_shared_expert_inputs``).

Readiness, fixing a race of the reference: there each *monitor* block bumps ``send_buf_ready``
(Region F) and the packers wait for ``n_signal_sms`` bumps. A monitor finishes only after the
routed copies of its expert, so a token that is routed to no waited-on expert (every token
without a local expert under ``skip_a2a``) could be packed before it is staged. Here every
*send* (comm) block bumps F once it has staged all of its tokens (``publish_send_buf_ready``:
the role's barrier, then thread 0's ``red.release.gpu.global.add.u32``), and the packers wait
until F equals ``n_send_sms = grid - n_signal_sms`` (``ld.acquire.gpu`` poll), so every row of
the send buffer is staged before any packer reads it, with or without ``skip_a2a``.

Both sides run only when the slice is not empty (``T_se > 0``): then there is at least one
packer, and the last packer to start (Region G, ``atom.relaxed.gpu.add``) re-arms F and G
for the next call; every packer has passed its F wait before G reaches that count.
"""

from __future__ import annotations

import ir
from ir import AtomOp, CmpOp, Scope, Sem
from ir import types as T

from .common import comm_sync, exit_if_aborted
from .common import word as _word


def se_token_slice(r: ir.RoleBuilder, cfg, n_tokens, my_rank, allreduce_world_size=None):
    """``(row0, T_se)``: the first token and the count of this rank's shared-expert slice
    (``reference.se_slice``). Without ``skip_a2a`` every token, ``(0, n_tokens)``; under
    ``skip_a2a`` the slice of ``allreduce_world_size`` ``W`` (a u32 launch argument; 0 is
    taken as 1): ``row0 = r*(T//W) + min(r, T%W)``, ``T_se = (T + W - r - 1) // W``."""
    if not cfg.skip_a2a:
        return ir.Const(0, T.u32), ir.as_expr(n_tokens)
    if allreduce_world_size is None:
        raise ValueError("fused_shared_expert with skip_a2a: the shared-expert slice needs "
                         "allreduce_world_size (a launch argument)")
    w = r.let("se_world", ir.as_expr(allreduce_world_size).max(1))
    rank = r.let("se_rank", ir.as_expr(my_rank))
    row0 = r.let("se_row0", rank * (n_tokens // w) + rank.min(n_tokens % w))
    t_se = r.let("se_tokens", ir.Select(rank < w, (n_tokens + w - rank - 1) // w,
                                        ir.Const(0, T.u32)))
    return row0, t_se


def send_buf_ready_ptr(cfg, wait_counters):
    """Region F (``send_buf_ready``) in the dispatch_wait counters; Region G follows it."""
    return _word(wait_counters, cfg.layout.send_buf_ready_offset)


def publish_send_buf_ready(r: ir.RoleBuilder, cfg, wait_counters, t_se):
    """Comm (send) block, after ``copy_and_send_tokens`` staged all its tokens: when
    ``T_se > 0``, the role's barrier, then thread 0 bumps ``send_buf_ready`` with
    ``red.release.gpu.global.add.u32`` (the barrier orders every thread's send-buffer stores
    before it)."""
    with r.if_(ir.as_expr(t_se) > 0):
        comm_sync(r)
        with r.if_(r.tid.eq(0)):
            r.red(AtomOp.ADD, send_buf_ready_ptr(cfg, wait_counters), 1, Sem.RELEASE,
                  Scope.GPU)


def pack_shared_expert_inputs(r: ir.RoleBuilder, cfg, *, send_rows, output_tokens,
                              fused_se_counter, shared_expert_token_count, pack_sm_id,
                              n_active_comm_sms, n_send_sms, err_buf):
    """Copy the shared expert's ``T_se`` tokens (``shared_expert_token_count``), already in
    wire format in the send buffer from ``send_rows`` (row ``row0``), to output rows
    ``[0, T_se)`` (group 0). ``n_pack = min(n_tiles, n_active_comm_sms)`` blocks take part
    (``pack_sm_id < n_pack``; the others skip it, no early exit). Thread 0 waits (bounded,
    ``ld.acquire.gpu``) until ``send_buf_ready`` (``fused_se_counter[0]``) equals
    ``n_send_sms``, counts itself started (``fused_se_counter[1]``, ``atom.relaxed.gpu.add``;
    the last starter re-arms both words), the role's barrier; then tiles ``pack_sm_id,
    pack_sm_id + n_pack, ...`` of the dispatch_wait tile size, warp ``w`` copying tile tokens
    ``w, w + n_warps, ...`` with the format's ``copy_msg_to_output`` (no top-k extraction:
    ``src_info`` of these rows is not written)."""
    fmt, lay = cfg.token_fmt, cfg.layout
    TT = fmt.dispatch_wait_tile_shape[0]   # the format copies whole rows: no k splits here
    t_se = r.let("se_count", ir.as_expr(shared_expert_token_count))
    n_tiles = r.let("se_tiles", (t_se + (TT - 1)) // TT)
    n_pack = r.let("se_packers", n_tiles.min(n_active_comm_sms))
    ready, started = fused_se_counter, _word(fused_se_counter, 1)
    with r.if_(ir.as_expr(pack_sm_id) < n_pack):
        with r.if_(r.tid.eq(0)):
            r.spin_wait(ready, T.u32, CmpOp.EQ, n_send_sms, buffer="send_buf_ready",
                        index=lay.send_buf_ready_offset, sem=Sem.ACQUIRE, scope=Scope.GPU,
                        backoff_ns=32)
            old = r.atomic(AtomOp.ADD, started, 1, Sem.RELAXED, Scope.GPU, name="se_started")
            with r.if_(old.eq(n_pack - 1)):
                r.store(ready, 0)
                r.store(started, 0)
        comm_sync(r)
        exit_if_aborted(r, err_buf)
        with r.for_range("se_tile", pack_sm_id, n_tiles, n_pack) as tile:
            ts = r.let("se_ts", tile * TT)
            n_in_tile = r.let("se_n", (t_se - ts).min(TT))
            with r.for_range("se_j", r.warp, n_in_tile, r.n_threads // 32) as j:
                row = r.let("se_row", ts + j)
                msg = r.let("se_msg", send_rows + row.cast(T.u64) * lay.send_buf_row_bytes)
                fmt.emit_copy_msg_to_output(r, msg, row, output_tokens)


__all__ = ["se_token_slice", "send_buf_ready_ptr", "publish_send_buf_ready",
           "pack_shared_expert_inputs"]
