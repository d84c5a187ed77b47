"""The dispatch kernels with every registered format on the CPU (tests/support/format_cases.py): they
build, verify, pass the PTX checker and assemble (ptxas, sm_90); their launch parameters; the
PTX instructions each format declares its bit-exactness relies on (``ptx_must_contain``,
``ptx_must_not_contain``); and the CLI selecting a format by name."""

from __future__ import annotations

import functools
import re

import pytest

import epgen
import ir
from backends.nvptx import assemble, check_ptx, emit_ptx
from epgen import cli
from epgen.formats import make_format
from epgen.formats.scaling import E2M1
from format_cases import ALL as FORMATS, QUANT
# (R, E, H, K, max_tpr, num_threads, n_sms); the default preset's kernels of every format are
# goldens (tests/ptx/test_golden.py assembles them and runs the PTX checker)
SHAPES = [(2, 16, 256, 4, 32, 256, 9), (1, 8, 128, 2, 16, 128, 9)]


def make_cfg(shape, fmt):
    R, E, H, K, T, threads, sms = shape
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format(fmt, H, K))


@functools.lru_cache(maxsize=None)
def module_and_ptx(shape, fmt):
    module = epgen.build_module(make_cfg(shape, fmt))
    return module, emit_ptx(module)


def entry(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    nxt = ptx.find(".entry ", start + 1)
    return ptx[start:nxt if nxt > 0 else len(ptx)]


@pytest.mark.parametrize("fmt", QUANT)
def test_kernels_build_verify_and_assemble(fmt, ptxas):
    cfg = make_cfg(SHAPES[0], fmt)
    module, ptx = module_and_ptx(SHAPES[0], fmt)
    ir.verify(module)
    check_ptx(module, ptx)
    report = assemble(ptx, "sm_90", ptxas=ptxas)
    for k in module.kernels:
        res = report.kernels[k.name]
        # ptxas saves the registers live across the IEEE division's slow-path subroutine
        # (div.rn.f32) in local memory; a few words of that are tolerated, real spilling
        # (the vectors of a token, a 64-register cap) is not
        assert res.spill_stores <= 64 and res.spill_loads <= 64, (k.name, res)
        # every rank's grid must fit the GPU: at most 64 registers at 1024 threads per block
        assert res.registers * cfg.num_threads <= 65536, (k.name, res)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-E{}-H{}".format(*s))
def test_format_launch_parameters(shape):
    """Formats declare their own launch parameters; BF16's kernels keep theirs unchanged; the
    fused single launch takes the union of the two kernels' extra parameters."""
    names = {}
    for fmt in FORMATS:
        m = epgen.build_module(make_cfg(shape, fmt))
        ir.verify(m)
        names[fmt] = {k.name: {p.name for p in k.params} for k in m.kernels}
    extra = {fmt: {k: names[fmt][k] - names["BF16"][k] for k in names["BF16"]} for fmt in FORMATS}
    A, W, F = "ep_dispatch_async", "ep_dispatch_wait", "ep_dispatch"
    assert extra["BF16"] == {A: set(), W: set(), F: set()}
    assert extra["BlockwiseFP8"] == {A: set(), W: {"output_scales", "output_scales_rows"},
                                     F: {"output_scales", "output_scales_rows"}}
    assert extra["NVFP4"] == {A: {"input_scale"}, W: {"output_scales"},
                              F: {"input_scale", "output_scales"}}
    assert extra["MXFP8"] == {A: set(), W: {"output_scales"}, F: {"output_scales"}}
    for fmt in QUANT:      # every quantising format: what its declaration implies
        f = make_format(fmt, shape[2], shape[3])
        send = {"input_scale"} if f.uses_input_scale else set()
        wait = {"output_scales"} | ({"output_scales_rows"} if f.scales_transposed else set())
        assert extra[fmt] == {A: send, W: wait, F: send | wait}, fmt
    m = epgen.build_module(make_cfg(shape, "NVFP4"))
    assert m.kernel(A).param("input_scale").dtype == ir.types.f32


@pytest.mark.parametrize("fmt", FORMATS)
def test_send_ptx_has_what_the_format_declares(fmt):
    """Each format's declared instructions (its element encoding's and scale rule's, for a
    quantising format) are in the send kernel's PTX, and the ones it excludes are not."""
    f = make_cfg(SHAPES[0], fmt).token_fmt
    send = entry(module_and_ptx(SHAPES[0], fmt)[1], "ep_dispatch_async")
    assert f.ptx_must_contain or f.ptx_must_not_contain, f"{fmt} declares no PTX"
    for text in f.ptx_must_contain:
        assert text in send, f"{fmt}: {text!r} is not in ep_dispatch_async"
    for text in f.ptx_must_not_contain:
        assert text not in send, f"{fmt}: {text!r} is in ep_dispatch_async"


@pytest.mark.parametrize("fmt", QUANT)
def test_send_ptx_is_exact_arithmetic(fmt):
    """What bit-exactness with the reference relies on besides the declared instructions
    (``test_send_ptx_has_what_the_format_declares``): no approximate division or reciprocal,
    the butterfly group maximum, and the non-coherent input load."""
    cfg = make_cfg(SHAPES[0], fmt)
    send = entry(module_and_ptx(SHAPES[0], fmt)[1], "ep_dispatch_async")
    assert not re.search(r"\t(fma|mad)\.\w*f32|div\.(approx|full)\.f32|rcp\.approx", send)
    assert "ld.global.nc.L2::256B.v4.b32 " in send
    lanes = cfg.token_fmt.group_size // 8
    bfly = re.findall(r"shfl\.sync\.bfly\.b32 \t%r\d+, %r\d+, (\d+), 31, -1;", send)
    assert sorted({int(d) for d in bfly}) == [d for d in (1, 2, 4, 8) if d < lanes]
    if cfg.token_fmt.element is E2M1:   # saturate at 6, one rounding add.rn.f32 per element
        assert len(re.findall(r"\tmin\.f32 \t%r\d+, %r\d+, 0f40C00000;", send)) == 8
        assert len(re.findall(r"\tadd\.rn\.f32 \t", send)) == 8
        assert not re.search(r"\tsetp\.g[te]\.f32 \t", send)   # no threshold count


def test_fp8_wait_pads_and_transposes():
    cfg = make_cfg(SHAPES[0], "BlockwiseFP8")
    text = ir.print_module(epgen.build_module(cfg))
    wait = text[text.index("kernel ep_dispatch_wait"):]
    assert "shared pad_totals[128]" in wait
    # rows rounded up to 4 per expert, scale g of row r at (g * output_scales_rows + r) * 4,
    # stored a tile at a time: adjacent threads take adjacent rows (ts_j = i % 128) of one
    # scale vector, whose message address lane 0 left in shared memory
    assert "mul(div(add(sub(%pad_hi, %pad_lo), 3:u32), 4:u32), 4:u32)" in wait
    assert "st.shared [ptradd(&tile_msgs, cvt.u64(mul(%j, 8:u32)))], %msg" in wait
    # (all of a thread's items in flight: its item index clamped to the tile's last, the
    # row to the tile's last row, the stores guarded by ts_ok)
    assert "%ts_j:u32 = min(rem(min(%ts_i, 127:u32), 128:u32), sub(%n_in_tile, 1:u32))" in wait
    assert "%ts_ok:pred = and(lt(%ts_i, 128:u32), lt(rem(%ts_i, 128:u32), %n_in_tile))" in wait
    assert "%ts_row:u32 = add(%tile_row0, %ts_j)" in wait
    for q in range(4):
        g = "cvt.u64(%ts_g)" if q == 0 else f"cvt.u64(add(%ts_g, {q}:u32))"
        assert (f"st.global [ptradd($output_scales, mul(add(mul({g}, "
                f"cvt.u64($output_scales_rows)), cvt.u64(%ts_row)), 4:u64))], "
                f"extract(%ts_w, {q})") in wait
    assert "rs_g" not in wait          # no per-message scale stores left


@pytest.mark.parametrize("fmt", QUANT)
def test_cli_ptx_selects_the_format_by_name(fmt, capsys):
    assert cli.main(["ptx", "--preset", "small", "--set", f"format={fmt.lower()}"]) == 0
    out = capsys.readouterr().out
    assert ".entry ep_dispatch_async(" in out
    assert all(text in out for text in make_format(fmt, 256, 4).ptx_must_contain)


def test_cli_run_rejects_a_bad_input_scale(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--preset", "small", "--set", "format=NVFP4", "--input-scale", "0"])
    assert info.value.code == 2
    assert "--input-scale" in capsys.readouterr().err


def test_cli_rejects_a_bad_hid_dim_for_the_format(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["ptx", "--preset", "small", "--set", "format=BlockwiseFP8",
                  "--set", "hid_dim=192"])
    assert info.value.code == 2
    assert "hid_dim=192 must be a multiple of 128" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", QUANT)
def test_ir_text_round_trips(fmt):
    module = module_and_ptx(SHAPES[0], fmt)[0]
    text = ir.print_module(module)
    assert ir.parse_module(text) == module


def test_fp8_tile_scales_guard_the_padding_groups():
    # H = 384: 3 scale groups in one 16-byte vector, so the fourth lane of the vector is
    # message padding and must not be stored; H = 512 fills the vector (no guard)
    for H, guarded in ((384, True), (512, False)):
        cfg = make_cfg((2, 16, H, 4, 32, 256, 9), "BlockwiseFP8")
        text = ir.print_module(epgen.build_module(cfg))
        start = text.index("kernel ep_dispatch_wait")
        end = text.find("kernel ", start + 1)
        wait = text[start:end if end > 0 else None]
        assert ("if lt(add(%ts_g, 3:u32), 3:u32)" in wait) is guarded, H
        assert wait.count("extract(%ts_w, ") == 4


def test_tile_scale_scratch_is_counted_for_the_fused_kernel():
    from epgen.kernels.dispatch_wait import copy_scratch_bytes
    base = copy_scratch_bytes(make_cfg(SHAPES[0], "BF16"))
    for fmt in QUANT:
        cfg = make_cfg(SHAPES[0], fmt)
        per_tile = cfg.token_fmt.copies_scales_per_tile
        want = base + (8 * 128 if per_tile else 0)   # one address per tile row
        assert copy_scratch_bytes(cfg) == want, fmt
    assert make_cfg(SHAPES[0], "BlockwiseFP8").token_fmt.copies_scales_per_tile


@pytest.mark.parametrize("share,want", [(28, 7), (14, 7), (7, 7), (16, 8), (1, 1), (11, 1)])
def test_warp_copy_keeps_the_lanes_share_in_flight(share, want):
    from epgen.kernels import common
    assert common.warp_copy_unroll(32 * share) == want
    assert common.warp_copy_unroll(32 * share + 16) == 4      # uneven share: 4 and a tail


@pytest.mark.parametrize("unroll", [0, True, 1.5])
def test_quantiser_refuses_bad_items_in_flight(unroll):
    fmt = make_format("NVFP4", 256, 4)
    kb = ir.KernelBuilder("q", 32)
    src = kb.param("src", ir.types.ptr_global)
    with kb.role("all") as r:
        with pytest.raises(ValueError, match="unroll .* must be a positive integer"):
            fmt.emit_broadcast_token(r, src, [ir.Const(0, ir.types.u64)] * 4, unroll=unroll)


def test_quantiser_loads_its_items_first():
    # unroll 2: both items' loads come before the first item's quantisation
    fmt = make_format("BlockwiseFP8", 1024, 2)
    kb = ir.KernelBuilder("q", 32)
    src = kb.param("src", ir.types.ptr_global)
    dst = kb.param("dst", ir.types.u64)
    with kb.role("all") as r:
        fmt.emit_broadcast_token(r, src, [dst, dst], unroll=2)
    text = ir.print_module(ir.Module("q", (kb.build(),)))
    loop = text[text.index("for %q_warp_item"):]
    loads = [m.start() for m in re.finditer(r"= ld\.global\.nc\.L2::256B", loop)]
    assert len(loads) == 2 and all(a < loop.index("div(") for a in loads)
