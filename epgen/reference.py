"""Numpy ground truth of dispatch (``dispatch_async`` + ``dispatch_wait``) for every rank.

``dispatch(cfg, tokens, topk_ids)`` takes one ``[T_r, H]`` token array and one ``[T_r, K]``
array of global expert ids per rank and returns, per destination rank, a ``RankResult``: the
received tokens grouped per local expert, ``row_offsets``, ``expert_ids``,
``src_info``, ``counts[L, R]`` and the start row of every (local expert, source rank) block.

Row order (the reference's, with its nondeterminism removed): groups in order (the shared
expert first with ``fused_shared_expert``), inside a local expert source-rank-major, inside a
source in token order. The kernels fill a block's slots in the order their reservations
happened, so rows may be permuted within an (expert, source) block; ``RankResult.canonical()``
and ``compare`` sort each block by source token index before comparing.

``ep_final_layout`` (docs/final-layout.md): without ``ep_prod_reserve`` the layout is
capacity-strided: group ``j`` starts at row ``j * R * max_tokens_per_rank`` and its (expert,
source) blocks fill ``[start, start + total)`` in the order the sources reserved them, so the
model's ``block_starts`` (source-rank-major) is one valid order of many; ``compare`` accepts
any order of whole blocks that tiles that range exactly. With ``ep_prod_reserve`` the layout
is the standard one above, blocks source-rank-major (deterministic), rows inside a block still
in reservation order.

``skip_a2a``: ``L = n_experts // n_ranks`` experts per device (``n_ranks`` and ``n_experts``
global, or ``n_ranks = 1`` and one device's experts, the reference host's per-device form);
the lists hold one input per *device*, ``ranks`` gives each device's id (default ``0, 1,
...``), and device ``d`` keeps its own tokens routed to global experts ``[d*L, (d+1)*L)``, all
of them at source coordinate 0 (``counts[:, 0]``; the other columns are 0). With ``fused_shared_expert`` it packs its slice
of the (replicated) tokens, ``allreduce_world_size`` ``W`` ways (default: the number of
devices).

Masked slots: a top-k id of ``-1`` (``MASKED``) selects no expert (a padding token, a
pruned expert). Nothing is sent for it, no row is reserved, ``counts`` and ``row_offsets``
do not include it, and combine skips it (``reference_combine``). A token whose ids are all
``-1`` is dispatched nowhere.

Masked ranks (``ep_rank_mask``, docs/design.md "Rank masks"): ``mask_ranks(cfg, tokens,
topk_ids, masked)`` gives the inputs whose ``dispatch`` (and ``combine``) are what the ranks
outside ``masked`` receive and reduce when the ranks of ``masked`` are masked: a masked
rank sends nothing (its input is empty) and every slot routed to one of its experts is
``-1``. The masked ranks' own results are not modelled (they are not expected to call).

Rows that the kernels never write hold, in a reference result: padding rows zero tokens and
``src_info = (-1, -1)``; shared-expert rows ``src_info = (-1, -1)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from . import interop
from .errors import EPInputError
from .reference_combine import combine

__all__ = ["EPInputError", "MASKED", "RankResult", "dispatch", "combine", "validate_inputs",
           "compare", "assert_match", "se_slice", "mask_ranks"]

#: under skip_a2a (global ids) the first invalid id: ids travel as uint16 in message headers,
#: where 0xffff is a masked slot's id (and the device check's sentinel for a bad one)
SKIP_A2A_ID_BOUND = (1 << 16) - 1
#: a top-k id that selects no expert (a masked slot: nothing sent, weight ignored)
MASKED = -1


# ---- input validation ----------------------------------------------------------------------
def _shape_dtype(x) -> tuple[tuple[int, ...], str]:
    """Shape and element dtype name of a numpy/ml_dtypes array, a torch tensor, a CUDA array
    (``__cuda_array_interface__``), a DLPack object or anything ``np.asarray`` accepts; no
    device data is read."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(d) for d in x.shape), str(x.dtype).removeprefix("torch.")
    try:
        cai = x.__cuda_array_interface__
    except (AttributeError, TypeError):
        cai = None
    if cai is not None:
        return tuple(cai["shape"]), np.dtype(cai["typestr"]).name
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        info = interop.describe(x, "input")
        return tuple(int(d) for d in info.shape), info.dtype
    arr = np.asarray(x)
    return arr.shape, arr.dtype.name


def _host_ids(x, where: str) -> np.ndarray:
    """``x`` as a host array (numpy, torch CPU, DLPack host objects); a device array is
    refused with an ``EPInputError`` naming ``where``."""
    if isinstance(x, np.ndarray):
        return x
    on_device = f"{where}: expert ids must be readable on the host (copy them to a numpy " \
        f"array first): a device array"
    if getattr(x, "__cuda_array_interface__", None) is not None:
        raise EPInputError(on_device)
    try:
        info = interop.describe(x, where)
    except EPInputError:
        raise
    except Exception as exc:
        raise EPInputError(f"{where}: expert ids must be readable on the host (copy them to "
                           f"a numpy array first): {exc}") from exc
    if info.on_device:
        raise EPInputError(on_device)
    return interop.host_array(x, where)


def per_rank_list(x, name: str) -> list:
    """``x`` as a list with one entry per rank: a sequence as it is, a 3-D array as its
    slices, a 2-D array as one entry; anything else is an ``EPInputError`` naming ``name``."""
    if isinstance(x, np.ndarray):
        return list(x) if x.ndim == 3 else [x]
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return list(x)
    raise EPInputError(f"{name}: must be a list of one array per rank, got {type(x).__name__}")


def mask_ranks(cfg, tokens, topk_ids, masked) -> tuple[list, list]:
    """The inputs ``(tokens, topk_ids)`` (one array per rank) as the ranks outside ``masked``
    (an iterable of rank numbers) see them when those ranks are masked (module docstring):
    a masked rank's tokens and ids empty (``[0, H]``, ``[0, K]``), and in every other rank's
    ids each slot routed to an expert of a masked rank (``id // n_local_experts`` in
    ``masked``) set to ``MASKED``. Not for ``skip_a2a`` (no other rank to mask)."""
    if cfg.skip_a2a:
        raise EPInputError("mask_ranks: skip_a2a has no other rank to mask")
    R, L = cfg.n_ranks, cfg.layout.n_local_experts
    masked = sorted({int(q) for q in masked})
    bad = [q for q in masked if not 0 <= q < R]
    if bad:
        raise EPInputError(f"masked: ranks {bad} are not in [0, {R})")
    toks, ids = per_rank_list(tokens, "tokens"), per_rank_list(topk_ids, "topk_ids")
    out_toks, out_ids = [], []
    for r, (x, i) in enumerate(zip(toks, ids)):
        i = np.asarray(_host_ids(i, f"topk_ids[{r}]"))
        if r in masked:
            x = np.asarray(x)
            out_toks.append(x[:0])
            out_ids.append(i[:0].copy())
            continue
        i = i.copy()
        owner = np.where(i >= 0, i // L, -1)
        i[np.isin(owner, masked)] = MASKED
        out_toks.append(x)
        out_ids.append(i)
    return out_toks, out_ids


def _devices(cfg, n: int, ranks, allreduce_world_size) -> tuple[list[int], int]:
    """Destination ids of the inputs (ranks, or device ids under skip_a2a) and the SE
    allreduce world size (``n`` when unused)."""
    if not cfg.skip_a2a:
        if ranks is not None or allreduce_world_size is not None:
            raise EPInputError("ranks and allreduce_world_size apply only with skip_a2a")
        if n != cfg.n_ranks:
            raise EPInputError(f"expected one input per rank: n_ranks={cfg.n_ranks}, got {n}")
        return list(range(n)), n
    if n < 1:
        raise EPInputError("skip_a2a: expected one input per device, got none")
    ids = list(range(n)) if ranks is None else [int(r) for r in ranks]
    if len(ids) != n:
        raise EPInputError(f"skip_a2a: ranks has {len(ids)} entries for {n} devices")
    if min(ids) < 0 or len(set(ids)) != n:
        raise EPInputError(f"skip_a2a: ranks must be distinct device ids >= 0, got {ids}")
    w = n if allreduce_world_size is None else int(allreduce_world_size)
    if cfg.fused_shared_expert and (w < 1 or max(ids) >= w):
        raise EPInputError(f"skip_a2a with fused_shared_expert: every device id must be < "
                           f"allreduce_world_size={w}, got ranks {ids}")
    return ids, w


def validate_inputs(cfg, tokens, topk_ids, *, ranks=None, allreduce_world_size=None,
                    strict_dtypes: bool = False) -> tuple[int, ...]:
    """Check dispatch inputs against ``cfg``; return each rank's token count ``T_r``.

    Checks: one input per rank (per device under ``skip_a2a``), ``tokens[r]`` of shape
    ``[T_r, hid_dim]`` and a dtype the format accepts, ``topk_ids[r]`` of shape
    ``[T_r, top_k]`` and an integer dtype (exactly int32 with ``strict_dtypes``),
    ``T_r <= max_tokens_per_rank``, every id in ``[0, n_experts)`` (``[0, 65535)`` under
    ``skip_a2a``, where ids are global: ``0xffff`` is a masked slot's id on the wire) or ``-1`` (``MASKED``: the slot selects no expert),
    and the experts of a token unique (``-1`` may repeat). Token values are never
    read, so device arrays are fine for ``tokens``; ``topk_ids`` must be readable on the host.
    Raises ``EPInputError`` (a ``ValueError``) naming the rank and the rule.
    """
    fmt = cfg.token_fmt
    H, K = fmt.hid_dim, fmt.top_k
    toks = per_rank_list(tokens, "tokens")
    ids = per_rank_list(topk_ids, "topk_ids")
    if len(toks) != len(ids):
        raise EPInputError(f"tokens has {len(toks)} entries but topk_ids has {len(ids)}")
    _devices(cfg, len(toks), ranks, allreduce_world_size)
    id_bound = SKIP_A2A_ID_BOUND if cfg.skip_a2a else cfg.n_experts
    counts = []
    for r, (x, i) in enumerate(zip(toks, ids)):
        shape, dtype = _shape_dtype(x)
        if len(shape) != 2 or shape[1] != H:
            raise EPInputError(f"tokens[{r}]: shape {shape} must be [T, hid_dim={H}]")
        if dtype not in fmt.accepted_input_dtypes:
            raise EPInputError(f"tokens[{r}]: dtype {dtype} is not accepted by {fmt.name} "
                               f"(use one of {', '.join(fmt.accepted_input_dtypes)})")
        T = shape[0]
        if T > cfg.max_tokens_per_rank:
            raise EPInputError(f"tokens[{r}]: T={T} exceeds max_tokens_per_rank="
                               f"{cfg.max_tokens_per_rank}")
        ishape, idtype = _shape_dtype(i)
        if tuple(ishape) != (T, K):
            raise EPInputError(f"topk_ids[{r}]: shape {tuple(ishape)} must be [T, top_k] = "
                               f"[{T}, {K}] (T from tokens[{r}])")
        if strict_dtypes and idtype != "int32":
            raise EPInputError(f"topk_ids[{r}]: dtype {idtype} must be int32")
        a = _host_ids(i, f"topk_ids[{r}]")
        if a.dtype.kind not in "iu":
            raise EPInputError(f"topk_ids[{r}]: dtype {a.dtype} must be an integer type "
                               f"(int32)")
        if a.size:
            a = a.astype(np.int64)
            bad = np.argwhere(((a < 0) & (a != MASKED)) | (a >= id_bound))
            if bad.size:
                t, k = bad[0]
                raise EPInputError(f"topk_ids[{r}][{t}, {k}] = {a[t, k]} is not an expert id in "
                                   f"[0, {id_bound}) nor -1 (a masked slot)")
            s = np.sort(a, axis=1)
            dup = np.argwhere((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != MASKED))
            if dup.size:
                t, k = dup[0]
                raise EPInputError(f"topk_ids[{r}][{t}] lists expert {s[t, k]} more than once "
                                   f"(top-k ids must be unique per token; only -1 may repeat)")
            cap = cfg.layout.block_capacity
            if cap < cfg.max_tokens_per_rank:
                per_expert = np.bincount(a[a != MASKED], minlength=id_bound)
                over = np.flatnonzero(per_expert > cap)
                if over.size:
                    g = int(over[0])
                    raise EPInputError(
                        f"topk_ids[{r}] routes {per_expert[g]} tokens to expert {g}, more than "
                        f"recv_block_capacity={cap} slots of its receive block")
        counts.append(T)
    return tuple(counts)


# ---- results --------------------------------------------------------------------------------
def se_slice(n_tokens: int, rank: int, world: int | None) -> tuple[int, int]:
    """``(row0, T_se)``: the shared-expert token slice of ``rank`` (docs/fused.md). Without an
    allreduce world (``world is None``) a rank packs all its tokens."""
    if world is None:
        return 0, n_tokens
    T, W, r = n_tokens, world, rank
    return r * (T // W) + min(r, T % W), (T + W - r - 1) // W


@attrs.define(eq=False)
class RankResult:
    """One destination's dispatch output (the reference's grouped layout).

    ``row_offsets`` uint32 [G+1] (``G = L + se``; group ``j``'s rows are
    ``[row_offsets[j], row_offsets[j+1])``, padded to ``expert_m_padding``); ``expert_ids``
    int32 [G] (identity; with the shared expert, id 0 is it and local expert ``e`` is
    ``e + 1``); ``src_info`` int32 [rows, 2] = (source token index, top-k slot);
    ``counts`` int32 [L, R] (tokens from source ``r`` to local expert ``e``);
    ``block_starts`` int64 [L, R] (first row of each (expert, source) block);
    ``se_tokens``/``se_token_start``: the shared-expert rows (group 0) and the first source
    token they copy. ``out_tokens`` rows are the format's host rows (BF16: uint16 bits;
    the quantising formats: uint8 codes). ``out_scales``: None, or the quantising formats'
    scales one row per output row (``[rows, hid_dim // group_size]``; float32 for
    BlockwiseFP8, uint8 e4m3/e8m0 bits for NVFP4/MXFP8), whatever the device layout
    (BlockwiseFP8's device tensor is transposed: ``fmt.scales_to_device``/
    ``fmt.scales_from_device`` convert).
    """

    rank: int
    out_tokens: np.ndarray
    row_offsets: np.ndarray
    expert_ids: np.ndarray
    src_info: np.ndarray
    counts: np.ndarray
    block_starts: np.ndarray
    se_tokens: int = 0
    se_token_start: int = 0
    out_scales: np.ndarray | None = None

    @property
    def n_groups(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def se(self) -> int:
        """1 when group 0 is the shared expert, else 0."""
        return self.n_groups - np.asarray(self.counts).shape[0]

    @property
    def n_rows(self) -> int:
        """Rows spanned by the groups (``row_offsets[-1]``), padding included."""
        return int(self.row_offsets[-1])

    @property
    def group_starts(self) -> np.ndarray:
        return np.asarray(self.row_offsets[:-1], dtype=np.int64)

    @property
    def group_counts(self) -> np.ndarray:
        """Rows actually written per group (no padding)."""
        routed = np.asarray(self.counts, dtype=np.int64).sum(axis=1)
        return np.concatenate([[self.se_tokens], routed]) if self.se else routed

    def blocks(self):
        """Yield ``(e, src, start, count)`` for every (local expert, source) block."""
        counts = np.asarray(self.counts)
        starts = np.asarray(self.block_starts)
        for e in range(counts.shape[0]):
            for s in range(counts.shape[1]):
                yield e, s, int(starts[e, s]), int(counts[e, s])

    def routed_rows_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_rows, dtype=bool)
        for _e, _s, start, c in self.blocks():
            mask[start:start + c] = True
        return mask

    @classmethod
    def from_outputs(cls, cfg, rank, out_tokens, row_offsets, expert_ids, src_info, counts, *,
                     se_tokens=0, se_token_start=0, out_scales=None, block_starts=None):
        """Build a result from kernel outputs (host arrays). ``block_starts`` defaults to
        the standard layout's: group start plus the exclusive prefix of ``counts`` over
        source ranks."""
        row_offsets = np.asarray(row_offsets)
        counts = np.asarray(counts)
        if block_starts is None:
            se = int(bool(cfg.fused_shared_expert))
            block_starts = _block_starts(row_offsets, counts, se)
        return cls(rank=int(rank), out_tokens=np.asarray(out_tokens), row_offsets=row_offsets,
                   expert_ids=np.asarray(expert_ids), src_info=np.asarray(src_info),
                   counts=counts, block_starts=np.asarray(block_starts),
                   se_tokens=int(se_tokens), se_token_start=int(se_token_start),
                   out_scales=None if out_scales is None else np.asarray(out_scales))

    def canonical(self) -> RankResult:
        """A copy trimmed to ``n_rows`` rows in which each (expert, source) block is sorted by
        source token index, rows no kernel writes are cleared (padding: zero tokens;
        padding and shared-expert rows: ``src_info = (-1, -1)``). Two correct results of the
        same dispatch have equal canonical forms field by field. Raises ``ValueError`` when
        the blocks do not fit the rows (an inconsistent result)."""
        n = self.n_rows
        out = np.array(self.out_tokens[:n], copy=True)
        src = np.array(self.src_info[:n], copy=True)
        scales = None if self.out_scales is None else np.array(self.out_scales[:n], copy=True)
        if out.shape[0] < n or src.shape[0] < n:
            raise ValueError(f"rank {self.rank}: row_offsets span {n} rows but out_tokens has "
                             f"{out.shape[0]} and src_info {src.shape[0]}")
        written = np.zeros(n, dtype=bool)
        g0 = int(self.row_offsets[0])
        if self.se:
            if g0 + self.se_tokens > n:
                raise ValueError(f"rank {self.rank}: shared-expert rows exceed {n} rows")
            written[g0:g0 + self.se_tokens] = True
        routed = np.zeros(n, dtype=bool)
        for e, s, start, c in self.blocks():
            if c < 0 or start < 0 or start + c > n:
                raise ValueError(f"rank {self.rank}: block (expert {e}, source {s}) rows "
                                 f"[{start}, {start + c}) outside [0, {n})")
            if c:
                sl = slice(start, start + c)
                order = np.argsort(src[sl, 0], kind="stable")
                out[sl] = out[sl][order]
                src[sl] = src[sl][order]
                if scales is not None:
                    scales[sl] = scales[sl][order]
                routed[sl] = True
        written |= routed
        out[~written] = 0
        if scales is not None:
            scales[~written] = 0
        src[~routed] = -1
        return attrs.evolve(self, out_tokens=out, src_info=src, out_scales=scales,
                            row_offsets=np.asarray(self.row_offsets).astype(np.uint32),
                            expert_ids=np.asarray(self.expert_ids).astype(np.int32),
                            counts=np.asarray(self.counts).astype(np.int32),
                            block_starts=np.asarray(self.block_starts).astype(np.int64))


def _block_starts(row_offsets, counts, se: int) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.int64)
    L = counts.shape[0]
    excl = np.cumsum(counts, axis=1) - counts
    return np.asarray(row_offsets[se:se + L], dtype=np.int64)[:, None] + excl


# ---- the model ----------------------------------------------------------------------------
def dispatch(cfg, tokens, topk_ids, *, ranks=None, allreduce_world_size=None,
             input_scale: float = 1.0) -> list[RankResult]:
    """Reference dispatch; one ``RankResult`` per destination rank (per device under
    ``skip_a2a``, in input order). See the module docstring. ``input_scale``: the global
    input scale of formats that use one (NVFP4; ``fmt.uses_input_scale``), ignored by the
    others."""
    validate_inputs(cfg, tokens, topk_ids, ranks=ranks, allreduce_world_size=allreduce_world_size)
    fmt, lay = cfg.token_fmt, cfg.layout
    enc = {"input_scale": input_scale} if getattr(fmt, "uses_input_scale", False) else {}
    toks = per_rank_list(tokens, "tokens")
    ids = [np.asarray(i).astype(np.int64) for i in per_rank_list(topk_ids, "topk_ids")]
    devices, world = _devices(cfg, len(toks), ranks, allreduce_world_size)
    L, R, se = lay.n_local_experts, cfg.n_ranks, int(bool(cfg.fused_shared_expert))

    # each source's tokens through the format once: what a destination would output
    decoded = [fmt.decode_payload(fmt.encode_payload(fmt.as_host_tokens(x), **enc)) for x in toks]

    results = []
    for i, d in enumerate(devices):
        # (source coordinate, source input index) pairs feeding destination d
        sources = [(0, i)] if cfg.skip_a2a else [(s, s) for s in range(R)]
        parts = []
        for s, j in sources:
            t, k = np.nonzero((ids[j] >= d * L) & (ids[j] < (d + 1) * L))
            parts.append((ids[j][t, k] - d * L, np.full(t.shape, s), t, k, np.full(t.shape, j)))
        e, s, t, k, j = (np.concatenate(c).astype(np.int64) for c in zip(*parts))
        order = np.lexsort((t, s, e))  # expert, then source rank, then token
        e, s, t, k, j = e[order], s[order], t[order], k[order], j[order]

        counts = np.zeros((L, R), dtype=np.int64)
        np.add.at(counts, (e, s), 1)
        if se:
            w = world if cfg.skip_a2a else None
            row0, t_se = se_slice(ids[i].shape[0], d, w)
        else:
            row0, t_se = 0, 0
        group_counts = np.concatenate([[t_se] * se, counts.sum(axis=1)]).astype(np.int64)
        if lay.capacity_strided:
            row_offsets = (np.arange(lay.n_groups + 1) * R * cfg.max_tokens_per_rank) \
                .astype(np.uint32)
        else:
            row_offsets = fmt.pad_row_offsets(group_counts)
        block_starts = _block_starts(row_offsets, counts, se)
        n_rows = int(row_offsets[-1])

        per_expert = counts.sum(axis=1)
        pos = np.arange(e.size) - (np.cumsum(per_expert) - per_expert)[e]
        rows = row_offsets[se:][e].astype(np.int64) + pos

        out = np.zeros((n_rows, *fmt.out_row_shape), dtype=fmt.host_dtype)
        src_info = np.full((n_rows, 2), -1, dtype=np.int32)
        has_scales = decoded[0][1] is not None
        scales = (np.zeros((n_rows, *decoded[0][1].shape[1:]), dtype=decoded[0][1].dtype)
                  if has_scales else None)
        for jj in np.unique(j):
            m = j == jj
            out[rows[m]] = decoded[jj][0][t[m]]
            if has_scales:
                scales[rows[m]] = decoded[jj][1][t[m]]
        src_info[rows, 0] = t
        src_info[rows, 1] = k
        if se and t_se:
            g0 = int(row_offsets[0])
            out[g0:g0 + t_se] = decoded[i][0][row0:row0 + t_se]
            if has_scales:
                scales[g0:g0 + t_se] = decoded[i][1][row0:row0 + t_se]

        results.append(RankResult(
            rank=d, out_tokens=out, row_offsets=row_offsets,
            expert_ids=np.arange(lay.n_groups, dtype=np.int32), src_info=src_info,
            counts=counts.astype(np.int32), block_starts=block_starts, se_tokens=t_se,
            se_token_start=row0, out_scales=scales))
    return results


# ---- comparison ------------------------------------------------------------------------------
def _first_diff(a, b, what: str, limit: int) -> list[str]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return [f"{what}: shape {b.shape} != expected {a.shape}"]
    bad = np.argwhere(a != b)
    return [f"{what}{list(map(int, idx))}: got {b[tuple(idx)]}, expected {a[tuple(idx)]}"
            for idx in list(bad)[:limit]]


def _bits(a: np.ndarray) -> np.ndarray:
    """Float arrays as their bit patterns (scales compare bit-exactly, NaN included)."""
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def compare(cfg, expected: RankResult, actual: RankResult, *, limit: int = 10) -> list[str]:
    """Differences between a reference result and another (e.g. the GPU's), modulo the
    order of rows within an (expert, source) block; padding rows and the ``src_info`` of
    shared-expert rows are not compared. Empty when they match."""
    r = expected.rank
    diffs = []
    for name in ("counts", "expert_ids", "row_offsets"):
        diffs += _first_diff(getattr(expected, name), getattr(actual, name),
                             f"rank {r} {name}", limit)
    if (expected.se_tokens, expected.se_token_start) != (actual.se_tokens,
                                                        actual.se_token_start):
        diffs.append(f"rank {r} shared-expert rows: got ({actual.se_tokens} from "
                     f"{actual.se_token_start}), expected ({expected.se_tokens} from "
                     f"{expected.se_token_start})")
    if not cfg.layout.capacity_strided:
        diffs += _first_diff(expected.block_starts, actual.block_starts,
                             f"rank {r} block_starts", limit)
    else:  # there, blocks land in reservation order, tiling each group's dense range
        diffs += _strided_tiling_diffs(expected, actual)
    if diffs:
        return diffs
    try:
        a = actual.canonical()
    except ValueError as exc:
        return [str(exc)]
    x = expected.canonical()
    fields = [("out_tokens", x.out_tokens, a.out_tokens), ("src_info", x.src_info, a.src_info)]
    if x.out_scales is not None or a.out_scales is not None:
        if x.out_scales is None or a.out_scales is None:
            return [f"rank {r} out_scales: present on one side only"]
        fields.append(("out_scales", x.out_scales, a.out_scales))
    fields = [(name, _bits(xv), _bits(av)) for name, xv, av in fields]
    for name, xv, av in fields:
        if xv.shape[1:] != av.shape[1:]:
            return [f"rank {r} {name}: row shape {av.shape[1:]} != expected {xv.shape[1:]}"]
    for e, s, xs, c in x.blocks():
        if c == 0:
            continue
        as_ = int(a.block_starts[e, s])
        for name, xv, av in fields:
            bad = np.nonzero(np.any((xv[xs:xs + c] != av[as_:as_ + c])
                                    .reshape(c, -1), axis=1))[0]
            for row in bad[:limit]:
                diffs.append(f"rank {r} {name}: expert {e} source {s} row {xs + row} (source "
                             f"token {int(x.src_info[xs + row, 0])}) differs")
            if len(diffs) >= limit:
                return diffs
    if x.se_tokens:
        g0 = int(x.row_offsets[0])
        sl = slice(g0, g0 + x.se_tokens)
        for name, xv, av in fields:
            if name == "src_info":
                continue
            bad = np.nonzero(np.any((xv[sl] != av[sl]).reshape(x.se_tokens, -1), axis=1))[0]
            diffs += [f"rank {r} {name}: shared-expert row {g0 + row} differs"
                      for row in bad[:limit]]
    return diffs[:limit]


def _strided_tiling_diffs(expected: RankResult, actual: RankResult) -> list[str]:
    """Capacity-strided layout: the non-empty (expert, source) blocks of ``actual`` must tile
    each group's dense range ``[row_offsets[g], row_offsets[g] + total)`` exactly, in any
    order (counts are compared first)."""
    counts = np.asarray(actual.counts, dtype=np.int64)
    starts = np.asarray(actual.block_starts, dtype=np.int64)
    se = expected.se
    diffs = []
    for e in range(counts.shape[0]):
        g0 = int(expected.row_offsets[e + se])
        spans = sorted((int(starts[e, s]), int(counts[e, s]), s)
                       for s in range(counts.shape[1]) if counts[e, s])
        at = g0
        for start, c, s in spans:
            if start != at:
                diffs.append(f"rank {expected.rank} block_starts: expert {e} source {s} starts "
                             f"at row {start}, expected the next free row {at} of the expert's "
                             f"dense range from {g0}")
                break
            at += c
    return diffs


def assert_match(cfg, expected, actual, *, limit: int = 10) -> None:
    """``compare`` for one result or a list of them; raises ``AssertionError`` listing the
    first differences."""
    if isinstance(expected, RankResult):
        expected, actual = [expected], [actual]
    if len(expected) != len(actual):
        raise AssertionError(f"{len(actual)} results, expected {len(expected)}")
    diffs = []
    for x, a in zip(expected, actual):
        diffs += compare(cfg, x, a, limit=limit)
    if diffs:
        raise AssertionError("dispatch results differ:\n  " + "\n  ".join(diffs[:limit]))
