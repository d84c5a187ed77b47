"""The P2P benchmark (``epgen bench --world p2p``, docs/multi-gpu.md): epgen's dispatch round trip
on a ``P2PWorld`` (one GPU per rank), against the NVLink bandwidth and against
``torch.distributed`` NCCL all-to-all plus a permute of the same job, all in one run.
``--op combine|moe``: the combine alone or dispatch + combine (``epgen.bench.combine``),
timed the same way and against the same NVLink bandwidth by the bytes they move over the
links (``link_bytes``); no NCCL baseline for them.

Method
------
* **Shapes, variants, inputs**: as the emulated benchmark (``epgen.bench``): each shape is a
  number of tokens per rank, each variant a set of flag overrides; ``sets`` input sets staged
  on each rank's GPU and rotated; the output checked against the numpy reference before and
  (unless ``--no-post-check``) after timing.
* **Timing, the same for epgen and NCCL** (``TIMING``): every sample starts from an idle
  device and includes the host's enqueue time, with no spin-kernel gate, because the NCCL job
  cannot be gated (its split sizes go through the host, so the host waits for the device in
  the middle of the job). epgen: the host waits for every rank stream, then CUDA events
  around a fork/join over the rank streams (a timing stream on the first rank's GPU that
  every rank's stream waits on and that waits on every rank's stream: cross-GPU event waits,
  ``runner.measure_world(host_sync=True)``); NCCL as below. The median of ``iters`` samples
  after ``warmup``. (The emulated benchmark gates its samples instead: device time only.)
* **NVLink reference** (``measure_peer_copy``, behind the gate unless ``--no-gate``: copies
  alone, no host work inside): ``copy_mib`` MiB copied between GPUs with
  ``cuMemcpyAsync`` (buffers in peer-accessible pools, peer access enabled, so the copy
  engines move it over the direct peer path): ``pair``, GPU ``d0`` to ``d1`` alone; ``ring``,
  every GPU sending to the next at once (each GPU sends and receives one copy, as in the
  all-to-all). Bandwidth per GPU = bytes one GPU sends / time; the ring's is the reference.
* **Bytes per GPU** (``link_bytes``): what crosses the links: each (token, k) message whose
  destination is another rank, as the send path writes it (``link_bytes.dispatch_row_bytes``:
  the message, or under ``ep_final_layout`` an output row, its scales and its header;
  under ``ep_rank_dedup`` one message per (token, destination rank) plus a 4-byte index
  word per (token, k)), counted per source (sent) and per destination (received);
  the busiest GPU's larger count over the inputs sets bounds the time; the combine sends each
  remote (token, k)'s BF16 row back (``combine_row_bytes``, the other way), moe both. GB/s
  per GPU = those bytes / the op's time (1 GB = 1e9 B); fraction = that / the ring's
  bandwidth per GPU. The goal: >= 0.8 at prefill.
* **NCCL baseline** (``nccl_dispatch``; ``nccl_phase``): one spawned process per rank
  (``multiprocessing``, spawn: CUDA cannot be forked), one NCCL process group (``torch.distributed``, file
  store), each rank on its GPU with the same input sets (written by this process, read by
  the workers). One round trip, what a PyTorch user writes: sort the (token, k) pairs by
  expert (one stable argsort), gather the rows (``index_select``), ``all_to_all_single`` of
  the [R, L] counts, the split sizes to the host (``tolist``: ``all_to_all_single`` takes them
  on the host), ``all_to_all_single`` of the rows, then the permute into (local expert,
  source) groups (one stable argsort of the received rows' experts, one ``index_select``).
  Timed with CUDA events per rank after a ``dist.barrier()`` and a synchronise (so host time,
  which the host sync makes part of the job, is included, as in epgen's samples); an
  iteration's time is the slowest rank's; the median over iterations. Rows move as BF16 (the input), whatever the
  epgen variant's format. Checked: one rank's grouping of set 0 against the reference.
  Speed-up = NCCL time / epgen time; the goal: > 1 at both shapes.
* **Fewer than 2 GPUs**: nothing runs; the results say why (``skipped``).

The pure parts (``link_bytes``, ``gpu_rates``, ``slowest_rank_times``,
``alltoall_permute_numpy``, the NCCL job's numpy twin, and the report) are tested on the CPU
(tests/sim/test_bench_p2p.py); the device parts need several GPUs (docs/multi-gpu.md).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import traceback

import numpy as np

from .. import presets, reference
from ..formats import BF16Format
from ..inspection import combine_buffers
from . import combine, common, inputs, memory, report, runner
from .baseline import compare_grouping
from .memory import fmt_gb
from .plan import Plan, shape_name
from .report import Progress, git_commit, write_json
from .timing import Gate, fork_join, sample, summarize
from .link_bytes import SLOT_ENTRY_BYTES, dispatch_row_bytes, rank_counts
from .traffic import combine_bytes, op_bytes, round_trip_bytes

NCCL_NAME = "torch NCCL all_to_all+permute"
MIN_GPUS = 2
OP_LABELS = {"dispatch": "round trip", "combine": "combine", "moe": "dispatch + combine"}
"""What each ``--op`` times, as the progress lines, the report and the plot name it."""
PLOT_TITLES = {"dispatch": "dispatch round trip", "combine": "combine",
               "moe": "dispatch + combine"}
NO_COMBINE_BASELINE = ("no NCCL baseline for --op combine|moe: the NCCL job times the "
                       "dispatch only")


# ---- pure: bytes, rates, the NCCL job's numpy twin --------------------------------------------
def link_row_bytes(cfg) -> int:
    """Bytes one routed (token, k) sends to another GPU: a message (staged layout), or an
    output row, its scales and its header row (``ep_final_layout``), as the build's send path
    writes them (``link_bytes.dispatch_row_bytes``)."""
    return dispatch_row_bytes(cfg)


def combine_row_bytes(cfg) -> int:
    """Bytes the combine sends back to another GPU per routed (token, k): its BF16 expert
    output row (whatever the dispatch format)."""
    return cfg.token_fmt.hid_dim * 2


def pair_counts(cfg, topk_ids) -> np.ndarray:
    """``[R, R]``: routed (token, k) pairs each source rank sends to each destination rank
    (``-1`` slots nowhere; ``link_bytes.rank_counts``)."""
    return rank_counts(cfg, topk_ids)[0]


def dispatch_bytes_matrix(cfg, topk_ids) -> np.ndarray:
    """``[R, R]``: dispatch bytes each source rank writes on each destination rank: a
    message (``link_row_bytes``) per routed (token, k); under ``ep_rank_dedup`` one per
    (token, destination rank) holding one of the token's experts plus each (token, k)'s
    index and slot-table words (``link_bytes.SLOT_ENTRY_BYTES``)."""
    slots, ranks = rank_counts(cfg, topk_ids)
    if cfg.ep_rank_dedup:
        return ranks * link_row_bytes(cfg) + slots * SLOT_ENTRY_BYTES
    return slots * link_row_bytes(cfg)


def link_bytes(cfg, topk_ids, op: str = "dispatch") -> dict:
    """Bytes crossing the GPU links in one ``op`` of ``topk_ids`` (one ``[T, K]`` array per
    rank): ``sent[r]`` (rank r to other ranks), ``received[r]``, ``local`` (to itself, no
    link), ``busiest`` (the largest sent or received count of one GPU). ``dispatch``: the
    round trip's messages (``dispatch_bytes_matrix``: under ``ep_rank_dedup`` one per (token,
    destination rank) and two words per slot, index and slot table); ``combine``: each
    routed (token, k)'s BF16 row back from its destination to its source (``combine_row_bytes``); ``moe``: both."""
    if op not in ("dispatch", "combine", "moe"):
        raise ValueError(f"link_bytes: op must be dispatch, combine or moe, got {op!r}")
    R = cfg.n_ranks
    row, crow = link_row_bytes(cfg), combine_row_bytes(cfg)
    moved = np.zeros((R, R), np.int64)          # [writer, owner of the memory written]
    if op in ("dispatch", "moe"):
        moved += dispatch_bytes_matrix(cfg, topk_ids)
    if op in ("combine", "moe"):
        moved += pair_counts(cfg, topk_ids).T * crow      # destination -> source
    local = np.diag(moved).copy()
    sent, received = moved.sum(axis=1) - local, moved.sum(axis=0) - local
    return {"row_bytes": row, "combine_row_bytes": crow, "sent": sent.tolist(),
            "received": received.tolist(), "local": local.tolist(),
            "total_remote": int(sent.sum()),
            "busiest": int(max(sent.max(initial=0), received.max(initial=0)))}


def sets_link_bytes(cfg, sets, op: str = "dispatch") -> dict:
    """``link_bytes`` averaged over the input sets (the timing rotates them): ``busiest`` and
    ``mean_sent`` (a GPU's mean sent bytes), plus each set's."""
    per = [link_bytes(cfg, ids, op) for _toks, ids in sets]
    return {"row_bytes": per[0]["row_bytes"],
            "busiest": float(np.mean([p["busiest"] for p in per])),
            "mean_sent": float(np.mean([np.mean(p["sent"]) for p in per])),
            "per_set": per}


def gpu_rates(nbytes: dict, ms: float, link_gbps: float | None) -> dict:
    """GB/s per GPU of a round trip of ``ms`` moving ``nbytes`` (``sets_link_bytes``): the
    busiest GPU's and the mean, and the busiest's fraction of ``link_gbps``."""
    if not ms:
        return {"busiest_gpu_gbps": None, "mean_gpu_gbps": None, "fraction_of_link": None}
    busiest = nbytes["busiest"] / ms / 1e6
    return {"busiest_gpu_gbps": busiest, "mean_gpu_gbps": nbytes["mean_sent"] / ms / 1e6,
            "fraction_of_link": busiest / link_gbps if link_gbps else None}


def slowest_rank_times(per_rank) -> list[float]:
    """Per iteration, the slowest rank's time (every rank's list has one entry per
    iteration): the time of the collective round trip."""
    lists = [list(t) for t in per_rank]
    if not lists or len({len(t) for t in lists}) != 1:
        raise ValueError(f"ranks report different iteration counts: {[len(t) for t in lists]}")
    return [max(col) for col in zip(*lists)]


def bf16_config(cfg):
    """``cfg`` with BF16 tokens of the same width: what the NCCL baseline moves."""
    fmt = cfg.token_fmt
    if isinstance(fmt, BF16Format):
        return cfg
    return cfg.replace(token_fmt=BF16Format(hid_dim=fmt.hid_dim, top_k=fmt.top_k))


def nccl_rank_result(cfg, rank: int, rows, recv_counts, src_info) -> reference.RankResult:
    """``reference.RankResult`` of one destination of the NCCL job: ``rows`` grouped by
    (local expert, source), ``recv_counts [R, L]`` (source, local expert), ``src_info``
    ``[n, 2]`` (token, k)."""
    counts = np.asarray(recv_counts, dtype=np.int64).T
    L = counts.shape[0]
    return reference.RankResult.from_outputs(
        cfg, rank, np.asarray(rows), cfg.token_fmt.pad_row_offsets(counts.sum(axis=1)),
        np.arange(L, dtype=np.int32), np.asarray(src_info, dtype=np.int32),
        counts.astype(np.int32))


def _send_side(cfg, x, ids):
    """One source's half of the job (numpy twin of the start of ``nccl_dispatch``)."""
    R, L, K = cfg.n_ranks, cfg.layout.n_local_experts, cfg.token_fmt.top_k
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    order = np.argsort(flat, kind="stable")
    send = np.asarray(x)[order // K]
    cnt = np.bincount(flat, minlength=R * L).reshape(R, L)
    tk = np.stack([order // K, order % K], axis=1)
    offs = np.concatenate([[0], np.cumsum(cnt.sum(axis=1))])
    return send, cnt, tk, offs


def alltoall_permute_numpy(cfg, tokens, topk_ids) -> list[reference.RankResult]:
    """The NCCL baseline's job on the host, step for step as ``nccl_dispatch`` does it on the
    GPUs (the all-to-alls as concatenations): a ``RankResult`` per destination."""
    R, L = cfg.n_ranks, cfg.layout.n_local_experts
    sends = [_send_side(cfg, x, ids) for x, ids in zip(tokens, topk_ids)]
    out = []
    for d in range(R):
        recv_cnt = np.stack([cnt[d] for _s, cnt, _tk, _o in sends])              # [src, L]
        recv = np.concatenate([s[o[d]:o[d + 1]] for s, _c, _tk, o in sends])
        rtk = np.concatenate([tk[o[d]:o[d + 1]] for _s, _c, tk, o in sends])
        eid = np.repeat(np.tile(np.arange(L), R), recv_cnt.reshape(-1))
        perm = np.argsort(eid, kind="stable")
        out.append(nccl_rank_result(cfg, d, recv[perm], recv_cnt, rtk[perm]))
    return out


# ---- the NCCL job on the GPUs --------------------------------------------------------------------
def nccl_dispatch(torch, dist, cfg, x, ids, with_src_info: bool = False):
    """One round trip of the NCCL baseline on this process's rank (module docstring):
    ``x [T, H]`` bf16, ``ids [T, K]`` int64 on this rank's GPU. Returns (grouped rows,
    ``recv_counts [R, L]``, ``src_info [n, 2]`` int32 or None). Mirrors
    ``alltoall_permute_numpy`` line by line."""
    R, L, K = dist.get_world_size(), cfg.layout.n_local_experts, cfg.token_fmt.top_k
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    send = torch.index_select(x, 0, order // K)
    cnt = torch.bincount(flat, minlength=R * L).view(R, L)
    recv_cnt = torch.empty_like(cnt)
    dist.all_to_all_single(recv_cnt, cnt)
    in_splits = cnt.sum(dim=1).tolist()                  # host sync: the API takes lists
    out_splits = recv_cnt.sum(dim=1).tolist()
    recv = x.new_empty((sum(out_splits), x.shape[1]))
    dist.all_to_all_single(recv, send, out_splits, in_splits)
    eid = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(R),
                                  recv_cnt.reshape(-1))
    perm = torch.argsort(eid, stable=True)
    rows = torch.index_select(recv, 0, perm)
    src = None
    if with_src_info:
        tk = torch.stack([order // K, order % K], dim=1).to(torch.int32)
        rtk = tk.new_empty((sum(out_splits), 2))
        dist.all_to_all_single(rtk, tk, out_splits, in_splits)
        src = torch.index_select(rtk, 0, perm)
    return rows, recv_cnt, src


def _nccl_worker(job: dict, rank: int, tmp: str) -> None:
    """One rank of the NCCL baseline (a spawned process): writes ``rank<r>.json`` (times or
    the error) and, for the check rank, ``check.npz``."""
    out = {"rank": rank}
    dist = None
    try:
        import torch
        import torch.distributed as dist

        cfg = presets.config_from_dict(job["config"])
        dev = torch.device("cuda", job["devices"][rank])
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp, "store"),
                                rank=rank, world_size=cfg.n_ranks)
        staged = []
        for i in range(job["sets"]):
            x = np.load(os.path.join(tmp, f"set{i}_tokens{rank}.npy"))
            a = np.load(os.path.join(tmp, f"set{i}_ids{rank}.npy"))
            staged.append((torch.from_numpy(x.view(np.int16)).to(dev).view(torch.bfloat16),
                           torch.from_numpy(a.astype(np.int64)).to(dev)))
        rows, cnt, src = nccl_dispatch(torch, dist, cfg, *staged[0], with_src_info=True)
        torch.cuda.synchronize()
        if rank == job["check_rank"]:
            np.savez(os.path.join(tmp, "check.npz"),
                     rows=rows.view(torch.int16).cpu().numpy().view(np.uint16),
                     counts=cnt.cpu().numpy(), src_info=src.cpu().numpy())
        del rows, cnt, src
        times = []
        for i in range(job["warmup"] + job["iters"]):
            x, a = staged[i % len(staged)]
            dist.barrier()
            torch.cuda.synchronize()
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            e0.record()
            nccl_dispatch(torch, dist, cfg, x, a)
            e1.record()
            e1.synchronize()
            if i >= job["warmup"]:
                times.append(e0.elapsed_time(e1))
        out["times_ms"] = times
        out["torch"] = torch.__version__
        out["nccl"] = str(torch.cuda.nccl.version())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        try:
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        with open(os.path.join(tmp, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f)


def nccl_phase(plan: Plan, T: int, sets, devices, progress, timeout_s: float = 900.0) -> dict:
    """Run the NCCL baseline of shape ``T`` on ``sets`` in one spawned process per rank; its
    round-trip summary (the slowest rank per iteration) and the check of
    ``plan.check_rank``."""
    import multiprocessing

    cfg = bf16_config(plan.config(T))
    out = {"name": NCCL_NAME}
    iters, warmup = plan.iters_for(T), plan.warmup_for(T)
    with tempfile.TemporaryDirectory(prefix="epgen-nccl-") as tmp:
        for i, (toks, ids) in enumerate(sets):
            for r in range(cfg.n_ranks):
                np.save(os.path.join(tmp, f"set{i}_tokens{r}.npy"), np.asarray(toks[r]))
                np.save(os.path.join(tmp, f"set{i}_ids{r}.npy"), np.asarray(ids[r]))
        job = {"config": presets.config_to_dict(cfg), "devices": list(devices),
               "sets": len(sets), "iters": iters, "warmup": warmup,
               "check_rank": plan.check_rank}
        progress(f"  nccl: {cfg.n_ranks} processes, {warmup} warm-up + {iters} iterations")
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_nccl_worker, args=(job, r, tmp), daemon=True)
                 for r in range(cfg.n_ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        reports = []
        for r in range(cfg.n_ranks):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    reports.append(json.load(f))
            else:
                reports.append({"rank": r, "error": "no report (the process died)"})
        errors = [f"rank {x['rank']}: {x['error']}" for x in reports if "error" in x]
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout_s:.0f} s (killed)")
        if errors:
            out["error"] = "; ".join(errors)
            progress(f"  nccl FAILED: {out['error']}")
            return out
        out["versions"] = {"torch": reports[0]["torch"], "nccl": reports[0]["nccl"]}
        out["per_rank_median_ms"] = [float(np.median(x["times_ms"])) for x in reports]
        out["round_trip"] = summarize(slowest_rank_times([x["times_ms"] for x in reports]))
        chk = np.load(os.path.join(tmp, "check.npz"))
        got = nccl_rank_result(cfg, plan.check_rank, chk["rows"], chk["counts"],
                               chk["src_info"])
    want = reference.dispatch(cfg, *sets[0])[plan.check_rank]
    diffs = compare_grouping(cfg, want, got)
    out["check"] = "ok" if not diffs else "FAILED: " + "; ".join(diffs[:3])
    out["check_against"] = f"reference, rank {plan.check_rank}, set 0"
    progress(f"  nccl: {1e3 * out['round_trip']['median_ms']:.1f} us, check {out['check']}")
    return out


# ---- the NVLink reference -----------------------------------------------------------------------
def measure_peer_copy(devices, mib: int, iters: int, gate=None, warmup: int = 3) -> dict:
    """Peer-copy bandwidth per GPU (module docstring): ``pair`` (first GPU to the second
    alone) and ``ring`` (every GPU to the next at once); ``gbps_per_gpu`` is the ring's."""
    from backends import cuda
    from backends.cuda import compat
    devs = list(dict.fromkeys(devices))
    n = mib << 20
    drv = compat.driver()
    pools = {d: cuda.peer_memory_resource(d, [e for e in devs if e != d]) for d in devs}
    src = {d: cuda.zeros(n, np.uint8, device=d, memory_resource=pools[d]) for d in devs}
    dst = {d: cuda.zeros(n, np.uint8, device=d, memory_resource=pools[d]) for d in devs}
    streams = {d: cuda.create_stream(d) for d in devs}
    for d in devs:
        cuda.get_device(d).sync()
    ts = cuda.create_stream(devs[0])

    def copy(a, b):                     # GPU a's stream pushes a's source into b's buffer
        with cuda.using_device(a):
            cuda.check(drv.cuMemcpyAsync(dst[b].ptr, src[a].ptr, n, streams[a].handle),
                       "cuMemcpyAsync")

    def timed(pairs):
        used = [streams[a] for a, _b in pairs]
        return sample(lambda i: fork_join(ts, used, gate,
                                          lambda: [copy(a, b) for a, b in pairs]),
                      iters, warmup, gate)

    res = {"bytes_per_gpu": n, "size_mib": mib, "devices": devs}
    for name, pairs in (("pair", [(devs[0], devs[1])]),
                        ("ring", [(d, devs[(k + 1) % len(devs)]) for k, d in enumerate(devs)])):
        s = summarize(timed(pairs))
        s["gbps_per_gpu"] = n / s["median_ms"] / 1e6
        res[name] = s
    res["gbps_per_gpu"] = res["ring"]["gbps_per_gpu"]
    for d in devs:
        streams[d].sync()
    return res


# ---- the run --------------------------------------------------------------------------------------
def p2p_devices(plan: Plan) -> tuple[int, ...]:
    """The GPU of each rank: ``plan.devices``, else rank r on GPU r."""
    return tuple(plan.devices) if plan.devices else tuple(range(plan.base.n_ranks))


def skip_reason(plan: Plan, n_gpus: int) -> str | None:
    """Why the P2P benchmark cannot run on a machine of ``n_gpus`` GPUs (None: it can)."""
    devices = p2p_devices(plan)
    if n_gpus < MIN_GPUS:
        return (f"the P2P benchmark needs at least {MIN_GPUS} GPUs, this machine has "
                f"{n_gpus}")
    if len(set(devices)) < MIN_GPUS:
        return f"--devices {','.join(map(str, devices))} uses fewer than {MIN_GPUS} GPUs"
    if max(devices) >= n_gpus:
        return (f"needs {max(devices) + 1} GPUs for {plan.base.n_ranks} ranks "
                f"(devices {','.join(map(str, devices))}), this machine has {n_gpus}")
    return None


def rank_memory(plan: Plan, cfg, T: int) -> int:
    """Device bytes one rank of a ``P2PWorld`` of ``cfg`` needs on its GPU: its buffers
    (``memory.world_memory``), its staged input sets and, for ``--op combine|moe``, its
    combine buffers (``inspection.combine_buffers``)."""
    need = memory.world_memory(cfg)["per_rank_total"] + \
        memory.staged_inputs_memory(cfg, T, plan.sets) // max(cfg.n_ranks, 1)
    if plan.op != "dispatch":
        need += combine_buffers(cfg)["bytes_per_rank"]["combine_total"]
    return need


def gpu_memory_shortfalls(plan: Plan, cfg, T: int, devices) -> dict:
    """Per GPU of ``devices`` (the GPU of each rank), the bytes a ``P2PWorld`` of ``cfg``
    with its staged input sets needs there (``rank_memory`` times the ranks the GPU holds)
    when that is more than ``plan.mem_fraction`` of the GPU's free memory:
    ``{gpu: (need, free)}``, empty when everything fits."""
    per_rank = rank_memory(plan, cfg, T)
    out = {}
    for gpu in sorted(set(devices)):
        need = per_rank * list(devices).count(gpu)
        free, _total = memory.mem_info(gpu)
        if need > plan.mem_fraction * free:
            out[gpu] = (need, free)
    return out


def variant_phase(plan: Plan, T: int, variant, sets, need: int, cap: int, devices,
                  link_gbps, progress, w=None) -> dict:
    """Build, check and time one variant's ``P2PWorld`` on ``sets``, as the NCCL baseline
    is timed: from an idle device, host enqueue included, no gate (module docstring).
    ``plan.op`` combine or moe: ``combine.measure_world`` with the router weights ``w``,
    timed the same way."""
    from ..runtime.p2p_world import P2PWorld
    cfg = plan.config(T, variant, cap)
    nbytes = sets_link_bytes(cfg, sets, plan.op)
    key = combine.PRIMARY[plan.op]
    rt = round_trip_bytes(cfg, T)
    out = {"label": variant.label, "spec": variant.spec, "config": cfg.describe(),
           "bytes": rt if plan.op == "dispatch" else {
               **rt, "combine": combine_bytes(cfg, T), "total": op_bytes(cfg, T, plan.op)},
           "link_bytes": {
               k: v for k, v in nbytes.items() if k != "per_set"},
           "memory": {"per_gpu": rank_memory(plan, cfg, T)}}
    if cap < need:
        out["skipped"] = (f"--block-capacity {cap} is smaller than the largest (expert, "
                          f"source) block of the routings ({need})")
        progress(f"  epgen {variant.label} skipped: {out['skipped']}")
        return out
    short = gpu_memory_shortfalls(plan, cfg, T, devices)
    if short:
        out["skipped"] = "; ".join(
            f"GPU {g} needs {fmt_gb(n)}, more than {plan.mem_fraction:.0%} of its "
            f"{fmt_gb(f)} free" for g, (n, f) in short.items())
        progress(f"  epgen {variant.label} skipped: {out['skipped']}")
        return out
    opts = variant.world_options
    if opts.get("batched"):
        out["error"] = "batched: one launch for every rank needs the ranks on one GPU " \
                       "(EmulatedWorld); a P2P world launches on each rank's GPU"
        progress(f"  epgen {variant.label} FAILED: {out['error']}")
        return out
    def world():
        return P2PWorld(cfg, arch=plan.arch, devices=devices, fused=opts.get("fused"))
    try:
        if plan.op == "dispatch":
            r = runner.measure_world(cfg, sets, plan.iters_for(T), plan.warmup_for(T), None,
                                     arch=plan.arch, post_check=plan.post_check,
                                     progress=progress, graph=opts.get("graph", False),
                                     host_sync=True, world_factory=world)
        else:
            r = combine.measure_world(cfg, sets, w, plan.iters_for(T), plan.warmup_for(T),
                                      None, op=plan.op, arch=plan.arch,
                                      post_check=plan.post_check, progress=progress,
                                      graph=opts.get("graph", False), host_sync=True,
                                      world_factory=world)
    except Exception as exc:  # noqa: BLE001 - reported; the other variants still run
        out["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"  epgen {variant.label} FAILED: {out['error']}")
        return out
    r[key].update(gpu_rates(nbytes, r[key]["median_ms"], link_gbps))
    out.update(r)
    m = r[key]
    frac = m.get("fraction_of_link")
    progress(f"  epgen {variant.label}: check {r['check']}, {OP_LABELS[plan.op]} "
             f"{1e3 * m['median_ms']:.1f} us, busiest GPU {m['busiest_gpu_gbps']:.1f} GB/s"
             + (f" ({frac:.3f} of the peer copy)" if frac is not None else ""))
    return out


def run_shape(plan: Plan, T: int, devices, torch, link_gbps, progress) -> dict:
    out = {"shape": shape_name(T), "tokens_per_rank": T, "routing": plan.routing,
           "zipf_s": plan.zipf_s if plan.routing == "zipf" else None,
           "iters": plan.iters_for(T), "warmup": plan.warmup_for(T)}
    progress.step(f"T={T} ({out['shape']}): {plan.sets} input sets, NCCL baseline")
    sets = inputs.make_input_sets(plan.config(T), T, plan.sets, plan.routing, plan.zipf_s,
                                  plan.seed)
    need, cap = inputs.block_capacity(plan.block_capacity, sets, plan.base.n_experts, T)
    out["largest_block"], out["recv_block_capacity"] = need, cap
    b = {"name": NCCL_NAME}
    w = combine.weights(plan.config(T), T, plan.seed) if plan.op != "dispatch" else None
    if plan.op != "dispatch":
        b["skipped"] = NO_COMBINE_BASELINE
    elif not plan.baseline:
        b["skipped"] = "--no-baseline"
    elif torch is None:
        b["skipped"] = "torch with CUDA is not available"
    else:
        try:
            b = nccl_phase(plan, T, sets, devices, progress)
        except Exception as exc:  # noqa: BLE001 - reported; the rest still runs
            b["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"  nccl FAILED: {b['error']}")
    if "round_trip" in b:   # GB/s by the staged BF16 job's link bytes, as epgen's default
        nb = sets_link_bytes(bf16_config(plan.config(T, None, cap)), sets)
        b["link_bytes"] = {k: v for k, v in nb.items() if k != "per_set"}
        b["round_trip"].update(gpu_rates(nb, b["round_trip"]["median_ms"], link_gbps))
    out["baseline"] = b
    out["variants"] = []
    for v in plan.variants:
        progress.step(f"T={T}: epgen {v.label} on GPUs {','.join(map(str, devices))}")
        r = variant_phase(plan, T, v, sets, need, cap, devices, link_gbps, progress, w)
        if "round_trip" in r and "round_trip" in b:
            r["speedup_vs_baseline"] = b["round_trip"]["median_ms"] / r["round_trip"]["median_ms"]
        out["variants"].append(r)
    return out


#: how the P2P benchmark times epgen and the NCCL baseline (the same way: module docstring)
TIMING = ("from an idle device, host enqueue included, no gate, median over iterations: "
          "epgen after the host waited for every rank stream, CUDA events around a fork/join "
          "over the rank streams (cross-GPU); NCCL per rank after a dist.barrier() and a "
          "synchronise, CUDA events around the job, the slowest rank per iteration")


def failures(results) -> list[str]:
    """Errors and failed checks (skipped phases are not failures)."""
    return common.failures(results, baseline="nccl")


def run(plan: Plan, progress: Progress) -> dict:
    """The P2P benchmark of ``plan`` (``plan.world == "p2p"``)."""
    from backends import cuda
    from backends.cuda.errors import CudaUnavailableError

    from ..runtime.p2p_world import check_peer_access
    if not cuda.gpu_available():
        raise CudaUnavailableError("no usable CUDA GPU here (backends.cuda.gpu_available() is "
                                   "False); run the P2P benchmark on a machine with several "
                                   "NVIDIA GPUs")
    commit, dirty = git_commit()
    devices = p2p_devices(plan)
    n_gpus = cuda.device_count()
    results = {
        "world": "p2p", "op": plan.op,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty, "command": sys.argv,
        "gpus": n_gpus, "devices": list(devices), "plan": plan.describe(),
        "method": {"timing": TIMING, "gate": "peer copies only" if plan.gate else "none",
                   "inputs": f"{plan.sets} staged sets rotated",
                   "link_bytes": "remote (token, k) messages (staged; ep_rank_dedup: "
                                 "(token, remote rank) messages and two 4-byte words per "
                                 "slot) or output+header rows (final layout) of the busiest GPU"
                                 + ("" if plan.op == "dispatch" else
                                    "; combine: each remote (token, k) BF16 row back to its "
                                    "source" + (", after the dispatch's" if plan.op == "moe"
                                                else "")) + "; GB = 1e9 B",
                   "link_reference": "cuMemcpyAsync peer copies, every GPU to the next at "
                                     "once (ring), bytes sent per GPU / time",
                   "baseline": NCCL_NAME + ": one process per rank, the slowest rank per "
                               "iteration"},
        "shapes": [],
    }
    reason = skip_reason(plan, n_gpus)
    if reason is not None:
        results["skipped"] = reason
        results["failures"] = []
        progress(f"P2P benchmark skipped: {reason}")
        return results
    dev0 = cuda.get_device(devices[0])
    results["device"] = {"name": getattr(dev0, "name", "unknown"), "arch": cuda.arch(dev0),
                         "sm_count": cuda.sm_count(dev0),
                         "memory_total": memory.mem_info(devices[0])[1]}
    check_peer_access(plan.base, devices, cuda.can_access_peer)
    for a in set(devices):
        for b in set(devices):
            cuda.enable_peer_access(a, b)
    torch, why = common.import_torch()
    gate = None
    if torch is None:
        progress(f"torch unavailable ({why}): no NCCL baseline, no gate")
        results["torch"] = f"unavailable: {why}"
    else:
        results["torch"] = torch.__version__
        if plan.gate:
            gate = Gate(torch, devices[0])
    progress(f"peer copies, {plan.copy_mib} MiB per GPU, GPUs {','.join(map(str, devices))}")
    results["peer_copy"] = measure_peer_copy(devices, plan.copy_mib, plan.copy_iters, gate)
    link_gbps = results["peer_copy"]["gbps_per_gpu"]
    progress(f"  peer copy per GPU: ring {link_gbps:.1f} GB/s, pair "
             f"{results['peer_copy']['pair']['gbps_per_gpu']:.1f} GB/s")
    for T in plan.tokens:
        results["shapes"].append(run_shape(plan, T, devices, torch, link_gbps, progress))
    if gate is not None:
        results["gate"] = gate.describe()
    results["failures"] = failures(results)
    return results


# ---- report ---------------------------------------------------------------------------------------
def _op(results) -> str:
    return results.get("op", "dispatch")


def table_rows(results) -> list[dict]:
    """One row per variant of every shape (its ``--op`` figure), then NCCL's."""
    rows = []
    key = combine.PRIMARY[_op(results)]
    what = "" if _op(results) == "dispatch" else f" {OP_LABELS[_op(results)]}"
    for s in results.get("shapes", []):
        common = {"shape": s["shape"], "T": s["tokens_per_rank"]}
        for v in s["variants"]:
            m = v.get(key)
            if m is None:
                rows.append({**common, "variant": f"epgen {v['label']}{what}",
                             "note": v.get("skipped") or v.get("error")})
                continue
            rows.append({**common, "variant": f"epgen {v['label']}{what}",
                         "us": 1e3 * m["median_ms"],
                         "gbps": m.get("busiest_gpu_gbps"), "frac": m.get("fraction_of_link"),
                         "speedup": v.get("speedup_vs_baseline")})
        b = s["baseline"]
        if "round_trip" in b:
            rows.append({**common, "variant": NCCL_NAME,
                         "us": 1e3 * b["round_trip"]["median_ms"], "speedup": 1.0,
                         "gbps": b["round_trip"].get("busiest_gpu_gbps"),
                         "frac": b["round_trip"].get("fraction_of_link"),
                         "note": None if b.get("check") == "ok" else b.get("check")})
        else:
            rows.append({**common, "variant": NCCL_NAME, "note": b.get("skipped") or b.get("error")})
    return rows


def format_table(rows) -> str:
    """The P2P table: ``report.format_table`` per GPU, against the link and NCCL."""
    return report.format_table(rows, routing=False, gbps_label="GB/s/GPU", gbps_width=9,
                               frac_label="frac link", speedup_label="vs NCCL")


def print_report(results, file=None) -> None:
    file = file or sys.stdout
    op = "" if _op(results) == "dispatch" else f" --op {_op(results)}"
    head = (f"epgen bench --world p2p{op}  {results['date']}  commit {results['git_commit']}"
            f"{'+dirty' if results.get('git_dirty') else ''}  GPUs "
            f"{','.join(map(str, results['devices']))} of {results['gpus']}")
    if "device" in results:
        d = results["device"]
        head += f"  {d['name']} ({d['arch']}, {d['sm_count']} SMs)"
    print(head, file=file)
    if "skipped" in results:
        print(f"skipped: {results['skipped']}", file=file)
        return
    c = results.get("peer_copy")
    if c:
        print(f"peer copy per GPU ({c['size_mib']} MiB, cuMemcpyAsync): ring "
              f"{c['ring']['gbps_per_gpu']:.1f} GB/s (the reference), pair "
              f"{c['pair']['gbps_per_gpu']:.1f} GB/s", file=file)
    print("epgen and NCCL timed alike: from an idle device, host enqueue included, no gate",
          file=file)
    report.print_shapes(results, file, "nccl", lambda v: f"busiest GPU "
                        f"{v['link_bytes']['busiest'] / 1e6:.3f} MB over the links per "
                        f"{OP_LABELS[_op(results)]}")
    print(file=file)
    print(format_table(table_rows(results)), file=file)


def plot_series(results) -> dict[str, list[tuple[int, float]]]:
    """The busiest GPU's GB/s over the links against tokens per rank: one series per epgen
    variant (``epgen <label>``), then NCCL's (by the staged BF16 job's bytes); shapes
    without a number left out."""
    series: dict[str, list[tuple[int, float]]] = {}
    key = combine.PRIMARY[_op(results)]
    for s in results["shapes"]:
        for label, m in ([(f"epgen {v['label']}", v.get(key, {}))
                          for v in s["variants"]]
                         + [(NCCL_NAME, s["baseline"].get("round_trip", {}))]):
            pts = series.setdefault(label, [])
            if m.get("busiest_gpu_gbps") is not None:
                pts.append((s["tokens_per_rank"], m["busiest_gpu_gbps"]))
    return {k: sorted(v) for k, v in series.items() if v}


def plot(results, path: str) -> None:
    """Write a PNG: ``plot_series`` over tokens per rank (log 2 axis), the peer-copy
    bandwidth per GPU as a horizontal line."""
    link = (results.get("peer_copy") or {}).get("gbps_per_gpu")
    b = results["plan"]["base"]
    fmt = b["token_fmt"]
    report.draw_results_plot(results, plot_series(results), path, dashed=NCCL_NAME,
                             line=(link, f"peer copy ({link:.0f} GB/s/GPU)") if link else None,
                             ylabel="GB/s per GPU over the links (busiest GPU)",
                             heading=f"{PLOT_TITLES[_op(results)]} on "
                                     f"{len(results['devices'])} GPUs: "
                                     f"E={b['n_experts']}, H={fmt['hid_dim']}, K={fmt['top_k']}, "
                                     f"{fmt['name']}")


def execute(plan: Plan, *, json_path: str | None = None, plot_path: str | None = None) -> dict:
    """``run`` with progress on stderr, then the JSON, the report on stdout and the plot."""
    progress = Progress(total=len(plan.tokens) * (1 + len(plan.variants)))
    results = run(plan, progress)
    if json_path:
        write_json(results, json_path)
        progress(f"wrote {json_path}")
    print_report(results)
    if plot_path:
        plot(results, plot_path)
        progress(f"wrote {plot_path}")
    return results
