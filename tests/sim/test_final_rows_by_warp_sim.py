"""``ep_final_layout`` for the block-scaled formats on the warp send path
(``broadcasts_final_rows``): each warp writes the payload to the K output rows and the
scales to their places: the output scales (row-major) or the header rows (BlockwiseFP8's
transposed scales, which dispatch_wait's header pass writes transposed). On the simulator
against the reference, the payload and scales staged or not; the staged path that formats
with ragged scale rows keep; which formats and configurations take the path."""

from __future__ import annotations

import pytest

import ir
from epgen.formats import make_format
from epgen.kernels import build_module, send_policy

import format_cases
from format_cases import FORMATS, QUANT, case_ids
from test_formats_sim import FLAGS, make_cfg, run_calls, tuned

ROW_MAJOR = [f for f in QUANT if not FORMATS[f].scales_transposed]
#: ``broadcasts_final_rows``: row-major scales whose rows are whole 16-byte vectors (every
#: such format at the smallest such H; NVFP4 also with two scale vectors, H=512), and the
#: transposed scales (BlockwiseFP8's, through the header rows) at the simulator's sizes
CASES = [(f, format_cases.scales_whole_vectors_hid_dim(f)) for f in ROW_MAJOR] \
    + [("NVFP4", 512)] \
    + [(f, h) for f, h in format_cases.sim_cases(every_shape=True) if f not in ROW_MAJOR]
#: row-major scales whose rows are not whole vectors (NVFP4 and MXFP8 at H=64: 4- and
#: 2-byte rows)
RAGGED = [(f, h) for f, h in format_cases.sim_cases() if f in ROW_MAJOR
          and (h // FORMATS[f].group_size * FORMATS[f].scale_bytes) % 16]
FINAL = ["final_layout", "prod_reserve"]


def shared_names(cfg):
    k = build_module(cfg).kernel("ep_dispatch_async")
    return {b.name for b in k.shared}


@pytest.mark.parametrize("flags", FINAL)
@pytest.mark.parametrize("fmt,H", CASES, ids=case_ids(CASES))
def test_final_rows_by_warp_match_the_reference(fmt, H, flags, seed):
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    assert send_policy.uses_warp_send(cfg)
    assert "send_scale_dsts" in shared_names(cfg)
    run_calls(cfg, seed)


@pytest.mark.parametrize("stage_bytes", [None, 0], ids=["staged", "unstaged"])
@pytest.mark.parametrize("fmt", QUANT)
def test_final_rows_by_warp_every_store_path(fmt, stage_bytes, seed):
    cfg = make_cfg(fmt, 512, **FLAGS["prod_reserve"])
    if stage_bytes is not None:
        cfg = tuned(cfg, quant_stage_bytes=stage_bytes)
    assert "send_scale_dsts" in shared_names(cfg)
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("flags", FINAL)
@pytest.mark.parametrize("fmt,H", CASES + RAGGED, ids=case_ids(CASES + RAGGED))
def test_which_configurations_take_the_path(fmt, H, flags):
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    can = cfg.token_fmt.broadcasts_final_rows
    assert can == ((fmt, H) in CASES)
    assert send_policy.uses_warp_send(cfg) == can


@pytest.mark.parametrize("flags", FINAL)
@pytest.mark.parametrize("fmt,H", RAGGED, ids=case_ids(RAGGED))
def test_ragged_scale_rows_keep_the_staged_kernels(fmt, H, flags, seed):
    """Formats whose scale rows are not whole 16-byte vectors take the staged path (one
    token per block, a warp per slot copying the message), which matches the reference."""
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    assert not send_policy.uses_warp_send(cfg)
    assert "send_scale_dsts" not in shared_names(cfg)
    run_calls(cfg, seed, n_calls=2)


def test_transposed_scales_travel_in_the_header_rows(seed, monkeypatch):
    """BlockwiseFP8 (transposed output scales): the senders write each row's scales
    row-major into its header row (``hdr_scale_bytes``), and dispatch_wait's header pass
    writes each tile's scales transposed; a wait that skips that pass leaves the output
    scales wrong."""
    from epgen.formats.blockscaled_emit import BlockScaledEmitter
    cfg = make_cfg("BlockwiseFP8", 512, **FLAGS["prod_reserve"])
    lay = cfg.layout
    assert lay.hdr_scale_bytes == 16 and lay.hdr_bytes == lay.hdr_scales_offset + 16
    text = ir.print_module(build_module(cfg))
    wait = text[text.index("kernel ep_dispatch_wait"):]
    assert "shared tile_hdr_rows[" in wait
    run_calls(cfg, seed, n_calls=1)
    monkeypatch.setattr(BlockScaledEmitter, "emit_copy_tile_scales",
                        lambda *a, **k: None)
    # three calls: one call's random token counts may all be 0 (nothing to get wrong)
    with pytest.raises(AssertionError):
        run_calls(cfg, seed, n_calls=3)


def test_scales_of_ragged_rows_are_refused():
    fmt = make_format("NVFP4", 64, 2)                  # 4 scale bytes per row
    kb = ir.KernelBuilder("k", 32)
    src = kb.param("src", ir.types.ptr_global)
    with kb.role("r") as r:
        with pytest.raises(ValueError, match="scale_dsts needs output scales whose rows"):
            fmt.emit_broadcast_token(r, src, [ir.Const(0, ir.types.u64)] * 2,
                                     scale_dsts=[ir.Const(0, ir.types.u64)] * 2)
