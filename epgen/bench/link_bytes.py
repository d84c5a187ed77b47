"""Link bytes: the bytes of one dispatch and one combine that cross between ranks (source rank
!= destination rank), counted from the actual routing, as opposed to the total bytes a round
trip moves through memory (``traffic``). Numpy only; no GPU.

What crosses, per (token, k) slot whose expert lives on another rank (a ``-1`` slot selects
no expert and sends nothing; under ``skip_a2a`` nothing leaves a device):

* **dispatch**, staged layout: one message, ``fmt.msg_size()`` bytes (payload, scales,
  header), less the padding of its payload and scale fields where the warp send path
  writes the fields one by one (``dispatch_row_bytes``); ``ep_final_layout``: the output row,
  its scales and its header row;
* **dispatch with ``dedup``** (``ep_rank_dedup``: one message per (token, destination
  rank), expanded at the destination; ``kernels/rank_dedup.py``): one message, as its send
  path writes it, with the token's ``K`` float32 router weights after it
  (``dedup_message_bytes``), per (token, remote rank) that holds at least one of the token's
  experts, plus the index-table and slot-table words (4 bytes each) of each remote (token,
  k) slot; through NVSHMEM each slot word is first stored into the source's own slot table
  (4 local bytes per such slot);
* **combine**: one BF16 row (``H * 2`` bytes) per remote (token, k) slot, sent back; with
  ``fp8`` an E4M3 row plus one float32 scale per 128 elements (``combine_row_bytes``); with
  ``partial_reduce`` (the destination sums its local experts' rows of a token first) one row
  per (token, remote rank) instead;
* **signals** (the SHMEM transport, destinations outside the source's P2P group): a put
  that signals is a put-with-signal whose signal is an 8-byte word, counted apart
  (``*_signal``) from the data bytes, which are the same as the peer stores'. Every dispatch
  message and combine row is one, except under ``dedup``: the message put carries no signal
  (``nvshmem_fence`` orders it, no bytes), each slot's index-word put carries one. The count
  and arrival words (one per block or per rank pair, whatever the routing) are not counted.

Same-rank slots move the same bytes inside a device (``*_local``). ``python -m
epgen.bench.link_bytes`` prints the dedup and FP8 ratios at a configuration (docs/PERF.md,
"Link bytes").
"""

from __future__ import annotations

import argparse
import math
import sys

import attrs
import numpy as np

from ..config import EPConfig
from ..formats import make_format
from ..kernels.send_policy import uses_block_broadcast, uses_warp_send
from .inputs import make_input_sets

SLOT_ENTRY_BYTES = 8
"""Bytes ``ep_rank_dedup`` stores (or puts) on the destination per remote (token, k) slot:
its index-table word and its slot-table word, 4 bytes each."""
SLOT_WORD_BYTES = 4
"""Bytes of one slot-table word: under ``ep_rank_dedup`` the SHMEM transport stores each
remote slot's word into the source's own slot table before putting it (a local store)."""
SIGNAL_BYTES = 8
"""Bytes of the signal word of one NVSHMEM put-with-signal."""
FP8_SCALE_GROUP = 128
"""Elements per float32 scale of the FP8 combine row (the BlockwiseFP8 rule)."""


@attrs.frozen
class LinkBytes:
    """The bytes of one dispatch and one combine of a routing, by where they go:
    ``*_link`` cross between ranks (data only), ``*_local`` stay on the source's own rank,
    ``*_signal`` are the signal words of the SHMEM transport's puts (8 bytes each);
    ``*_messages`` count what crosses (messages or rows)."""

    dispatch_link: int
    combine_link: int
    dispatch_local: int
    combine_local: int
    dispatch_signal: int
    combine_signal: int
    dispatch_messages: int
    combine_rows: int

    @property
    def local(self) -> int:
        """Same-rank bytes of the dispatch and the combine."""
        return self.dispatch_local + self.combine_local

    @property
    def signal_bytes(self) -> int:
        """Signal bytes of the dispatch and the combine."""
        return self.dispatch_signal + self.combine_signal

    def as_dict(self) -> dict:
        """Every field and the sums, as plain ints (the benchmark's JSON)."""
        return {**attrs.asdict(self), "local": self.local, "signal_bytes": self.signal_bytes}


def dispatch_row_bytes(cfg) -> int:
    """Bytes one message writes on another rank, as the build's send path writes them
    (``send_policy.uses_warp_send``). The warp send path writes the fields themselves: the
    payload, the scales (unpadded) and the header fields (``src_info_size +
    topk_info_size``); the send-buffer and block-staged paths copy the staged message whole,
    ``msg_size()`` bytes, the padding of the payload and scale fields included. Under
    ``ep_final_layout`` the same bytes land in the output row, its scales (row-major formats:
    the output scales; transposed ones: the header row) and the header row, whose whole
    ``hdr_bytes`` the send-buffer path copies."""
    fmt = cfg.token_fmt
    header = fmt.src_info_size + fmt.topk_info_size
    payload = int(getattr(fmt, "payload_bytes", fmt.token_size))
    scales = int(getattr(fmt, "out_scale_bytes_per_row", 0))
    by_warp = uses_warp_send(cfg)
    if not cfg.ep_final_layout:
        return payload + scales + header if by_warp else int(fmt.msg_size())
    if getattr(fmt, "scales_transposed", False):
        return payload + (header + scales if by_warp else cfg.layout.hdr_bytes)
    return payload + scales + (header if by_warp else cfg.layout.hdr_bytes)


def dedup_message_bytes(cfg) -> int:
    """Bytes one deduplicated message writes on another rank: the message
    (``dispatch_row_bytes``) and the token's ``K`` float32 weights, which the warp and
    block-staged paths store apart (``4 K``); the send-buffer path copies (or puts) the
    whole staged row, ``layout.dedup_row_bytes``."""
    if uses_warp_send(cfg) or uses_block_broadcast(cfg):
        return dispatch_row_bytes(cfg) + 4 * cfg.token_fmt.top_k
    return cfg.layout.dedup_row_bytes


def combine_row_bytes(hid_dim: int, fp8: bool = False, whole_slot: bool = False) -> int:
    """Bytes of one combine row: BF16 (``H * 2``), or with ``fp8`` E4M3 elements plus one
    float32 scale per 128 (``H + ceil(H / 128) * 4``), as the P2P send writes them (the
    quantiser's stores, straight into the slot). ``whole_slot`` (the SHMEM transport,
    ``cfg.needs_shmem``: every row is quantised into the send staging, then copied or put
    whole in 16-byte vectors, ``kernels/combine_fp8.py``): the FP8 slot with the padding of
    its codes and scales to 16 bytes each (``combine_fp8.slot_bytes``)."""
    if not fp8:
        return 2 * hid_dim
    scales = -(-hid_dim // FP8_SCALE_GROUP) * 4
    if whole_slot:
        return -(-hid_dim // 16) * 16 + -(-scales // 16) * 16
    return hid_dim + scales


def rank_counts(cfg, topk_ids) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, pairs)``, each ``[R, R]`` (source, destination): the (token, k) slots each
    source routes to each destination rank, and the (token, destination) pairs with at least
    one such slot. ``-1`` slots count nowhere; under ``skip_a2a`` a source keeps only the
    ids of its own experts (the others select nothing on it)."""
    R, L = cfg.n_ranks, cfg.layout.n_local_experts
    if len(topk_ids) != R:
        raise ValueError(f"link_bytes: topk_ids must hold one array per rank ({R}), got "
                         f"{len(topk_ids)}")
    slots = np.zeros((R, R), dtype=np.int64)
    pairs = np.zeros((R, R), dtype=np.int64)
    for s, ids in enumerate(topk_ids):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2:
            raise ValueError(f"link_bytes: topk_ids[{s}] must be [T, K], got shape "
                             f"{ids.shape}")
        if ids.size and ids.max() >= cfg.n_experts:
            raise ValueError(f"link_bytes: topk_ids[{s}] holds expert {int(ids.max())} >= "
                             f"n_experts={cfg.n_experts}")
        valid = ids >= 0
        dest = np.where(valid, ids // L, R)          # R: the "no expert" column
        if cfg.skip_a2a:
            dest = np.where(dest == s, dest, R)
        hit = np.zeros((ids.shape[0], R + 1), dtype=bool)
        np.put_along_axis(hit, dest, True, axis=1)
        slots[s] = np.bincount(dest.ravel(), minlength=R + 1)[:R]
        pairs[s] = hit[:, :R].sum(axis=0)
    return slots, pairs


def link_bytes(cfg, topk_ids, *, dedup: bool = False, fp8: bool = False,
               partial_reduce: bool = False) -> LinkBytes:
    """The ``LinkBytes`` of one dispatch and one combine of ``topk_ids`` (one ``[T, K]``
    array per rank, ``-1`` slots allowed) on ``cfg`` (module docstring). ``dedup``: one
    message per (token, destination rank) plus two 4-byte words per slot
    (``ep_rank_dedup``); ``fp8``: FP8 combine rows (the FP8 combine); ``partial_reduce``:
    one combine row per (token, destination rank)."""
    slots, pairs = rank_counts(cfg, topk_ids)
    R, P = cfg.n_ranks, cfg.p2p_world_size
    src, dst = np.indices((R, R))
    remote = (src != dst) & (not cfg.skip_a2a)
    local = src == dst
    shmem = remote & bool(cfg.use_shmem) & (src // P != dst // P)
    d_msgs = pairs if dedup else slots
    d_bytes = slots * dispatch_row_bytes(cfg) if not dedup else \
        pairs * dedup_message_bytes(cfg) + slots * SLOT_ENTRY_BYTES
    if dedup:   # each put slot word is staged first in the source's own slot table
        d_bytes = d_bytes + np.diag((slots * shmem).sum(axis=1) * SLOT_WORD_BYTES)
    c_rows = pairs if partial_reduce else slots
    c_bytes = c_rows * combine_row_bytes(cfg.token_fmt.hid_dim, fp8, cfg.needs_shmem)
    return LinkBytes(
        dispatch_link=int(d_bytes[remote].sum()), combine_link=int(c_bytes[remote].sum()),
        dispatch_local=int(d_bytes[local].sum()), combine_local=int(c_bytes[local].sum()),
        # one signal per slot, with or without dedup (its index words' puts signal)
        dispatch_signal=SIGNAL_BYTES * int(slots[shmem].sum()),
        combine_signal=SIGNAL_BYTES * int(c_rows[shmem].sum()),
        dispatch_messages=int(d_msgs[remote].sum()), combine_rows=int(c_rows[remote].sum()))


def sets_link_bytes(cfg, sets, *, dedup: bool = False, fp8: bool = False,
                    partial_reduce: bool = False) -> dict:
    """``link_bytes`` of each input set ``(tokens, topk_ids)`` (the benchmark rotates them)
    and their mean per call: ``{"per_set": [...], "mean": {...}}`` (``LinkBytes.as_dict``
    fields; the mean as floats)."""
    per = [link_bytes(cfg, ids, dedup=dedup, fp8=fp8, partial_reduce=partial_reduce).as_dict()
           for _toks, ids in sets]
    mean = {k: float(np.mean([p[k] for p in per])) for k in per[0]} if per else {}
    return {"per_set": per, "mean": mean}


OP_LINK = {"dispatch": ("dispatch_link",), "combine": ("combine_link",),
           "moe": ("dispatch_link", "combine_link")}
"""The link bytes of what each ``--op`` times."""


def op_link_bytes(cfg, sets, op: str, *, dedup: bool = False, fp8: bool = False,
                  partial_reduce: bool = False) -> dict:
    """What ``epgen bench`` reports of a variant: the mean per call over the input sets of
    ``sets_link_bytes`` (``LinkBytes`` fields), ``link`` (the bytes crossing between ranks
    in what ``op`` times: the dispatch's, the combine's or both), ``options`` (the choices
    counted) and ``per_set_link``."""
    if op not in OP_LINK:
        raise ValueError(f"op_link_bytes: op must be one of {', '.join(OP_LINK)}, got {op!r}")
    got = sets_link_bytes(cfg, sets, dedup=dedup, fp8=fp8, partial_reduce=partial_reduce)
    keys = OP_LINK[op]
    return {**got["mean"], "link": sum(got["mean"][k] for k in keys),
            "per_set_link": [sum(p[k] for k in keys) for p in got["per_set"]],
            "options": {"dedup": dedup, "fp8": fp8, "partial_reduce": partial_reduce}}


def dedup_ratios(cfg, topk_ids) -> dict:
    """The figures of the deduplicated dispatch and the FP8 combine on one routing: dispatch
    link bytes with ``dedup`` over today's, the combine's with ``partial_reduce`` over
    today's, the FP8 combine's over BF16's; the remote (token, k) slots and remote (token,
    rank) pairs behind them."""
    today = link_bytes(cfg, topk_ids)
    ded = link_bytes(cfg, topk_ids, dedup=True, partial_reduce=True)
    fp8 = link_bytes(cfg, topk_ids, fp8=True)
    return {"dispatch_today": today.dispatch_link, "dispatch_dedup": ded.dispatch_link,
            "dispatch_signal_today": today.dispatch_signal,
            "dispatch_signal_dedup": ded.dispatch_signal,
            "dispatch_ratio": ded.dispatch_link / today.dispatch_link
            if today.dispatch_link else None,
            "remote_slots": today.dispatch_messages, "remote_pairs": ded.dispatch_messages,
            "combine_bf16": today.combine_link, "combine_partial_reduce": ded.combine_link,
            "combine_partial_ratio": ded.combine_link / today.combine_link
            if today.combine_link else None,
            "combine_fp8": fp8.combine_link,
            "fp8_ratio": fp8.combine_link / today.combine_link if today.combine_link else None}


def issue_config(n_ranks: int = 8, n_experts: int = 256, hid_dim: int = 7168, top_k: int = 8,
                 tokens: int = 4096, fmt: str = "BF16", p2p_world_size: int | None = None):
    """The configuration of the dedup figures: H=7168, K=8, E=256 over 8 ranks, every rank a
    P2P peer (defaults), ``tokens`` per rank; a ``p2p_world_size`` below ``n_ranks`` puts
    the other groups behind the SHMEM transport (``use_shmem``)."""
    P = n_ranks if p2p_world_size is None else p2p_world_size
    return EPConfig(num_threads=1024, n_sms=132, n_experts=n_experts, n_ranks=n_ranks,
                    max_tokens_per_rank=tokens, p2p_world_size=P, use_shmem=P < n_ranks,
                    token_fmt=make_format(fmt, hid_dim, top_k))


def figure(cfg, tokens: int, routing: str = "uniform", zipf_s: float = 0.8,
           seed: int = 0) -> dict:
    """``dedup_ratios`` of one routing drawn as ``epgen bench`` draws its first input set
    (``inputs.make_input_sets``: ``routing`` uniform or zipf, ``seed``)."""
    _toks, ids = make_input_sets(cfg, tokens, 1, routing, zipf_s, seed)[0]
    return {"routing": routing, "zipf_s": zipf_s if routing == "zipf" else None,
            "seed": seed, "tokens_per_rank": tokens, **dedup_ratios(cfg, ids)}


def expected_distinct_ranks(n_experts: int, n_ranks: int, top_k: int) -> float:
    """Expected distinct ranks a uniform top-k (without replacement) reaches: ``R * (1 -
    C(E - L, K) / C(E, K))``, ``L = E / R`` (the closed form the measured routing is
    compared with)."""
    L = n_experts // n_ranks
    return n_ranks * (1 - math.comb(n_experts - L, top_k) / math.comb(n_experts, top_k))


def main(argv=None) -> int:
    """``python -m epgen.bench.link_bytes``: the dispatch dedup and FP8 combine ratios at a
    configuration, for uniform and Zipf routing, on the routing ``epgen bench`` draws."""
    p = argparse.ArgumentParser(prog="python -m epgen.bench.link_bytes",
                                description=main.__doc__)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hid-dim", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--format", default="BF16", help="dispatch token format (default BF16)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--p2p-world-size", type=int, default=None,
                   help="ranks per P2P group (default: all); fewer: the SHMEM transport "
                        "between groups, whose signal bytes are printed too")
    p.add_argument("--zipf-s", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        cfg = issue_config(a.ranks, a.experts, a.hid_dim, a.top_k, a.tokens, a.format,
                           a.p2p_world_size)
    except ValueError as exc:
        p.error(str(exc))
    fmt = cfg.token_fmt
    print(f"{fmt.name} H={fmt.hid_dim} K={fmt.top_k} E={cfg.n_experts} R={cfg.n_ranks}, "
          f"{a.tokens} tokens per rank, seed {a.seed}; expected distinct ranks per token "
          f"(uniform): {expected_distinct_ranks(cfg.n_experts, cfg.n_ranks, fmt.top_k):.3f}")
    for kind in ("uniform", "zipf"):
        f = figure(cfg, a.tokens, kind, a.zipf_s, a.seed)
        name = kind if kind == "uniform" else f"zipf s={a.zipf_s}"
        print(f"{name:<13} dispatch link {f['dispatch_today'] / 1e9:.4f} GB today, "
              f"{f['dispatch_dedup'] / 1e9:.4f} GB dedup: ratio {f['dispatch_ratio']:.4f} "
              f"({f['remote_pairs'] / f['remote_slots']:.4f} messages per remote slot); "
              f"combine partial reduce {f['combine_partial_ratio']:.4f}, "
              f"FP8 {f['fp8_ratio']:.4f}")
        if cfg.needs_shmem:
            print(f"{'':<13} SHMEM signals (8 B per put-with-signal, one per remote slot): "
                  f"{f['dispatch_signal_today'] / 1e6:.3f} MB today, "
                  f"{f['dispatch_signal_dedup'] / 1e6:.3f} MB dedup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
