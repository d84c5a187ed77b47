"""``epgen bench --world shmem``: each process of ``epgen launch`` (or torchrun) is one PE and
times its own rank of a ``ShmemWorld``; rank 0 combines every PE's timings.

Method
------
* **Worlds.** One NVSHMEM session per process (``ShmemSession``). One world per
  ``p2p_world_size`` of the plan (``--compare-p2p P,Q``: every one of the list, one after the
  other on the same session, each closed before the next is built; else the configuration's
  alone), sized for the largest shape, so every shape runs on it.
* **Inputs.** Per shape every PE draws every rank's tokens and top-k ids from ``--seed``
  (uniform routing) and loads its own; with ``--op combine|moe`` also every rank's router
  weights (``combine.weights``).
* **Checks** (unless ``--no-post-check``). The first call of each shape goes through the
  world's API: ``dispatch`` against this rank's part of ``reference.dispatch`` and, for
  combine and moe, ``combine`` of expert rows that name their slot (the row of slot
  ``(t, k)`` of source ``s`` is source ``s``'s token ``t`` rotated by ``k`` elements, built
  from each row's ``src_info``, so rows in any order within a block are right) against
  ``reference.combine`` for this source. Every PE hears every PE's verdict (a gather), so
  all stop together when one failed. After the timing: the last call's dispatch and, BF16,
  its combine (transform-free rows) again. Above ``combine.PREFILL_CHECK_TOKENS`` tokens per
  rank each combine check computes that many of this source's tokens, spread evenly
  (``combine.check_tokens``; the whole reference combine of a prefill shape takes tens of
  seconds).
* **Timing** (as the dispatch of this world was always timed): per call, this PE loads its
  inputs, records an event on its stream, enqueues the timed work, records an event, waits
  for its stream (``world.check``: the timeout records), then meets the others at the host
  barrier that the world needs between calls (outside the timed span). ``dispatch``: the
  round trip (dispatch_async + dispatch_wait); ``combine``: the combine alone, the call's
  round trip enqueued before the first event (untimed: the event follows it on the stream);
  ``moe``: the round trip and the combine. The combine is transform-free as on the other
  worlds: the PE's expert-output buffer is pointed at its grouped dispatch output, so each
  received row goes back as it came and nothing is copied between calls (a quantising
  format's rows are not BF16: there the check's rows stay in the buffer and go back each
  call, the same bytes). ``--warmup`` untimed calls (default 5), then the median of
  ``--iters`` (default 50). No gate: the events are on the PE's own stream, recorded behind
  its previous work, so host enqueue time shows only where the stream ran dry.
* **Extra combines** (``--combine-fp8``, ``--combine-partial``; ``--op combine``): after
  the plain combine's figure of a shape, each one (``combine.CombineArm``) goes the same
  way on the same world (``measure_arm``): a round trip and its combine through the API
  with the arm's flags (the partial-reduce combine's round trip carries this rank's
  weights, which it weighs with) checked against ``reference.combine`` with them, every PE
  hearing every verdict; then the same timed calls, the arm's kernels launched; then the
  same check after them. Its bytes sent: the FP8 row (``link_bytes.combine_row_bytes``),
  or one BF16 row per (token, remote rank), per remote slot. Its figure sits under its key
  of the shape's entry, with its speed-up over the plain combine (slowest PE).
* **Combining the PEs** (rank 0, after a gather of every PE's times): per shape and world,
  each PE's median, and the median over calls of the slowest PE's time of each call (the
  calls line up: every PE passes the same barrier between them), which is the figure the
  table and the comparison use. GB/s per PE: the bytes a PE sends to other PEs (dispatch:
  one message per remote (token, k) slot; combine: one BF16 row per remote
  (token, k)), the mean over PEs, over that median.
* **Comparison** (``--compare-p2p``): per shape, each world's figure against the largest
  ``p2p_world_size``'s, as "x of direct stores" = its median / this one's (1.0: as fast;
  0.2: five times slower), for the slowest PE and for each PE alone.

Output: each PE prints its own line per shape and world (``rank R: ...``, prefixed by the
launcher); rank 0 then prints the combined table and the comparison, and writes ``--json``.
The pure parts (bytes, expert rows, the combination, the comparison, the report) are tested
on the CPU (tests/unit/test_bench_shmem.py), the measurement on simulated PEs
(tests/sim/test_bench_shmem_sim.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import sys

import numpy as np

from backends import cuda

from .. import reference, routing
from ..reference_combine import source_of_rows
from ..runtime.shmem_session import ShmemSession
from ..runtime.shmem_world import ShmemWorld
from ..combine_layout import CombineLayout
from ..inspection import combine_buffers
from . import combine as bench_combine
from . import copy_rate
from . import memory
from .link_bytes import SLOT_ENTRY_BYTES, combine_row_bytes, dispatch_row_bytes
from .p2p import slowest_rank_times
from .plan import shape_name
from .report import Progress, git_commit, write_json
from .timing import summarize

OP_LABELS = {"dispatch": "round trip", "combine": "combine", "moe": "dispatch + combine"}
"""What each ``--op`` times, as the lines name it."""
TIMING = ("per PE on its own stream: an event before and after the timed launches, the "
          "stream then waited for and a host barrier of every PE between calls (untimed); "
          "no gate; the slowest PE per call, median over calls")


# ---- pure: bytes, expert rows ---------------------------------------------------------------------
def sent_bytes(cfg, topk_ids, rank: int) -> int:
    """Bytes rank ``rank`` sends to other ranks: one message per (token, k) slot whose
    expert is on another rank (``-1`` slots send nothing), each as the send path writes it
    (``link_bytes.dispatch_row_bytes``); under ``ep_rank_dedup`` one message per (token,
    other rank) holding one of the token's experts plus each such slot's index and slot-table
    words (``link_bytes.SLOT_ENTRY_BYTES``)."""
    L = cfg.layout.n_local_experts
    ids = np.asarray(topk_ids)
    remote = (ids >= 0) & (ids // L != rank)
    slots = int(np.count_nonzero(remote))
    if not cfg.ep_rank_dedup:
        return slots * dispatch_row_bytes(cfg)
    pairs = sum(len(set((row[hit] // L).tolist())) for row, hit in zip(ids, remote))
    return pairs * dispatch_row_bytes(cfg) + slots * SLOT_ENTRY_BYTES


def copy_messages(cfg, all_topk_ids) -> int:
    """``--copy-rate``: the messages each PE copies, the bytes the busiest PE's dispatch
    sends (``sent_bytes``) in whole messages of ``msg_bytes`` (at least one)."""
    busiest = max(sent_bytes(cfg, all_topk_ids[r], r) for r in range(cfg.n_ranks))
    return max(1, busiest // cfg.layout.msg_bytes)


def combine_sent_bytes(cfg, all_topk_ids, rank: int, *, fp8: bool = False,
                       partial_reduce: bool = False) -> int:
    """Bytes rank ``rank`` sends back to other ranks in the combine: one BF16 row of
    ``hid_dim`` per (token, k) of another source routed to one of its experts; ``fp8``:
    the FP8 combine's row instead (``link_bytes.combine_row_bytes``, as this transport
    writes it); ``partial_reduce``: one row per token of another source with at least one
    of its experts."""
    L = cfg.layout.n_local_experts
    n = 0
    for s, ids in enumerate(all_topk_ids):
        if s == rank:
            continue
        mine = np.asarray(ids) // L == rank
        n += int(np.count_nonzero(mine.any(axis=1) if partial_reduce else mine))
    return n * combine_row_bytes(cfg.token_fmt.hid_dim, fp8, cfg.needs_shmem)


def op_sent_bytes(cfg, all_topk_ids, rank: int, op: str) -> int:
    """Bytes rank ``rank`` sends to other ranks in one ``op``: the dispatch's
    (``sent_bytes``), the combine's (``combine_sent_bytes``), or both (``moe``)."""
    n = 0
    if op in ("dispatch", "moe"):
        n += sent_bytes(cfg, all_topk_ids[rank], rank)
    if op in ("combine", "moe"):
        n += combine_sent_bytes(cfg, all_topk_ids, rank)
    return n


def symmetric_bytes(cfg, op: str, arms: tuple = ()) -> int:
    """Bytes of NVSHMEM's symmetric heap one PE's world of ``cfg`` allocates (docs/shmem.md):
    the buffers peers write or puts read (``memory.world_memory``'s send and receive buffers,
    counts, grouped output, header and prod buffers) and, for combine and moe, the combine's
    receive buffer (with its guard), arrival words and expert outputs; with the extra
    combines ``arms`` (``combine.CombineArm``) the FP8 combine's receive buffer and send
    staging, the partial-reduce combine's send staging (``runtime.combine_partial``). The heap
    (``NVSHMEM_SYMMETRIC_SIZE``) must hold it; NVSHMEM's own allocations come on top."""
    per_rank = memory.world_memory(cfg)["per_rank"]
    n = sum(per_rank[k] for k in ("send_buf", "recv_buf", "recv_count", "out_tokens",
                                  "hdr_buf", "prod_buf"))
    if op != "dispatch":
        b = combine_buffers(cfg)["bytes_per_rank"]
        n += b["combine_recv_buf"] + b["combine_recv_guard"] + 2 * b["combine_arrival"] + \
            b["combine_expert_out"]
    if any(a.fp8 for a in arms):
        clay = CombineLayout(cfg)
        n += clay.fp8_recv_bytes + clay.fp8_stage_bytes
    if any(a.partial_reduce for a in arms) and cfg.needs_shmem:
        n += cfg.layout.max_out_rows * 2 * cfg.token_fmt.hid_dim
    return n


def expert_rows(result, tokens, only_source: int | None = None) -> np.ndarray:
    """A destination's expert outputs for ``result`` (its ``reference.RankResult``): the row
    of slot ``(t, k)`` of source ``s`` is ``tokens[s][t]`` rotated by ``k`` elements (BF16
    bits), so it names its slot whatever the order of the rows; rows of no source (padding,
    shared-expert rows) and, with ``only_source``, rows of the other sources are zero."""
    src = source_of_rows(result)
    H = np.asarray(tokens[0]).shape[1]
    out = np.zeros((len(src), H), np.uint16)
    info = np.asarray(result.src_info)
    for s in np.unique(src[src >= 0]) if only_source is None else [only_source]:
        rows = np.flatnonzero(src == s)
        x = np.asarray(tokens[s])
        for k in np.unique(info[rows, 1]):
            mine = rows[info[rows, 1] == k]
            out[mine] = np.roll(x[info[mine, 0]], int(k), axis=1)
    return out


# ---- one PE's measurement -------------------------------------------------------------------------
def _combine_check(cfg, got, ref, rows, weights, me: int, what: str, flags=None) -> list[str]:
    """This PE's combine ``got`` against ``reference.combine`` of source ``me`` (``rows``:
    every destination's expert rows; ``flags``: an extra combine's): every token, or above
    ``combine.PREFILL_CHECK_TOKENS`` tokens ``combine.check_tokens`` of them. Its problems."""
    n = len(weights[me])
    picked = bench_combine.check_tokens(n) if n > bench_combine.PREFILL_CHECK_TOKENS else None
    want = reference.combine(cfg, ref, rows, weights, sources=[me],
                             tokens=None if picked is None else {me: picked},
                             **(flags or {}))[me]
    got = np.asarray(got)
    return _combine_problems(got if picked is None else got[picked], want, what)


def _combine_problems(got, want, what: str) -> list[str]:
    if got.shape != want.shape:
        return [f"{what}: combine shape {got.shape}, expected {want.shape}"]
    bad = int(np.count_nonzero(got != want))
    return [f"{what}: combine differs from the reference in {bad} elements"] if bad else []


def _time_calls(world, comb, op: str, x, ids, iters: int, warmup: int) -> list[float]:
    """The timed calls of this PE (module docstring, "Timing"): ``iters`` times in ms."""
    rk = world.ranks[0]
    checked = None if comb is None else comb.program
    times = []
    for i in range(warmup + iters):
        world.load_inputs(x, ids)
        if op == "combine":
            world.enqueue_round_trip()            # untimed: the start event follows it
        start = cuda.record(rk.stream)
        if op != "combine":
            world.enqueue_round_trip()
        if comb is not None:
            comb.enqueue()
        end = cuda.record(rk.stream)
        world.check_with(checked, f"benchmark {op}")
        world.barrier("bench")
        if i >= warmup:
            times.append(cuda.elapsed_ms(start, end))
    return times


def measure_shape(world, plan, T: int, tokens, topk_ids, weights, *,
                  exchange=lambda verdict: [verdict]) -> dict:
    """This PE's figure of ``plan.op`` at ``T`` tokens per rank on ``world`` (module
    docstring): ``tokens``, ``topk_ids`` (and for combine and moe ``weights``) of every
    rank. ``exchange(problems)`` returns every PE's list of check problems (a gather; the
    default: this PE's alone). Returns ``{"rank", "sent_bytes", "check", "post_check",
    "times_ms"}``; without ``times_ms`` when a PE's check failed (every PE stops then). Each
    extra combine of the plan (``ShmemPlan.arms``) adds its own ``{"sent_bytes", "check",
    "post_check", "times_ms"}`` under its key (``measure_arm``), timed after the plain
    figure."""
    cfg, me, op = world.cfg, world.rank, plan.op
    ref = reference.dispatch(cfg, tokens, topk_ids) if plan.check else None
    out = {"rank": me, "sent_bytes": op_sent_bytes(cfg, topk_ids, me, op)}
    got = world.dispatch(tokens[me], topk_ids[me])
    problems = [] if ref is None else reference.compare(cfg, ref[me], got)[:3]
    comb = None
    if op != "dispatch":
        y = world.combine(expert_rows(got, tokens), weights[me])
        comb = world.combiner()
        if ref is not None and not problems:
            problems += _combine_check(cfg, y, ref, [expert_rows(r, tokens, me) for r in ref],
                                       weights, me, f"rank {me}")
    out["check"] = _agree(exchange, problems, ref is not None)
    if out["check"].startswith("FAILED"):
        return out
    _time_and_recheck(world, comb, plan, T, op, out, tokens, topk_ids, weights, ref)
    for arm in plan.arms:
        out[arm.key] = measure_arm(world, plan, T, arm, tokens, topk_ids, weights, ref,
                                   exchange)
        if "times_ms" not in out[arm.key]:
            break
    return out


def measure_arm(world, plan, T: int, arm, tokens, topk_ids, weights, ref, exchange) -> dict:
    """This PE's figure of an extra combine (``combine.CombineArm``: the FP8 or the
    partial-reduce combine) after the plain one, the same way (module docstring): a round
    trip through the API (carrying this rank's weights for the partial-reduce combine,
    which weighs with them; the timed calls keep the weights buffer it loads), the arm's
    combine of it through the API checked against ``reference.combine`` with the arm's
    flags (every PE hears every verdict), then the timed calls and the check after them.
    Its ``sent_bytes``: ``combine_sent_bytes`` with the arm's flags."""
    cfg, me = world.cfg, world.rank
    out = {"sent_bytes": combine_sent_bytes(cfg, topk_ids, me, **arm.flags)}
    carried = weights[me] if arm.partial_reduce else None
    got = world.dispatch(tokens[me], topk_ids[me], topk_weights=carried)
    y = world.combine(expert_rows(got, tokens), arm.call_weights(weights[me]), **arm.flags)
    problems = []
    if ref is not None:
        problems = _combine_check(cfg, y, ref, [expert_rows(r, tokens, me) for r in ref],
                                  weights, me, f"rank {me} {arm.name}", arm.flags)
    out["check"] = _agree(exchange, problems, ref is not None)
    if not out["check"].startswith("FAILED"):
        _time_and_recheck(world, world.combiner(), plan, T, "combine", out, tokens, topk_ids,
                          weights, ref, arm.flags)
    return out


def _agree(exchange, problems: list, checked: bool) -> str:
    """Every PE's verdict on a check (``exchange``: a gather of each PE's ``problems``):
    "FAILED: ..." naming the PEs that failed, else "ok" (or "skipped" when not
    ``checked``)."""
    everyone = exchange(problems)
    failed = [f"rank {r}: {'; '.join(p)}" for r, p in enumerate(everyone) if p]
    if failed:
        return "FAILED: " + " | ".join(failed)
    return "ok" if checked else "skipped"


def _time_and_recheck(world, comb, plan, T: int, op: str, out: dict, tokens, topk_ids,
                      weights, ref, flags=None) -> None:
    """The timed calls of ``op`` into ``out["times_ms"]`` (``comb``'s combine
    transform-free, its own expert-output buffer back after them), then with ``ref`` the
    last call's dispatch and combine (``flags``: an extra combine's) against the reference
    into ``out["post_check"]``."""
    cfg, me = world.cfg, world.rank
    fixed = cfg.token_fmt.name != "BF16"
    saved = None
    if comb is not None and not fixed:
        saved = comb.bufs[0].expert_out
        comb.bufs[0].expert_out = world.ranks[0].out_tokens      # transform-free
    try:
        out["times_ms"] = _time_calls(world, comb, op, tokens[me], topk_ids[me], plan.iters,
                                      plan.warmup)
        if ref is not None:
            late = reference.compare(cfg, ref[me], world.results()[0])[:3]
            why_not = None if comb is None else (
                "fixed rows of a quantising format" if fixed else None)
            if comb is not None and why_not is None:
                late += _combine_check(cfg, comb.finish()[0], ref, [r.out_tokens for r in ref],
                                       weights, me, "last call", flags)
            out["post_check"] = "FAILED: " + "; ".join(late) if late else (
                "ok" if why_not is None else f"dispatch ok; combine not checked ({why_not})")
    finally:
        if saved is not None:
            comb.bufs[0].expert_out = saved


# ---- combining the PEs ----------------------------------------------------------------------------
def path_name(p2p_world_size: int, n_ranks: int) -> str:
    """How a world of ``p2p_world_size`` reaches the other PEs."""
    if p2p_world_size >= n_ranks:
        return "direct stores"
    if p2p_world_size == 1:
        return "SHMEM puts"
    return f"stores in groups of {p2p_world_size}, puts between"


def combine_pes(per_pe: list[dict], p2p_world_size: int, n_ranks: int, T: int,
                arms: tuple = ()) -> dict:
    """One shape and world from every PE's ``measure_shape`` (rank order): each PE's median,
    the slowest PE per call (``summary``), the checks; each extra combine of ``arms``
    (``combine.CombineArm``) that every PE timed, the same under its key, with its
    speed-up (``arm.speedup_key``: the plain combine's median over its own)."""
    keys = {a.key for a in arms}
    entry = {"p2p_world_size": p2p_world_size, "path": path_name(p2p_world_size, n_ranks),
             "tokens_per_rank": T, "shape": shape_name(T)}
    entry.update(_figure([{k: v for k, v in r.items() if k not in keys} for r in per_pe]))
    for arm in arms:
        if not all(arm.key in r for r in per_pe):
            continue
        fig = entry[arm.key] = _figure([{"rank": r["rank"], **r[arm.key]} for r in per_pe],
                                       f" ({arm.key})")
        if "error" in fig:
            entry.setdefault("error", fig["error"])
        if "summary" in fig and "summary" in entry and fig["summary"]["median_ms"]:
            entry[arm.speedup_key] = entry["summary"]["median_ms"] / \
                fig["summary"]["median_ms"]
    return entry


def _figure(per_pe: list[dict], what: str = "") -> dict:
    """One timed thing of every PE (``rank``, ``sent_bytes``, ``check``, ``post_check``,
    ``times_ms``): ``per_pe`` without the times and with each PE's summary, ``summary``
    (the slowest PE per call), ``gbps_per_pe`` and the first failed check (``error``)."""
    out = {"per_pe": [{k: v for k, v in r.items() if k != "times_ms"} for r in per_pe]}
    failed = [r["check"] + what for r in per_pe if r["check"].startswith("FAILED")] + \
        [f"rank {r['rank']} after timing{what}: {r['post_check']}" for r in per_pe
         if r.get("post_check", "").startswith("FAILED")]
    if failed:
        out["error"] = failed[0]
    if all("times_ms" in r for r in per_pe):
        for pe, r in zip(out["per_pe"], per_pe):
            pe.update(summarize(r["times_ms"]))
        out["summary"] = summarize(slowest_rank_times([r["times_ms"] for r in per_pe]))
        ms = out["summary"]["median_ms"]
        out["gbps_per_pe"] = statistics.fmean(r["sent_bytes"] for r in per_pe) / ms / 1e6 \
            if ms else None
    return out


def comparisons(runs: list[dict], reference_size: int) -> list[dict]:
    """Per shape, each world's figure against the ``reference_size`` world's (module
    docstring, "Comparison"): ``of_reference`` = reference median / its median, for the
    slowest PE and per PE (``per_pe_of_reference``)."""
    out = []
    for T in dict.fromkeys(r["tokens_per_rank"] for r in runs):
        same = [r for r in runs if r["tokens_per_rank"] == T and "summary" in r]
        ref = next((r for r in same if r["p2p_world_size"] == reference_size), None)
        if ref is None:
            continue
        for r in same:
            if r is ref:
                continue
            med, rmed = r["summary"]["median_ms"], ref["summary"]["median_ms"]
            out.append({"tokens_per_rank": T, "shape": shape_name(T),
                        "p2p_world_size": r["p2p_world_size"], "path": r["path"],
                        "reference_p2p_world_size": reference_size,
                        "reference_path": ref["path"],
                        "median_us": 1e3 * med, "reference_median_us": 1e3 * rmed,
                        "of_reference": rmed / med,
                        "per_pe_of_reference": [b["median_ms"] / a["median_ms"] for a, b in
                                                zip(r["per_pe"], ref["per_pe"])]})
    return out


# ---- report ---------------------------------------------------------------------------------------
def rank_line(entry: dict, rank: int, op: str, n_ranks: int) -> str:
    """This PE's line of one shape and world (the line ``epgen bench --world shmem`` has
    always printed per rank, for each op)."""
    pe = entry["per_pe"][rank]
    head = (f"rank {rank}: {entry['tokens_per_rank']} tokens/rank, {n_ranks} PEs "
            f"(p2p_world_size={entry['p2p_world_size']})")
    if "median_ms" not in pe:
        return f"{head}: {pe['check']}"
    gbs = pe["sent_bytes"] / (pe["median_ms"] * 1e-3) / 1e9
    return (f"{head}: {OP_LABELS[op]} median {pe['median_ms'] * 1e3:.1f} us, min "
            f"{pe['min_ms'] * 1e3:.1f} us over {pe['n']} calls, {gbs:.2f} GB/s sent")


def arm_line(entry: dict, rank: int, arm, n_ranks: int) -> str | None:
    """This PE's line of an extra combine (``combine.CombineArm``) of one shape and world,
    as ``rank_line``'s, with its speed-up over the plain combine; None when it did not
    run."""
    fig = entry.get(arm.key)
    if fig is None:
        return None
    line = rank_line({**entry, **fig}, rank, "combine", n_ranks).replace(
        f": {OP_LABELS['combine']} median", f": {arm.key} median", 1)
    x = entry.get(arm.speedup_key)
    return line + ("" if x is None else f" ({x:.2f}x the {arm.versus}, slowest PE)")


def arms_of(plan: dict) -> tuple:
    """The extra combines a run's plan (``ShmemPlan.describe``) timed."""
    return bench_combine.extra_arms(plan.get("combine_fp8", False),
                                    plan.get("combine_partial", False))


def of_label(reference_size: int, n_ranks: int) -> str:
    """How the comparison names the world it compares with."""
    if reference_size >= n_ranks:
        return "of direct stores"
    return f"of p2p_world_size={reference_size}"


def format_table(results: dict) -> str:
    """Rank 0's table: per shape and world, the slowest PE's median, the range of the PEs'
    medians, GB/s sent per PE and, with a comparison, the fraction of the reference."""
    n, ref = results["n_pes"], results["plan"]["reference_size"]
    compare = len(results["plan"]["p2p_sizes"]) > 1
    ratios = {(c["tokens_per_rank"], c["p2p_world_size"]): c["of_reference"]
              for c in results["comparisons"]}
    head = (f"{'shape':<8} {'T':>5} {'p2p':>4} {'path':<28} {'median us':>10} "
            f"{'PE medians us':>17} {'GB/s/PE':>8}")
    if compare:
        head += f"  x {of_label(ref, n)}"
    lines = [head]
    for r in results["runs"]:
        cells = f"{r['shape']:<8} {r['tokens_per_rank']:>5} {r['p2p_world_size']:>4} " \
                f"{r['path']:<28}"
        if "summary" not in r:
            lines.append(f"{cells} {'-':>10}  ({r.get('error', 'not timed')})")
            continue
        meds = [pe["median_ms"] * 1e3 for pe in r["per_pe"]]
        cells += (f" {r['summary']['median_ms'] * 1e3:>10.1f} "
                  f"{f'{min(meds):.1f}-{max(meds):.1f}':>17} "
                  f"{r['gbps_per_pe'] or 0:>8.2f}")
        if compare:
            x = 1.0 if r["p2p_world_size"] == ref else \
                ratios.get((r["tokens_per_rank"], r["p2p_world_size"]))
            cells += f"  {'-' if x is None else f'{x:.3f}x'}"
        lines.append(cells)
        lines += _arm_rows(r, arms_of(results["plan"]))
    return "\n".join(lines)


def _arm_rows(run: dict, arms: tuple) -> list[str]:
    """The table's row of each extra combine of ``run`` that was timed: its slowest PE's
    median, the PEs' range, GB/s sent per PE and its speed-up over the plain combine."""
    rows = []
    for arm in arms:
        fig = run.get(arm.key, {})
        if "summary" not in fig:
            continue
        meds = [pe["median_ms"] * 1e3 for pe in fig["per_pe"]]
        x = run.get(arm.speedup_key)
        rows.append(f"{'':<8} {'':>5} {'':>4} {'  ' + arm.key:<28} "
                    f"{fig['summary']['median_ms'] * 1e3:>10.1f} "
                    f"{f'{min(meds):.1f}-{max(meds):.1f}':>17} "
                    f"{fig['gbps_per_pe'] or 0:>8.2f}"
                    + ("" if x is None else f"  {x:.2f}x the {arm.versus}"))
    return rows


def comparison_lines(results: dict) -> list[str]:
    """One sentence per comparison: both medians and the ratio."""
    n, op = results["n_pes"], results["op"]
    out = []
    for c in results["comparisons"]:
        per_pe = ", ".join(f"{x:.2f}" for x in c["per_pe_of_reference"])
        out.append(f"T={c['tokens_per_rank']} {OP_LABELS[op]}: p2p_world_size="
                   f"{c['p2p_world_size']} ({c['path']}) {c['median_us']:.1f} us against "
                   f"p2p_world_size={c['reference_p2p_world_size']} "
                   f"({c['reference_path']}) {c['reference_median_us']:.1f} us: "
                   f"{c['of_reference']:.2f}x {of_label(c['reference_p2p_world_size'], n)} "
                   f"(per PE {per_pe})")
    return out


def print_report(results: dict, file=None) -> None:
    """Rank 0's report: the header, the table, the comparisons, the failures."""
    file = file or sys.stdout
    dirty = "+dirty" if results.get("git_dirty") else ""
    mps = results.get("mps_thread_percentage")
    print(f"epgen bench --world shmem --op {results['op']}  {results['date']}  commit "
          f"{results['git_commit']}{dirty}  {results['n_pes']} PEs, {results['device']}"
          + (f", MPS {mps}% per PE" if mps else ""), file=file)
    print(f"timed {TIMING}; {results['plan']['iters']} calls after "
          f"{results['plan']['warmup']}", file=file)
    print(format_table(results), file=file)
    for line in comparison_lines(results):
        print(line, file=file)
    for entry in results.get("copy_rate", ()):
        print(copy_rate.report_line(entry["tokens_per_rank"], entry), file=file)
    for f in results["failures"]:
        print(f"FAILED: {f}", file=file)


def time_copy_rate(world, plan, T: int, ids, exchange, results: dict, out) -> bool:
    """``--copy-rate`` at ``T`` tokens per rank on ``world`` (``copy_rate.measure`` of
    ``copy_messages``): its entry into ``results["copy_rate"]``, its line on ``out``, its
    failed checks into ``results["failures"]``. Returns whether every check passed."""
    entry = copy_rate.measure(world, copy_messages(world.cfg, ids), plan.iters, plan.warmup,
                              exchange)
    entry = {"tokens_per_rank": T, "p2p_world_size": world.cfg.p2p_world_size, **entry}
    results["copy_rate"].append(entry)
    print(copy_rate.report_line(T, entry), file=out, flush=True)
    bad = copy_rate.failures(entry)
    results["failures"] += [f"T={T}: {f}" for f in bad]
    return not bad


# ---- the run --------------------------------------------------------------------------------------
def _gather(session):
    """``exchange`` over the session's bootstrap: every PE's JSON-able value, rank order."""
    def exchange(value):
        data = session.bootstrap.all_gather_bytes(json.dumps(value).encode(), "bench")
        return [json.loads(b) for b in data]
    return exchange


def run(plan, *, session=None, json_path: str | None = None, out=None) -> dict:
    """Time ``plan`` (a ``plan.ShmemPlan``) on this PE (module docstring); every PE gets
    the combined results, rank 0 prints them and writes ``json_path``. ``session``: the
    NVSHMEM session to run on (default: a new one, closed at the end). Returns the results
    (``failures``: empty when every check passed)."""
    out = sys.stdout if out is None else out
    commit, dirty = git_commit()
    results = {"world": "shmem", "op": plan.op, "n_pes": plan.base.n_ranks,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "git_commit": commit, "git_dirty": dirty, "command": sys.argv,
               "mps_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
               "plan": {**plan.describe(), "reference_size": plan.reference_size},
               "symmetric_bytes_per_pe": max(symmetric_bytes(plan.config(p), plan.op,
                                                             plan.arms)
                                             for p in plan.sizes),
               "nvshmem_symmetric_size": os.environ.get("NVSHMEM_SYMMETRIC_SIZE"),
               "method": {"timing": TIMING, "inputs": "one uniform routing per shape",
                          "sent_bytes": "dispatch: a message per remote (token, k) slot "
                                        "(ep_rank_dedup: per (token, remote rank), plus "
                                        "two 4-byte words per slot); combine: a BF16 row "
                                        "per remote (token, k) (combine_fp8: its FP8 "
                                        "row; combine_partial: a BF16 row per (token, "
                                        "remote rank))"},
               "runs": [], "failures": [], "copy_rate": []}
    with contextlib.ExitStack() as stack:
        if session is None:
            session = stack.enter_context(ShmemSession(n_ranks=plan.base.n_ranks))
        me = session.rank
        progress = Progress(total=1 + (len(plan.sizes) + plan.copy_rate) * len(plan.tokens))
        step = progress.step if me == 0 else (lambda msg: None)
        exchange = _gather(session)
        step(f"{plan.base.n_ranks} PEs; each world needs "
             f"{results['symmetric_bytes_per_pe'] / 2**30:.2f} GiB of symmetric heap per PE "
             f"(NVSHMEM_SYMMETRIC_SIZE="
             f"{results['nvshmem_symmetric_size'] or 'unset: NVSHMEM default 1 GiB'})")
        for p in plan.sizes:
            cfg = plan.config(p)
            with ShmemWorld(cfg, session=session, arch=plan.arch) as world:
                results["device"] = getattr(world.device, "name", "unknown")
                for T in plan.tokens:
                    step(f"p2p_world_size={p}, T={T}: {OP_LABELS[plan.op]}")
                    rng = np.random.default_rng(plan.seed)
                    toks, ids = routing.routing(rng, cfg, T)
                    w = bench_combine.weights(cfg, T, plan.seed) if plan.op != "dispatch" \
                        else None
                    mine = measure_shape(world, plan, T, toks, ids, w, exchange=exchange)
                    entry = combine_pes(exchange(mine), p, cfg.n_ranks, T, plan.arms)
                    results["runs"].append(entry)
                    print(rank_line(entry, me, plan.op, cfg.n_ranks), file=out, flush=True)
                    for arm in plan.arms:
                        line = arm_line(entry, me, arm, cfg.n_ranks)
                        if line is not None:
                            print(line, file=out, flush=True)
                    if "error" in entry:
                        results["failures"].append(f"p2p_world_size={p}, T={T}: "
                                                   f"{entry['error']}")
                    if "summary" not in entry or any(
                            "summary" not in entry.get(a.key, {}) for a in plan.arms):
                        break
                    if plan.copy_rate and p == min(plan.sizes):
                        step(f"p2p_world_size={p}, T={T}: copy rate")
                        if not time_copy_rate(world, plan, T, ids, exchange, results, out):
                            break
            if results["failures"]:
                break
    results["comparisons"] = comparisons(results["runs"], plan.reference_size)
    if me == 0:
        if json_path:
            write_json(results, json_path)
            progress(f"wrote {json_path}")
        print_report(results, file=out)
    return results
