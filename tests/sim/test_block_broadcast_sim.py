"""The block-staged broadcast as the staged variants' send path where it is faster
(``send_policy.prefers_block_broadcast``: BF16, MXFP8 and BlockwiseFP8 at prefill-sized
calls) on the CPU simulator against the numpy reference, bit for bit, over back-to-back
calls: staged, ORD-R, ``skip_a2a`` and the fused launch; and the rule itself."""

from __future__ import annotations

import pytest

import epgen
import ir
from epgen.formats import make_format
from epgen.kernels import dispatch_async, send_policy
from epgen.presets import load_preset

from format_cases import ALL, FORMATS, case_ids
from test_formats_sim import FLAGS, make_cfg, run_calls

#: the formats that prefer the block-staged broadcast (``prefers_block_staged_broadcast``) at
#: H=512 (BlockwiseFP8 at 384: a ragged vector of scales), and BF16 with a ragged staging trip
CASES = [(f, 384 if f == "BlockwiseFP8" else 512) for f in ALL
         if FORMATS[f].prefers_block_staged_broadcast] + [("BF16", 576)]


@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
@pytest.mark.parametrize("flags", ["staged", "ord_r", "skip_a2a"])
@pytest.mark.parametrize("fmt,H", CASES, ids=case_ids(CASES))
def test_block_broadcast_matches_reference(fmt, H, flags, fused, seed):
    # up to 16 tokens per rank over 5 blocks: each block alternates its two buffers; the
    # simulator's calls are small, so every call counts as prefill-sized (threshold 1)
    cfg = make_cfg(fmt, H, **FLAGS[flags]).replace(max_tokens_per_rank=16)
    cfg = cfg.replace(tuning=cfg.tuning.replace(block_broadcast_min_tokens_per_block=1))
    assert send_policy.prefers_block_broadcast(cfg)
    assert not send_policy.uses_warp_send(cfg) and send_policy.uses_block_broadcast(cfg)
    module = epgen.build_module(cfg)
    roles = [r.name for r in module.kernel(dispatch_async.KERNEL_NAME).roles]
    assert roles == ["monitor", "comm", "signal"]
    text = ir.print_module(module)
    assert "shared send_msg[" in text and "token_group" not in text
    run_calls(cfg, seed, n_calls=2, fused=fused)


def test_rule():
    """Prefill (4096 tokens over 33 blocks) takes the block-staged broadcast for BF16, MXFP8
    and BlockwiseFP8, not NVFP4; decode (128 tokens) and the final layout keep the warp
    path."""
    prefill, decode = load_preset("prefill"), load_preset("decode")

    def with_fmt(cfg, name):
        return cfg.replace(token_fmt=make_format(name, 7168, 8))

    for name in ALL:
        want = FORMATS[name].prefers_block_staged_broadcast
        assert send_policy.prefers_block_broadcast(with_fmt(prefill, name)) is want, name
        assert not send_policy.prefers_block_broadcast(with_fmt(decode, name)), name
    assert not send_policy.prefers_block_broadcast(prefill.replace(ep_final_layout=True))
    assert send_policy.uses_warp_send(prefill.replace(ep_final_layout=True))


def test_threshold_above_the_call_means_the_warp_path():
    """``tuning.block_broadcast_min_tokens_per_block`` above a full call's tokens per block
    keeps prefill on the warp path."""
    prefill = load_preset("prefill")
    assert not send_policy.uses_warp_send(prefill)
    tokens_per_block = prefill.max_tokens_per_rank // prefill.n_sms
    tuned = prefill.replace(tuning=prefill.tuning.replace(
        block_broadcast_min_tokens_per_block=tokens_per_block + 1))
    assert send_policy.uses_warp_send(tuned)
