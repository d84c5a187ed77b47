"""Numpy ground truth of combine: every dispatched row goes back to the rank and top-k slot it
came from, and each source rank reduces its tokens' expert outputs with the router weights.

``combine(cfg, dispatch_results, expert_outputs, topk_weights)`` takes, per destination rank,
the ``RankResult`` its dispatch produced (``epgen.reference.dispatch`` or a world's result:
its ``src_info``, ``counts`` and ``block_starts`` say where each row came from) and that
rank's expert outputs, one BF16 row (uint16 bit patterns) per row of its grouped output; and,
per source rank, the router weights ``[T, K]`` (float32). It returns per source rank:

- with weights, ``out[t] = sum_k w[t, k] * y[t, k]`` over the top-k slots that received a row
  (a slot that dispatch sent nowhere, as ``skip_a2a``'s non-local experts or a masked slot
  whose id is ``-1``, adds nothing: its weight is never read, so even a NaN there has no
  effect), as BF16 bits ``[T, H]``; a token whose slots are all masked combines to zero
  (plus its shared-expert row and residual);
- ``topk_weights=None``: the unreduced rows ``[T, K, H]`` (BF16 bits; slots that received no
  row are zero).

The expert outputs are BF16 whatever the dispatch format (the quantising formats quantize
only the dispatch). Rows are found from each result's blocks, so every layout (staged,
``ep_final_layout`` with or without ``ep_prod_reserve``) is read the same way. Under
``skip_a2a`` the lists are per device: device ``d``'s rows go back to device ``d`` (its
``src_info`` names its own tokens), and the slots routed to other devices' experts received
no row here.

**Summation order (what a kernel must do to match bit for bit).** In float32, per token and
element: ``acc = 0``; for ``k = 0 .. K-1`` in order, over the slots that received a row,
``acc = fma(w[t, k], y[t, k], acc)`` (``fma.rn.f32``, one rounding); then, with
``fused_shared_expert``, ``acc = acc + s[t]`` for the tokens of this rank's shared-expert slice
(``s``: the shared expert's output rows, group 0 of the source's own result); then, with a
``residual`` ``[T, H]`` (BF16), ``acc = acc + r[t]`` (``add.rn.f32``); the result rounds to
BF16 to nearest even. BF16 inputs widen to float32 exactly. Infinities and NaN follow IEEE
754, and every NaN that the f32 arithmetic returns is the GPU's canonical NaN ``0x7fffffff``
(single precision keeps no payload or sign), so a NaN result is always BF16 ``0x7fff``.

**``fp8=True``** (the FP8 combine, epgen's own; docs/combine.md, "FP8 combine"): every row
that received a slot is first quantised as the destination's kernel does, with the
BlockwiseFP8 format's host quantiser (E4M3, one float32 scale ``max(amax, 1e-4) / 448`` per
128 elements), and dequantised as the source's kernel does (``y = mul.rn.f32(e4m3 value,
scale)``: ``epgen.combine_fp8.wire_values``); the sum above then takes ``y`` in place of the
widened BF16 row, in the same order. The unreduced form returns ``y`` rounded to BF16 (zero
for slots without a row). Shared-expert rows and the residual do not cross the link: BF16 as
before. ``hid_dim`` must be a multiple of 128.

**``partial_reduce=True``** (``ep_rank_dedup``'s partial-reduce combine, epgen's own;
docs/combine.md, "Partial reduce"): ``topk_weights`` are the weights the dispatch carried.
Each destination ``d`` first sums, per source token ``t``, its own slots in float32: ``p =
0``; for ``k = 0 .. K-1`` in order over the slots whose row ``d`` received, ``p = fma(w[t,
k], y[t, k], p)``; ``p`` rounds to BF16 (nearest even, NaN quiet) and crosses as one row.
The source then sums: ``acc = 0``; for ``k = 0 .. K-1`` in order over the slots that *lead*
their destination (the lowest slot of the token that received a row from that rank),
``acc = acc + p_d`` (``add.rn.f32``, ``p_d`` widened exactly); then the shared expert, the
residual and the rounding as above. Each partial is rounded to BF16 once more than in the
plain combine (the error: docs/combine.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backends.sim.numerics import add_f32, fma_f32

from . import combine_fp8, interop
from .errors import EPInputError

__all__ = ["combine", "bf16_to_f32", "f32_to_bf16", "source_of_rows"]


def bf16_to_f32(bits) -> np.ndarray:
    """BF16 bit patterns (uint16) as float32, exactly."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x) -> np.ndarray:
    """float32 rounded to BF16 (nearest even) as uint16 bits; NaN becomes a quiet NaN of the
    same sign (``cvt.rn.bf16.f32``)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x0040).astype(np.uint16), rounded)


def source_of_rows(result) -> np.ndarray:
    """The source rank of every row of a destination's grouped output (``[rows]`` int32; -1
    for rows no source sent: padding and shared-expert rows), from its blocks
    (``block_starts``, ``counts``)."""
    rows = len(result.src_info)
    src = np.full(rows, -1, np.int32)
    L, R = result.counts.shape
    for e in range(L):
        for s in range(R):
            start, n = int(result.block_starts[e, s]), int(result.counts[e, s])
            src[start:start + n] = s
    return src


def _expert_rows(cfg, dispatch_results, expert_outputs) -> list[np.ndarray]:
    """Each destination's expert outputs as BF16 bits, shapes checked."""
    n = len(dispatch_results)
    if len(expert_outputs) != n:
        raise EPInputError(f"expert_outputs: one array per destination rank ({n}), got "
                           f"{len(expert_outputs)}")
    H = cfg.token_fmt.hid_dim
    ys = []
    for d, (res, y) in enumerate(zip(dispatch_results, expert_outputs)):
        y = interop.host_bf16(y, f"expert_outputs[{d}]")
        if y.ndim != 2 or y.shape[1] != H or y.shape[0] < len(res.src_info):
            raise EPInputError(f"expert_outputs[{d}]: must be [rows >= {len(res.src_info)}, "
                               f"{H}] BF16, got shape {y.shape}")
        ys.append(y)
    return ys


def combine(cfg, dispatch_results: Sequence, expert_outputs, topk_weights=None,
            *, residual=None, n_tokens: Sequence[int] | None = None,
            sources: Sequence[int] | None = None, tokens: dict | None = None,
            fp8: bool = False, partial_reduce: bool = False) -> list[np.ndarray]:
    """Per source rank, its tokens' combined rows (module docstring). ``n_tokens``: each
    source's token count (default: the rows of its weights, or of its residual; required
    for the unreduced form without a residual). ``sources``: compute only these sources'
    results (the others are None): a benchmark's check at large shapes. ``tokens``:
    ``{source: token indices}`` (distinct, in range) to compute only those tokens of that
    source: its result then has one row per index, in that order (``out[s][i]`` is token
    ``tokens[s][i]``'s row of the full result); each token's sum is the same. ``fp8``: the FP8
    combine (module docstring; ``ValueError`` naming ``hid_dim`` unless a multiple of 128).
    ``partial_reduce``: the partial-reduce combine (module docstring; ``topk_weights``
    required, ``fp8`` refused)."""
    K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    if partial_reduce and (fp8 or topk_weights is None):
        raise ValueError("reference.combine: partial_reduce=True needs the dispatched "
                         "topk_weights and is not built with fp8=True")
    if fp8:
        combine_fp8.check_hid_dim(H, "reference.combine")
    ys = _expert_rows(cfg, dispatch_results, expert_outputs)
    n_src = cfg.n_ranks if not cfg.skip_a2a else len(dispatch_results)
    if n_tokens is None:
        base = topk_weights if topk_weights is not None else residual
        if base is None:
            raise EPInputError("n_tokens: needed to size the unreduced rows (no weights, no "
                               "residual)")
        n_tokens = [np.asarray(b).shape[0] for b in base]
    if len(n_tokens) != n_src:
        raise EPInputError(f"one entry per source rank ({n_src}), got {len(n_tokens)}")
    wanted = set(range(n_src)) if sources is None else {int(x) for x in sources}
    sel = _selected_tokens(n_tokens, wanted, tokens)
    # position of each token in its source's result (-1: not computed)
    pos = [None if x is None else np.full(T, -1, np.int64) for x, T in zip(sel, n_tokens)]
    for p, x in zip(pos, sel):
        if x is not None:
            p[x] = np.arange(len(x))
    # rows[s][i, k] = the expert output row that slot (sel[s][i], k) of source s received
    rows = [np.zeros((len(x), K, H), np.uint16) if x is not None else None for x in sel]
    got = [np.zeros((len(x), K), bool) if x is not None else None for x in sel]
    # dest[s][i, k] = the destination rank that returned slot (sel[s][i], k) (-1: none)
    dest = [np.full((len(x), K), -1, np.int64) if x is not None else None for x in sel]
    for d, (res, y) in enumerate(zip(dispatch_results, ys)):
        src = source_of_rows(res) if not cfg.skip_a2a else np.where(
            res.src_info[:, 0] >= 0, d, -1).astype(np.int32)
        if cfg.fused_shared_expert:
            src[:res.se_tokens] = -1
        sent = np.nonzero(src >= 0)[0]
        t_of, k_of = res.src_info[sent, 0], res.src_info[sent, 1]
        for s in np.unique(src[sent]):
            if int(s) not in wanted:
                continue
            mine = src[sent] == s
            t, k = t_of[mine], k_of[mine]
            bad = (t < 0) | (t >= n_tokens[s]) | (k < 0) | (k >= K)
            if bad.any():
                row = int(sent[mine][bad][0])
                raise EPInputError(f"dispatch_results[{d}].src_info[{row}] = "
                                   f"{tuple(int(v) for v in res.src_info[row])} is out of "
                                   f"range for source {s} ({n_tokens[s]} tokens, top_k={K})")
            i = pos[s][t]
            keep = i >= 0
            i, k = i[keep], k[keep]
            rows[s][i, k] = y[sent[mine][keep]]
            got[s][i, k] = True
            dest[s][i, k] = d
    if fp8:       # what crosses the link, dequantised: the values the source reduces
        vals = [None if rows[s] is None else combine_fp8.wire_values(cfg, rows[s])
                for s in range(n_src)]
    else:
        vals = [None if r is None else bf16_to_f32(r) for r in rows]
    if topk_weights is None:
        if not fp8:
            return rows
        return [None if v is None else np.where(got[s][..., None], f32_to_bf16(v),
                                                np.uint16(0))
                for s, v in enumerate(vals)]
    out = []
    for s, T in enumerate(n_tokens):
        if s not in wanted:
            out.append(None)
            continue
        w = interop.host_float32(topk_weights[s], f"topk_weights[{s}]")
        if w.shape != (T, K):
            raise EPInputError(f"topk_weights[{s}]: must be [{T}, {K}] float32, got {w.shape}")
        w, n = w[sel[s]], len(sel[s])
        if partial_reduce:
            acc = _partial_sums(w, vals[s], got[s], dest[s])
        else:
            acc = np.zeros((n, H), np.float32)
            for k in range(K):
                term = fma_f32(w[:, k:k + 1], vals[s][:, k], acc)
                acc = np.where(got[s][:, k:k + 1], term, acc)
        if cfg.fused_shared_expert:
            res = dispatch_results[s]
            i = pos[s][res.se_token_start:res.se_token_start + res.se_tokens]
            here = i >= 0          # the shared-expert slice's tokens that are computed
            se = bf16_to_f32(ys[s][:res.se_tokens][here])
            acc[i[here]] = add_f32(acc[i[here]], se)
        if residual is not None:
            r = interop.host_bf16(residual[s], f"residual[{s}]")
            if r.shape != (T, H):
                raise EPInputError(f"residual[{s}]: must be [{T}, {H}] BF16, got {r.shape}")
            acc = add_f32(acc, bf16_to_f32(r[sel[s]]))
        out.append(f32_to_bf16(acc))
    return out


def _selected_tokens(n_tokens, wanted, tokens) -> list[np.ndarray | None]:
    """Per source: the token indices whose rows ``combine`` computes (all of a wanted
    source's unless ``tokens`` names some), None for a source not wanted."""
    tokens = {} if tokens is None else tokens
    extra = sorted(int(s) for s in tokens if int(s) not in wanted)
    if extra:
        raise ValueError(f"reference.combine: tokens names sources {extra} that are not "
                         f"computed (sources={sorted(wanted)})")
    out = []
    for s, T in enumerate(n_tokens):
        if s not in wanted:
            out.append(None)
            continue
        if s not in tokens:
            out.append(np.arange(T))
            continue
        x = np.asarray(tokens[s], np.int64).reshape(-1)
        if x.size and (x.min() < 0 or x.max() >= T or np.unique(x).size != x.size):
            raise ValueError(f"reference.combine: tokens[{s}] must be distinct token indices "
                             f"in [0, {T}), got {x.tolist()[:8]}...")
        out.append(x)
    return out


def _partial_sums(w, vals, got, dest) -> np.ndarray:
    """The source's float32 sum under ``partial_reduce`` (module docstring): ``w`` ``[T,
    K]``, ``vals`` ``[T, K, H]`` the widened returned rows, ``got`` which slots received a
    row, ``dest`` from which rank."""
    T, K, H = vals.shape
    acc = np.zeros((T, H), np.float32)
    for k in range(K):
        # slot k leads its rank when no earlier slot of the token came from the same rank
        lead = got[:, k].copy()
        for j in range(k):
            lead &= ~(got[:, j] & (dest[:, j] == dest[:, k]))
        part = np.zeros((T, H), np.float32)
        for j in range(k, K):        # the rank's slots in order (all at or after its lead)
            mine = (got[:, j] & (dest[:, j] == dest[:, k]))[:, None]
            part = np.where(mine, fma_f32(w[:, j:j + 1], vals[:, j], part), part)
        crossed = bf16_to_f32(f32_to_bf16(part))
        acc = np.where(lead[:, None], add_f32(acc, crossed), acc)
    return acc
