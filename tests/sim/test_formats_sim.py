"""The quantising formats (every registered one) end to end on the CPU: the real
``EmulatedWorld`` runs the generated kernels in the IR simulator (``backends.sim``, whose
float arithmetic rounds as the hardware's ``.rn`` instructions and whose ``cvt.rn.satfinite
.e4m3x2`` matches the PTX), against the numpy reference, bit for bit (payload, scales,
offsets, src_info), over back-to-back calls, with the flags that change where scales go:
staged, ORD-R, ``skip_a2a`` (one device), the fused kernel (with the shared expert), the final
layout (the sender writes
each row's scales into the destination's output scales: ``scales_ptrs``) and prod reserve.

Shapes (tests/support/format_cases.py): BlockwiseFP8 with H = 384 (3 scale groups: the tile scale
copy's padding guard) and 512 (a whole vector of scales); the others with H = 64. The GPU tests
(tests/gpu/test_formats_gpu.py, tests/gpu/test_p2p_gpu.py) run the same against real memory ordering.
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
import ir
from epgen import round_trips
from epgen.formats import make_format

import format_cases
from format_cases import case_ids
from sim_world import sim_world

CASES = format_cases.sim_cases(every_shape=True)
#: every format, BF16 too
WARP_CASES = [(f, 512) for f in format_cases.PLAIN] + CASES
#: the formats that take a global input scale (NVFP4)
INPUT_SCALED = [(f, h) for f, h in format_cases.sim_cases()
                if format_cases.FORMATS[f].uses_input_scale]
FLAGS = {
    "staged": {},
    "ord_r": {"ep_ord_r": True, "has_rank_flag": True},
    "skip_a2a": {"skip_a2a": True},
    "fused_se": {"fused_shared_expert": True},
    "final_layout": {"ep_final_layout": True},
    "prod_reserve": {"ep_final_layout": True, "ep_prod_reserve": True},
}


def make_cfg(fmt, H, **flags):
    R = 1 if flags.get("skip_a2a") else 2      # the per-device instantiation
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=2 * R, n_ranks=R,
                          max_tokens_per_rank=4, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format(fmt, H, 2), **flags)


def tuned(cfg, **changes):
    """``cfg`` built with ``changes`` to its ``tuning``."""
    return cfg.replace(tuning=cfg.tuning.replace(**changes))


def run_calls(cfg, seed, n_calls=3, input_scale=1.0, **world_kwargs):
    """``n_calls`` checked round trips (``epgen.round_trips``) with fresh token counts each;
    ``input_scale`` passed to every dispatch of a format that uses one."""
    rng = np.random.default_rng(seed)
    kw = {"input_scale": input_scale} if getattr(cfg.token_fmt, "uses_input_scale", False) \
        else {}

    def counts(call):
        return [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    with sim_world(cfg, seed, **world_kwargs) as world:
        inputs = round_trips.drawn_inputs(rng, cfg, counts, n_calls)
        for _ in round_trips.checked_calls(world, inputs, seed=f"{seed} ({cfg.token_fmt.name})",
                                           call=lambda toks, ids: world.dispatch(toks, ids, **kw)):
            pass


@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
@pytest.mark.parametrize("fmt,H", CASES, ids=case_ids(CASES))
def test_formats_match_reference(fmt, H, flags, seed):
    run_calls(make_cfg(fmt, H, **FLAGS[flags]), seed)


@pytest.mark.parametrize("input_scale", [0.25, 3.0])
@pytest.mark.parametrize("fmt,H", INPUT_SCALED, ids=case_ids(INPUT_SCALED))
def test_input_scale(fmt, H, input_scale, seed):
    run_calls(make_cfg(fmt, H), seed, n_calls=2, input_scale=input_scale)


@pytest.mark.parametrize("fmt,H", WARP_CASES, ids=case_ids(WARP_CASES))
@pytest.mark.parametrize("flags", ["staged", "ord_r", "skip_a2a", "prod_reserve"])
def test_send_destinations_in_shared_memory(fmt, H, flags, seed):
    """The warp send path: each lane leaves its destination in shared memory and every store
    loads it back; same results."""
    from epgen.kernels import send_policy
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    text = ir.print_module(epgen.build_module(cfg))
    warp_path = send_policy.uses_warp_send(cfg)     # the staged paths have no such table
    assert ("shared send_dsts[512]" in text) is warp_path
    assert ("ld.shared [ptradd(%warp_dsts" in text) is warp_path
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("fmt,H", [("BlockwiseFP8", 384), ("NVFP4", 1024), ("MXFP8", 64)],
                         ids=["BlockwiseFP8-H384", "NVFP4-H1024", "MXFP8-H64"])
def test_quantised_payload_staged_in_shared_memory(fmt, H, seed):
    """``tuning.quant_stage_bytes`` = 256: the warp quantises 256-byte chunks of the payload
    into shared memory and copies them to the destinations as 16-byte vectors; the last chunk
    may be partial (FP8 H=384: 32 + 16 items, NVFP4 H=1024: 64 + 64, MXFP8 H=64: one chunk of
    8). Same bytes as the reference."""
    cfg = tuned(make_cfg(fmt, H), quant_stage_bytes=256)
    text = ir.print_module(epgen.build_module(cfg))
    assert "shared quant_stage[512]" in text and "for %q_chunk:u32" in text
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("stage", [100, 128, 0.5, True])
def test_staging_chunk_must_hold_whole_trips(stage):
    fmt = make_format("BlockwiseFP8", 512, 2)          # 8 payload bytes per item
    with pytest.raises(ValueError, match="multiple of 256 bytes"):
        fmt.emitter.check_stage_bytes(stage)


@pytest.mark.parametrize("preset,fmt,want,token_warps", [
    ("prefill", "NVFP4", 2048, 1), ("prefill", "BlockwiseFP8", 2048, 1),  # 16 warps x 2 KB fit
    ("decode", "NVFP4", 896, 4), ("decode", "BlockwiseFP8", 1792, 4),     # a quarter payload
    ("default", "NVFP4", 1024, 1),              # 32 warps (one per token): what fits
    ("default", "BlockwiseFP8", 1024, 1)])      # 32 warps: what fits
def test_staging_chunk_fits_the_static_shared_memory(preset, fmt, want, token_warps):
    """The warp send path's default chunk (``quant_stage_bytes`` = 2048 preferred; when warps
    share a token, their share of the payload, ``part_chunk_bytes``, if smaller) shrinks to
    whole trips that fit 48 KB of static shared memory with the block's other buffers; the
    kernel builds. (Prefill BlockwiseFP8 takes the block-staged broadcast by default: a
    threshold above any call keeps the warp path here.)"""
    from epgen.kernels import send_policy
    from epgen.presets import load_preset
    cfg = load_preset(preset)
    assert send_policy.send_warps_per_token(cfg) == token_warps
    cfg = cfg.replace(token_fmt=make_format(fmt, 7168, cfg.layout.top_k),
                      tuning=cfg.tuning.replace(block_broadcast_min_tokens_per_block=1 << 20))
    assert send_policy.uses_warp_send(cfg)
    text = ir.print_module(epgen.build_module(cfg))
    warps = cfg.num_threads // 32
    assert f"shared quant_stage[{warps * want}]" in text


def test_staging_chunk_rules():
    fmt = make_format("NVFP4", 7168, 8).emitter         # 4 payload bytes per item: 128 / trip
    assert fmt.stage_chunk_bytes(2048, 16, 4224) == 2048
    # (49152 - 8448) // 32 = 1272 bytes of room per warp, less the scales of a 1272-byte
    # chunk (318 items: 159 one-byte scales) and 16 bytes of rounding: 1097, 8 trips of 128
    assert fmt.stage_chunk_bytes(2048, 32, 8448) == 1024
    fp8 = make_format("BlockwiseFP8", 7168, 8).emitter  # 8 bytes per item: 256 per trip
    assert fp8.stage_chunk_bytes(2048, 32, 8448) == 1024
    assert fmt.stage_chunk_bytes(0, 16, 0) == 0
    assert fmt.stage_chunk_bytes(2048, 1024, 49152 - 100) == 0   # not one trip: no staging
    with pytest.raises(ValueError, match="multiple of 128 bytes"):
        fmt.stage_chunk_bytes(100, 16, 0)


@pytest.mark.parametrize("fmt,H", CASES, ids=case_ids(CASES))
@pytest.mark.parametrize("items", [1, 2])
@pytest.mark.parametrize("token_warps", [1, 2])
def test_unstaged_send_path(fmt, H, items, token_warps, seed):
    """The warp send path without staging (``tuning.quant_stage_bytes = 0``), 1 or 2 items
    per trip (``tuning.quant_items_in_flight``), one or two warps per token
    (``tuning.send_warps_per_token_max``). Same bytes as the reference."""
    from epgen.kernels import send_policy
    cfg = tuned(make_cfg(fmt, H), quant_stage_bytes=0, quant_items_in_flight=items,
                send_warps_per_token_max=token_warps)
    assert send_policy.send_warps_per_token(cfg) == token_warps
    text = ir.print_module(epgen.build_module(cfg))
    assert "quant_stage" not in text
    assert "send_dsts" in text
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("fmt,H,stage", [("BlockwiseFP8", 384, 256), ("BlockwiseFP8", 512, 512),
                                         ("NVFP4", 1024, 256), ("NVFP4", 64, 2048),
                                         ("MXFP8", 64, 256)],
                         ids=["FP8-H384-tail", "FP8-H512", "NVFP4-H1024", "NVFP4-H64",
                              "MXFP8-H64-tail"])
@pytest.mark.parametrize("flags", ["staged", "ord_r"])
def test_scales_staged_with_the_payload(fmt, H, stage, flags, seed):
    """Each chunk's group scales are staged in shared memory beside its payload and copied to
    the destinations in wide units (16 bytes where a chunk's scales allow), the last partial
    unit scale by scale (FP8 H=384: 2 + 1 groups of 4 bytes per chunk; MXFP8 H=64: 2
    one-byte scales). Same bytes as the reference."""
    cfg = tuned(make_cfg(fmt, H, **FLAGS[flags]), quant_stage_bytes=stage)
    text = ir.print_module(epgen.build_module(cfg))
    assert "shared quant_stage_scales[" in text
    assert "for %q_sc:u32" in text
    run_calls(cfg, seed, n_calls=2)


NAMED_CASES = [("BF16", 512), ("BF16", 576)] + CASES   # BF16 576: a ragged staging trip


@pytest.mark.parametrize("fmt,H", NAMED_CASES, ids=case_ids(NAMED_CASES))
@pytest.mark.parametrize("flags", [{}, {"ep_ord_r": True, "has_rank_flag": True}],
                         ids=["send_join_named", "send_join_named+ord_r"])
def test_send_join_named_pipeline(fmt, H, flags, seed):
    """``ep_send_join_named`` keeps the block-staged broadcast: two shared buffers and one
    join per token; the next token's loads and slot reservations are issued before the
    current broadcast (the quantising formats quantise them after it, ``emit_stage_loads``);
    the monitor blocks send too, between their count and their signal. Up to 8 tokens per
    rank over 3 or 4 sending
    blocks: each block alternates its buffers. Same results as the reference every way."""
    from epgen.kernels import dispatch_async
    cfg = make_cfg(fmt, H, ep_send_join_named=True, **flags).replace(max_tokens_per_rank=8)
    module = epgen.build_module(cfg)
    text = ir.print_module(module)
    assert "%t_next" in text
    assert "%g_ahead" in text
    assert ("%sq_item" in text) is (fmt != "BF16")
    roles = [r.name for r in module.kernel(dispatch_async.KERNEL_NAME).roles]
    assert roles == ["monitor", "comm", "signal"]
    run_calls(cfg, seed, n_calls=2)


#: shapes whose row-major scales are whole 16-byte vectors, so dispatch_wait copies them in
#: the payload's trip, every format with row-major scales at the smallest such H: NVFP4
#: H=256 (8 payload vectors and 1 scale vector, the scale in the payload's 32-lane slot: the
#: ``selp`` path), MXFP8 H=512 (32 payload vectors, then a ragged slot of 1)
SEGMENT_CASES = [(f, format_cases.scales_whole_vectors_hid_dim(f)) for f in format_cases.QUANT
                 if not format_cases.FORMATS[f].scales_transposed]


@pytest.mark.parametrize("fmt,H", SEGMENT_CASES, ids=case_ids(SEGMENT_CASES))
@pytest.mark.parametrize("flags", FLAGS, ids=list(FLAGS))
def test_scales_copied_with_the_payload(fmt, H, flags, seed):
    """Row-major scales of whole vectors ride in the payload's loads (``warp_copy_segments``);
    every flag that moves scales, against the reference."""
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    assert cfg.token_fmt.scales_ride_with_payload
    run_calls(cfg, seed, n_calls=2)
