"""BlockwiseFP8Pow2 (e4m3 elements, one float32 power-of-two scale per 128: DeepEP's
``calculate_fp8_scales`` with ``round_scale=True``) against an independent model written here
from DeepEP's code, in Python integers and float64, without the codec's helpers:

    amax      = max(1e-4, max_i |x_i|)                 (NaN elements ignored)
    v         = RN_f32(amax * RN_f32(1 / 448))         (the product is exact in float64)
    e         = ceil(log2(v))                          (math.frexp)
    scale     = 2^e,  q_i = x_i * 2^-e                 (exact)
    byte_i    = e4m3(q_i)                              (nearest on the e4m3 grid, ties to the
                                                        even code, saturating at 448)

The policies DeepEP's code leaves to chance are ours, as BlockwiseFP8's and MXFP8's
(docs/formats.md): a NaN element encodes as -448 (the clamp before the conversion); an
infinite element makes the group dead: scale +inf (``0x7F800000``, DeepEP's ``scale_inv``
bits too) and zero payload bytes, so it dequantises to NaN.

Checked here: the model against hand-worked values and ml_dtypes; the codec
(``BlockwiseFP8Pow2Format.quantize``, the message, ``dequantize``) on random tokens over the
whole bf16 range and on the edge cases (zeros, subnormals, 448 times powers of two, a bf16 ulp
either side of a scale boundary, the 1e-4 floor, the largest bf16, ties, NaN, +-inf); the
device scale step (``quant_ir.fp32_pow2_group_scale``, evaluated on numpy arrays) on every
bf16 ``amax``; the layout. The kernels themselves run in the registry-wide tests: the item
quantiser's IR against the codec (tests/unit/test_formats_quant.py), the simulator in every
layout and with combine (tests/sim/test_formats_sim.py, tests/sim/test_combine_sim.py, ...),
the GPU (tests/gpu/test_formats_gpu.py, ...).
"""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest

import ir_numpy
from epgen import BlockwiseFP8Pow2Format
from epgen.formats import quant_ir as Q
from ir import types as T

H, K = 512, 2
GROUP = 128


def rn_f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


#: DeepEP's ``kFinfoAmaxInvE4M3``: ``1 / 448.0f``, rounded to float32
INV_448 = rn_f32(1.0 / 448.0)
#: DeepEP's ``kFP8Margin``
MARGIN = rn_f32(1e-4)


def e4m3_grid() -> np.ndarray:
    """float64 magnitudes of the e4m3 codes 0..126 (OCP FP8 E4M3: bias 7, 3 mantissa bits,
    subnormals ``m * 2^-9``; code 127 is NaN), ascending with the code."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))


GRID = e4m3_grid()


def e4m3_model(q: np.ndarray) -> np.ndarray:
    """e4m3 codes (uint8) of float64 ``q``: NaN -> -448 (0xFE), magnitudes saturated to 448,
    then the nearest grid value, a tie to the even code; the sign in bit 7."""
    q = np.where(np.isnan(q), -448.0, q)
    a = np.minimum(np.abs(q), 448.0)
    hi = np.searchsorted(GRID, a).clip(1, len(GRID) - 1)
    lo = hi - 1
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == GRID[hi], hi, code)
    return (code | (np.signbit(q).astype(np.int64) << 7)).astype(np.uint8)


def pow2_exponent(amax: float) -> int | None:
    """DeepEP's ``e`` of a group maximum (a float32 value, NaN already ignored), or None
    for an infinite one (a dead group)."""
    if math.isinf(amax):
        return None
    v = rn_f32(max(MARGIN, amax) * INV_448)
    m, ex = math.frexp(v)                 # v = m * 2^ex, 0.5 <= m < 1
    return ex - 1 if m == 0.5 else ex


def model(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(payload uint8 ``[T, H]``, scales float32 ``[T, H/128]``) of float32 tokens ``x``."""
    t, h = x.shape
    g = x.astype(np.float64).reshape(t, h // GROUP, GROUP)
    payload = np.zeros(g.shape, np.uint8)
    scales = np.zeros((t, h // GROUP), np.float32)
    for i in range(t):
        for j in range(h // GROUP):
            vals = g[i, j]
            finite_abs = np.abs(vals[~np.isnan(vals)])
            e = pow2_exponent(float(finite_abs.max()) if finite_abs.size else 0.0)
            if e is None:
                scales[i, j] = np.float32(np.inf)
                continue
            scales[i, j] = math.ldexp(1.0, e)
            payload[i, j] = e4m3_model(vals * math.ldexp(1.0, -e))
    return payload.reshape(t, h), scales


def bf16_f32(values) -> np.ndarray:
    """float32 values rounded to bf16 (the format's inputs are bf16)."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def group(head, fill=0.0) -> np.ndarray:
    g = np.full(GROUP, fill, np.float64)
    g[:len(head)] = head
    return g


BF16_MAX = 3.3895314e38
#: 1.75 and its bf16 neighbours: 448 * 2^k is 1.75 * 2^(k+8)
BELOW, ABOVE = 1.75 - 2.0 ** -7, 1.75 + 2.0 ** -7


def edge_groups() -> list[np.ndarray]:
    """Groups of 128 at the edges of the rule."""
    return [
        group([]),                                            # all zero: amax -> 1e-4, e = -22
        group([-0.0, 0.0, -0.0]),                             # signed zeros
        group([448.0, -1.0, 1.0, 0.5]),                       # scale exactly 1
        group([448.0, 1.0625, 1.1875, 2.0 ** -9, 2.0 ** -10, 432.0, -448.0]),   # e4m3 ties
        group([448.0 * 2.0 ** 20, 3.0 * 2.0 ** 20]),          # 448 * 2^k: e = k
        group([448.0 * 2.0 ** -30, -(2.0 ** -31)]),           # k < 0; below the floor too
        group([ABOVE * 2.0 ** 12, 2.0 ** 12]),                # a bf16 ulp above: e = 5
        group([BELOW * 2.0 ** 12, -(2.0 ** 12)]),             # a bf16 ulp below: e = 4
        group([ABOVE * 2.0 ** -2, 0.125]),                    # same around 448 * 2^-10
        group([BELOW * 2.0 ** -2, 0.125]),
        group([BF16_MAX, -1.0, 1e30, 2.0 ** 100]),            # the largest bf16: e = 120
        group([2.0 ** 127, -(2.0 ** 126)]),                   # large powers of two
        group([2.0 ** -133, -(2.0 ** -133), 2.0 ** -126]),    # bf16 subnormals: the floor
        group([1.0001e-4, -5e-5]),                            # just above the 1e-4 floor
        group([0.9999e-4, 3e-5]),                             # just below it
        group([np.nan, 224.0, -1.0]),                         # NaN ignored by amax, -> -448
        group([np.nan] * GROUP),                              # all NaN: amax 1e-4
        group([np.inf, 1.0, -2.0]),                           # dead group
        group([-np.inf, np.nan, 3.0]),                        # dead group with a NaN
        group([1.0, 1.0 + 2.0 ** -7, 0.75 + 2.0 ** -9], fill=-0.5),
    ]


def edge_tokens() -> np.ndarray:
    groups = edge_groups()
    per_row = H // GROUP
    groups += [group([])] * (-len(groups) % per_row)
    return bf16_f32(np.concatenate(groups).reshape(-1, H))


def random_tokens(rng, t: int) -> np.ndarray:
    """bf16 tokens whose groups span the whole bf16 exponent range."""
    x = rng.standard_normal((t, H))
    x *= 2.0 ** rng.integers(-133, 126, size=(t, H // GROUP, 1)).repeat(GROUP, axis=2) \
        .reshape(t, H)
    return bf16_f32(x)


def test_the_model_itself():
    """The model of this file against values worked out by hand, and its e4m3 rounding
    against ml_dtypes on every e4m3 value, every midpoint and a float32 ulp either side."""
    assert struct.unpack("<I", struct.pack("<f", INV_448))[0] == 0x3B124925
    assert INV_448 == float(np.float32(1) / np.float32(448))
    # 1e-4 / 448 = 2.23e-7 lies in (2^-23, 2^-22]
    assert [pow2_exponent(a) for a in (0.0, 448.0, 449.0, 447.0, 896.0, 1000.0, math.inf)] \
        == [-22, 0, 1, 0, 1, 2, None]
    payload, scales = model(bf16_f32(np.concatenate(
        [group([450.0, 3.0, -448.0]), group([]), group([np.inf, 1.0]),
         group([np.nan, 2.0])]))[None])
    assert list(scales[0]) == [2.0, 2.0 ** -22, np.inf, 2.0 ** -7]
    # 450 / 2 = 225 -> 224 (0x76); 1.5 (0x3c); -224 (0xf6); NaN -> -448; 2 * 2^7 = 256
    assert list(payload[0, :3]) == [0x76, 0x3C, 0xF6]
    assert (payload[0, GROUP:3 * GROUP] == 0).all()
    assert list(payload[0, 3 * GROUP:3 * GROUP + 2]) == [0xFE, 0x78]
    mid = (GRID[1:] + GRID[:-1]) / 2
    v = np.concatenate([GRID, mid, np.nextafter(mid.astype(np.float32), np.float32(0)),
                        np.nextafter(mid.astype(np.float32), np.float32(1000)), [500.0, 1e6]])
    v = np.concatenate([v, -v]).astype(np.float32)
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert (e4m3_model(v.astype(np.float64)) == want).all()


def test_codec_matches_the_model_on_the_edges():
    x = edge_tokens()
    f = BlockwiseFP8Pow2Format(H, K)
    payload, scales = f.quantize(x)
    want_payload, want_scales = model(x)
    assert scales.dtype == np.float32
    assert (scales.view(np.uint32) == want_scales.view(np.uint32)).all(), \
        (scales, want_scales)
    assert (payload == want_payload).all()


def test_codec_matches_the_model_on_random_tokens(seed):
    rng = np.random.default_rng(seed)
    x = random_tokens(rng, 128)
    x[rng.random(x.shape) < 0.002] = np.nan          # a few NaN elements
    payload, scales = BlockwiseFP8Pow2Format(H, K).quantize(x)
    want_payload, want_scales = model(x)
    bad = np.argwhere(scales.view(np.uint32) != want_scales.view(np.uint32))
    assert bad.size == 0, f"seed {seed}: scales differ at {bad[:3]}"
    bad = np.argwhere(payload != want_payload)
    assert bad.size == 0, f"seed {seed}: payload differs at {bad[:3]}"


def test_finite_scales_are_normal_powers_of_two(seed):
    """Every finite group's scale is a normal power of two (its low 23 bits zero, never zero),
    its exponent byte ``bits >> 23`` is DeepEP's UE8M0 code, and the group's largest element
    code lies in ``[224, 448]`` unless the 1e-4 floor took over."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([random_tokens(rng, 64), edge_tokens()])
    payload, scales = BlockwiseFP8Pow2Format(H, K).quantize(x)
    live = np.isfinite(scales)
    bits = scales.view(np.uint32)[live]
    assert (bits & 0x7FFFFF == 0).all() and (bits >> 23 > 0).all() and (bits >> 23 < 255).all()
    e = np.array([pow2_exponent(float(a)) for a in
                  np.fmax.reduce(np.abs(x.reshape(-1, GROUP)), axis=1, initial=0.0)])
    assert ((bits >> 23).astype(np.int64) == e[live.reshape(-1)] + 127).all()
    q = np.abs(payload.view(ml_dtypes.float8_e4m3fn).astype(np.float64)) \
        .reshape(-1, GROUP).max(axis=1)
    amax = np.fmax.reduce(np.abs(x.reshape(-1, GROUP)), axis=1, initial=0.0)
    above_floor = live.reshape(-1) & (amax > 2e-4)
    assert ((q[above_floor] >= 224) & (q[above_floor] <= 448)).all()


def test_no_element_saturates_on_a_whole_binade():
    """docs/formats.md's claims about the rule, on every float32 ``amax`` of one binade (the
    rule is the same in every binade of the normal range): the largest element ``amax *
    2^-e`` lies in ``(224, 448]``, so it never saturates, and a division ``amax / 448``
    would pick the same ``e`` as the multiply by ``RN(1/448)``."""
    amax = (np.arange(2 ** 23, dtype=np.uint32) | np.uint32(0x43800000)).view(np.float32)
    mant, ex = np.frexp((amax * np.float32(INV_448)).astype(np.float64))
    e = np.where(mant == 0.5, ex - 1, ex)
    top = amax.astype(np.float64) * np.ldexp(1.0, -e)
    assert top.max() == 448.0 and top.min() > 224.0
    mant, ex = np.frexp((amax / np.float32(448)).astype(np.float64))
    assert (np.where(mant == 0.5, ex - 1, ex) == e).all()


def test_nonfinite_policy():
    """A NaN element: ignored by amax, encoded as -448 (0xfe). An infinite element: the group
    is dead, scale +inf and zero payload bytes; it dequantises to NaN."""
    f = BlockwiseFP8Pow2Format(GROUP, 1)
    payload, s = f.quantize(bf16_f32(group([np.nan, 224.0, -1.0]))[None])
    assert s[0, 0] == np.float32(0.5) and list(payload[0, :3]) == [0xFE, 0x7E, 0xC0]
    payload, s = f.quantize(bf16_f32(group([np.nan] * GROUP))[None])
    assert s[0, 0] == np.float32(2.0 ** -22) and (payload == 0xFE).all()
    for inf in (np.inf, -np.inf):
        payload, s = f.quantize(bf16_f32(group([inf, 3.0, np.nan]))[None])
        assert s.view(np.uint32)[0, 0] == 0x7F800000 and (payload == 0).all()
        with np.errstate(invalid="ignore"):                 # 0 * inf
            assert np.isnan(f.dequantize(payload, s)).all()


def test_message_and_dequantisation(seed):
    """The message: e4m3 bytes, then the float32 scales at ``scales_offset``; the host decode
    gives them back and dequantisation is ``value * scale``."""
    rng = np.random.default_rng(seed)
    f = BlockwiseFP8Pow2Format(H, K)
    x = random_tokens(rng, 8)
    bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    msgs = f.pack_messages(bits, np.arange(8), np.zeros((8, K), np.int64))
    want_payload, want_scales = model(x)
    assert (msgs[:, :H] == want_payload).all()
    so = f.scales_offset
    assert (msgs[:, so:so + 4 * H // GROUP].view(np.float32) == want_scales).all()
    rows, scales, _src, _ids = f.unpack_messages(msgs)
    q = GRID[rows & 0x7F] * np.where(rows & 0x80, -1.0, 1.0)
    want = q * np.repeat(want_scales.astype(np.float64), GROUP, axis=1)
    assert (f.dequantize(rows, scales) == want).all()


def test_scale_step_on_every_bf16_amax():
    """``quant_ir.fp32_pow2_group_scale`` (the IR of the send's scale), evaluated on numpy
    arrays, on every non-negative bf16 and +inf, against the model: the scale's bits, the
    liveness, and the multiplier ``2^-e`` of every live group."""
    c = ir_numpy.Compiled(lambda r, a: Q.fp32_pow2_group_scale(r, a, 448.0, 1e-4, "p"),
                          {"amax": T.f32})
    amax = (np.arange(0, 0x7F81, dtype=np.uint32) << 16).view(np.float32)
    env = c(amax=amax)
    scale, mult, live = (np.asarray(c.value(env, v)) for v in c.result)
    e = [pow2_exponent(float(a)) for a in amax]
    want_live = np.array([k is not None for k in e])
    want_bits = np.array([0x7F800000 if k is None else (k + 127) << 23 for k in e], np.uint32)
    assert (live.astype(bool) == want_live).all()
    assert (scale.view(np.uint32) == want_bits).all()
    want_mult = np.array([math.ldexp(1.0, -k) for k in e if k is not None])
    assert (mult[want_live].astype(np.float64) == want_mult).all()


def test_layout():
    f = BlockwiseFP8Pow2Format(7168, 8)
    assert (f.element_bits, f.group_size, f.scale_bytes) == (8, 128, 4)
    assert f.payload_bytes == 7168 and f.scales_size == 224 and f.msg_size() == 7424
    assert f.out_row_shape == (7168,) and f.out_scales_shape(5) == (56, 5)
    assert f.scales_transposed and f.expert_m_padding == 4 and not f.uses_input_scale
    assert f.describe()["out_scales"]["dtype"] == "f32" and f.scales_host_dtype == np.float32
    assert f.pad_row_offsets(np.array([1, 4, 5, 0])).tolist() == [0, 4, 8, 16, 16]
    assert "mul.rn.f32" in f.ptx_must_contain and "0f3B124925" in f.ptx_must_contain
    assert f.ptx_must_not_contain == ("div.rn.f32",)
    for bad in (64, 192, 7000):
        with pytest.raises(ValueError, match=f"hid_dim={bad} must be a multiple of 128"):
            BlockwiseFP8Pow2Format(bad, 8)
