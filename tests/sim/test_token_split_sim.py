"""Warps sharing a token on the warp send path (``tuning.send_warps_per_token_max``,
``send_warps_per_token``) end to end on the CPU simulator: part 0 of each group reserves and
writes the headers, the group's own barrier hands the addresses to the other parts, every
part moves its share of the token and counts its share of each copy, and the monitors wait
for ``token_warps`` times their count. Several token groups per block (two, and four), each
with tokens in a full call, so every group barrier runs; every format, against the numpy
reference bit for bit, over back-to-back calls, with the flags that keep the warp path
(staged, ORD-R, ``skip_a2a``) and the fused single launch.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import epgen
import ir
from epgen.kernels import dispatch_async, send_policy
from epgen.presets import load_preset
from backends import nvptx

from sim_world import sim_world
from test_formats_sim import FLAGS, make_cfg
from world_checks import checked_calls
from format_cases import FORMATS, QUANT

#: (format, H): BF16 with a tail past the parts' even share (H=576); every quantising format
#: with a 512-byte payload, where every part gets a chunk (and BlockwiseFP8 384: a partial
#: second chunk)
SPLIT_CASES = [("BF16", 512), ("BF16", 576), ("BlockwiseFP8", 384)] \
    + [(f, 512 * 8 // FORMATS[f].element_bits) for f in QUANT]
SPLIT_FLAGS = ["staged", "ord_r", "skip_a2a"]


def tuned(cfg, **changes):
    """``cfg`` with its tuning's ``changes``."""
    return cfg.replace(tuning=cfg.tuning.replace(**changes))


def split_cfg(fmt, H, token_warps, groups=2, **flags):
    """``make_cfg`` with ``groups`` token groups of ``token_warps`` warps per block and
    ``tuning.send_warps_per_token_max`` raised so that ``send_warps_per_token`` picks them;
    ``max_tokens_per_rank`` is the most the rule allows (a group per token over the grid's
    blocks: ``n_sms * groups``), so a full call gives every group of a block tokens."""
    base = make_cfg(fmt, H, **flags)
    cfg = tuned(base.replace(num_threads=32 * token_warps * groups,
                             max_tokens_per_rank=base.n_sms * groups),
                send_warps_per_token_max=token_warps)
    assert send_policy.send_warps_per_token(cfg) == token_warps
    return cfg


def run_split_calls(cfg, seed, fused=False):
    """Two checked calls: every rank's full ``max_tokens_per_rank`` (so every token group of
    every sending block has tokens), then a random count per rank."""
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    counts = lambda call: [T] * cfg.n_ranks if call == 0 else \
        [int(rng.integers(0, T + 1)) for _ in range(cfg.n_ranks)]          # noqa: E731
    with sim_world(cfg, seed, fused=fused) as world:
        for _ in checked_calls(world, rng, seed, counts, calls=2, graph=False):
            pass


@pytest.mark.parametrize("token_warps", [2, 4])
@pytest.mark.parametrize("flags", SPLIT_FLAGS)
@pytest.mark.parametrize("fmt,H", SPLIT_CASES, ids=[f"{f}-H{h}" for f, h in SPLIT_CASES])
def test_split_tokens_match_reference(fmt, H, flags, token_warps, seed):
    """Two token groups per block, each on its own barrier."""
    run_split_calls(split_cfg(fmt, H, token_warps, **FLAGS[flags]), seed)


@pytest.mark.parametrize("token_warps,groups", [(2, 4), (4, 2)])
def test_each_token_group_keeps_its_own_barrier(token_warps, groups, seed):
    """The most groups per block the default tuning allows (4), and the widest groups: a
    group's parts meet only each other at its barrier (part 0's addresses and counter
    offsets reach its own group's parts), over several interleavings. Groups sharing one
    barrier pair warps of different groups, which then count other groups' copies: the
    monitors never see their counts (a SimHang) or rows go wrong."""
    cfg = split_cfg("BF16", 512, token_warps, groups)
    for s in range(3):
        run_split_calls(cfg, seed + s)


@pytest.mark.parametrize("token_warps,groups", [(2, 2), (2, 4), (4, 2)])
def test_group_barriers_are_declared_per_group(token_warps, groups):
    """The comm role declares one barrier per token group: ids 4, 5, ..., each of the
    group's ``32 * token_warps`` threads."""
    cfg = split_cfg("BF16", 512, token_warps, groups)
    comm = epgen.build_module(cfg).kernel(dispatch_async.KERNEL_NAME).role("comm")
    assert [(b.name, b.id, b.count, b.group) for b in comm.barriers if b.group] == \
        [(f"token_group{i}", 4 + i, 32 * token_warps, True) for i in range(groups)]


@pytest.mark.parametrize("fmt,H", [("BF16", 512), ("NVFP4", 1024)], ids=["BF16", "NVFP4"])
def test_split_tokens_fused_launch(fmt, H, seed):
    run_split_calls(split_cfg(fmt, H, 2), seed, fused=True)


def test_rule_picks_the_most_warps_that_keep_a_group_per_token():
    """Decode (128 tokens per rank, 33 blocks x 16 warps): 4 warps per token (132 groups);
    8 would leave 66 groups for 128 tokens. Prefill keeps one warp per token; so do the
    final layout and the default maximum."""
    decode, prefill = load_preset("decode"), load_preset("prefill")
    assert send_policy.send_warps_per_token(decode) == decode.tuning.send_warps_per_token_max
    assert send_policy.send_warps_per_token(tuned(decode, send_warps_per_token_max=1)) == 1
    eight = dict(send_warps_per_token_max=8)
    assert send_policy.send_warps_per_token(tuned(decode, **eight)) == 4
    assert send_policy.send_warps_per_token(tuned(prefill, **eight)) == 1
    assert send_policy.send_warps_per_token(
        tuned(decode.replace(ep_final_layout=True), **eight)) == 1
    # at most max_token_groups = 4 groups per block: 1024 threads need 8 warps per group,
    # beyond the default maximum of 4 (the default preset keeps one warp per token)
    wide = decode.replace(num_threads=1024, n_sms=64, max_tokens_per_rank=32)
    assert send_policy.send_warps_per_token(tuned(wide, **eight)) == 8
    assert send_policy.send_warps_per_token(tuned(load_preset("default"), **eight)) == 8
    assert send_policy.send_warps_per_token(wide) == 1
    assert send_policy.send_warps_per_token(load_preset("default")) == 1
    # ... and never more than 16 - TOKEN_GROUP_BARRIER_BASE = 12 barrier ids
    assert send_policy.send_warps_per_token(
        tuned(wide, max_token_groups=16, send_warps_per_token_max=2)) == 1


def test_split_decode_ptx():
    """The decode preset with 4 warps per token: four group barriers of 128 threads, each
    synced twice per round, and the monitors' finished target four times their count."""
    cfg = tuned(load_preset("decode"), send_warps_per_token_max=4)
    module = epgen.build_module(cfg)
    assert ir.check(module) == []
    ptx = nvptx.emit_ptx(module)
    nvptx.check_ptx(module, ptx)
    comm = module.kernel(dispatch_async.KERNEL_NAME).role("comm")
    assert [(b.id, b.count, b.group) for b in comm.barriers] == \
        [(4 + i, 128, True) for i in range(4)]
    for i in range(4):
        assert len(re.findall(rf"\bbar\.sync\s+{4 + i},\s*128;", ptx)) == 2 * 2   # both kernels
    text = ir.print_kernel(module.kernel(dispatch_async.KERNEL_NAME))
    assert re.search(r"spin_wait\.acquire\.gpu\.global\.u32 .* eq mul\(%count, 4:u32\)", text)
