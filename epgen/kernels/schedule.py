"""The SM schedule of dispatch_wait (``sm_schedule_offset``): which local
expert each copy block starts on, in proportion to the experts' token counts.

The rule (``sm_schedule`` is its numpy model; ``fill_sm_schedule`` builds the same integer
arithmetic in the aux block)::

    n      = min(copy blocks (grid - 1), the table's n_sms entries)
    c[e]   = routed tokens of local expert e;  C = sum(c);  Z = #{e : c[e] > 0}
    X      = max(n - Z, 0)                              spare blocks, shared by token count
    before = sum(c[:e]);  first(e) = #{e' < e : c[e'] > 0} + (X * before) // C
    blocks(e) = [c[e] > 0] + (X * (before + c[e])) // C - (X * before) // C
    table[b] = e  for b in [first(e), first(e) + blocks(e)) clipped to [0, n); else 0

So every expert with tokens gets at least one block, zero-token experts get none, the spare
blocks go where the tokens are, and the table is non-decreasing with ``table[0]`` the first
expert that has tokens (0 when no expert has any).

Copy blocks (``claim_next_tile``): block ``b`` starts on ``table[b]`` and claims that expert's
tiles as before (``atom.acquire.gpu.add`` on its tile counter); once a claim comes back past the
expert's last tile it moves on to the next later expert that still has unclaimed tiles (warp 0
probes 32 experts at once: region B totals and ``ld.relaxed.gpu`` of their tile counters). Each
tile id of an expert is handed out by exactly one ``fetch_add``, so no tile is copied twice; and
block 0 starts at or before every expert with tokens and walks through all later ones until each
is exhausted, so every tile is claimed: coverage is exact for any table that is non-decreasing
from ``table[0] <= `` the first expert with tokens (tests/sim/test_schedule.py simulates it).
"""

from __future__ import annotations

import numpy as np

import ir
from ir import AtomOp, Scope, Sem, ShflMode
from ir import types as T

from .common import block_inclusive_scan, lowest_set_bit
from .common import word as _word


def sm_schedule(expert_counts, n_blocks: int, n_entries: int | None = None) -> np.ndarray:
    """Numpy model of the table: ``expert_counts`` [L] routed tokens per local expert,
    ``n_blocks`` copy blocks (grid - 1); returns int32 [n_entries] (default ``n_blocks``)."""
    c = np.asarray(expert_counts, dtype=np.int64)
    n_entries = n_blocks if n_entries is None else n_entries
    n = min(n_blocks, n_entries)
    table = np.zeros(n_entries, dtype=np.int32)
    total = int(c.sum())
    if total == 0:
        return table
    nz = c > 0
    z = int(nz.sum())
    spare = max(n - z, 0)
    before = np.cumsum(c) - c
    nz_before = np.cumsum(nz) - nz
    lo = (spare * before) // total
    hi = (spare * (before + c)) // total
    first = nz_before + lo
    count = nz.astype(np.int64) + hi - lo
    for e in np.flatnonzero(nz):
        table[min(first[e], n):min(first[e] + count[e], n)] = e
    return table


def fill_sm_schedule(r: ir.RoleBuilder, cfg, ctr, S, warp_totals, n_copy_blocks=None):
    """Aux block: write the ``n_sms``-entry table at ``ctr + sm_schedule_offset`` words from
    the inclusive prefix ``S`` (shared, one u32 per count word ``e*R + src``). Every thread of
    the role takes part: a zero fill of the table, a block scan of "expert has tokens" (three
    ``comm_sync``, reusing ``warp_totals``), then thread ``e < L`` stores its expert's blocks.
    The caller's barrier before the ready flag's ``st.release.gpu`` publishes the table.
    ``n_copy_blocks``: the copy blocks (a u32 value; default ``grid - 1``), of which the
    first ``n_sms`` get entries."""
    lay = cfg.layout
    L, R, E = lay.n_local_experts, cfg.n_ranks, cfg.n_experts
    table = _word(ctr, lay.sm_schedule_offset)
    tid = r.tid
    with r.for_range("sched_z", tid, cfg.n_sms, r.n_threads) as b:
        r.store(_word(table, b), 0)
    c_before = r.var("c_before", T.u32, 0)
    c_e = r.var("c_e", T.u32, 0)
    with r.if_(tid < L):
        with r.if_(tid > 0):
            r.assign(c_before, r.load(_word(S, tid * R - 1), T.u32, name="s_before"))
        r.assign(c_e, r.load(_word(S, tid * R + (R - 1)), T.u32, name="s_incl") - c_before)
    has = r.let("has_tokens", ir.Cast(T.u32, c_e > 0))
    n_warps = r.n_threads // 32
    nz_incl = block_inclusive_scan(r, has, warp_totals, n_warps, "nz")
    with r.if_(has.ne(0)):
        z = r.load(_word(warp_totals, n_warps - 1), T.u32, name="n_nonzero")
        total = r.load(_word(S, E - 1), T.u32, name="c_total").cast(T.u64)
        n_copy = r.n_blocks - 1 if n_copy_blocks is None else ir.as_expr(n_copy_blocks)
        n = r.let("n_copy", n_copy.min(cfg.n_sms))
        spare = r.let("spare", ir.Select(n > z, n - z, ir.Const(0, T.u32)).cast(T.u64))
        lo = r.let("sched_lo", ((spare * c_before.cast(T.u64)) // total).cast(T.u32))
        hi = r.let("sched_hi", ((spare * (c_before + c_e).cast(T.u64)) // total).cast(T.u32))
        first = r.let("sched_first", nz_incl - 1 + lo)
        with r.for_range("sched_b", first, (first + 1 + hi - lo).min(n)) as b:
            r.store(_word(table, b), tid)


def first_expert(r: ir.RoleBuilder, cfg, ctr, sm_id=None) -> ir.Var:
    """This copy block's first expert: ``table[sm_id]`` (``sm_id`` the block's index among the
    copy blocks, default the block index; a block past the table's ``n_sms`` entries starts
    on expert 0, which is always a correct start)."""
    lay = cfg.layout
    sm = r.block if sm_id is None else ir.as_expr(sm_id)
    e0 = r.var("sched_e0", T.u32, 0)
    with r.if_(sm < cfg.n_sms):
        r.assign(e0, r.load(_word(ctr, lay.sm_schedule_offset + sm), T.u32,
                            name="sched_ld"))
    return e0


def expert_tiles(total, tile_tokens: int, k_splits: int):
    """Tile ids of an expert with ``total`` tokens: ``ceil(total / TT) * KS``."""
    n = (total + (tile_tokens - 1)) // tile_tokens
    return n * k_splits if k_splits > 1 else n


def claim_next_tile(r: ir.RoleBuilder, cfg, ctr, cur_e: ir.Var, cur_tiles: ir.Var,
                    claim: ir.Var, name: str = "claim"):
    """Warp 0 of a copy block (all 32 lanes, warp-uniform): claim the next tile, starting on
    expert ``cur_e`` (``cur_tiles`` its tile count), moving on to later experts when it is
    exhausted. On return ``cur_e`` is the expert (``L``: no work left), ``claim`` the tile id
    and ``cur_tiles`` that expert's tile count."""
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R = lay.n_local_experts, cfg.n_ranks
    TT, KS = fmt.dispatch_wait_tile_shape
    work = _word(ctr, lay.work_counter_offset)
    totals = _word(ctr, lay.rank_prefix_offset + (R - 1))
    found = r.var(f"{name}_found", T.pred, ir.Const(0, T.pred))
    with r.while_(~found & (cur_e < L)):
        got = r.var(f"{name}_got", T.u32, 0)
        with r.if_(r.lane.eq(0)):
            r.assign(got, r.atomic(AtomOp.ADD, _word(work, cur_e), 1, Sem.ACQUIRE, Scope.GPU,
                                   name=f"{name}_old"))
        r.assign(claim, r.shfl(ShflMode.IDX, got, 0, name=f"{name}_b"))
        with r.if_(claim < cur_tiles):
            r.assign(found, ir.Const(1, T.pred))
        with r.else_():
            # probe the later experts, 32 per step, for one with unclaimed tiles
            nxt = r.var(f"{name}_next", T.u32, cur_e + 1)
            r.assign(cur_e, L)
            with r.while_(nxt < L):
                ej = r.let(f"{name}_ej", nxt + r.lane)
                tot = r.var(f"{name}_tot", T.u32, 0)
                has = r.var(f"{name}_has", T.pred, ir.Const(0, T.pred))
                with r.if_(ej < L):
                    r.assign(tot, r.load(_word(totals, ej * R), T.u32, name=f"{name}_tl"))
                    seen = r.load(_word(work, ej), T.u32, Sem.RELAXED, Scope.GPU,
                                  name=f"{name}_seen")
                    r.assign(has, seen < expert_tiles(tot, TT, KS))
                mask = r.ballot(has, name=f"{name}_mask")
                with r.if_(mask.ne(0)):
                    first = lowest_set_bit(r, mask, f"{name}_lsb")
                    r.assign(cur_e, nxt + first)
                    r.assign(cur_tiles, expert_tiles(
                        r.shfl(ShflMode.IDX, tot, first, name=f"{name}_tot_b"), TT, KS))
                    r.break_()
                r.assign(nxt, nxt + 32)


def load_expert_tiles(r: ir.RoleBuilder, cfg, ctr, e) -> ir.Expr:
    """Tile count of local expert ``e`` from its region B total (``e < L``)."""
    lay, fmt = cfg.layout, cfg.token_fmt
    TT, KS = fmt.dispatch_wait_tile_shape
    tot = r.load(_word(ctr, lay.rank_prefix_offset + e * cfg.n_ranks + (cfg.n_ranks - 1)),
                 T.u32, name="e_total")
    return expert_tiles(tot, TT, KS)


__all__ = ["sm_schedule", "fill_sm_schedule", "first_expert", "claim_next_tile",
           "expert_tiles", "load_expert_tiles"]
