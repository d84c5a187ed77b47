"""The PyTorch baseline (docs/PERF.md, "Method"): what a one-GPU user would write to group all
ranks' routed tokens by (destination, local expert, source).

Inputs ``tokens [R, T, H]`` bf16 and ``topk [R, T, K]`` int64 on the GPU;
``order = argsort(topk.flatten(), stable=True)`` (one argsort: sorting by global expert id,
stably, is sorting by the key ``((dst*L + e)*R + src)*T*K + t*K + k``, i.e. destination,
local expert, source, token), then one ``index_select`` of the token rows ``order // K``
into a preallocated grouped output (all ranks' rows concatenated, each rank's in epgen's
grouping). Device-side only, no host synchronisation. ``measure`` times it behind the same
gate as everything else and returns one rank's grouping for the check (untimed): a
``reference.RankResult`` to compare with the reference model (``compare_grouping``: rows
compared per (expert, source) block, their order within a block free).

The host functions import numpy only; ``dispatch_torch`` and ``measure`` use torch.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from .timing import sample, summarize, timed_torch

NAME = "torch argsort+index_select"
"""The baseline's row label in the table, the JSON and the plot."""


def sort_key(topk_ids, n_local_experts: int, n_ranks: int) -> np.ndarray:
    """The composite key (destination, local expert, source) for ``topk_ids [R, T, K]`` (numpy):
    ``((dst * L + e) * R + src) * T * K + t * K + k`` with ``dst, e = divmod(id, L)``, flattened
    in ``(src, t, k)`` order. Since ``dst * L + e`` is the global id, the key is
    ``id * R * T * K + flat index``: sorting it is a stable sort of the flat ids."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    R, T, K = ids.shape
    if R != n_ranks:
        raise ValueError(f"topk_ids has {R} ranks, expected {n_ranks}")
    L = n_local_experts
    dst, e = np.divmod(ids, L)
    src = np.arange(R, dtype=np.int64)[:, None, None]
    t = np.arange(T, dtype=np.int64)[None, :, None]
    k = np.arange(K, dtype=np.int64)[None, None, :]
    return ((((dst * L + e) * R + src) * T * K) + t * K + k).reshape(-1)


def dispatch_numpy(tokens, topk_ids):
    """The baseline on the host: ``tokens [R, T, H]``, ``topk_ids [R, T, K]`` ->
    (grouped rows ``[R*T*K, H]``, ``order``): one stable argsort, one row gather."""
    tokens = np.asarray(tokens)
    ids = np.asarray(topk_ids)
    R, T, K = ids.shape
    order = np.argsort(ids.reshape(-1), kind="stable")
    rows = tokens.reshape(R * T, -1)[order // K]
    return rows, order


def dispatch_torch(tokens, topk_ids, out=None):
    """The PyTorch baseline (device-side, no host sync): ``tokens [R, T, H]`` (bf16),
    ``topk_ids [R, T, K]`` (int64) -> (grouped rows ``[R*T*K, H]``, ``order``). ``out``: a
    preallocated ``[R*T*K, H]`` output."""
    import torch
    R, T, K = topk_ids.shape
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    src_rows = tokens.reshape(R * T, tokens.shape[-1])
    rows = torch.index_select(src_rows, 0, order // K, out=out) if out is not None \
        else torch.index_select(src_rows, 0, order // K)
    return rows, order


def rank_range(cfg, topk_ids, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of destination ``rank`` in the baseline's grouped output."""
    ids = np.asarray(topk_ids).reshape(-1)
    L = cfg.layout.n_local_experts
    return int(np.count_nonzero(ids < rank * L)), int(np.count_nonzero(ids < (rank + 1) * L))


def rank_result(cfg, topk_ids, order, rank: int, rank_rows) -> reference.RankResult:
    """``reference.RankResult`` of destination ``rank`` from the baseline: ``order`` (the
    host copy of the argsort) and ``rank_rows``, its rows ``[start, end)`` of the grouped
    output (``rank_range``)."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    R, T, K = ids.shape
    L = cfg.layout.n_local_experts
    start, end = rank_range(cfg, ids, rank)
    flat = np.asarray(order, dtype=np.int64)[start:end]
    g = ids.reshape(-1)[flat]
    if g.size and (g.min() < rank * L or g.max() >= (rank + 1) * L):
        raise AssertionError(f"baseline rows of rank {rank} hold experts outside it")
    src, t, k = flat // (T * K), (flat // K) % T, flat % K
    counts = np.zeros((L, R), dtype=np.int64)
    np.add.at(counts, (g - rank * L, src), 1)
    row_offsets = cfg.token_fmt.pad_row_offsets(counts.sum(axis=1))
    src_info = np.stack([t, k], axis=1).astype(np.int32)
    return reference.RankResult.from_outputs(
        cfg, rank, np.asarray(rank_rows), row_offsets, np.arange(L, dtype=np.int32), src_info,
        counts.astype(np.int32))


def compare_grouping(cfg, expected, actual, limit: int = 10) -> list[str]:
    """Differences between two destinations' grouped outputs, rows free within an (expert,
    source) block: ``reference.compare`` for the compact layouts; for the capacity-strided
    layout (``ep_final_layout`` without ``ep_prod_reserve``), whose group offsets differ from
    the baseline's compact ones by design, the counts and every block's rows and src_info."""
    if not cfg.layout.capacity_strided:
        return reference.compare(cfg, expected, actual, limit=limit)
    r = expected.rank
    if not np.array_equal(np.asarray(expected.counts), np.asarray(actual.counts)):
        return [f"rank {r} counts differ"]
    try:
        x, a = expected.canonical(), actual.canonical()
    except ValueError as exc:
        return [str(exc)]
    diffs = []
    for e, s, xs, c in x.blocks():
        as_ = int(a.block_starts[e, s])
        for name in ("out_tokens", "src_info"):
            xv, av = getattr(x, name)[xs:xs + c], getattr(a, name)[as_:as_ + c]
            if not np.array_equal(xv, av):
                diffs.append(f"rank {r} {name}: expert {e} source {s} differs")
        if len(diffs) >= limit:
            break
    return diffs[:limit]


def measure(torch, cfg, sets, iters: int, warmup: int, gate, device_index: int,
            check_rank: int, progress) -> dict:
    """Time the baseline on the input ``sets`` (rotated) on its own torch stream. Returns
    ``{"round_trip": summary, "check_result": RankResult of check_rank for set 0}``."""
    dev = torch.device("cuda", device_index)
    stream = torch.cuda.Stream(device=dev)
    res = {}
    staged, out = [], None
    try:
        with torch.cuda.stream(stream):
            for toks, ids in sets:
                x = torch.from_numpy(np.stack(toks).view(np.int16)).to(dev).view(torch.bfloat16)
                a = torch.from_numpy(np.stack(ids).astype(np.int64)).to(dev)
                staged.append((x, a))
            R, T, K = staged[0][1].shape
            out = torch.empty((R * T * K, cfg.token_fmt.hid_dim), dtype=torch.bfloat16,
                              device=dev)
            rows, order = dispatch_torch(*staged[0], out=out)        # the check, untimed
        stream.synchronize()
        ids0 = np.stack(sets[0][1])
        start, end = rank_range(cfg, ids0, check_rank)
        got_rows = rows[start:end].view(torch.int16).cpu().numpy().view(np.uint16)
        res["check_result"] = rank_result(cfg, ids0, order.cpu().numpy(), check_rank, got_rows)
        del rows, order

        def once(i):
            x, a = staged[i % len(staged)]
            return timed_torch(torch, stream, gate, lambda: dispatch_torch(x, a, out=out))
        progress(f"  baseline: timing ({warmup} warm-up + {iters} iterations)")
        res["round_trip"] = summarize(sample(once, iters, warmup, gate))
    finally:
        stream.synchronize()
        staged = out = None
        torch.cuda.empty_cache()
    return res
