"""The PyTorch baseline of the combine (``epgen bench --op combine|moe``): what a one-GPU user
would write to send every grouped row back to its ``(source, token, k)`` slot and reduce with
the router weights.

Input: the dispatch baseline's grouped rows ``[R*T*K, H]`` bf16 (transform-free: the rows
themselves are the expert outputs) and its ``order`` (the flat ``(source, token, k)`` index of
each grouped row, ``baseline.dispatch_torch``); ``index_copy_`` scatters them into a
preallocated ``[R*T*K, H]`` (that is ``[R, T, K, H]``), then in float32 ``(slots * w).sum(K)``
rounds to bf16. ``moe`` times ``baseline.dispatch_torch`` then this. Device-side only, no host
synchronisation; timed behind the same gate as everything else.

Check (untimed, ``check``): one source's unreduced slots equal ``reference.combine`` of the
reference dispatch bit for bit; its reduced rows are within one BF16 rounding of the reference
(torch's sum order is not the kernels' fused multiply-add chain). ``combine_numpy`` is the same
computation on the host. The host functions import numpy only.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from ..reference_combine import bf16_to_f32, f32_to_bf16
from .baseline import dispatch_torch
from .timing import sample, summarize, timed_torch

NAMES = {"combine": "torch index_copy+weighted sum",
         "moe": "torch argsort+index_select+index_copy+weighted sum"}
"""The baseline's row label per ``--op``."""


def combine_numpy(rows, order, weights, R: int, T: int, K: int):
    """The baseline on the host: ``(slots [R, T, K, H], out [R, T, H])`` BF16 bits from the
    grouped ``rows`` (uint16), ``order`` and ``weights [R, T, K]`` float32."""
    rows = np.asarray(rows, np.uint16)
    slots = np.zeros((R * T * K, rows.shape[1]), np.uint16)
    slots[np.asarray(order)] = rows
    slots = slots.reshape(R, T, K, -1)
    w = np.asarray(weights, np.float32)[..., None]
    return slots, f32_to_bf16((bf16_to_f32(slots) * w).sum(axis=2, dtype=np.float32))


def combine_torch(rows, order, weights, slots):
    """The PyTorch baseline (module docstring): ``rows [R*T*K, H]`` bf16, ``order`` int64,
    ``weights [R, T, K]`` float32, ``slots`` a preallocated ``[R*T*K, H]`` bf16; returns
    ``[R, T, H]`` bf16."""
    R, T, K = weights.shape
    slots.index_copy_(0, order, rows)
    acc = (slots.view(R, T, K, -1).float() * weights.unsqueeze(-1)).sum(dim=2)
    return acc.to(rows.dtype)


def check(cfg, sets, weights, check_rank: int, slots, out) -> list[str]:
    """Differences of source ``check_rank``'s baseline ``slots [T, K, H]`` and ``out [T, H]``
    (BF16 bits, set 0) from the reference (module docstring)."""
    toks, ids = sets[0]
    want = reference.dispatch(cfg, toks, ids)
    ys = [r.out_tokens for r in want]
    n = [len(i) for i in ids]
    s = check_rank
    diffs = []
    exact = reference.combine(cfg, want, ys, None, n_tokens=n, sources=[s])[s]
    if not np.array_equal(np.asarray(slots), exact):
        diffs.append(f"rank {s} slots: {np.count_nonzero(np.asarray(slots) != exact)} elements "
                     f"differ from the reference")
    ref = bf16_to_f32(reference.combine(cfg, want, ys, weights, n_tokens=n, sources=[s])[s])
    got = bf16_to_f32(np.asarray(out, np.uint16))
    with np.errstate(invalid="ignore", over="ignore"):
        bound = 2.0 ** -7 * (np.abs(np.asarray(weights[s], np.float64))[..., None]
                             * np.abs(bf16_to_f32(exact).astype(np.float64))).sum(axis=1)
        close = (got == ref) | (np.isnan(got) & np.isnan(ref)) | (
            np.abs(got.astype(np.float64) - ref) <= bound + 1e-30)
    bad = ~close
    if bad.any():
        diffs.append(f"rank {s} reduced rows: {int(bad.sum())} elements beyond one BF16 "
                     f"rounding of the reference")
    return diffs


def measure(torch, cfg, sets, weights, iters: int, warmup: int, gate, device_index: int,
            check_rank: int, progress, op: str = "combine") -> dict:
    """Time the baseline of ``op`` (``combine``: the scatter and reduction on the grouped rows
    of each set, computed untimed first; ``moe``: the dispatch baseline then those) on the
    input ``sets`` (rotated) on its own torch stream. Returns ``{"round_trip": summary,
    "check": [differences]}``."""
    dev = torch.device("cuda", device_index)
    stream = torch.cuda.Stream(device=dev)
    res = {}
    staged = []
    try:
        with torch.cuda.stream(stream):
            w = torch.from_numpy(np.stack(weights)).to(dev)
            for toks, ids in sets:
                x = torch.from_numpy(np.stack(toks).view(np.int16)).to(dev).view(torch.bfloat16)
                a = torch.from_numpy(np.stack(ids).astype(np.int64)).to(dev)
                rows, order = dispatch_torch(x, a)
                staged.append((x, a, rows, order))
            R, T, K = staged[0][1].shape
            grouped = torch.empty_like(staged[0][2])
            slots = torch.zeros_like(staged[0][2])
            out = combine_torch(staged[0][2], staged[0][3], w, slots)   # the check, untimed
        stream.synchronize()
        as_bits = lambda t: t.view(torch.int16).cpu().numpy().view(np.uint16)  # noqa: E731
        res["check"] = check(cfg, sets, weights, check_rank,
                             as_bits(slots.view(R, T, K, -1)[check_rank]),
                             as_bits(out[check_rank]))

        def once(i):
            x, a, rows, order = staged[i % len(staged)]
            if op == "moe":
                def body():
                    grouped_rows, grouped_order = dispatch_torch(x, a, out=grouped)
                    combine_torch(grouped_rows, grouped_order, w, slots)
            else:
                def body():
                    combine_torch(rows, order, w, slots)
            return timed_torch(torch, stream, gate, body)
        progress(f"  baseline: timing ({warmup} warm-up + {iters} iterations)")
        res["round_trip"] = summarize(sample(once, iters, warmup, gate))
    finally:
        stream.synchronize()
        staged = None
        torch.cuda.empty_cache()
    return res
