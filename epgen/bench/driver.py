"""Runs a ``Plan`` on the GPU and assembles the results (plain data: what the report, the JSON
and the plot read).

Order: the gate, the copy, then per shape: the input sets, the baseline phase, then each
variant's epgen phase (a world built, checked, timed, checked again, torn down). Phases that
would not fit in device memory are skipped with a message saying what they need; a phase
that raises is reported and the run goes on. ``results["failures"]`` lists the errors and
failed checks (the command exits 1 when there are any).
"""

from __future__ import annotations

import datetime
import sys

from .. import reference
from ..combine_layout import CombineLayout
from ..inspection import combine_buffers
from . import baseline, combine, combine_baseline, common, inputs, memory, p2p, runner
from .common import bf16_config, failures
from .memory import fmt_gb
from .plan import Plan, shape_name
from .report import Progress, git_commit, publish
from .timing import Gate, rate
from .link_bytes import op_link_bytes
from .traffic import baseline_bytes, combine_bytes, op_bytes, round_trip_bytes


def variant_link_bytes(cfg, sets, op: str, fp8: bool = False,
                       partial_reduce: bool = False) -> dict:
    """The bytes crossing between ranks in what ``op`` times, from the variant's input sets
    (``link_bytes.op_link_bytes``: the mean per call, the dispatch as ``cfg`` sends it, one
    message per (token, rank) under ``ep_rank_dedup``; the combine in BF16 rows, or with
    ``fp8`` the FP8 combine's, with ``partial_reduce`` one row per (token, rank))."""
    return op_link_bytes(cfg, sets, op, dedup=cfg.ep_rank_dedup, fp8=fp8,
                         partial_reduce=partial_reduce)


def add_link_rate(m: dict, link: dict) -> None:
    """Put ``link`` (``variant_link_bytes``) into the measurement ``m``: ``link_bytes`` and
    ``link_gbps`` (those bytes over its median time, 1 GB = 1e9 B)."""
    m["link_bytes"] = link["link"]
    m["link_gbps"] = rate(link["link"], m["median_ms"])[0]


def _fits(plan: Plan, need: int, out: dict, hint: str = "") -> bool:
    """Whether ``need`` bytes fit in ``plan.mem_fraction`` of the free device memory; if not,
    ``out["skipped"]`` says why (then ``hint``)."""
    free, _total = memory.mem_info(plan.device)
    out["memory"]["free_before"] = free
    if need <= plan.mem_fraction * free:
        return True
    out["skipped"] = (f"needs {fmt_gb(need)} of device memory, more than "
                      f"{plan.mem_fraction:.0%} of the {fmt_gb(free)} free{hint}")
    return False


def baseline_phase(plan: Plan, T: int, sets, torch, gate, copy_gbps, progress) -> dict:
    """Time the baseline on ``sets`` and check its grouping of ``plan.check_rank`` against
    the reference model (which every epgen variant is checked against too). The baseline
    gathers bf16 rows whatever epgen's token format, so it runs and is checked as BF16."""
    cfg = bf16_config(plan.config(T))
    out = {"name": baseline.NAME, "bytes": baseline_bytes(cfg, T),
           "memory": {"estimate": memory.baseline_memory(cfg, T, plan.sets)}}
    if not plan.baseline:
        out["skipped"] = "--no-baseline"
    elif torch is None:
        out["skipped"] = "torch with CUDA is not available"
    elif _fits(plan, out["memory"]["estimate"], out):
        try:
            b = baseline.measure(torch, cfg, sets, plan.iters_for(T), plan.warmup_for(T), gate,
                                 plan.device, plan.check_rank, progress)
            want = reference.dispatch(cfg, *sets[0])[plan.check_rank]
            diffs = baseline.compare_grouping(cfg, want, b["check_result"])
        except Exception as exc:  # noqa: BLE001 - reported; the rest still runs
            out["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"  baseline FAILED: {out['error']}")
            return out
        m = out["round_trip"] = b["round_trip"]
        m["bytes"] = out["bytes"]
        m["gbps"], m["fraction_of_copy"] = rate(m["bytes"], m["median_ms"], copy_gbps)
        out["check"] = "ok" if not diffs else "FAILED: " + "; ".join(diffs[:3])
        out["check_against"] = f"reference, rank {plan.check_rank}, set 0"
        progress(f"  baseline: {1e3 * m['median_ms']:.1f} us, check {out['check']}")
    if "skipped" in out:
        progress(f"  baseline skipped: {out['skipped']}")
    return out


def variant_phase(plan: Plan, T: int, variant, sets, need: int, cap: int, gate, copy_gbps,
                  progress) -> dict:
    """Build, check and time one variant's world on ``sets``."""
    cfg = plan.config(T, variant, cap)
    nbytes = round_trip_bytes(cfg, T)
    link = variant_link_bytes(cfg, sets, "dispatch")
    wm = memory.world_memory(cfg)
    full = memory.world_memory(plan.config(T, variant))["total"]
    staged = memory.staged_inputs_memory(cfg, T, plan.sets)
    out = {"label": variant.label, "spec": variant.spec, "config": cfg.describe(),
           "bytes": nbytes, "link_bytes": link,
           "memory": {"world": wm["total"], "world_per_rank": wm["per_rank"],
                      "world_full_capacity": full, "epgen_phase": wm["total"] + staged}}
    progress(f"  memory: {fmt_gb(wm['total'] + staged)} (world {fmt_gb(wm['total'])} at "
             f"recv_block_capacity={cap}; {fmt_gb(full)} at full capacity)")
    if cap < need:
        out["skipped"] = (f"--block-capacity {cap} is smaller than the largest (expert, "
                          f"source) block of the routings ({need})")
    elif _fits(plan, out["memory"]["epgen_phase"], out,
               f" (per rank: recv_buf {fmt_gb(wm['per_rank']['recv_buf'])}, out_tokens "
               f"{fmt_gb(wm['per_rank']['out_tokens'])}); lower --block-capacity, the Zipf "
               f"skew (--zipf-s) or the tokens per rank"):
        try:
            r = runner.measure_world(cfg, sets, plan.iters_for(T), plan.warmup_for(T), gate,
                                     device=plan.device, arch=plan.arch,
                                     post_check=plan.post_check, progress=progress,
                                     **variant.world_options)
        except Exception as exc:  # noqa: BLE001 - reported; the other variants still run
            out["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"  epgen {variant.label} FAILED: {out['error']}")
            return out
        for key, nb in (("round_trip", nbytes["total"]), ("dispatch_async", nbytes["async"]),
                        ("dispatch_wait", nbytes["wait"])):
            if key not in r:               # the fused single launch has no separate halves
                continue
            m = r[key]
            m["bytes"] = nb
            m["gbps"], m["fraction_of_copy"] = rate(nb, m["median_ms"], copy_gbps)
        if copy_gbps:
            r["round_trip"]["byte_floor_us"] = nbytes["total"] / copy_gbps / 1e3
        add_link_rate(r["round_trip"], link)
        out.update(r)
        progress(f"  epgen {variant.label}: check {r['check']}, round trip "
                 f"{1e3 * r['round_trip']['median_ms']:.1f} us")
    if "skipped" in out:
        progress(f"  epgen {variant.label} skipped: {out['skipped']}")
    return out


def _combine_memory(cfg, fp8: bool = False) -> int:
    """Every rank's combine buffers (``inspection.combine_buffers``); ``fp8``: with the FP8
    combine's receive buffer and staging (``CombineLayout``)."""
    per_rank = combine_buffers(cfg)["bytes_per_rank"]["combine_total"]
    if fp8:
        clay = CombineLayout(cfg)
        per_rank += clay.fp8_recv_bytes + clay.fp8_stage_bytes
    return cfg.n_ranks * per_rank


def combine_baseline_phase(plan: Plan, T: int, sets, w, torch, gate, copy_gbps,
                           progress) -> dict:
    """Time the combine (``--op combine``) or dispatch + combine (``moe``) baseline and check
    one source against the reference (``combine_baseline``). The baseline moves BF16 rows
    whatever epgen's token format, so it runs and is checked as BF16."""
    cfg = bf16_config(plan.config(T))
    nbytes = op_bytes(cfg, T, plan.op) if plan.op == "combine" else \
        baseline_bytes(cfg, T) + combine_bytes(cfg, T)["total"]
    out = {"name": combine_baseline.NAMES[plan.op], "bytes": nbytes,
           # each set's grouped rows, the slots, the grouped output of moe, and the float32
           # product of the reduction (twice the slots)
           "memory": {"estimate": memory.baseline_memory(cfg, T, plan.sets)
                      + (plan.sets + 4) * combine_bytes(cfg, T)["rows"]}}
    if not plan.baseline:
        out["skipped"] = "--no-baseline"
    elif torch is None:
        out["skipped"] = "torch with CUDA is not available"
    elif _fits(plan, out["memory"]["estimate"], out):
        try:
            b = combine_baseline.measure(torch, cfg, sets, w, plan.iters_for(T),
                                         plan.warmup_for(T), gate, plan.device,
                                         plan.check_rank, progress, op=plan.op)
        except Exception as exc:  # noqa: BLE001 - reported; the rest still runs
            out["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"  baseline FAILED: {out['error']}")
            return out
        m = out["round_trip"] = b["round_trip"]
        m["bytes"] = nbytes
        m["gbps"], m["fraction_of_copy"] = rate(nbytes, m["median_ms"], copy_gbps)
        out["check"] = "ok" if not b["check"] else "FAILED: " + "; ".join(b["check"][:3])
        out["check_against"] = f"reference, rank {plan.check_rank}, set 0"
        progress(f"  baseline: {1e3 * m['median_ms']:.1f} us, check {out['check']}")
    if "skipped" in out:
        progress(f"  baseline skipped: {out['skipped']}")
    return out


def combine_variant_phase(plan: Plan, T: int, variant, sets, w, need: int, cap: int, gate,
                          copy_gbps, progress) -> dict:
    """Build, check and time one variant's combine (``--op combine``) or dispatch + combine
    (``moe``) on ``sets`` (``epgen.bench.combine``)."""
    cfg = plan.config(T, variant, cap)
    key = combine.PRIMARY[plan.op]
    rt = round_trip_bytes(cfg, T)
    cb = combine_bytes(cfg, T)
    wm = memory.world_memory(cfg)
    need_bytes = wm["total"] + _combine_memory(cfg, plan.combine_fp8) + \
        memory.staged_inputs_memory(cfg, T, plan.sets)
    link = variant_link_bytes(cfg, sets, plan.op)
    out = {"label": variant.label, "spec": variant.spec, "config": cfg.describe(),
           "bytes": {**rt, "layout": rt["layout"], "combine": cb,
                     "total": op_bytes(cfg, T, plan.op)}, "link_bytes": link,
           "memory": {"world": wm["total"], "combine": _combine_memory(cfg, plan.combine_fp8),
                      "epgen_phase": need_bytes}}
    partial = _partial_arm(plan, cfg, variant, out, progress)
    if cap < need:
        out["skipped"] = (f"--block-capacity {cap} is smaller than the largest (expert, "
                          f"source) block of the routings ({need})")
    elif _fits(plan, need_bytes, out):
        try:
            r = combine.measure_world(cfg, sets, w, plan.iters_for(T), plan.warmup_for(T),
                                      gate, op=plan.op, device=plan.device, arch=plan.arch,
                                      post_check=plan.post_check, progress=progress,
                                      combine_fp8=plan.combine_fp8, combine_partial=partial,
                                      **variant.world_options)
        except Exception as exc:  # noqa: BLE001 - reported; the other variants still run
            out["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"  epgen {variant.label} FAILED: {out['error']}")
            return out
        m = r[key]
        m["bytes"] = out["bytes"]["total"]
        m["gbps"], m["fraction_of_copy"] = rate(m["bytes"], m["median_ms"], copy_gbps)
        if copy_gbps:
            m["byte_floor_us"] = m["bytes"] / copy_gbps / 1e3
        add_link_rate(m, link)
        out.update(r)
        progress(f"  epgen {variant.label}: check {r['check']}, {key} "
                 f"{1e3 * m['median_ms']:.1f} us")
        for arm in combine.extra_arms(plan.combine_fp8, partial):
            if arm.key in r:
                _arm_figures(out, cfg, T, sets, arm, copy_gbps, progress)
    if "skipped" in out:
        progress(f"  epgen {variant.label} skipped: {out['skipped']}")
    return out


def _partial_arm(plan: Plan, cfg, variant, out: dict, progress) -> bool:
    """Whether this variant times the partial-reduce combine: ``--combine-partial`` and a
    configuration that takes it; where it does not (no ``ep_rank_dedup``), its
    ``combine_partial`` says why and the variant's other figures still run."""
    if not plan.combine_partial:
        return False
    try:
        combine.check_arm(cfg, combine.PARTIAL_ARM)
    except ValueError as exc:
        out["combine_partial"] = {"skipped": f"--combine-partial: {exc}"}
        progress(f"  epgen {variant.label}: combine_partial skipped "
                 f"({out['combine_partial']['skipped']})")
        return False
    return True


def _arm_figures(out: dict, cfg, T: int, sets, arm, copy_gbps, progress) -> None:
    """An extra combine's figures beside the plain one's (``combine.CombineArm``:
    ``--combine-fp8``, ``--combine-partial``): its bytes (``arm.bytes``), GB/s and fraction
    of the copy, its link bytes and their rate (``variant_link_bytes`` with its flags), and
    ``arm.speedup_key`` (the plain combine's median over its own)."""
    m = out[arm.key]
    b = arm.bytes(cfg, T, sets)
    out["bytes"][arm.key] = b
    m["bytes"] = b["total"]
    m["gbps"], m["fraction_of_copy"] = rate(m["bytes"], m["median_ms"], copy_gbps)
    add_link_rate(m, variant_link_bytes(cfg, sets, "combine", **arm.flags))
    out[arm.speedup_key] = out["combine"]["median_ms"] / m["median_ms"]
    progress(f"  epgen: {arm.key} {1e3 * m['median_ms']:.1f} us "
             f"({out[arm.speedup_key]:.2f}x the {arm.versus}; link bytes "
             f"{b['link_ratio']:.4f} of {arm.versus.split()[0]}'s)")


def run_shape(plan: Plan, T: int, torch, gate, copy_gbps, progress) -> dict:
    """One shape: the input sets and their block capacity, the baseline, every variant, and
    each variant's speed-up over the baseline."""
    out = {"shape": shape_name(T), "tokens_per_rank": T, "routing": plan.routing,
           "zipf_s": plan.zipf_s if plan.routing == "zipf" else None,
           "iters": plan.iters_for(T), "warmup": plan.warmup_for(T)}
    progress.step(f"T={T} ({out['shape']}, {plan.routing} routing): {plan.sets} input sets, "
                  f"baseline")
    sets = inputs.make_input_sets(plan.config(T), T, plan.sets, plan.routing, plan.zipf_s,
                                  plan.seed)
    need, cap = inputs.block_capacity(plan.block_capacity, sets, plan.base.n_experts, T)
    out["largest_block"], out["recv_block_capacity"] = need, cap
    key = combine.PRIMARY[plan.op]
    if plan.op == "dispatch":
        out["baseline"] = baseline_phase(plan, T, sets, torch, gate, copy_gbps, progress)
    else:
        w = combine.weights(plan.config(T), T, plan.seed)
        out["baseline"] = combine_baseline_phase(plan, T, sets, w, torch, gate, copy_gbps,
                                                 progress)
    out["variants"] = []
    for v in plan.variants:
        progress.step(f"T={T}: epgen {v.label}")
        if plan.op == "dispatch":
            r = variant_phase(plan, T, v, sets, need, cap, gate, copy_gbps, progress)
        else:
            r = combine_variant_phase(plan, T, v, sets, w, need, cap, gate, copy_gbps,
                                      progress)
        if key in r and "round_trip" in out["baseline"]:
            r["speedup_vs_baseline"] = (out["baseline"]["round_trip"]["median_ms"]
                                        / r[key]["median_ms"])
        out["variants"].append(r)
    return out


def run(plan: Plan, progress: Progress) -> dict:
    """Run every shape and variant of ``plan``; ``CudaUnavailableError`` without a usable
    GPU."""
    from backends import cuda
    from backends.cuda.errors import CudaUnavailableError
    if not cuda.gpu_available():
        raise CudaUnavailableError("no usable CUDA GPU here (backends.cuda.gpu_available() is "
                                   "False); run the benchmark on a machine with an NVIDIA GPU")
    dev = cuda.get_device(plan.device)
    commit, dirty = git_commit()
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty, "command": sys.argv,
        "device": {"name": getattr(dev, "name", "unknown"), "ordinal": plan.device,
                   "arch": cuda.arch(dev), "sm_count": cuda.sm_count(dev),
                   "memory_total": memory.mem_info(plan.device)[1]},
        "plan": plan.describe(),
        "op": plan.op,
        "method": {"timing": "CUDA events, fork/join over the rank streams, median",
                   "gate": plan.gate, "inputs": f"{plan.sets} staged sets rotated",
                   "bytes": "staged: input + 2 x messages + output rows; final layout: input "
                            "+ output rows; GB = 1e9 B",
                   "link_bytes": "bytes crossing between ranks (epgen.bench.link_bytes): a "
                                 "message per remote (token, k) slot (ep_rank_dedup: per "
                                 "(token, remote rank), plus two 4-byte words per slot); "
                                 "combine: a BF16 row per remote slot (combine_fp8: its FP8 "
                                 "slot; combine_partial: a BF16 row per (token, remote "
                                 "rank)); mean per call over the input sets",
                   "baseline": "argsort(topk.flatten(), stable=True) + index_select"},
    }
    if plan.op != "dispatch":
        results["method"].update(
            bytes="combine: 3 x routed rows + output rows (BF16); moe: dispatch + combine",
            combine="transform-free: each rank's expert outputs are its grouped dispatch "
                    "rows; weights loaded once",
            baseline=("index_copy_ into [R*T*K, H] + float32 (slots * w).sum(K) to bf16"
                      + ("; after argsort + index_select" if plan.op == "moe" else "")))
    results["shapes"] = []
    torch, why = common.import_torch()
    gate = copy_gbps = None
    if torch is None:
        progress(f"torch unavailable ({why}): no baseline, no gate, copy not measured")
        results["torch"] = f"unavailable: {why}"
    else:
        torch.cuda.set_device(plan.device)
        results["torch"] = torch.__version__
        if plan.gate:
            gate = Gate(torch, plan.device)
        progress(f"device-to-device copy, {plan.copy_mib} MiB")
        results["copy"] = runner.measure_copy(torch, plan.device, plan.copy_mib,
                                              plan.copy_iters, gate)
        copy_gbps = results["copy"]["gbps"]
        progress(f"  copy: {copy_gbps:.1f} GB/s")
    for T in plan.tokens:
        results["shapes"].append(run_shape(plan, T, torch, gate, copy_gbps, progress))
    if gate is not None:
        results["gate"] = gate.describe()
    results["failures"] = failures(results)
    return results


def execute(plan: Plan, *, json_path: str | None = None, plot_path: str | None = None) -> dict:
    """``run`` with progress on stderr, then ``publish``: the JSON, the report on stdout, the
    plot. The body of ``epgen bench`` and ``benchmarks/dispatch_bench.py``. A plan for the
    P2P world runs ``epgen.bench.p2p`` instead."""
    if plan.world == "p2p":
        return p2p.execute(plan, json_path=json_path, plot_path=plot_path)
    progress = Progress(total=len(plan.tokens) * (1 + len(plan.variants)))
    results = run(plan, progress)
    publish(results, json_path=json_path, plot_path=plot_path, progress=progress)
    return results
