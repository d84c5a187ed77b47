"""The link-byte model (``epgen.bench.link_bytes``) against a slot-by-slot count written here
(every (token, k) slot and every (token, rank) pair visited in Python), and its message
sizes against hand-counted fields (the simulator's traffic counter checks both against the
kernels: tests/sim/test_link_bytes_sim.py), on routings with ``-1`` slots, under the SHMEM and ``skip_a2a``
configurations; the figures of the per-rank deduplicated dispatch and the FP8 combine at
H=7168, K=8, E=256 over 8 ranks; bad inputs refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest

import epgen
from epgen import routing
from epgen.bench import link_bytes as lb
from epgen.formats import make_format


def _cfg(R=4, E=8, H=256, K=3, fmt="BF16", P=None, **flags):
    flags.setdefault("use_shmem", False)
    return epgen.EPConfig(num_threads=64, n_sms=R + 4, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=16, p2p_world_size=P or R,
                          token_fmt=make_format(fmt, H, K), **flags)


def _slow_count(cfg, ids, dedup, fp8, partial):
    """(dispatch link, combine link, dispatch local, combine local, dispatch signal, combine
    signal), visiting every slot."""
    L, P, H = cfg.n_experts // cfg.n_ranks, cfg.p2p_world_size, cfg.token_fmt.hid_dim
    msg = lb.dispatch_row_bytes(cfg)       # checked below and against the simulator
    if dedup:                              # the K float32 weights travel with the message
        msg = lb.dedup_message_bytes(cfg)  # checked below
    crow = (H + math.ceil(H / 128) * 4) if fp8 else 2 * H
    if fp8 and cfg.needs_shmem:        # the staged FP8 slot goes whole: codes and scales
        crow = 16 * math.ceil(H / 16) + 16 * math.ceil(math.ceil(H / 128) * 4 / 16)
    out = dict.fromkeys(("dl", "cl", "dloc", "cloc", "ds", "cs"), 0)
    for s, a in enumerate(ids):
        for row in a:
            ranks = []
            for e in row:
                if e < 0:
                    continue
                d = int(e) // L
                if cfg.skip_a2a and d != s:
                    continue
                ranks.append(d)
            for d in set(ranks) if dedup else ranks:
                out["dloc" if d == s else "dl"] += msg
            for d in ranks:                # a message's put, or a dedup slot's two words
                remote = d != s and cfg.use_shmem and s // P != d // P
                if dedup:
                    out["dloc" if d == s else "dl"] += 4 + 4
                    if remote:             # its slot word, staged in the source's own table
                        out["dloc"] += 4
                if remote:
                    out["ds"] += 8
            for d in set(ranks) if partial else ranks:
                out["cloc" if d == s else "cl"] += crow
                if d != s and cfg.use_shmem and s // P != d // P:
                    out["cs"] += 8
    return tuple(out.values())


CASES = {
    "bf16": {},
    "fp8_dispatch": {"fmt": "BlockwiseFP8", "H": 384},
    "mxfp4": {"fmt": "MXFP4", "H": 256},
    "final_bf16": {"ep_final_layout": True},
    "final_nvfp4": {"fmt": "NVFP4", "ep_final_layout": True},
    "final_fp8": {"fmt": "BlockwiseFP8", "H": 384, "ep_final_layout": True},
    "shmem_mixed": {"P": 2, "use_shmem": True},
    "shmem_mixed_h640": {"P": 2, "use_shmem": True, "H": 640},
    "skip_a2a": {"skip_a2a": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dedup,fp8,partial", [(False, False, False), (True, False, False),
                                               (False, True, False), (True, True, True)])
def test_model_matches_a_slot_by_slot_count(case, dedup, fp8, partial, rng):
    cfg = _cfg(**CASES[case])
    _toks, ids = routing.masked_routing(rng, cfg, [16, 0, 7, 16], fraction=0.25)
    got = lb.link_bytes(cfg, ids, dedup=dedup, fp8=fp8, partial_reduce=partial)
    want = _slow_count(cfg, ids, dedup, fp8, partial)
    assert (got.dispatch_link, got.combine_link, got.dispatch_local, got.combine_local,
            got.dispatch_signal, got.combine_signal) == want
    if cfg.skip_a2a:
        assert got.dispatch_link == got.combine_link == 0
    assert got.signal_bytes == got.dispatch_signal + got.combine_signal
    assert got.local == got.dispatch_local + got.combine_local


@pytest.mark.parametrize("case,want", [
    ({}, 512 + 16 + 16),                                    # BF16: no padding
    ({"fmt": "MXFP8"}, 256 + 8 + 16 + 16),                  # warp path: fields unpadded
    ({"fmt": "MXFP8", "P": 2, "use_shmem": True}, 272 + 32),  # send buffer: msg_size()
    ({"fmt": "BlockwiseFP8", "H": 384, "ep_final_layout": True}, 384 + 32 + 12),
    ({"fmt": "NVFP4", "ep_final_layout": True}, 128 + 16 + 32),
    ({"fmt": "MXFP4", "ep_final_layout": True}, 128 + 8 + 32),  # send buffer: hdr_bytes
])
def test_dispatch_row_bytes_by_send_path(case, want):
    assert lb.dispatch_row_bytes(_cfg(**case)) == want


@pytest.mark.parametrize("case,want", [
    ({}, 512 + 16 + 16 + 12),                               # warp path: message + 3 weights
    ({"fmt": "MXFP8"}, 256 + 8 + 16 + 16 + 12),
    ({"P": 2, "use_shmem": True}, 560),          # send buffer: the staged row, 16-aligned
])
def test_dedup_message_bytes_by_send_path(case, want):
    assert lb.dedup_message_bytes(_cfg(**case)) == want


def test_today_matches_the_p2p_benchmarks_count(rng):
    """Without ``-1`` slots the model's dispatch and combine link bytes are what the P2P
    benchmark's per-GPU count sends in total."""
    from epgen.bench import p2p
    for flags in ({}, {"ep_final_layout": True}):
        cfg = _cfg(**flags)
        _toks, ids = routing.routing(rng, cfg, 16)
        got = lb.link_bytes(cfg, ids)
        assert got.dispatch_link == p2p.link_bytes(cfg, ids, "dispatch")["total_remote"]
        assert got.combine_link == p2p.link_bytes(cfg, ids, "combine")["total_remote"]


ISSUE = dict(n_ranks=8, n_experts=256, hid_dim=7168, top_k=8)


def test_dedup_dispatch_is_at_most_070_of_today_at_uniform_routing(seed):
    """H=7168, K=8, E=256, 8 ranks, uniform routing: about 4.63 of a token's 7 remote slots
    land on distinct ranks (1 - C(224, 8) / C(256, 8) of 8 ranks, 7/8 of them remote), so
    the deduplicated dispatch sends ~0.66 of today's bytes (the index entries add 4 bytes per
    slot)."""
    cfg = lb.issue_config(**ISSUE, tokens=512)
    f = lb.figure(cfg, 512, "uniform", seed=seed % 2**31)
    assert f["dispatch_ratio"] <= 0.70
    distinct = lb.expected_distinct_ranks(256, 8, 8)
    assert 5.29 < distinct < 5.30
    msg = cfg.token_fmt.msg_size()
    expected = (distinct * 7 / 8 * msg + 7 * 4) / (7 * msg)
    assert f["dispatch_ratio"] == pytest.approx(expected, abs=0.01)
    assert f["combine_partial_ratio"] == pytest.approx(distinct / 8, abs=0.01)


def test_zipf_figure_and_fp8_combine_ratio(seed):
    cfg = lb.issue_config(**ISSUE, tokens=256)
    f = lb.figure(cfg, 256, "zipf", zipf_s=0.8, seed=seed % 2**31)
    assert 0 < f["dispatch_ratio"] <= 1
    assert f["fp8_ratio"] == (7168 + 7168 / 32) / (2 * 7168)
    assert f["fp8_ratio"] <= 0.55


def test_one_hot_routing_to_one_rank_gains_k_fold():
    """Every token's K experts on one other rank: dedup sends one message per token."""
    cfg = _cfg(R=2, E=8, K=3)
    ids = [np.array([[4, 5, 6]] * 5, np.int32), np.array([[0, 2, 3]] * 2, np.int32)]
    today, ded = lb.link_bytes(cfg, ids), lb.link_bytes(cfg, ids, dedup=True)
    msg = cfg.token_fmt.msg_size()
    assert today.dispatch_link == 21 * msg
    assert ded.dispatch_link == 7 * (msg + 3 * 4) + 21 * 8     # message + weights; 2 words a slot
    assert ded.dispatch_messages == 7


def test_bad_inputs_are_refused_by_name():
    cfg = _cfg()
    with pytest.raises(ValueError, match=r"topk_ids must hold one array per rank \(4\)"):
        lb.link_bytes(cfg, [np.zeros((2, 3), np.int32)])
    with pytest.raises(ValueError, match=r"topk_ids\[1\] holds expert 8 >= n_experts=8"):
        lb.link_bytes(cfg, [np.zeros((1, 3), np.int32), np.full((1, 3), 8, np.int32),
                            np.zeros((0, 3), np.int32), np.zeros((0, 3), np.int32)])
    with pytest.raises(ValueError, match=r"topk_ids\[0\] must be \[T, K\]"):
        lb.link_bytes(cfg, [np.zeros(3, np.int32)] * 4)


def test_entry_point_prints_both_routings(capsys):
    assert lb.main(["--tokens", "64", "--hid-dim", "256"]) == 0
    out = capsys.readouterr().out
    assert "uniform" in out and "zipf s=0.8" in out and "FP8 0.5156" in out


def test_entry_point_prints_the_shmem_signals_between_groups(capsys, rng):
    """Two P2P groups of 2: the dedup dispatch still signals once per remote slot outside
    the group (its index words' puts), so its signal bytes equal today's."""
    assert lb.main(["--tokens", "64", "--hid-dim", "256", "--ranks", "4", "--experts", "16",
                    "--p2p-world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "SHMEM signals" in out
    cfg = lb.issue_config(4, 16, 256, 8, 64, p2p_world_size=2)
    assert cfg.use_shmem and cfg.needs_shmem
    _toks, ids = routing.routing(rng, cfg, 64)
    L = 4
    slots = sum(int(((a // L) // 2 != s // 2).sum()) for s, a in enumerate(ids))
    f = lb.dedup_ratios(cfg, ids)
    assert f["dispatch_signal_today"] == f["dispatch_signal_dedup"] == 8 * slots
