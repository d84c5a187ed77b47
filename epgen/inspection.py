"""``epgen inspect``: what one configuration generates, as plain data (``inspect_config``) and
as aligned text (``format_text``).

The report holds the parameters, every layout member and buffer size, the counter regions,
and per kernel: its roles with their block, thread and warp ranges (the grid is ``n_sms``
blocks, as the world launches it), each role's named barriers, the ordered IR operations by
the PTX instruction each must produce (with how often the PTX holds it), the PTX's atomics,
releases and acquires by scope (``backends.nvptx.check_ptx``), the bounded waits, the NVSHMEM
calls by role with their ordering role (put, put_signal, fence, quiet, signal, query:
``ir.nvshmem``), and the ``ptxas`` resources when ``ptxas`` is found. ``op`` picks the
kernels: dispatch (the default), combine (``ep_combine_async``, ``ep_combine_wait``) or all;
with the combine, the report adds its per-rank buffers (``combine_buffers``). Kernels that
call NVSHMEM are checked and assembled as they run: with NVSHMEM's device bitcode linked in
(``nvptx.emit_linked_ptx``).
"""

from __future__ import annotations

import collections

import attrs

import ir
from ir import nodes as N
from ir import nvshmem as ir_nvshmem

from .combine_layout import CombineLayout
from .runtime.combine import GUARD_BYTES
from .tuning import Tuning

SCOPES = ("cta", "cluster", "gpu", "sys")
PTXAS_FIELDS = ("registers", "spill_stores", "spill_loads", "stack_frame", "smem", "barriers",
                "cmem")


class _Symbolic(Exception):
    """A block-range bound that is not a function of the grid size alone."""


def _eval_block(e, grid: int) -> int:
    if e is None:
        return grid
    if isinstance(e, N.Const):
        return int(e.value)
    if isinstance(e, N.SRegRead) and e.sreg is ir.SReg.NCTAID_X:
        return grid
    if isinstance(e, N.Cast):
        return _eval_block(e.a, grid)
    if isinstance(e, N.BinOp):
        ops = {ir.BinOpKind.ADD: int.__add__, ir.BinOpKind.SUB: int.__sub__,
               ir.BinOpKind.MUL: int.__mul__, ir.BinOpKind.MIN: min, ir.BinOpKind.MAX: max}
        if e.op in ops:
            return ops[e.op](_eval_block(e.a, grid), _eval_block(e.b, grid))
    raise _Symbolic


def _block_range(rng: N.BlockRange, grid: int) -> list:
    """``[start, stop)`` of a role's blocks for a grid of ``grid`` blocks; a bound that depends
    on more than the grid size stays as its IR text."""
    out = []
    for e in (rng.start, rng.stop):
        try:
            out.append(_eval_block(e, grid))
        except _Symbolic:
            out.append(ir.print_expr(e))
    return out


def _role(role: N.Role, kernel: N.Kernel, grid: int) -> dict:
    t = role.threads
    base, end = (0, kernel.block_threads) if t is None else (t.base, t.base + t.count)
    uses = collections.Counter((type(s).__name__, s.barrier.id) for s in N.walk(role.body)
                               if isinstance(s, (N.BarSync, N.BarArrive)))
    barriers = [{"name": b.name, "id": b.id,
                 "count": kernel.block_threads if b.count is None else b.count,
                 "whole_cta": b.count is None,
                 "bar_sync": uses[("BarSync", b.id)], "bar_arrive": uses[("BarArrive", b.id)]}
                for b in role.barriers]
    return {"name": role.name, "blocks": _block_range(role.blocks, grid), "threads": [base, end],
            "warps": [base // 32, -(-end // 32)], "barriers": barriers}


def _ordered(kernel: str, ops, found: dict) -> list[dict]:
    """Ordered IR operations of ``kernel`` grouped by the PTX instruction each must produce."""
    rows: dict[str, dict] = {}
    for op in ops:
        if op.kernel != kernel:
            continue
        row = rows.setdefault(op.expected, {"instruction": op.expected, "roles": [],
                                            "ir": 0, "ptx": found.get((kernel, op.expected))})
        row["ir"] += 1
        if op.role not in row["roles"]:
            row["roles"].append(op.role)
    return sorted(rows.values(), key=lambda r: r["instruction"])


def _nvshmem_calls(kernel: N.Kernel) -> list[dict]:
    """The kernel's NVSHMEM calls, one row per (role, function) in IR order, with the
    function's ordering role (``kind``) and how many call sites the role has."""
    rows: dict[tuple[str, str], dict] = {}
    for role in kernel.roles:
        for node in N.walk(role.body):
            if isinstance(node, N.Call) and ir_nvshmem.is_nvshmem(node.name):
                row = rows.setdefault((role.name, node.name), {
                    "role": role.name, "function": node.name,
                    "kind": ir_nvshmem.FUNCTIONS[node.name].role, "calls": 0})
                row["calls"] += 1
    return list(rows.values())


def _ptxas(ptx: str, arch: str) -> dict:
    from backends import nvptx

    exe = nvptx.find_ptxas()
    if exe is None:
        return {"found": False, "path": None, "error": None, "kernels": {}}
    try:
        report = nvptx.assemble(ptx, arch=arch, ptxas=exe)
    except nvptx.PtxasError as e:
        return {"found": True, "path": str(exe), "error": str(e), "kernels": {}}
    return {"found": True, "path": str(exe), "error": None,
            "kernels": {k: attrs.asdict(v) for k, v in report.kernels.items()}}


def _region(r) -> dict:
    return {"name": r.name, "offset": r.offset, "size": r.size, "end": r.end, "doc": r.doc}


OPS = ("dispatch", "combine", "all")
"""The kernel sets ``inspect_config`` (and ``epgen inspect --op``) reports on."""


def build_op_module(cfg, op: str):
    """The IR module of ``op``'s kernels (``OPS``): the dispatch module, the combine module
    (``ValueError`` where combine does not take ``cfg``), or both in one module."""
    from .kernels import build_combine_module, build_module

    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if op == "dispatch":
        return build_module(cfg)
    combine = build_combine_module(cfg)
    if op == "combine":
        return combine
    return ir.Module("ep_dispatch_combine", build_module(cfg).kernels + combine.kernels)


def combine_buffers(cfg) -> dict:
    """Per rank, the combine's buffers in bytes (docs/combine.md "Buffers") and its counter
    words (``CombineLayout.describe``)."""
    fmt, lay = cfg.token_fmt, cfg.layout
    T, K, H = cfg.max_tokens_per_rank, fmt.top_k, fmt.hid_dim
    clay = CombineLayout(cfg)
    sizes = {"combine_recv_buf": clay.recv_bytes, "combine_recv_guard": GUARD_BYTES,
             "combine_arrival": 4 * clay.arrival_words,
             "combine_expert_out": lay.max_out_rows * H * 2, "combine_weights": T * K * 4,
             "combine_residual": T * H * 2, "combine_out": T * K * H * 2}
    sizes["combine_total"] = sum(sizes.values())
    return {"layout": clay.describe(), "bytes_per_rank": sizes}


def inspect_config(cfg, arch: str = "sm_90", preset: str | None = None,
                   overrides: dict | None = None, ptxas: bool = True,
                   op: str = "dispatch") -> dict:
    """The report of ``cfg`` (plain data, JSON-ready); ``preset`` and ``overrides`` only label
    it. ``ptxas=False`` skips assembling. ``op``: which kernels (``OPS``; ``ValueError`` for
    a combine ``cfg`` does not take)."""
    from backends import nvptx

    lay = cfg.layout
    module = build_op_module(cfg, op)
    link = {"needed": nvptx.uses_nvshmem(module), "error": None}
    try:
        ptx = nvptx.emit_linked_ptx(module, arch=arch)
    except nvptx.NvshmemLinkError as e:     # checked unlinked; ptxas cannot resolve the calls
        link["error"] = str(e)
        ptx = nvptx.emit_ptx(module, arch=arch)
    check = nvptx.check_ptx(module, ptx)
    assembled = _ptxas(ptx, arch) if ptxas and link["error"] is None else None
    if ptxas and link["error"] is not None:
        exe = nvptx.find_ptxas()
        assembled = {"found": exe is not None, "path": exe and str(exe), "kernels": {},
                     "error": f"not assembled: NVSHMEM is not linked: {link['error']}"}
    grid = cfg.n_sms
    kernels = []
    for k in module.kernels:
        scope = check.by_scope.get(k.name, {})
        kernels.append({
            "name": k.name, "grid_blocks": grid, "block_threads": k.block_threads,
            "warps": k.block_threads // 32,
            "static_shared_bytes": sum(b.nbytes for b in k.shared),
            "roles": [_role(r, k, grid) for r in k.roles],
            "ordered_ops": _ordered(k.name, check.ops, check.found),
            "by_scope": {kind: {s: scope.get(kind, {}).get(s, 0) for s in SCOPES}
                         for kind in ("atomics", "releases", "acquires")},
            "bounded_waits": [{"site": s.site_id, "role": s.role, "buffer": s.buffer}
                              for s in k.sites],
            "nvshmem_calls": _nvshmem_calls(k),
            "ptxas": None if not assembled else assembled["kernels"].get(k.name),
        })
    return {
        "preset": preset, "overrides": dict(overrides or {}), "arch": arch, "op": op,
        "parameters": cfg.describe(),
        "effective_flags": cfg.effective_flags(),
        "layout": lay.members(),
        "sizes": lay.sizes(),
        "counter_regions": [_region(r) for r in lay.counter_regions().values()],
        "dispatch_wait_words": [_region(w) for w in lay.dispatch_wait_words()],
        "combine_buffers": combine_buffers(cfg) if op != "dispatch" else None,
        "kernels": kernels,
        "nvshmem_link": link,
        "ptxas": None if assembled is None else {k: v for k, v in assembled.items()
                                                 if k != "kernels"},
    }


# ---------------------------------------------------------------------------------------------
# Text


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _text(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ", ".join(_text(x) for x in v) + "]"
    return str(v)


def _kv(pairs, indent: str = "  ") -> list[str]:
    width = max((len(k) for k, _ in pairs), default=0)
    return [f"{indent}{k:<{width}}  {_text(v)}" for k, v in pairs]


def _table(header: list[str], rows: list[list], indent: str = "  ") -> list[str]:
    """Aligned columns; numbers right-aligned, text left-aligned."""
    cells = [[_text(c) for c in row] for row in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(row[i], int) for row in rows) and rows for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines


def _range(r: list) -> str:
    return f"[{r[0]}, {r[1]})"


def _kernel_lines(k: dict, arch: str) -> list[str]:
    out = [f"kernel {k['name']}: grid {k['grid_blocks']} blocks x {k['block_threads']} threads "
           f"({k['warps']} warps), static shared {k['static_shared_bytes']} bytes", "  roles"]
    out += _table(["role", "blocks", "threads", "warps"],
                  [[r["name"], _range(r["blocks"]), _range(r["threads"]), _range(r["warps"])]
                   for r in k["roles"]], "    ")
    out.append("  named barriers")
    rows = [[r["name"], b["name"], b["id"], f"{b['count']}" + (" (all)" if b["whole_cta"] else ""),
             b["bar_sync"], b["bar_arrive"]] for r in k["roles"] for b in r["barriers"]]
    out += (_table(["role", "barrier", "id", "count", "bar.sync", "bar.arrive"], rows, "    ")
            if rows else ["    (none)"])
    out.append("  ordered operations (IR ops, and how often the PTX holds their instruction)")
    out += _table(["instruction", "roles", "IR", "PTX"],
                  [[o["instruction"], ",".join(o["roles"]), o["ir"], o["ptx"]]
                   for o in k["ordered_ops"]], "    ")
    out.append("  atomics, releases and acquires by scope (PTX)")
    out += _table(["", *SCOPES], [[kind, *counts.values()] for kind, counts in
                                  k["by_scope"].items()], "    ")
    out.append("  bounded waits")
    out += (_table(["site", "role", "buffer"],
                   [[w["site"], w["role"], w["buffer"]] for w in k["bounded_waits"]], "    ")
            if k["bounded_waits"] else ["    (none)"])
    out.append("  NVSHMEM calls")
    out += (_table(["role", "function", "kind", "calls"],
                   [[c["role"], c["function"], c["kind"], c["calls"]]
                    for c in k["nvshmem_calls"]], "    ")
            if k["nvshmem_calls"] else ["    (none)"])
    if k["ptxas"] is not None:
        p = k["ptxas"]
        out.append(f"  ptxas ({arch}): " + ", ".join(f"{f.replace('_', ' ')} {p[f]}"
                                                     for f in PTXAS_FIELDS))
    return out


def _changed_tuning(tuning: dict) -> dict:
    """The fields of a ``Tuning.describe()`` table that differ from the defaults."""
    default = Tuning().describe()
    return {k: v for k, v in tuning.items() if default.get(k) != v}


def format_text(report: dict) -> str:
    """The report as aligned plain text."""
    label = report["preset"] or "(custom)"
    if report["overrides"]:
        label += " with " + " ".join(f"{k}={v}" for k, v in report["overrides"].items())
    tuned = _changed_tuning(report["parameters"].get("tuning", {}))
    if tuned:
        label += ", tuned " + " ".join(f"{k}={v}" for k, v in tuned.items())
    op = report.get("op", "dispatch")
    out = [f"preset {label}, arch {report['arch']}"
           + (f", {op} kernels" if op != "dispatch" else ""), "", "parameters"]
    out += _kv(_flat(report["parameters"]))
    if report.get("effective_flags"):
        out += ["", "effective flags"] + _kv(list(report["effective_flags"].items()))
    out += ["", "layout members"] + _kv(_flat(report["layout"]))
    out += ["", "sizes"] + _kv(list(report["sizes"].items()))
    out += ["", "counter regions (Int32 words)"]
    out += _table(["region", "offset", "size", "end", "contents"],
                  [[r["name"], r["offset"], r["size"], r["end"], r["doc"]]
                   for r in report["counter_regions"]])
    out += ["", "dispatch_wait words (offsets inside the dispatch_wait region)"]
    out += _table(["word", "offset", "size", "end", "contents"],
                  [[w["name"], w["offset"], w["size"], w["end"], w["doc"]]
                   for w in report["dispatch_wait_words"]])
    cb = report.get("combine_buffers")
    if cb:
        out += ["", "combine buffers (bytes per rank)"] + _kv(list(cb["bytes_per_rank"].items()))
        out += ["", "combine layout"] + _kv(list(cb["layout"].items()))
    for k in report["kernels"]:
        out += [""] + _kernel_lines(k, report["arch"])
    link = report["nvshmem_link"]
    if link["needed"]:
        out += ["", "NVSHMEM: device bitcode linked into the PTX" if link["error"] is None
                else f"NVSHMEM: not linked ({link['error']}); checked on our PTX only"]
    px = report["ptxas"]
    if px is not None:
        out.append("")
        if not px["found"]:
            out.append("ptxas: not found (set EPGEN_PTXAS or CUDA_HOME, put ptxas on PATH, or "
                       "pip install nvidia-cuda-nvcc); no resources shown")
        elif px["error"]:
            out.append(f"ptxas ({px['path']}) failed:")
            out += ["  " + line for line in px["error"].splitlines()]
        else:
            out.append(f"ptxas: {px['path']}")
    return "\n".join(out) + "\n"
