"""The send path's token splitting and block-staged broadcast on the GPU, against the numpy
reference bit for bit, with real memory ordering:

- warps sharing a token on the warp send path (``tuning.send_warps_per_token_max``,
  ``send_warps_per_token``): the decode preset (128 tokens per rank, 4 warps per token) in
  every format, stream launches, the fused launch and graph replays; the formats' test
  shapes with ORD-R and ``skip_a2a``;
- ``ep_send_join_named``'s block-staged broadcast on every block: every format, with ORD-R;
- the same broadcast as the default send path of BF16, MXFP8 and BlockwiseFP8 at
  prefill-sized calls (``prefers_block_broadcast``): stream, fused and graph launches, with
  ORD-R and ``skip_a2a``.

Each test sets its tuning itself, so it checks the path whatever the shipped default is.
"""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.formats import make_format
from epgen.kernels import send_policy
from epgen.presets import load_preset

import format_cases
from test_formats_gpu import MANY, SMALL, WIDE, make_cfg

pytestmark = pytest.mark.gpu

FORMATS = format_cases.ALL
#: the formats whose default send path at prefill is the block-staged broadcast
BLOCK_BROADCAST_FORMATS = [f for f in FORMATS
                           if format_cases.FORMATS[f].prefers_block_staged_broadcast]


def decode_cfg(fmt):
    cfg = load_preset("decode")
    return cfg if fmt == "BF16" else cfg.replace(token_fmt=make_format(fmt, 7168, 8))


def shape_cfg(shape, fmt, **flags):
    if fmt == "BF16":
        cfg = make_cfg(shape, "NVFP4", **flags)
        return cfg.replace(token_fmt=make_format("BF16", cfg.token_fmt.hid_dim,
                                                 cfg.token_fmt.top_k))
    return make_cfg(shape, fmt, **flags)


def check_calls(world, cfg, seed, n_calls=3, full=False, graph=False):
    """``n_calls`` round trips (every rank full with ``full``, else random counts), each
    against the reference; with ``graph`` each after the first is a replay of a captured
    graph (inputs rewritten in place)."""
    rng = np.random.default_rng(seed)
    captured = None
    try:
        for call in range(n_calls):
            counts = [cfg.max_tokens_per_rank if full else
                      int(rng.integers(0, cfg.max_tokens_per_rank + 1))
                      for _ in range(cfg.n_ranks)]
            if graph:      # a graph freezes the token counts: every call full
                counts = [cfg.max_tokens_per_rank] * cfg.n_ranks
            toks, ids = routing.routing(rng, cfg, counts)
            if graph and captured is not None:
                world.load_inputs(toks, ids)
                captured.launch()
                world.check("graph replay")
                got = world.results()
            else:
                got = world.dispatch(toks, ids)
                if graph:
                    captured = world.capture_round_trip()
            want = reference.dispatch(cfg, toks, ids)
            try:
                reference.assert_match(cfg, want, got)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, {cfg.token_fmt.name}, call {call}: "
                                     f"{exc}") from None
    finally:
        if captured is not None:
            captured.close()


@pytest.mark.parametrize("launch", ["stream", "fused", "graph"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_with_four_warps_per_token(fmt, launch, seed):
    cfg = decode_cfg(fmt)
    cfg = cfg.replace(tuning=cfg.tuning.replace(send_warps_per_token_max=4))
    assert send_policy.send_warps_per_token(cfg) == 4
    world = epgen.EmulatedWorld(cfg, fused=launch == "fused")
    check_calls(world, cfg, seed, n_calls=3, full=True, graph=launch == "graph")


@pytest.mark.parametrize("flags", [{}, dict(ep_ord_r=True, has_rank_flag=True),
                                   dict(skip_a2a=True)], ids=["plain", "ord_r", "skip_a2a"])
@pytest.mark.parametrize("shape", [SMALL, WIDE, MANY], ids=["small", "wide", "many"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_tokens_on_the_format_shapes(fmt, shape, flags, seed):
    cfg = shape_cfg(shape, fmt, **flags)
    cfg = cfg.replace(tuning=cfg.tuning.replace(send_warps_per_token_max=4))
    assert send_policy.send_warps_per_token(cfg) > 1
    check_calls(epgen.EmulatedWorld(cfg), cfg, seed)


@pytest.mark.parametrize("flags", [{}, dict(ep_ord_r=True, has_rank_flag=True)],
                         ids=["plain", "ord_r"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_named_join_on_every_block(fmt, flags, seed):
    cfg = shape_cfg(MANY, fmt, ep_send_join_named=True, **flags)
    assert send_policy.sends_from_every_block(cfg)
    check_calls(epgen.EmulatedWorld(cfg), cfg, seed, full=False)
    check_calls(epgen.EmulatedWorld(cfg, fused=True), cfg, seed + 1, n_calls=2)


#: a prefill-like geometry for the block-staged broadcast as the default send path
#: (``prefers_block_broadcast``): 256 tokens per rank over 9 blocks (16 or more per block),
#: 8 local experts
BLOCK_SHAPE = (4, 32, 2048, 8, 256, 256, 9)


@pytest.mark.parametrize("launch", ["stream", "fused", "graph"])
@pytest.mark.parametrize("flags", [{}, dict(ep_ord_r=True, has_rank_flag=True),
                                   dict(skip_a2a=True)], ids=["plain", "ord_r", "skip_a2a"])
@pytest.mark.parametrize("fmt", BLOCK_BROADCAST_FORMATS)
def test_block_broadcast_as_the_default_path(fmt, flags, launch, seed):
    cfg = shape_cfg(BLOCK_SHAPE, fmt, **flags)
    assert send_policy.prefers_block_broadcast(cfg)
    world = epgen.EmulatedWorld(cfg, fused=launch == "fused")
    check_calls(world, cfg, seed, n_calls=3, full=launch == "graph", graph=launch == "graph")
