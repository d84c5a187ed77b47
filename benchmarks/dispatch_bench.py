"""Dispatch round-trip benchmark on an ``EmulatedWorld`` (DESIGN.md section 10, issue 3 item 8,
issue 6 item 1): epgen's dispatch_async + dispatch_wait against a device-to-device copy and
against the PyTorch baseline, all measured in the same process.

    PYTHONPATH=. python3 benchmarks/dispatch_bench.py                   # decode and prefill
    PYTHONPATH=. python3 benchmarks/dispatch_bench.py --tokens 128 --routing zipf --json out.json

Defaults: 8 emulated ranks, H=7168, K=8, E=256, BF16, 512 threads and 33 blocks per rank (the
8 ranks' 264 blocks are co-resident on the H200's 132 SMs), tokens per rank 128 (decode) and
4096 (prefill). ``--format BlockwiseFP8`` (or ``NVFP4``, ``MXFP8``) times the quantising round
trip: bf16 tokens in, quantized rows and scales out (``--input-scale`` for NVFP4).

Method
------
* **Inputs.** ``--sets`` (default 3) input sets are generated on the host (random tokens;
  uniform or Zipf-like routing, ``epgen.routing``) and staged on the GPU once. Iteration ``i``
  uses set ``i % sets``. For epgen the staged device arrays are swapped into each rank's
  ``tokens``/``topk_ids`` slots (the kernels take them as pointers), so nothing is copied
  inside or between timed calls and the world's own input buffers are left alone; the
  original buffers are put back afterwards. The baseline gets the same sets as torch tensors.
* **Timing** (every epgen number): a fork/join on a separate timing stream. The timing
  stream waits for all work already on every rank stream, runs the *gate* (below), records
  the start event; every rank stream waits on it; the measured calls are enqueued; every
  rank stream records an event the timing stream waits on; the timing stream records the end
  event. Time = start -> end, one synchronisation per iteration; the median over ``--iters``
  after ``--warmup`` iterations is reported. ``dispatch_async`` alone: the round trip's
  dispatch_wait is enqueued after the join, untimed. ``dispatch_wait`` alone: dispatch_async
  is enqueued before the fork (the fork waits for it), so only the receive side is timed.
* **Gate.** Without it, the interval would include the Python time to enqueue 16 launches
  (hundreds of microseconds, more than the decode round trip). The gate is a
  ``torch.cuda._sleep`` spin kernel on the timing stream ahead of the start event, long enough
  that all launches are queued before the start event completes; so the figure is device time
  (kernels, launch latencies, inter-stream waits) without host enqueue time. An iteration in
  which the start event had already completed when enqueueing finished is discarded and the
  gate doubled. ``--no-gate`` measures with host enqueue time included. The baseline and the
  copy are timed behind the same gate on their torch stream.
* **Bytes.** Staged layout (issue 6 item 1): input read once (``sum T_r * H * 2``, bf16 for
  every format), each routed message of the format written and read once (``2 * n_routed *
  msg_bytes``: 14368 B for BF16, 7424 for BlockwiseFP8 and MXFP8, 4064 for NVFP4 at H=7168,
  K=8), each output row of the format written once with its scales (``n_routed * (row +
  scale bytes)``: 2H for BF16, H + 4H/128 for BlockwiseFP8, H/2 + H/16 for NVFP4, H + H/32
  for MXFP8); ``n_routed = sum T_r * K``. dispatch_async alone: input + messages
  written; dispatch_wait alone: messages read + output rows. ``ep_final_layout``: input +
  output rows. GB/s = bytes / time (1 GB = 1e9 B).
* **Copy.** ``copy_`` of a ``--copy-mib`` buffer in torch (and ``b[...] = a`` in CuPy when
  CuPy imports), bytes = read + written; the larger bandwidth is the reference. fraction =
  (bytes / time) / copy bandwidth.
* **PyTorch baseline** (DESIGN section 10; the same bf16 gather for every ``--format``, and for
  a quantising format checked against the reference's BF16 grouping): inputs
  ``tokens [R, T, H]`` bf16 and
  ``topk [R, T, K]`` int64 on the GPU; ``order = argsort(topk.flatten(), stable=True)`` (one
  argsort; sorting by global expert id, stably, is sorting by the key
  ``((dst*L + e)*R + src)*T*K + t*K + k``: destination, local expert, source, token), then one
  ``index_select`` of the token rows ``order // K`` into a preallocated grouped output (all
  ranks' rows concatenated, each rank's in epgen's grouping). Device-side only. Checked once,
  untimed, against epgen's output for one rank (rows compared per (expert, source) block,
  order within a block free).
* **Correctness.** Before timing, ``world.dispatch`` on set 0 is compared with
  ``epgen.reference.dispatch`` (``reference.assert_match``); after the round-trip timing the
  world's last output is compared with the reference of the set it used.
* **Memory.** Per shape the baseline runs first, then epgen, each freeing its memory before
  the next. Each phase's device memory is estimated up front (``world_memory`` from
  ``cfg.layout``); a phase that needs more than ``--mem-fraction`` of the free memory is
  skipped with a message saying what it needs. The receive buffer has
  ``L * R * recv_block_capacity`` message slots; ``--block-capacity fit`` (default) sets
  ``recv_block_capacity`` to the largest (expert, source) block the staged routings produce,
  rounded up to 64 (capped at T), since the reference sizing (``full``:
  ``max_tokens_per_rank`` slots per block) needs about 152 GB (141 GiB) at prefill, more
  than an H200 holds. The capacity bounds memory only: the same bytes move, to other
  addresses. A skewed routing needs a large capacity (its hottest block): at prefill about
  101 GB at ``--zipf-s 0.8`` (the default), 129 GB at 1.0, 144 GB at 1.2.
* **Output.** Progress on stderr; then the copy bandwidth, the checks and a table (shape,
  variant, median us, GB/s, fraction of copy bandwidth, speed-up over the baseline) on
  stdout; ``--json FILE`` gets every number (all statistics, bytes, memory estimates,
  configurations), the device, the date and the git commit. Exit status 1 when a check
  failed or a phase raised.

The pure helpers (bytes, memory, the baseline's grouping, argument parsing, the table) import
with numpy only; CUDA, torch and CuPy are imported when a benchmark runs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

try:
    import epgen  # noqa: F401
except ImportError:  # run as a script from anywhere: the repository root holds epgen/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epgen import reference, routing  # noqa: E402
from epgen.config import BOOL_PARAMS, EPConfig  # noqa: E402
from epgen.formats import BF16Format, format_names, make_format  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE_NAMES = {128: "decode", 4096: "prefill"}
SMALL_SHAPE_TOKENS = 512          # at most this many tokens per rank: decode-like defaults
CAPACITY_MULTIPLE = 64            # --block-capacity fit rounds up to this
ALLOC_GRANULE = 2 << 20           # device allocations rounded up to this in the estimates
GiB = 1 << 30


# =============================================================================================
# Pure helpers (numpy only)
# =============================================================================================
def shape_name(tokens_per_rank: int) -> str:
    return SHAPE_NAMES.get(int(tokens_per_rank), f"T={tokens_per_rank}")


def default_iters(tokens_per_rank: int) -> int:
    return 100 if tokens_per_rank <= SMALL_SHAPE_TOKENS else 20


def default_warmup(tokens_per_rank: int) -> int:
    return 10 if tokens_per_rank <= SMALL_SHAPE_TOKENS else 3


def _token_list(values) -> list[int]:
    out = []
    for v in values:
        for part in str(v).split(","):
            if part.strip():
                n = int(part)
                if n <= 0:
                    raise argparse.ArgumentTypeError(f"tokens per rank must be > 0, got {n}")
                out.append(n)
    return out


def _capacity(text: str):
    if text in ("fit", "full"):
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--block-capacity must be 'fit', 'full' or a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"--block-capacity must be positive, got {n}")
    return n


def _positive(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dispatch_bench",
        description="Time epgen's dispatch round trip (dispatch_async + dispatch_wait) on an "
                    "EmulatedWorld against a device-to-device copy and the PyTorch baseline.",
        epilog="The method is described at the top of benchmarks/dispatch_bench.py.")
    ap.add_argument("--ranks", type=_positive, default=8, help="emulated ranks (default 8)")
    ap.add_argument("--hidden", type=_positive, default=7168, help="hidden size H (default 7168)")
    ap.add_argument("--topk", type=_positive, default=8, help="experts per token K (default 8)")
    ap.add_argument("--experts", type=_positive, default=256, help="experts E (default 256)")
    ap.add_argument("--format", default="BF16", choices=format_names(), metavar="NAME",
                    help="token format: " + ", ".join(format_names()) + " (default BF16)")
    ap.add_argument("--input-scale", type=float, default=1.0, metavar="S",
                    help="global input scale of the formats that take one (NVFP4; default 1.0)")
    ap.add_argument("--tokens", nargs="+", default=["128", "4096"], metavar="T",
                    help="tokens per rank, one shape each: '128 4096' or '128,4096' "
                         "(default: 128 4096 = decode and prefill)")
    ap.add_argument("--threads", type=_positive, default=512,
                    help="num_threads per block (default 512)")
    ap.add_argument("--sms", type=_positive, default=33,
                    help="n_sms = blocks per rank (default 33: 8 x 33 blocks on 132 SMs)")
    ap.add_argument("--flag", action="append", default=[], choices=BOOL_PARAMS, metavar="NAME",
                    help="set an EPConfig bool flag (repeatable), e.g. ep_final_layout; "
                         "default: none (the staged variant)")
    ap.add_argument("--iters", type=_positive, default=None,
                    help="timed iterations per measurement (default: 100 at <= 512 tokens per "
                         "rank, else 20)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed iterations first (default: 10 at <= 512 tokens, else 3)")
    ap.add_argument("--sets", type=_positive, default=3,
                    help="input sets rotated through the iterations (default 3)")
    ap.add_argument("--routing", choices=("uniform", "zipf"), default="uniform",
                    help="top-k routing: uniform, or Zipf-like expert popularity (default uniform)")
    ap.add_argument("--zipf-s", type=float, default=0.8,
                    help="Zipf exponent of --routing zipf (default 0.8; popularity 1/rank^s over "
                         "shuffled experts, the hottest ~24x the mean). The hottest (expert, "
                         "source) block sets the receive buffers' size: at prefill the world "
                         "needs ~101 GB at s=0.8, ~129 GB at s=1.0, ~144 GB at s=1.2")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--block-capacity", type=_capacity, default="fit",
                    help="recv_block_capacity: 'fit' (default: the routings' largest (expert, "
                         "source) block, rounded up to 64), 'full' (max_tokens_per_rank, the "
                         "reference sizing) or a number")
    ap.add_argument("--copy-mib", type=_positive, default=1024,
                    help="device-to-device copy size in MiB (default 1024)")
    ap.add_argument("--copy-iters", type=_positive, default=20,
                    help="timed copies (default 20)")
    ap.add_argument("--mem-fraction", type=float, default=0.9,
                    help="skip a phase needing more than this fraction of free device memory "
                         "(default 0.9)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    ap.add_argument("--check-rank", type=int, default=0,
                    help="rank whose baseline output is checked against epgen's (default 0)")
    ap.add_argument("--no-gate", action="store_true",
                    help="no spin kernel ahead of the start event: times include host enqueue")
    ap.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--no-post-check", action="store_true",
                    help="skip the check of the world's output after the round-trip timing")
    ap.add_argument("--json", metavar="FILE", help="write every number here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.tokens = _token_list(args.tokens)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(f"argument --tokens: {exc}")
    if not args.tokens:
        ap.error("argument --tokens: give at least one token count")
    if args.warmup is not None and args.warmup < 0:
        ap.error("argument --warmup: must be >= 0")
    if not 0 < args.mem_fraction <= 1:
        ap.error("argument --mem-fraction: must be in (0, 1]")
    fmt = make_format(args.format, 256, 1)
    if getattr(fmt, "uses_input_scale", False):
        try:
            fmt.check_input_scale(args.input_scale)
        except ValueError as exc:
            ap.error(f"argument --input-scale: {exc}")
    if args.experts % args.ranks:
        ap.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if not 0 <= args.check_rank < args.ranks:
        ap.error(f"--check-rank must be in [0, {args.ranks})")
    if args.zipf_s <= 0:
        ap.error("argument --zipf-s: must be > 0")
    args.flag = sorted(set(args.flag))
    for T in args.tokens:          # every parameter error now, before any GPU work
        try:
            make_config(args, T)
        except ValueError as exc:
            ap.error(f"tokens per rank {T}: {exc}")
    return args


def variant_name(flags) -> str:
    """``staged`` for the default flags, else the flags joined by ``+``."""
    return "+".join(sorted(flags)) if flags else "staged"


def make_config(args, tokens_per_rank: int, block_capacity=None) -> EPConfig:
    """The ``EPConfig`` of one shape (P2P only, ``max_tokens_per_rank = tokens_per_rank``);
    ``block_capacity`` None means the reference sizing."""
    cap = None if block_capacity is None or block_capacity >= tokens_per_rank \
        else int(block_capacity)
    return EPConfig(num_threads=args.threads, n_sms=args.sms, n_experts=args.experts,
                    n_ranks=args.ranks, max_tokens_per_rank=tokens_per_rank,
                    p2p_world_size=args.ranks, use_shmem=False,
                    token_fmt=make_format(getattr(args, "format", "BF16"), args.hidden,
                                          args.topk),
                    recv_block_capacity=cap, **{f: True for f in args.flag})


def bf16_config(cfg) -> EPConfig:
    """``cfg`` with the BF16 format of the same shape: what the PyTorch baseline moves."""
    fmt = cfg.token_fmt
    if isinstance(fmt, BF16Format):
        return cfg
    return cfg.replace(token_fmt=BF16Format(hid_dim=fmt.hid_dim, top_k=fmt.top_k,
                                            alignment=fmt.alignment))


def make_input_sets(cfg, tokens_per_rank: int, n_sets: int, routing_kind: str = "uniform",
                    zipf_s: float = 0.8, seed: int = 0) -> list[tuple[list, list]]:
    """``n_sets`` inputs ``(tokens, topk_ids)`` (one ``[T, H]`` uint16 and one ``[T, K]`` int32
    array per rank). Zipf: the same shuffled popularity for every set (a few hot experts)."""
    weights = None
    if routing_kind == "zipf":
        weights = routing.zipf_weights(cfg.n_experts, zipf_s, rng=np.random.default_rng(seed + 1))
    elif routing_kind != "uniform":
        raise ValueError(f"unknown routing {routing_kind!r}")
    rng = np.random.default_rng(seed)
    return [routing.routing(rng, cfg, tokens_per_rank, weights) for _ in range(n_sets)]


def block_counts(topk_ids, n_experts: int) -> np.ndarray:
    """``[n_sources, n_experts]``: tokens each source sends to each global expert (the fill of
    every (expert, source) block of the receive buffers)."""
    return np.stack([np.bincount(np.asarray(a, dtype=np.int64).ravel(), minlength=n_experts)
                     for a in topk_ids])


def fit_block_capacity(sets, n_experts: int, tokens_per_rank: int,
                       multiple: int = CAPACITY_MULTIPLE) -> int:
    """Smallest ``recv_block_capacity`` that holds every (expert, source) block of every set,
    rounded up to ``multiple`` and capped at ``tokens_per_rank``."""
    need = max(int(block_counts(ids, n_experts).max(initial=0)) for _toks, ids in sets)
    need = max(need, 1)
    return min(tokens_per_rank, -(-need // multiple) * multiple)


def _out_row_bytes(fmt) -> int:
    """Bytes of one output row (payload only)."""
    b = getattr(fmt, "out_row_bytes", None)
    if b is not None:
        return int(b)
    return int(math.prod(fmt.out_row_shape) * np.dtype(fmt.host_dtype).itemsize)


def _out_scale_bytes(fmt) -> int:
    """Bytes of output scales per output row (0 without scales)."""
    return int(getattr(fmt, "out_scale_bytes_per_row", 0))


def round_trip_bytes(cfg, tokens_per_rank) -> dict:
    """Bytes the round trip must move (issue 6 item 1) for ``tokens_per_rank`` (an int for
    every rank, or one count per rank).

    Staged layout: ``input`` (each input row read once), ``messages`` (each routed message,
    ``msg_size()`` bytes, written once by dispatch_async and read once by dispatch_wait),
    ``output`` (each output row written once, with its scales for a quantising format:
    ``out_row_bytes + out_scale_bytes_per_row``); ``async`` = input + messages, ``wait`` =
    messages + output, ``total`` = input + 2 * messages + output. ``ep_final_layout``:
    ``total`` = input + output (``messages`` 0; async and wait not split)."""
    fmt = cfg.token_fmt
    counts = [tokens_per_rank] * cfg.n_ranks if isinstance(tokens_per_rank, (int, np.integer)) \
        else list(tokens_per_rank)
    n_tokens = int(sum(counts))
    n_routed = n_tokens * fmt.top_k
    inp = n_tokens * fmt.input_row_bytes
    out = n_routed * (_out_row_bytes(fmt) + _out_scale_bytes(fmt))
    if cfg.ep_final_layout:
        return {"layout": "final", "n_tokens": n_tokens, "n_routed": n_routed, "input": inp,
                "messages": 0, "output": out, "async": None, "wait": None,
                "total": inp + out}
    msgs = n_routed * fmt.msg_size()
    return {"layout": "staged", "n_tokens": n_tokens, "n_routed": n_routed, "input": inp,
            "messages": msgs, "output": out, "async": inp + msgs, "wait": msgs + out,
            "total": inp + 2 * msgs + out}


def baseline_bytes(cfg, tokens_per_rank: int) -> int:
    """Bytes the baseline's gather moves: each routed row read once and written once."""
    n_routed = cfg.n_ranks * tokens_per_rank * cfg.token_fmt.top_k
    return 2 * n_routed * _out_row_bytes(cfg.token_fmt)


def _granule(nbytes: int) -> int:
    return -(-max(int(nbytes), 1) // ALLOC_GRANULE) * ALLOC_GRANULE


def world_memory(cfg) -> dict:
    """Device bytes an ``EmulatedWorld`` of ``cfg`` allocates (``epgen/runtime/world.py``'s
    per-rank buffers, from ``cfg.layout``), each allocation rounded up to 2 MiB."""
    lay, fmt = cfg.layout, cfg.token_fmt
    T, K, H = cfg.max_tokens_per_rank, fmt.top_k, fmt.hid_dim
    per_rank = {
        "tokens": T * H * 2,
        "topk_ids": T * K * 4,
        "send_buf": lay.send_buf_bytes,
        "recv_buf": lay.recv_buf_bytes,
        "recv_count": lay.recv_count_bytes,
        "counters": lay.counter_bytes,
        "out_tokens": lay.max_out_rows * _out_row_bytes(fmt),
        "out_scales": lay.max_out_rows * _out_scale_bytes(fmt),
        "row_offsets": (lay.n_groups + 1) * 4,
        "expert_ids": lay.n_groups * 4,
        "src_info": lay.max_out_rows * 8,
    }
    rank_total = sum(_granule(v) for v in per_rank.values())
    extra = 2 * cfg.n_ranks * _granule(8 * cfg.p2p_world_size) + 8 * ALLOC_GRANULE  # ptrs, diag
    return {"per_rank": per_rank, "per_rank_total": rank_total,
            "total": cfg.n_ranks * rank_total + extra}


def staged_inputs_memory(cfg, tokens_per_rank: int, n_sets: int) -> int:
    """Device bytes of the staged epgen input sets."""
    fmt = cfg.token_fmt
    per = _granule(tokens_per_rank * fmt.hid_dim * 2) + _granule(tokens_per_rank * fmt.top_k * 4)
    return n_sets * cfg.n_ranks * per


def baseline_memory(cfg, tokens_per_rank: int, n_sets: int) -> int:
    """Device bytes of the baseline: staged sets, the grouped output and the sort's buffers
    (keys, indices, radix-sort scratch, ``order // K``: about 8 int64 arrays), plus 256 MiB
    for torch's allocator."""
    R, T, K, H = cfg.n_ranks, tokens_per_rank, cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    n = R * T * K
    sets = n_sets * (_granule(R * T * H * 2) + _granule(n * 8))
    return sets + _granule(n * H * 2) + 8 * _granule(n * 8) + 256 * (1 << 20)


# ---- the baseline's grouping ----------------------------------------------------------------
def baseline_sort_key(topk_ids, n_local_experts: int, n_ranks: int) -> np.ndarray:
    """The composite key of DESIGN section 10 for ``topk_ids [R, T, K]`` (numpy):
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


def baseline_dispatch_numpy(tokens, topk_ids):
    """The baseline on the host: ``tokens [R, T, H]``, ``topk_ids [R, T, K]`` ->
    (grouped rows ``[R*T*K, H]``, ``order``): one stable argsort, one row gather."""
    tokens = np.asarray(tokens)
    ids = np.asarray(topk_ids)
    R, T, K = ids.shape
    order = np.argsort(ids.reshape(-1), kind="stable")
    rows = tokens.reshape(R * T, -1)[order // K]
    return rows, order


def baseline_dispatch_torch(tokens, topk_ids, out=None):
    """The PyTorch baseline a one-GPU user would write (device-side, no host sync):
    ``tokens [R, T, H]`` (bf16), ``topk_ids [R, T, K]`` (int64) -> (grouped rows
    ``[R*T*K, H]``, ``order``). ``out``: a preallocated ``[R*T*K, H]`` output."""
    import torch
    R, T, K = topk_ids.shape
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    src_rows = tokens.reshape(R * T, tokens.shape[-1])
    rows = torch.index_select(src_rows, 0, order // K, out=out) if out is not None \
        else torch.index_select(src_rows, 0, order // K)
    return rows, order


def baseline_rank_range(cfg, topk_ids, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of destination ``rank`` in the baseline's grouped output."""
    ids = np.asarray(topk_ids).reshape(-1)
    L = cfg.layout.n_local_experts
    return int(np.count_nonzero(ids < rank * L)), int(np.count_nonzero(ids < (rank + 1) * L))


def baseline_rank_result(cfg, topk_ids, order, rank: int, rank_rows) -> reference.RankResult:
    """``reference.RankResult`` of destination ``rank`` from the baseline: ``order`` (the
    host copy of the argsort) and ``rank_rows``, its rows ``[start, end)`` of the grouped
    output (``baseline_rank_range``)."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    R, T, K = ids.shape
    L = cfg.layout.n_local_experts
    start, end = baseline_rank_range(cfg, ids, rank)
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


# ---- statistics, table, provenance ----------------------------------------------------------
def summarize(samples_ms) -> dict:
    """Median, min, max, mean, p10, p90 (ms) and n of a list of timings."""
    s = sorted(float(x) for x in samples_ms)
    if not s:
        return {"n": 0}
    q = lambda p: s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]  # noqa: E731
    return {"n": len(s), "median_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1],
            "mean_ms": statistics.fmean(s), "p10_ms": q(0.1), "p90_ms": q(0.9)}


def rate(nbytes, ms, copy_gbps=None) -> tuple:
    """(GB/s, fraction of ``copy_gbps``) for ``nbytes`` moved in ``ms``; None when unknown."""
    if nbytes is None or not ms:
        return None, None
    gbps = nbytes / ms / 1e6
    return gbps, (gbps / copy_gbps if copy_gbps else None)


def format_table(rows) -> str:
    """Rows: dicts with ``shape, T, routing, variant, us, gbps, frac, speedup`` (None where
    there is no number) and an optional ``note``."""
    def cell(v, fmt):
        width = int(fmt.split(".")[0])
        return f"{'-':>{width}}" if v is None else format(v, fmt)
    vw = max([28] + [len(r["variant"]) for r in rows])
    lines = [f"{'shape':<8} {'T':>5} {'routing':<8} {'variant':<{vw}} {'median us':>10} "
             f"{'GB/s':>8} {'frac copy':>9} {'vs torch':>8}"]
    for r in rows:
        sp = r.get("speedup")
        line = (f"{r['shape']:<8} {r['T']:>5} {r['routing']:<8} {r['variant']:<{vw}} "
                f"{cell(r.get('us'), '10.1f')} {cell(r.get('gbps'), '8.1f')} "
                f"{cell(r.get('frac'), '9.3f')} {'-' if sp is None else f'{sp:.2f}x':>8}")
        if r.get("note"):
            line += f"  ({r['note']})"
        lines.append(line)
    return "\n".join(lines)


def git_commit(repo: str = REPO_ROOT) -> tuple[str, bool | None]:
    """(``git rev-parse --short HEAD`` or "unknown", whether the tree has changes or None).
    Where the tree is a copy without ``.git`` (the device machine), ``$EPGEN_COMMIT`` names
    the commit it was copied from."""
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


def _jsonable(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _fmt_gb(n) -> str:
    return f"{n / 1e9:.2f} GB"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# =============================================================================================
# GPU parts
# =============================================================================================
class Gate:
    """A ``torch.cuda._sleep`` spin kernel enqueued ahead of a start event (see the module
    docstring); ``grow()`` doubles it after an overrun."""

    MAX_MS = 500.0

    def __init__(self, torch, device_index: int, ms: float = 2.0):
        self.torch = torch
        self.device = torch.device("cuda", device_index)
        self.ms = ms
        self.overruns = 0
        s = torch.cuda.Stream(device=self.device)
        rates = []
        for cycles in (1_000_000, 4_000_000):
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            with torch.cuda.stream(s):
                e0.record(s)
                torch.cuda._sleep(cycles)
                e1.record(s)
            e1.synchronize()
            rates.append(cycles / max(e0.elapsed_time(e1), 1e-3))
        self.cycles_per_ms = rates[-1]
        self._external = {}

    def enqueue(self, torch_stream) -> None:
        with self.torch.cuda.stream(torch_stream):
            self.torch.cuda._sleep(int(self.ms * self.cycles_per_ms))

    def enqueue_core(self, core_stream) -> None:
        """Enqueue on a cuda.core stream (through a torch ``ExternalStream`` of its handle)."""
        h = int(core_stream.handle)
        ext = self._external.get(h)
        if ext is None:
            ext = self._external[h] = self.torch.cuda.ExternalStream(h, device=self.device)
        self.enqueue(ext)

    def grow(self) -> None:
        self.overruns += 1
        if self.ms >= self.MAX_MS:
            raise RuntimeError(f"the {self.ms:.0f} ms gate still expired before the host had "
                               "enqueued one iteration; use --no-gate")
        self.ms = min(2 * self.ms, self.MAX_MS)

    def describe(self) -> dict:
        return {"final_ms": self.ms, "overruns": self.overruns,
                "cycles_per_ms": self.cycles_per_ms}


def sample(once, iters: int, warmup: int, gate) -> list[float]:
    """Run ``once(i) -> (ms, overran)`` for ``warmup`` + ``iters`` good iterations; an
    overrun is discarded and grows the gate."""
    times, i, good = [], 0, 0
    while good < warmup + iters:
        ms, overran = once(i)
        i += 1
        if overran:
            gate.grow()
            continue
        if good >= warmup:
            times.append(ms)
        good += 1
    return times


def mem_info(device) -> tuple[int, int]:
    """(free, total) device bytes."""
    from backends.cuda import check, compat, using_device
    with using_device(device):
        free, total = check(compat.driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


def _import_torch():
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    return torch, None


def _timed_torch(torch, stream, gate, body) -> tuple[float, bool]:
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    if gate is not None:
        gate.enqueue(stream)
    with torch.cuda.stream(stream):
        start.record(stream)
        body()
        end.record(stream)
    overran = gate is not None and start.query()
    end.synchronize()
    return start.elapsed_time(end), overran


def measure_copy(torch, device_index: int, mib: int, iters: int, gate) -> dict:
    """Device-to-device copy bandwidth (read + write bytes) in torch and, when it imports, in
    CuPy; ``gbps`` is the larger."""
    n = mib << 20
    res = {"bytes_per_copy": 2 * n, "size_mib": mib}
    dev = torch.device("cuda", device_index)
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        a = torch.empty(n, dtype=torch.uint8, device=dev).fill_(7)
        b = torch.empty_like(a)
    stream.synchronize()
    t = sample(lambda i: _timed_torch(torch, stream, gate, lambda: b.copy_(a)), iters, 3, gate)
    res["torch"] = summarize(t)
    res["torch"]["gbps"] = 2 * n / res["torch"]["median_ms"] / 1e6
    del a, b
    torch.cuda.empty_cache()
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001
        res["cupy"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    else:
        with cupy.cuda.Device(device_index):
            ca = cupy.full(n, 7, dtype=cupy.uint8)
            cb = cupy.empty_like(ca)
            cs = cupy.cuda.ExternalStream(stream.cuda_stream)

            def cp_copy():
                with cs:
                    cb[...] = ca
            t = sample(lambda i: _timed_torch(torch, stream, gate, cp_copy), iters, 3, gate)
            res["cupy"] = summarize(t)
            res["cupy"]["gbps"] = 2 * n / res["cupy"]["median_ms"] / 1e6
            del ca, cb
            cupy.get_default_memory_pool().free_all_blocks()
    res["gbps"] = max(v["gbps"] for v in (res["torch"], res.get("cupy", {}))
                      if isinstance(v, dict) and "gbps" in v)
    return res


# ---- epgen ------------------------------------------------------------------------------------
class _StagedInputs:
    """Input sets on the device; ``use(i)`` points every rank's input slots at set
    ``i % n``; ``restore()`` puts the world's own buffers back."""

    def __init__(self, world, sets):
        from backends import cuda
        self.world = world
        self.orig = [(rk.tokens, rk.topk_ids, rk.n_tokens) for rk in world.ranks]
        self.sets = []
        for toks, ids in sets:
            per_rank = []
            for rk, x, a in zip(world.ranks, toks, ids):
                T = x.shape[0]
                dx = cuda.to_device(np.ascontiguousarray(x, dtype=np.uint16),
                                    device=world.device, stream=rk.stream)
                da = cuda.to_device(np.ascontiguousarray(a, dtype=np.int32),
                                    device=world.device, stream=rk.stream)
                per_rank.append((dx, da, T))
            self.sets.append(per_rank)
        world.synchronize()
        self.current = None

    def use(self, i: int) -> int:
        j = i % len(self.sets)
        for rk, (dx, da, T) in zip(self.world.ranks, self.sets[j]):
            rk.tokens, rk.topk_ids, rk.n_tokens = dx, da, T
        self.current = j
        return j

    def restore(self) -> None:
        for rk, (x, a, T) in zip(self.world.ranks, self.orig):
            rk.tokens, rk.topk_ids, rk.n_tokens = x, a, T


def _event_done(event) -> bool:
    """Whether a cuda.core event has completed (``is_done``, else ``cuEventQuery``)."""
    done = getattr(event, "is_done", None)
    if done is not None:
        return bool(done)
    from backends.cuda import compat
    return int(compat.driver().cuEventQuery(event.handle)[0]) == 0


def _fork_join(cuda, ts, world, gate, body) -> tuple[float, bool]:
    for rk in world.ranks:
        ts.wait(rk.stream.record())
    if gate is not None:
        gate.enqueue_core(ts)
    start = cuda.record(ts)
    for rk in world.ranks:
        rk.stream.wait(start)
    body()
    for rk in world.ranks:
        ts.wait(rk.stream.record())
    end = cuda.record(ts)
    overran = gate is not None and _event_done(start)
    return cuda.elapsed_ms(start, end), overran


def trim_memory_pool(device) -> None:
    """Give the device's current memory pool's free memory back (``cuMemPoolTrimTo``), so
    that torch can use what a torn-down world held; best effort."""
    try:
        from backends.cuda import check, compat, using_device
        drv = compat.driver()
        with using_device(device):
            dev = check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
            pool = check(drv.cuDeviceGetMemPool(dev), "cuDeviceGetMemPool")
            check(drv.cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo")
    except Exception as exc:  # noqa: BLE001
        log(f"  (memory pool not trimmed: {type(exc).__name__}: {exc})")


def bench_epgen(cfg, sets, iters, warmup, gate, *, device=None, check_rank=0,
                post_check=True, progress=log, input_scale=1.0) -> dict:
    """Build the world, check it against the reference on set 0, time dispatch_async,
    dispatch_wait and the round trip (fork/join, rotated staged inputs), check the last
    output. Returns the results and, under ``"check_result"``, the world's RankResult of
    ``check_rank`` for set 0 (for the baseline check)."""
    from backends import cuda

    import epgen
    res = {}
    t0 = time.perf_counter()
    world = epgen.EmulatedWorld(cfg, device=device, input_scale=input_scale)
    device = world.device
    res["build_s"] = time.perf_counter() - t0
    staged = None
    try:
        progress("  epgen: correctness check on set 0 (world.dispatch vs reference.dispatch)")
        got = world.dispatch(*sets[0])
        reference.assert_match(cfg, reference.dispatch(cfg, *sets[0], input_scale=input_scale),
                               got)
        res["check"] = "ok"
        res["check_result"] = got[check_rank]
        del got

        staged = _StagedInputs(world, sets)
        ts = cuda.create_stream(device)

        def async_once(i):
            staged.use(i)
            ms, over = _fork_join(cuda, ts, world, gate, world.dispatch_async)
            world.dispatch_wait()                  # untimed: drains the buffers
            return ms, over

        def wait_once(i):
            staged.use(i)
            world.dispatch_async()                 # untimed: the fork waits for it
            return _fork_join(cuda, ts, world, gate, world.dispatch_wait)

        def round_once(i):
            staged.use(i)
            return _fork_join(cuda, ts, world, gate,
                              lambda: (world.dispatch_async(), world.dispatch_wait()))

        for name, once in (("dispatch_async", async_once), ("dispatch_wait", wait_once),
                           ("round_trip", round_once)):
            progress(f"  epgen: timing {name} ({warmup} warm-up + {iters} iterations)")
            res[name] = summarize(sample(once, iters, warmup, gate))
            world.check(f"benchmark {name}")
        if post_check:
            last = staged.current
            progress(f"  epgen: checking the last round trip's output (set {last})")
            reference.assert_match(cfg, reference.dispatch(cfg, *sets[last],
                                                           input_scale=input_scale),
                                   world.results())
            res["post_check"] = "ok"
    finally:
        if staged is not None:
            staged.restore()
        world.synchronize()
        del staged, world
        gc.collect()
        device.sync()
        trim_memory_pool(device)
    return res


# ---- PyTorch baseline -------------------------------------------------------------------------
def bench_baseline(torch, cfg, sets, iters, warmup, gate, device_index, check_rank,
                   progress=log) -> dict:
    """Time the baseline on the staged sets. Returns the results and, under
    ``"check_result"``, the RankResult of ``check_rank`` it produced for set 0 (untimed)."""
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
            rows, order = baseline_dispatch_torch(*staged[0], out=out)   # the check, untimed
        stream.synchronize()
        ids0 = np.stack(sets[0][1])
        start, end = baseline_rank_range(cfg, ids0, check_rank)
        got_rows = rows[start:end].view(torch.int16).cpu().numpy().view(np.uint16)
        res["check_result"] = baseline_rank_result(cfg, ids0, order.cpu().numpy(), check_rank,
                                                   got_rows)
        del rows, order

        def once(i):
            x, a = staged[i % len(staged)]
            return _timed_torch(torch, stream, gate,
                                lambda: baseline_dispatch_torch(x, a, out=out))
        progress(f"  baseline: timing ({warmup} warm-up + {iters} iterations)")
        res["round_trip"] = summarize(sample(once, iters, warmup, gate))
    finally:
        stream.synchronize()
        del staged, out
        torch.cuda.empty_cache()
    return res


# ---- one shape, the run -----------------------------------------------------------------------
def run_shape(args, T, torch, gate, copy_gbps, progress=log) -> dict:
    """One shape: inputs, memory estimates, the baseline phase, the epgen phase, the baseline
    check against epgen's output. Phases that do not fit or fail are reported, not raised."""
    iters = args.iters or default_iters(T)
    warmup = default_warmup(T) if args.warmup is None else args.warmup
    name = shape_name(T)
    fmt_name = getattr(args, "format", "BF16")
    input_scale = getattr(args, "input_scale", 1.0)
    out = {"shape": name, "tokens_per_rank": T, "routing": args.routing,
           "zipf_s": args.zipf_s if args.routing == "zipf" else None,
           "format": fmt_name, "variant": variant_name(args.flag), "iters": iters,
           "warmup": warmup}
    progress(f"shape {name} (T={T}, routing {args.routing}): generating {args.sets} input sets")
    sets = make_input_sets(make_config(args, T), T, args.sets, args.routing, args.zipf_s,
                           args.seed)
    need = fit_block_capacity(sets, args.experts, T, multiple=1)
    if args.block_capacity == "fit":
        cap = fit_block_capacity(sets, args.experts, T)
    elif args.block_capacity == "full":
        cap = T
    else:
        cap = min(int(args.block_capacity), T)
    out["largest_block"] = need
    out["recv_block_capacity"] = cap
    cfg = make_config(args, T, cap)
    base_cfg = bf16_config(cfg)             # the baseline gathers bf16 rows, whatever the format
    out["config"] = cfg.describe()
    nbytes = round_trip_bytes(cfg, T)
    out["bytes"] = nbytes
    out["baseline_bytes"] = baseline_bytes(base_cfg, T)
    wm = world_memory(cfg)
    mem = {"world": wm["total"], "world_per_rank": wm["per_rank"],
           "staged_inputs": staged_inputs_memory(cfg, T, args.sets),
           "baseline": baseline_memory(base_cfg, T, args.sets),
           "world_full_capacity": world_memory(make_config(args, T))["total"]}
    mem["epgen_phase"] = mem["world"] + mem["staged_inputs"]
    out["memory"] = mem
    progress(f"  memory: epgen phase {_fmt_gb(mem['epgen_phase'])} (world "
             f"{_fmt_gb(mem['world'])} at recv_block_capacity={cap}, largest block {need}; "
             f"{_fmt_gb(mem['world_full_capacity'])} at full capacity), baseline phase "
             f"{_fmt_gb(mem['baseline'])}")

    # ---- baseline phase (first: torch gives its memory back reliably) ---------------------
    baseline_result = None
    if args.no_baseline:
        out["baseline_skipped"] = "--no-baseline"
    elif torch is None:
        out["baseline_skipped"] = "torch with CUDA is not available"
    else:
        free, _total = mem_info(args.device)
        mem["free_before_baseline"] = free
        if mem["baseline"] > args.mem_fraction * free:
            out["baseline_skipped"] = (f"needs {_fmt_gb(mem['baseline'])} of device memory, "
                                       f"more than {args.mem_fraction:.0%} of the "
                                       f"{_fmt_gb(free)} free")
        else:
            try:
                b = bench_baseline(torch, base_cfg, sets, iters, warmup, gate, args.device,
                                   args.check_rank, progress)
            except Exception as exc:  # noqa: BLE001 - reported; the rest still runs
                out["baseline_error"] = f"{type(exc).__name__}: {exc}"
                progress(f"  baseline FAILED: {out['baseline_error']}")
            else:
                baseline_result = b.pop("check_result")
                m = b["round_trip"]
                m["bytes"] = out["baseline_bytes"]
                m["gbps"], m["fraction_of_copy"] = rate(m["bytes"], m["median_ms"], copy_gbps)
                out["baseline"] = b
    if "baseline_skipped" in out:
        progress(f"  baseline skipped: {out['baseline_skipped']}")

    # ---- epgen phase ------------------------------------------------------------------------
    epgen_result = None
    if cap < need:
        out["epgen_skipped"] = (f"--block-capacity {cap} is smaller than the largest (expert, "
                                f"source) block of the routings ({need})")
    else:
        free, _total = mem_info(args.device)
        mem["free_before_epgen"] = free
        if mem["epgen_phase"] > args.mem_fraction * free:
            out["epgen_skipped"] = (
                f"needs {_fmt_gb(mem['epgen_phase'])} of device memory, more than "
                f"{args.mem_fraction:.0%} of the {_fmt_gb(free)} free (per rank: recv_buf "
                f"{_fmt_gb(wm['per_rank']['recv_buf'])}, out_tokens "
                f"{_fmt_gb(wm['per_rank']['out_tokens'])}); lower --block-capacity, the Zipf "
                f"skew (--zipf-s) or the tokens per rank")
    if "epgen_skipped" in out:
        progress(f"  epgen skipped: {out['epgen_skipped']}")
    else:
        try:
            r = bench_epgen(cfg, sets, iters, warmup, gate, device=args.device,
                            check_rank=args.check_rank,
                            post_check=not args.no_post_check, progress=progress,
                            input_scale=input_scale)
        except Exception as exc:  # noqa: BLE001 - reported; the other shapes still run
            out["epgen_error"] = f"{type(exc).__name__}: {exc}"
            progress(f"  epgen FAILED: {out['epgen_error']}")
        else:
            epgen_result = r.pop("check_result")
            for key, nb in (("round_trip", nbytes["total"]), ("dispatch_async", nbytes["async"]),
                            ("dispatch_wait", nbytes["wait"])):
                r[key]["bytes"] = nb
                r[key]["gbps"], r[key]["fraction_of_copy"] = rate(nb, r[key]["median_ms"],
                                                                  copy_gbps)
            if copy_gbps:
                r["round_trip"]["byte_floor_us"] = nbytes["total"] / copy_gbps / 1e3
            out["epgen"] = r
            progress(f"  epgen: check {r['check']}, round trip "
                     f"{1e3 * r['round_trip']['median_ms']:.1f} us")

    # ---- the baseline's output against epgen's (or the reference's) -------------------------
    if baseline_result is not None:
        against, what = epgen_result, "epgen"
        if base_cfg is not cfg:
            against, what = None, "reference (BF16 rows)"
        elif against is None:
            progress("  baseline check: epgen's output unavailable, using the reference")
            what = "reference"
        if against is None:
            against = reference.dispatch(base_cfg, *sets[0])[args.check_rank]
        diffs = compare_grouping(base_cfg, against, baseline_result)
        out["baseline"]["check"] = "ok" if not diffs else "FAILED: " + "; ".join(diffs[:3])
        out["baseline"]["check_against"] = f"{what}, rank {args.check_rank}, set 0"
        progress(f"  baseline check: {out['baseline']['check']} (vs {what})")
    if "epgen" in out and "baseline" in out:
        out["speedup_vs_baseline"] = (out["baseline"]["round_trip"]["median_ms"]
                                      / out["epgen"]["round_trip"]["median_ms"])
    return out


def table_rows(results) -> list[dict]:
    rows = []
    for s in results["shapes"]:
        common = {"shape": s["shape"], "T": s["tokens_per_rank"], "routing": s["routing"]}
        e = s.get("epgen")
        v = f"{s.get('format', 'BF16')} {s['variant']}"
        if e:
            for key, label, sp in (("round_trip", "round trip", s.get("speedup_vs_baseline")),
                                   ("dispatch_async", "dispatch_async", None),
                                   ("dispatch_wait", "dispatch_wait", None)):
                m = e[key]
                rows.append({**common, "variant": f"epgen {v} {label}",
                             "us": 1e3 * m["median_ms"], "gbps": m.get("gbps"),
                             "frac": m.get("fraction_of_copy"), "speedup": sp})
        else:
            rows.append({**common, "variant": f"epgen {v} round trip",
                         "note": s.get("epgen_skipped") or s.get("epgen_error")})
        b = s.get("baseline")
        if b:
            m = b["round_trip"]
            rows.append({**common, "variant": "torch argsort+index_select",
                         "us": 1e3 * m["median_ms"], "gbps": m.get("gbps"),
                         "frac": m.get("fraction_of_copy"), "speedup": 1.0,
                         "note": None if b["check"] == "ok" else b["check"]})
        else:
            rows.append({**common, "variant": "torch argsort+index_select",
                         "note": s.get("baseline_skipped") or s.get("baseline_error")})
    return rows


def run(args) -> tuple[dict, int]:
    """Run every shape; returns (results, exit status)."""
    from backends import cuda
    if not cuda.gpu_available():
        raise SystemExit("dispatch_bench: no usable CUDA GPU here (backends.cuda."
                         "gpu_available() is False); run it on the GPU machine")
    dev = cuda.get_device(args.device)
    commit, dirty = git_commit()
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty, "command": sys.argv,
        "device": {"name": getattr(dev, "name", "unknown"), "ordinal": args.device,
                   "arch": cuda.arch(dev), "sm_count": cuda.sm_count(dev),
                   "memory_total": mem_info(args.device)[1]},
        "args": vars(args),
        "method": {"timing": "CUDA events, fork/join over the rank streams, median",
                   "gate": not args.no_gate, "inputs": f"{args.sets} staged sets rotated",
                   "bytes": "staged: input + 2 x messages + output rows; GB = 1e9 B",
                   "baseline": "argsort(topk.flatten(), stable=True) + index_select"},
        "shapes": [],
    }
    torch, why = _import_torch()
    if torch is None:
        log(f"torch unavailable ({why}): no baseline, no gate, copy not measured")
        results["torch"] = f"unavailable: {why}"
    else:
        torch.cuda.set_device(args.device)
        results["torch"] = torch.__version__
    gate = None
    if torch is not None and not args.no_gate:
        gate = Gate(torch, args.device)
        results["gate"] = {"initial_ms": gate.ms, "cycles_per_ms": gate.cycles_per_ms}
    copy_gbps = None
    if torch is not None:
        log(f"device-to-device copy, {args.copy_mib} MiB")
        results["copy"] = measure_copy(torch, args.device, args.copy_mib, args.copy_iters, gate)
        copy_gbps = results["copy"]["gbps"]
        log(f"  copy: {copy_gbps:.1f} GB/s")
    status = 0
    for T in args.tokens:
        s = run_shape(args, T, torch, gate, copy_gbps)
        results["shapes"].append(s)
        if "epgen_error" in s or "baseline_error" in s or \
                s.get("baseline", {}).get("check", "ok") != "ok":
            status = 1
    if gate is not None:
        results["gate"].update(gate.describe())
    return results, status


def print_report(results, file=sys.stdout) -> None:
    dev = results["device"]
    print(f"dispatch_bench  {results['date']}  commit {results['git_commit']}"
          f"{'+dirty' if results.get('git_dirty') else ''}  {dev['name']} ({dev['arch']}, "
          f"{dev['sm_count']} SMs)", file=file)
    if "copy" in results:
        c = results["copy"]
        parts = [f"{k} {c[k]['gbps']:.1f} GB/s" for k in ("torch", "cupy")
                 if isinstance(c.get(k), dict) and "gbps" in c[k]]
        print(f"device-to-device copy ({c['size_mib']} MiB, read + write): "
              + ", ".join(parts) + f"; reference {c['gbps']:.1f} GB/s", file=file)
    for s in results["shapes"]:
        e = s.get("epgen", {})
        b = s.get("baseline", {})
        bits = [f"recv_block_capacity {s['recv_block_capacity']} (largest block "
                f"{s['largest_block']})",
                f"bytes {_fmt_gb(s['bytes']['total'])}"]
        if e:
            bits.append(f"epgen check: {e.get('check')}, post-timing check: "
                        f"{e.get('post_check', 'skipped')}")
        if b:
            bits.append(f"baseline check: {b['check']} (vs {b['check_against']})")
        label = s["shape"] if s["shape"].startswith("T=") \
            else f"{s['shape']} T={s['tokens_per_rank']}"
        print(f"{label} ({s['routing']}): " + "; ".join(bits), file=file)
    print(file=file)
    print(format_table(table_rows(results)), file=file)


def main(argv=None) -> int:
    args = parse_args(argv)
    results, status = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=_jsonable)
        log(f"wrote {args.json}")
    print_report(results)
    return status


if __name__ == "__main__":
    sys.exit(main())
