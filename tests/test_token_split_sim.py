"""Warps sharing a token on the warp send path (``tuning.send_warps_per_token_max``,
``send_warps_per_token``) end to end on the CPU simulator: part 0 of each group reserves and
writes the headers, a group barrier hands the addresses to the other parts, every part
moves its share of the token and counts its share of each copy, and the monitors wait for
``token_warps`` times their count. Every format, against the numpy reference bit for bit,
over back-to-back calls, with the flags that keep the warp path (staged, ORD-R,
``skip_a2a``) and the fused single launch.
"""

from __future__ import annotations

import re

import pytest

import epgen
import ir
from epgen.kernels import dispatch_async, send_policy
from epgen.presets import load_preset
from backends import nvptx

from format_cases import FORMATS, QUANT
from test_formats_sim import FLAGS, make_cfg, run_calls

#: (format, H): BF16 with a tail past the parts' even share (H=576); every quantising format
#: with a 512-byte payload, where every part gets a chunk (and BlockwiseFP8 384: a partial
#: second chunk)
SPLIT_CASES = [("BF16", 512), ("BF16", 576), ("BlockwiseFP8", 384)] \
    + [(f, 512 * 8 // FORMATS[f].element_bits) for f in QUANT]
SPLIT_FLAGS = ["staged", "ord_r", "skip_a2a"]


def tuned(cfg, **changes):
    """``cfg`` with its tuning's ``changes``."""
    return cfg.replace(tuning=cfg.tuning.replace(**changes))


def split_cfg(fmt, H, token_warps, **flags):
    """``make_cfg`` with ``token_warps`` warps per block (one group per block) and
    ``tuning.send_warps_per_token_max`` raised so that ``send_warps_per_token`` picks them."""
    cfg = tuned(make_cfg(fmt, H, **flags).replace(num_threads=32 * token_warps),
                send_warps_per_token_max=token_warps)
    assert send_policy.send_warps_per_token(cfg) == token_warps
    return cfg


@pytest.mark.parametrize("token_warps", [2, 4])
@pytest.mark.parametrize("flags", SPLIT_FLAGS)
@pytest.mark.parametrize("fmt,H", SPLIT_CASES, ids=[f"{f}-H{h}" for f, h in SPLIT_CASES])
def test_split_tokens_match_reference(fmt, H, flags, token_warps, seed):
    cfg = split_cfg(fmt, H, token_warps, **FLAGS[flags])
    text = ir.print_module(epgen.build_module(cfg))
    assert "barrier token_group0 id=4 count=%d group=true" % (32 * token_warps) in text
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("fmt,H", [("BF16", 512), ("NVFP4", 1024)], ids=["BF16", "NVFP4"])
def test_split_tokens_fused_launch(fmt, H, seed):
    cfg = split_cfg(fmt, H, 2)
    run_calls(cfg, seed, n_calls=2, fused=True)


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
