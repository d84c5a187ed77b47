"""``ep_final_layout`` for the block-scaled formats on the warp send path
(``dispatch_async.WARP_FINAL_ROWS_WITH_SCALES``, on by default): each warp writes the
payload to the K output rows and the scales to their places: the output scales (row-major)
or the header rows (BlockwiseFP8's transposed scales, which dispatch_wait's header pass
writes transposed). On the simulator against the reference, with the destinations in shared
memory or in registers, the payload (and its scales) staged or not; the staged
path it replaced; which formats and configurations take the path."""

from __future__ import annotations

import pytest

import ir
from epgen.formats import make_format
from epgen.kernels import build_module, dispatch_async

from test_formats_sim import FLAGS, make_cfg, quant_send_tuning, run_calls

#: ``broadcasts_final_rows``: row-major scales whose rows are whole 16-byte vectors, and
#: BlockwiseFP8's transposed scales (through the header rows)
CASES = [("NVFP4", 256), ("NVFP4", 512), ("MXFP8", 512), ("BlockwiseFP8", 384),
         ("BlockwiseFP8", 512)]
FINAL = ["final_layout", "prod_reserve"]


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(dispatch_async, "WARP_FINAL_ROWS_WITH_SCALES", True)


def shared_names(cfg):
    k = build_module(cfg).kernel("ep_dispatch_async")
    return {b.name for b in k.shared}


@pytest.mark.parametrize("flags", FINAL)
@pytest.mark.parametrize("fmt,H", CASES, ids=[f"{f}-H{h}" for f, h in CASES])
def test_final_rows_by_warp_match_the_reference(on, fmt, H, flags, seed):
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    assert dispatch_async.uses_warp_send(cfg)
    assert "send_scale_dsts" in shared_names(cfg)
    run_calls(cfg, seed)


@pytest.mark.parametrize("dsts_in_shared", [False, True])
@pytest.mark.parametrize("stage_bytes", [None, 0], ids=["staged", "unstaged"])
@pytest.mark.parametrize("fmt,H", [("NVFP4", 512), ("MXFP8", 512), ("BlockwiseFP8", 512)],
                         ids=["NVFP4-H512", "MXFP8-H512", "BlockwiseFP8-H512"])
def test_final_rows_by_warp_every_store_path(on, fmt, H, dsts_in_shared, stage_bytes, seed,
                                             monkeypatch):
    monkeypatch.setattr(dispatch_async, "SEND_DSTS_IN_SHARED", dsts_in_shared)
    if stage_bytes is not None:
        quant_send_tuning(monkeypatch, quant_stage_bytes=stage_bytes)
    cfg = make_cfg(fmt, H, **FLAGS["prod_reserve"])
    assert ("send_scale_dsts" in shared_names(cfg)) == dsts_in_shared
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("flags", FINAL)
@pytest.mark.parametrize("fmt,H", CASES + [("NVFP4", 64), ("MXFP8", 64)],
                         ids=lambda v: str(v))
def test_which_configurations_take_the_path(fmt, H, flags, monkeypatch):
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    can = cfg.token_fmt.broadcasts_final_rows
    assert can == ((fmt, H) in CASES)        # NVFP4 H=64 and MXFP8 H=64: 4- and 2-byte rows
    assert dispatch_async.uses_warp_send(cfg) == can   # on by default
    monkeypatch.setattr(dispatch_async, "WARP_FINAL_ROWS_WITH_SCALES", False)
    assert not dispatch_async.uses_warp_send(cfg)      # off: the staged path


@pytest.mark.parametrize("flags", FINAL)
@pytest.mark.parametrize("fmt,H", CASES, ids=[f"{f}-H{h}" for f, h in CASES])
def test_off_keeps_the_staged_kernels(fmt, H, flags, seed, monkeypatch):
    """Switched off, the staged path (one token per block, a warp per slot copying the
    message; BlockwiseFP8's scales into the header rows too) still matches the reference."""
    cfg = make_cfg(fmt, H, **FLAGS[flags])
    assert "send_scale_dsts" in shared_names(cfg)
    monkeypatch.setattr(dispatch_async, "WARP_FINAL_ROWS_WITH_SCALES", False)
    assert "send_scale_dsts" not in shared_names(cfg)
    run_calls(cfg, seed, n_calls=2)


@pytest.mark.parametrize("by_warp", [True, False], ids=["warp", "staged"])
def test_transposed_scales_travel_in_the_header_rows(by_warp, seed, monkeypatch):
    """BlockwiseFP8 (transposed output scales): the senders write each row's scales
    row-major into its header row (``hdr_scale_bytes``), and dispatch_wait's header pass
    writes each tile's scales transposed; a wait that skips that pass leaves the output
    scales wrong."""
    from epgen.formats.blockscaled_emit import BlockScaledEmitter
    monkeypatch.setattr(dispatch_async, "WARP_FINAL_ROWS_WITH_SCALES", by_warp)
    cfg = make_cfg("BlockwiseFP8", 512, **FLAGS["prod_reserve"])
    lay = cfg.layout
    assert lay.hdr_scale_bytes == 16 and lay.hdr_bytes == lay.hdr_scales_offset + 16
    text = ir.print_module(build_module(cfg))
    wait = text[text.index("kernel ep_dispatch_wait"):]
    assert "shared tile_hdr_rows[" in wait
    run_calls(cfg, seed, n_calls=1)
    monkeypatch.setattr(BlockScaledEmitter, "emit_copy_tile_scales",
                        lambda *a, **k: None)
    with pytest.raises(AssertionError):
        run_calls(cfg, seed, n_calls=1)


@pytest.mark.parametrize("by_warp", [True, False], ids=["warp", "staged"])
def test_transposed_scales_stored_in_place_when_switched_off(by_warp, seed, monkeypatch):
    """``layout.FINAL_SCALES_IN_HEADER_ROWS = False`` (the A/B's other arm): header rows
    without scales, each scale stored in its transposed place by the sender."""
    from epgen import layout
    monkeypatch.setattr(dispatch_async, "WARP_FINAL_ROWS_WITH_SCALES", by_warp)
    monkeypatch.setattr(layout, "FINAL_SCALES_IN_HEADER_ROWS", False)
    cfg = make_cfg("BlockwiseFP8", 512, **FLAGS["prod_reserve"])
    assert cfg.layout.hdr_scale_bytes == 0
    assert "tile_hdr_rows" not in ir.print_module(build_module(cfg))
    run_calls(cfg, seed, n_calls=2)


def test_scales_of_ragged_rows_are_refused():
    fmt = make_format("NVFP4", 64, 2)                  # 4 scale bytes per row
    kb = ir.KernelBuilder("k", 32)
    src = kb.param("src", ir.types.ptr_global)
    with kb.role("r") as r:
        with pytest.raises(ValueError, match="scale_dsts needs output scales whose rows"):
            fmt.emit_broadcast_token(r, src, [ir.Const(0, ir.types.u64)] * 2,
                                     scale_dsts=[ir.Const(0, ir.types.u64)] * 2)
