"""The benchmark's inputs on the host: rotated input sets (uniform or Zipf-like routing) and
the receive-block capacity they need (numpy only)."""

from __future__ import annotations

import numpy as np

from .. import routing

CAPACITY_MULTIPLE = 64
"""``--block-capacity fit`` rounds the largest (expert, source) block up to this."""


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


def block_capacity(setting, sets, n_experts: int, tokens_per_rank: int) -> tuple[int, int]:
    """(largest (expert, source) block of ``sets``, the capacity ``setting`` gives): ``"fit"``
    (``fit_block_capacity``), ``"full"`` (``tokens_per_rank``, the reference sizing) or a
    number (capped at ``tokens_per_rank``)."""
    need = fit_block_capacity(sets, n_experts, tokens_per_rank, multiple=1)
    if setting == "fit":
        return need, fit_block_capacity(sets, n_experts, tokens_per_rank)
    if setting == "full":
        return need, tokens_per_rank
    return need, min(int(setting), tokens_per_rank)
