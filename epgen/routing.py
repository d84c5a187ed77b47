"""Routing and token generators for tests and benchmarks: random top-k routings (ids unique
per token), skewed (Zipf-like) routings, masked routings (top-k ids of ``-1``: slots that
select no expert) and the edge cases the sim and GPU tests run (``EDGE_CASES``)."""

from __future__ import annotations

import numpy as np


def random_tokens(rng: np.random.Generator, T: int, H: int) -> np.ndarray:
    """``[T, H]`` random finite bfloat16 values as uint16 bit patterns."""
    vals = rng.standard_normal((T, H), dtype=np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16)


def random_topk(rng: np.random.Generator, T: int, n_experts: int, top_k: int,
                weights: np.ndarray | None = None) -> np.ndarray:
    """``[T, top_k]`` int32 expert ids, distinct within each token; drawn uniformly, or with
    probabilities ``weights`` (Gumbel top-k: sampling without replacement)."""
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} exceeds n_experts={n_experts}")
    keys = rng.random((T, n_experts))
    if weights is not None:
        keys = np.log(weights)[None, :] - np.log(-np.log(keys))
    return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int32)


def zipf_weights(n_experts: int, s: float = 1.2, rng: np.random.Generator | None = None):
    """Zipf-like expert popularity ``1 / rank^s`` (a few hot experts), optionally shuffled."""
    w = 1.0 / np.arange(1, n_experts + 1) ** s
    if rng is not None:
        rng.shuffle(w)
    return w / w.sum()


def routing(rng, cfg, tokens_per_rank, weights=None):
    """Tokens and top-k ids for every rank of ``cfg`` (``tokens_per_rank``: int or list)."""
    fmt = cfg.token_fmt
    if isinstance(tokens_per_rank, int):
        tokens_per_rank = [tokens_per_rank] * cfg.n_ranks
    toks = [random_tokens(rng, T, fmt.hid_dim) for T in tokens_per_rank]
    ids = [random_topk(rng, T, cfg.n_experts, fmt.top_k, weights) for T in tokens_per_rank]
    return toks, ids


def mask_slots(rng: np.random.Generator, ids: np.ndarray, fraction: float) -> np.ndarray:
    """A copy of ``[T, K]`` ids with each slot masked (set to ``-1``) with probability
    ``fraction``, at random positions."""
    out = np.array(ids, dtype=np.int32, copy=True)
    out[rng.random(out.shape) < fraction] = -1
    return out


def masked_routing(rng, cfg, tokens_per_rank, fraction: float = 0.3):
    """``routing`` with masked slots: a ``fraction`` of the slots at random positions set to
    ``-1``, and on every rank with tokens one random token whose slots are all ``-1``."""
    toks, ids = routing(rng, cfg, tokens_per_rank)
    ids = [mask_slots(rng, a, fraction) for a in ids]
    for a in ids:
        if a.shape[0]:
            a[int(rng.integers(a.shape[0]))] = -1
    return toks, ids


def edge_case(rng, cfg, name: str):
    """The edge cases every kernel is tested on (zero tokens, one hot expert, all tokens to one
    rank, ``T = max_tokens_per_rank``, a rank with no tokens; masked slots at random positions
    with a token of all ``-1``, a rank whose every slot is ``-1``; plus a random baseline), by
    name."""
    E, K, R = cfg.n_experts, cfg.token_fmt.top_k, cfg.n_ranks
    L, Tmax = E // R, cfg.max_tokens_per_rank
    if name == "zero_tokens":
        return routing(rng, cfg, 0)
    if name == "full":                                  # T = max_tokens_per_rank everywhere
        return routing(rng, cfg, Tmax)
    if name == "rank_without_tokens":
        counts = [int(rng.integers(1, Tmax + 1)) for _ in range(R)]
        counts[int(rng.integers(R))] = 0
        return routing(rng, cfg, counts)
    if name == "masked_slots":                          # random -1 slots, a token all -1
        return masked_routing(rng, cfg, Tmax)
    toks, ids = routing(rng, cfg, Tmax)
    if name == "masked_rank":                           # one rank sends nothing at all
        ids = [mask_slots(rng, a, 0.3) for a in ids]
        ids[int(rng.integers(R))][:] = -1
    elif name == "one_hot_expert":                      # every token picks expert `hot`
        hot = int(rng.integers(E))
        for a in ids:
            has = (a == hot).any(axis=1)
            a[~has, 0] = hot
    elif name == "all_to_one_rank":                     # every id on one destination rank
        dst = int(rng.integers(R))
        if K > L:
            raise ValueError("all_to_one_rank needs top_k <= n_local_experts")
        ids = [(dst * L + random_topk(rng, a.shape[0], L, K)).astype(np.int32) for a in ids]
    elif name != "random":
        raise ValueError(f"unknown edge case {name!r}")
    return toks, ids


EDGE_CASES = ("random", "zero_tokens", "full", "rank_without_tokens", "one_hot_expert",
              "all_to_one_rank", "masked_slots", "masked_rank")
