"""The bytes a dispatch round trip must move, by layout and token format,
and the bytes the PyTorch baseline's gather moves. GB/s figures divide these by the time
(1 GB = 1e9 B)."""

from __future__ import annotations

import math

import numpy as np


def out_row_bytes(fmt) -> int:
    """Bytes written per row of the grouped output: the row (``fmt.out_row_bytes``, else its
    shape) plus its scales for a quantising format (``out_scale_bytes_per_row``)."""
    b = getattr(fmt, "out_row_bytes", None)
    if b is None:
        b = math.prod(fmt.out_row_shape) * np.dtype(fmt.host_dtype).itemsize
    return int(b) + int(getattr(fmt, "out_scale_bytes_per_row", 0))


def round_trip_bytes(cfg, tokens_per_rank) -> dict:
    """Bytes the round trip must move for ``tokens_per_rank`` (an int for every rank, or one
    count per rank); the layout is ``cfg.ep_final_layout``'s.

    Staged layout: ``input`` (each input row read once), ``messages`` (each routed message,
    ``msg_size()`` bytes, written once by dispatch_async and read once by dispatch_wait),
    ``output`` (each output row written once); ``async`` = input + messages, ``wait`` =
    messages + output, ``total`` = input + 2 * messages + output. ``ep_final_layout`` (rows
    land in the grouped output directly): ``total`` = input + output (``messages`` 0; async
    and wait not split)."""
    fmt = cfg.token_fmt
    counts = [tokens_per_rank] * cfg.n_ranks if isinstance(tokens_per_rank, (int, np.integer)) \
        else list(tokens_per_rank)
    n_tokens = int(sum(counts))
    n_routed = n_tokens * fmt.top_k
    inp = n_tokens * fmt.input_row_bytes
    out = n_routed * out_row_bytes(fmt)
    if cfg.ep_final_layout:
        return {"layout": "final", "n_tokens": n_tokens, "n_routed": n_routed, "input": inp,
                "messages": 0, "output": out, "async": None, "wait": None,
                "total": inp + out}
    msgs = n_routed * fmt.msg_size()
    return {"layout": "staged", "n_tokens": n_tokens, "n_routed": n_routed, "input": inp,
            "messages": msgs, "output": out, "async": inp + msgs, "wait": msgs + out,
            "total": inp + 2 * msgs + out}


def baseline_bytes(cfg, tokens_per_rank: int) -> int:
    """Bytes the baseline's gather moves: each routed (token, k) row read once and written
    once (input rows: the baseline copies them as they are)."""
    n_routed = cfg.n_ranks * tokens_per_rank * cfg.token_fmt.top_k
    return 2 * n_routed * cfg.token_fmt.input_row_bytes


def combine_bytes(cfg, tokens_per_rank) -> dict:
    """Bytes a BF16 combine must move for ``tokens_per_rank`` (an int for every rank, or one
    count per rank): ``rows`` = the routed rows' bytes (``n_routed * H * 2``); ``async`` =
    2 * rows (each expert-output row read once and written once into its slot),
    ``wait`` = rows + ``output`` (each slot read once by the reduction, each output row
    ``H * 2`` bytes written once); ``total`` = 3 * rows + output. The PyTorch baseline
    (scatter into ``[T, K, H]``, then the weighted sum) moves the same."""
    H, K = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
    counts = [tokens_per_rank] * cfg.n_ranks if isinstance(tokens_per_rank, (int, np.integer)) \
        else list(tokens_per_rank)
    n_tokens = int(sum(counts))
    rows = n_tokens * K * H * 2
    out = n_tokens * H * 2
    return {"n_tokens": n_tokens, "n_routed": n_tokens * K, "rows": rows, "output": out,
            "async": 2 * rows, "wait": rows + out, "total": 3 * rows + out}


def op_bytes(cfg, tokens_per_rank, op: str) -> int:
    """Total bytes of what ``--op`` times: the dispatch round trip, the combine, or both
    (``moe``)."""
    if op == "dispatch":
        return round_trip_bytes(cfg, tokens_per_rank)["total"]
    if op == "combine":
        return combine_bytes(cfg, tokens_per_rank)["total"]
    return round_trip_bytes(cfg, tokens_per_rank)["total"] + \
        combine_bytes(cfg, tokens_per_rank)["total"]
