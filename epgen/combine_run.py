"""The host side of ``epgen run --combine``: a deterministic per-expert transform of each
destination's grouped rows (standing in for the experts), random router weights, and the
reference the world's combine must equal bit for bit.

The transform of a row of local group ``g`` (expert id ``e = expert_ids[g]`` of destination
``d``, global expert ``d * L + e``) is the affine map ``y = x * a + b`` in float32 (the
product and the sum each rounded to float32), rounded to BF16 to nearest even; ``x`` is the
row as float32 (BF16 widened exactly; a quantising format's row dequantized with its own
scales, ``fmt.dequantize``, then rounded to float32), ``a =
1 + (37 * gid % 16) / 32`` and ``b = (gid % 9 - 4) / 64`` for the global id ``gid``. It is
row-wise, so a destination's combine result does not depend on the order of the rows within
a block: the reference is ``reference.combine`` of the reference dispatch with the same
transform, whatever order the world's rows came in (``expected``).
"""

from __future__ import annotations

import numpy as np

from . import reference
from .reference_combine import bf16_to_f32, f32_to_bf16


def _coefficients(gid: int) -> tuple[np.float32, np.float32]:
    return np.float32(1 + (37 * gid % 16) / 32), np.float32((gid % 9 - 4) / 64)


def _rows_f32(cfg, result, input_scale: float) -> np.ndarray:
    """The grouped rows of ``result`` as float32 ``[rows, H]``."""
    fmt = cfg.token_fmt
    n = len(result.src_info)
    if fmt.name == "BF16":
        return bf16_to_f32(np.asarray(result.out_tokens, np.uint16)[:n])
    return fmt.dequantize(np.asarray(result.out_tokens)[:n], np.asarray(result.out_scales)[:n],
                          input_scale).astype(np.float32)


def expert_outputs(cfg, result, input_scale: float = 1.0) -> np.ndarray:
    """Destination ``result.rank``'s expert outputs: the transform (module docstring) of
    every row of its grouped output, ``[rows, H]`` BF16 bits (padding rows too: nothing
    sends them). ``input_scale``: the dispatch's (formats that use one)."""
    L = cfg.layout.n_local_experts
    x = _rows_f32(cfg, result, input_scale)
    n = len(result.src_info)
    y = np.zeros((n, cfg.token_fmt.hid_dim), np.uint16)
    offs = np.asarray(result.row_offsets, np.int64)
    for g, e in enumerate(np.asarray(result.expert_ids)):
        lo, hi = int(offs[g]), min(int(offs[g + 1]), n)
        if lo >= hi:
            continue
        a, b = _coefficients(result.rank * L + int(e))
        y[lo:hi] = f32_to_bf16(x[lo:hi] * a + b)
    return y


def router_weights(rng, cfg, topk_ids) -> list[np.ndarray]:
    """Per source, random ``[T, K]`` float32 weights (uniform in [0, 1))."""
    return [rng.random((len(i), cfg.token_fmt.top_k), dtype=np.float32) for i in topk_ids]


def expected(cfg, tokens, topk_ids, weights, input_scale: float = 1.0) -> list[np.ndarray]:
    """Per source, the ``[T, H]`` BF16 bits its combine must return: ``reference.combine``
    of the reference dispatch of these inputs, each destination's rows transformed."""
    want = reference.dispatch(cfg, tokens, topk_ids, input_scale=input_scale)
    return reference.combine(cfg, want, [expert_outputs(cfg, r, input_scale) for r in want],
                             weights)


def differences(got, want, limit: int = 10) -> list[str]:
    """One line per source whose combine result differs from ``want``."""
    out = []
    for s, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        if g.shape != w.shape:
            out.append(f"rank {s} combine: shape {g.shape}, expected {w.shape}")
        elif not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            t, h = (int(v) for v in bad[0])
            out.append(f"rank {s} combine: {len(bad)} elements differ, first [{t}, {h}]: "
                       f"{int(g[t, h]):#06x}, expected {int(w[t, h]):#06x}")
    return out[:limit]
