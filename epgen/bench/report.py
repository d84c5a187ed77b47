"""What a run shows: progress lines on stderr, the report and table on stdout, the JSON file
and the PNG plot (matplotlib, Agg backend, imported only by ``plot``), and the provenance
(git commit) recorded with the numbers. Everything here reads the plain-data results a run
produces (``epgen.bench.driver.run``) or a JSON file written from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from .baseline import NAME as BASELINE_NAME
from .memory import fmt_gb

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMBINES = (("combine", "combine"), ("combine_fp8", "combine (fp8)"),
            ("combine_partial", "combine (partial)"))
"""The combines ``--op combine`` times: result key, table label (``epgen.bench.combine``)."""
HALVES = (("send", "send"), ("reduce", "reduce"))
"""The split kernels' halves each combine is also timed by: key suffix, label suffix."""
TIMINGS = (("round_trip", "round trip"), ("dispatch_async", "dispatch_async"),
           ("dispatch_wait", "dispatch_wait"),
           *((f"{key}{suffix}", f"{label}{more}") for key, label in COMBINES
             for suffix, more in (("", ""), *((f"_{k}", f" {v}") for k, v in HALVES))),
           ("moe", "dispatch + combine"))
"""Timed parts of an epgen variant: result key, table label."""
PRIMARY = {"dispatch": "round_trip", "combine": "combine", "moe": "moe"}
"""The figure of each ``--op`` the speed-up and the plot use (``epgen.bench.combine``)."""


def _primary(results) -> str:
    return PRIMARY[results.get("op", "dispatch")]


class Progress:
    """Progress lines on ``stream`` (stderr), each with the seconds since the start;
    ``step(msg)`` numbers the steps of a run (``[3/10]``) out of ``total``."""

    def __init__(self, total: int = 0, stream=None, clock=time.monotonic):
        self.total, self.done = total, 0
        self.stream = stream
        self.clock = clock
        self.t0 = clock()

    def __call__(self, msg: str) -> None:
        print(f"[{self.clock() - self.t0:8.1f}s] {msg}", file=self.stream or sys.stderr,
              flush=True)

    def step(self, msg: str) -> None:
        self.done += 1
        self(f"[{self.done}/{self.total}] {msg}")


def git_commit(repo: str = REPO_ROOT) -> tuple[str, bool | None]:
    """(``git rev-parse --short HEAD`` or "unknown", whether the tree has changes or None).
    Where the tree is a copy without ``.git`` (e.g. one copied to a GPU machine),
    ``$EPGEN_COMMIT`` names the commit it was copied from."""
    if os.environ.get("EPGEN_COMMIT"):
        return os.environ["EPGEN_COMMIT"], None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                              capture_output=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown", None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                            text=True, capture_output=True, timeout=10)
        dirty = bool(st.stdout.strip()) if st.returncode == 0 else None
        return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


# ---- JSON -----------------------------------------------------------------------------------
def _jsonable(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(results: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=_jsonable)
        f.write("\n")


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---- table ----------------------------------------------------------------------------------
def table_rows(results) -> list[dict]:
    """One row per timed part of every variant of every shape, then the baseline's."""
    rows = []
    primary = _primary(results)
    label_of = dict(TIMINGS)
    for s in results["shapes"]:
        common = {"shape": s["shape"], "T": s["tokens_per_rank"], "routing": s["routing"]}
        for v in s["variants"]:
            if primary not in v:
                rows.append({**common, "variant": f"epgen {v['label']} {label_of[primary]}",
                             "note": v.get("skipped") or v.get("error")})
                continue
            for key, label in TIMINGS:
                m = v.get(key)
                if m is None:        # the fused kernel is timed as a round trip only
                    continue
                if "median_ms" not in m:     # an extra combine this variant does not take
                    rows.append({**common, "variant": f"epgen {v['label']} {label}",
                                 "note": m.get("skipped")})
                    continue
                rows.append({**common, "variant": f"epgen {v['label']} {label}",
                             "us": 1e3 * m["median_ms"], "gbps": m.get("gbps"),
                             "frac": m.get("fraction_of_copy"),
                             "speedup": v.get("speedup_vs_baseline") if key == primary
                             else None})
        b = s["baseline"]
        name = b.get("name", BASELINE_NAME)
        if "round_trip" in b:
            m = b["round_trip"]
            rows.append({**common, "variant": name, "us": 1e3 * m["median_ms"],
                         "gbps": m.get("gbps"), "frac": m.get("fraction_of_copy"),
                         "speedup": 1.0, "note": None if b["check"] == "ok" else b["check"]})
        else:
            rows.append({**common, "variant": name,
                         "note": b.get("skipped") or b.get("error")})
    return rows


def format_table(rows, *, routing: bool = True, gbps_label: str = "GB/s", gbps_width: int = 8,
                 frac_label: str = "frac copy", speedup_label: str = "vs torch") -> str:
    """Rows: dicts with ``shape, T, routing, variant, us, gbps, frac, speedup`` (None where
    there is no number) and an optional ``note``; the labels name the GB/s, fraction and
    speed-up columns (the P2P report: per GPU, of the link, vs NCCL); ``routing=False``
    leaves that column out."""
    def cell(v, width, prec):
        return f"{'-':>{width}}" if v is None else f"{v:{width}.{prec}f}"
    vw = max([28] + [len(r["variant"]) for r in rows])
    head = [f"{'shape':<8}", f"{'T':>5}"] + ([f"{'routing':<8}"] if routing else []) + [
        f"{'variant':<{vw}}", f"{'median us':>10}", f"{gbps_label:>{gbps_width}}",
        f"{frac_label:>9}", f"{speedup_label:>8}"]
    lines = [" ".join(head)]
    for r in rows:
        sp = r.get("speedup")
        cells = [f"{r['shape']:<8}", f"{r['T']:>5}"] + (
            [f"{r['routing']:<8}"] if routing else []) + [
            f"{r['variant']:<{vw}}", cell(r.get("us"), 10, 1),
            cell(r.get("gbps"), gbps_width, 1), cell(r.get("frac"), 9, 3),
            f"{'-' if sp is None else f'{sp:.2f}x':>8}"]
        line = " ".join(cells)
        if r.get("note"):
            line += f"  ({r['note']})"
        lines.append(line)
    return "\n".join(lines)


def print_shapes(results, file, baseline: str, traffic) -> None:
    """One line per shape (block capacity, the ``baseline``'s check) and one per variant
    (layout, ``traffic(variant)``, its checks or why it did not run)."""
    for s in results["shapes"]:
        b = s["baseline"]
        bits = [f"recv_block_capacity {s['recv_block_capacity']} (largest block "
                f"{s['largest_block']})"]
        if "check" in b:
            bits.append(f"{baseline} check: {b['check']} (vs {b['check_against']})")
        label = s["shape"] if s["shape"].startswith("T=") \
            else f"{s['shape']} T={s['tokens_per_rank']}"
        print(f"{label} ({s['routing']}): " + "; ".join(bits), file=file)
        for v in s["variants"]:
            what = (f"checks: {v['check']}, after timing {v.get('post_check', 'skipped')}"
                    if "check" in v else v.get("skipped") or v.get("error"))
            print(f"  {v['label']}: {v['bytes']['layout']} layout, {traffic(v)}; {what}",
                  file=file)


def variant_bytes(v, what: str, key: str) -> str:
    """A variant's bytes per ``what``: the total it moves through memory and, apart, the
    bytes crossing between ranks (``link_bytes``), with their rate over its ``key``
    measurement where that was timed."""
    text = f"{fmt_gb(v['bytes']['total'])} per {what}"
    link = v.get("link_bytes")
    if link is None:
        return text
    text += f", {fmt_gb(link['link'])} across ranks"
    gbps = v.get(key, {}).get("link_gbps")
    return text + (f" ({gbps:.1f} GB/s)" if gbps is not None else "")


def print_report(results, file=None) -> None:
    """The header (date, commit, device, copy), each shape's and variant's checks and bytes,
    then the table."""
    file = file or sys.stdout
    dev = results["device"]
    print(f"epgen bench  {results['date']}  commit {results['git_commit']}"
          f"{'+dirty' if results.get('git_dirty') else ''}  {dev['name']} ({dev['arch']}, "
          f"{dev['sm_count']} SMs)", file=file)
    c = results.get("copy")
    if c:
        parts = [f"{k} {c[k]['gbps']:.1f} GB/s" for k in ("torch", "cupy")
                 if "gbps" in c.get(k, {})]
        print(f"device-to-device copy ({c['size_mib']} MiB, read + write): "
              + ", ".join(parts) + f"; reference {c['gbps']:.1f} GB/s", file=file)
    what = {"dispatch": "round trip", "combine": "combine",
            "moe": "dispatch + combine"}[results.get("op", "dispatch")]
    key = _primary(results)
    print_shapes(results, file, "baseline", lambda v: variant_bytes(v, what, key))
    print(file=file)
    print(format_table(table_rows(results)), file=file)


def publish(results, *, json_path=None, plot_path=None, progress=None, file=None) -> None:
    """Write the JSON (``json_path``), print the report (``file``, default stdout), draw the
    plot (``plot_path``)."""
    if json_path:
        write_json(results, json_path)
        if progress:
            progress(f"wrote {json_path}")
    print_report(results, file=file)
    if plot_path:
        plot(results, plot_path)
        if progress:
            progress(f"wrote {plot_path}")


# ---- plot -----------------------------------------------------------------------------------
def plot_series(results) -> dict[str, list[tuple[int, float]]]:
    """Round-trip bandwidth (each by its own bytes) against tokens per rank: one series per
    epgen variant (``epgen <label>``), then the baseline's; shapes without a number left
    out."""
    series: dict[str, list[tuple[int, float]]] = {}
    key = _primary(results)
    for s in results["shapes"]:
        T = s["tokens_per_rank"]
        for v in s["variants"]:
            pts = series.setdefault(f"epgen {v['label']}", [])
            if v.get(key, {}).get("gbps") is not None:
                pts.append((T, v[key]["gbps"]))
    base = series.setdefault(_baseline_name(results), [])
    for s in results["shapes"]:
        gbps = s["baseline"].get("round_trip", {}).get("gbps")
        if gbps is not None:
            base.append((s["tokens_per_rank"], gbps))
    return {k: sorted(v) for k, v in series.items() if v}


def _baseline_name(results) -> str:
    names = [s["baseline"].get("name") for s in results["shapes"]]
    return next((n for n in names if n), BASELINE_NAME)


def draw_plot(series: dict, path: str, *, tokens, dashed: str, line=None, ylabel: str,
              title: str) -> None:
    """Write a PNG: each of ``series`` (label -> [(tokens per rank, GB/s)]) as a line over
    ``tokens`` (log 2 axis), ``dashed`` the baseline's label, ``line`` an optional
    ``(GB/s, label)`` drawn as a horizontal reference."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = 0.0
    for label, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "--" if label == dashed else "-", marker="o", label=label)
        top = max(top, *ys)
    if line is not None and line[0]:
        ax.axhline(line[0], color="black", linestyle=":", label=line[1])
        top = max(top, line[0])
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.minorticks_off()
    ax.set_ylim(0, 1.1 * top or 1.0)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, format="png")


def draw_results_plot(results, series: dict, path: str, *, dashed: str, line, ylabel: str,
                      heading: str) -> None:
    """``draw_plot`` of a benchmark's ``results``: over its shapes' tokens per rank, titled
    ``heading`` and, on a second line, the device, date and commit of the run."""
    draw_plot(series, path, tokens=sorted({s["tokens_per_rank"] for s in results["shapes"]}),
              dashed=dashed, line=line, ylabel=ylabel,
              title=f"{heading}\n{results['device']['name']}, {results['date'][:10]}, "
                    f"commit {results['git_commit']}")


def plot(results, path: str) -> None:
    """Write a PNG: ``plot_series`` as lines over tokens per rank (log 2 axis), the copy
    bandwidth as a horizontal line."""
    copy = results.get("copy", {}).get("gbps")
    b = results["plan"]["base"]
    fmt = b["token_fmt"]
    routing = {s["routing"] for s in results["shapes"]}
    what = {"dispatch": "dispatch round trip", "combine": "combine",
            "moe": "dispatch + combine"}[results.get("op", "dispatch")]
    draw_results_plot(results, plot_series(results), path, dashed=_baseline_name(results),
                      line=(copy, f"device copy ({copy:.0f} GB/s)") if copy else None,
                      ylabel="GB/s (each by the bytes it must move)",
                      heading=f"{what}: {b['n_ranks']} emulated ranks, "
                              f"E={b['n_experts']}, H={fmt['hid_dim']}, K={fmt['top_k']}, "
                              f"{fmt['name']}, {'/'.join(sorted(routing))} routing")
