"""MXFP4 (OCP MX v1.0: e2m1 elements, one e8m0 scale per 32) against an independent numpy
implementation of the OCP rule written here from the specification, in float64, without the
codec's helpers: ``X = floor(log2(amax)) - 2`` (2: e2m1's emax), scale code ``X + 127``,
elements ``v / 2^X`` rounded to nearest even on the e2m1 grid and saturated to +-6. The
policies the specification leaves open are ours, as the other formats have them
(docs/formats.md): ``amax == 0`` and maxima below ``2^-125`` give code 0 (``2^-127``); NaN
elements are ignored by ``amax`` and encode as +0; an infinite ``amax`` gives code 0xFF and
zero payload bytes.

Checked here: the codec (``MXFP4Format.quantize`` and the message) on random tokens over the
whole bf16 range and on the edge cases (zeros, subnormals, maxima at and just under powers of
two, saturating values, ties, NaN/inf); the device scale encoder (``quant_ir.e8m0_floor``,
evaluated on numpy arrays) on every bf16 ``amax``; the layout. The kernels themselves run in
the registry-wide tests: the item quantiser's IR against the codec
(tests/unit/test_formats_quant.py), the simulator in every layout and with combine
(tests/sim/test_formats_sim.py, tests/sim/test_combine_sim.py, ...), the GPU
(tests/gpu/test_formats_gpu.py, tests/gpu/test_p2p_gpu.py, ...).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ir_numpy
from epgen import MXFP4Format
from epgen.formats import quant_ir as Q
from ir import types as T

#: e2m1 magnitudes by code (OCP MX v1.0, table 5): sign in bit 3
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
H, K = 128, 2


def bf16_f32(values) -> np.ndarray:
    """float32 values rounded to bf16 (the format's inputs are bf16)."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def ocp_scale_codes(amax: np.ndarray) -> np.ndarray:
    """The OCP shared exponent of float64 group maxima as e8m0 codes (int64)."""
    with np.errstate(divide="ignore"):
        x = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
    codes = np.maximum(x + 127, 0)
    codes = np.where(amax == 0, 0, codes)
    return np.where(np.isinf(amax), 255, codes).astype(np.int64)


def e2m1_rne(v: np.ndarray) -> np.ndarray:
    """e2m1 codes of float64 ``v``: nearest grid magnitude to ``min(|v|, 6)``, ties to the
    even code; the sign in bit 3; NaN -> +0."""
    a = np.minimum(np.abs(v), 6.0)
    dist = np.abs(a[..., None] - E2M1_GRID)
    best = dist.min(axis=-1, keepdims=True)
    ties = dist == best
    # among the nearest grid points, the even code (two nearest: one even, one odd)
    even = ties & (np.arange(8) % 2 == 0)
    code = np.where(even.any(axis=-1), even.argmax(axis=-1), ties.argmax(axis=-1))
    code = code | (np.signbit(v).astype(np.int64) << 3)
    return np.where(np.isnan(v), 0, code)


def ocp_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed payload uint8 ``[T, H/2]``, scale codes uint8 ``[T, H/32]``) of float32
    tokens ``x`` by the OCP rule."""
    t, h = x.shape
    g = x.astype(np.float64).reshape(t, h // 32, 32)
    amax = np.where(np.isnan(g), 0.0, np.abs(g)).max(axis=2)
    codes = ocp_scale_codes(amax)
    live = codes != 255
    scale = np.exp2(np.where(live, codes, 127) - 127.0)
    nib = np.where(live[..., None], e2m1_rne(g / scale[..., None]), 0).reshape(t, h)
    payload = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return payload.astype(np.uint8), codes.astype(np.uint8)


def edge_tokens() -> np.ndarray:
    """Groups of 32 (one per row of 4 groups) at the edges of the rule."""
    rows = []

    def group(head, fill=0.0):
        g = np.full(32, fill, np.float64)
        g[:len(head)] = head
        return g

    grid = [0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 6.0, -6.0, 0.5]
    groups = [
        group([]),                                            # all zero: code 0
        group([-0.0, 0.0, -0.0]),                             # signed zeros
        group(grid),                                          # amax 6: X = 0, the ties
        group([4.0, 3.0, -1.0]),                              # amax a power of two: v = 4
        group([2.0 ** 100, 2.0 ** 99 * 3]),                   # saturates: 6 (2^99 * 3 / 2^98)
        group([7.96875, 7.0, 6.5, -6.25]),                    # amax just under 8: all saturate
        group([2.0 ** -1, 2.0 ** -2 * 1.5]),                  # X = -3
        group([2.0 ** -133, -(2.0 ** -133)]),                 # the smallest bf16 subnormals
        group([2.0 ** -126, 2.0 ** -127, 2.0 ** -130]),       # at the bottom of e8m0
        group([2.0 ** -124 * 1.5, 2.0 ** -127]),              # X = -127: code 0 exactly
        group([3.3895314e38, -1.0, 1e30]),                    # the largest bf16
        group([np.nan, 2.0, -1.0]),                           # NaN ignored by amax, -> +0
        group([np.nan] * 32),                                 # all NaN: amax 0
        group([np.inf, 1.0, -2.0]),                           # dead block
        group([-np.inf, np.nan, 3.0]),                        # dead block with a NaN
        group([1.0, 1.0 + 2.0 ** -7, 0.75 + 2.0 ** -9]),      # ties nudged off by a bf16 ulp
    ]
    for i in range(0, len(groups), H // 32):
        part = groups[i:i + H // 32]
        part += [group([])] * (H // 32 - len(part))
        rows.append(np.concatenate(part))
    return bf16_f32(np.array(rows))


def random_tokens(rng, t: int) -> np.ndarray:
    """bf16 tokens whose groups span the whole bf16 exponent range."""
    x = rng.standard_normal((t, H))
    x *= 2.0 ** rng.integers(-133, 126, size=(t, H // 32, 1)).repeat(32, axis=2).reshape(t, H)
    return bf16_f32(x)


def test_the_reference_model_itself():
    """The model of this file against values worked out by hand from the specification."""
    payload, codes = ocp_mxfp4(bf16_f32(np.concatenate([
        [6.0, -0.25, 5.0, 2.5, 0.75, -6.0] + [0.0] * 26,     # X = 0: code 127
        [2.0 ** 10, 2.0 ** 9 * 1.75] + [0.0] * 30,           # X = 8: 4 and 3.5 -> 4 (even)
        [0.0] * 32, [np.inf] + [1.0] * 31])[None]))
    assert list(codes[0]) == [127, 135, 0, 255]
    nib = np.stack([payload[0] & 0xF, payload[0] >> 4], axis=-1).reshape(-1)
    assert list(nib[:6]) == [7, 8, 6, 4, 2, 0xF]   # 6; -0.25 -> -0; 5 -> 4; 2.5 -> 2; 0.75 -> 1
    assert list(nib[32:34]) == [6, 6]
    assert (nib[64:] == 0).all()


def test_codec_matches_the_ocp_rule_on_the_edges():
    x = edge_tokens()
    payload, scales = MXFP4Format(H, K).quantize(x)
    want_payload, want_scales = ocp_mxfp4(x)
    assert (scales == want_scales).all(), (scales, want_scales)
    assert (payload == want_payload).all()


def test_codec_matches_the_ocp_rule_on_random_tokens(seed):
    rng = np.random.default_rng(seed)
    x = random_tokens(rng, 256)
    payload, scales = MXFP4Format(H, K).quantize(x)
    want_payload, want_scales = ocp_mxfp4(x)
    bad = np.argwhere(scales != want_scales)
    assert bad.size == 0, f"seed {seed}: scales differ at {bad[:3]}"
    assert (payload == want_payload).all(), f"seed {seed}: payload differs"


def test_message_carries_payload_then_scales(seed):
    """The message: packed nibbles, then the e8m0 codes at ``scales_offset``; the host
    decode gives them back, and dequantisation is ``value * 2^(code - 127)``."""
    rng = np.random.default_rng(seed)
    f = MXFP4Format(H, K)
    x = random_tokens(rng, 8)
    bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    msgs = f.pack_messages(bits, np.arange(8), np.zeros((8, K), np.int64))
    want_payload, want_scales = ocp_mxfp4(x)
    assert (msgs[:, :H // 2] == want_payload).all()
    assert (msgs[:, f.scales_offset:f.scales_offset + H // 32] == want_scales).all()
    rows, scales, _src, _ids = f.unpack_messages(msgs)
    nib = np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(8, H)
    sign = np.where(nib & 8, -1.0, 1.0)
    want = sign * E2M1_GRID[nib & 7] * np.repeat(np.exp2(scales - 127.0), 32, axis=1)
    assert (f.dequantize(rows, scales) == want).all()


def test_e8m0_floor_encoder_on_every_bf16_amax():
    """``quant_ir.e8m0_floor`` (the IR of the send's scale), evaluated on numpy arrays, on
    every non-negative bf16 and +inf, against the OCP rule of this file."""
    enc = ir_numpy.Compiled(lambda r, v: Q.e8m0_floor(r, v, 2, "s"), {"v": T.f32})
    amax = (np.arange(0, 0x7F81, dtype=np.uint32) << 16).view(np.float32)
    got = enc.value(enc(v=amax))
    assert (got == ocp_scale_codes(amax.astype(np.float64))).all()


def test_layout():
    f = MXFP4Format(7168, 8)
    assert (f.element_bits, f.group_size, f.scale_bytes) == (4, 32, 1)
    assert f.payload_bytes == 3584 and f.scales_size == 224 and f.msg_size() == 3840
    assert f.out_row_shape == (3584,) and f.out_scales_shape(5) == (5, 224)
    assert not f.uses_input_scale and not f.scales_transposed and f.expert_m_padding == 1
    assert f.describe()["out_scales"]["dtype"] == "e8m0 (u8 bits)"
    for bad in (16, 48, 7176):
        with pytest.raises(ValueError, match=f"hid_dim={bad} must be a multiple of 32"):
            MXFP4Format(bad, 8)
