"""What a block-scaled format is made of: an element encoding (``E4M3``, ``E2M1``) and a scale
rule (``FP32_PER_GROUP``, ``FP32_POW2_PER_GROUP``, ``E8M0_CEIL``, ``E8M0_OCP``,
``E4M3_GLOBAL``), with its group size
(``blockscaled.BlockScaledFormat``).

Each declaration pairs a numpy step (``quant_host``) with the device step that computes the
same bits (``quant_ir``), so a format's host codec (``BlockScaledCodec``) and device emitter
(``BlockScaledEmitter``) are both built from the same two declarations:

- the scale rule turns a group's ``|x|`` maximum into the scale as stored and the elements
  scaled by it (``host_scale`` / ``emit_scale``: the stored scale, the scaled elements and
  the group's liveness, or None when every group is live), and a stored scale back into the
  value one element step is worth (``host_decode``);
- the element encoding turns the scaled elements into payload bytes (``host_payload`` /
  ``emit_words``; a group that is not live encodes as zero bytes), codes back into values
  (``host_values``) and states the rounding error (``error_bound``).

Both declare the PTX instructions the send kernel must (and must not) contain with them
(``ptx_must_contain``, ``ptx_must_not_contain``; a format's are the union,
tests/ptx/test_formats_kernels.py checks them).
"""

from __future__ import annotations

import numpy as np

from . import quant_host as H
from . import quant_ir as Q
from .elements import E8M0_NAN, FP4_EMAX, FP4_MAX, FP8_EMAX, FP8_MAX, MIN_AMAX


def _rows(groups: np.ndarray) -> tuple[int, int]:
    """The shape ``[T, H]`` of the elements grouped as ``[T, groups, group_size]``."""
    t, n, size = groups.shape
    return t, n * size


class ElementEncoding:
    """How one scaled element is stored: ``bits`` wide, saturating at ``max`` (largest
    binade ``2^emax``)."""

    name = "abstract"
    bits = 0
    max = 0.0
    emax = 0
    #: the IR name of the payload words is ``<ir_prefix>_<words_stem>``
    words_stem = "word"
    ptx_must_contain: tuple[str, ...] = ()
    ptx_must_not_contain: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return self.name

    def host_payload(self, values: np.ndarray, live) -> np.ndarray:
        """Payload bytes (uint8 ``[T, H * bits / 8]``) of the scaled float32 elements
        ``values`` (``[T, groups, group_size]``); zero where ``live`` (``[T, groups]`` or
        None) is False."""
        raise NotImplementedError

    def host_values(self, rows: np.ndarray) -> np.ndarray:
        """float64 element values ``[n, H]`` of payload rows (uint8)."""
        raise NotImplementedError

    def emit_words(self, r, values, live, prefix: str, words: str) -> list:
        """IR: the payload u32 words of one 8-element item's scaled f32 ``values``."""
        raise NotImplementedError

    def error_bound(self, a: np.ndarray, step: np.ndarray) -> np.ndarray:
        """The stated bound of ``|x - decoded|`` for elements of magnitude ``a`` whose group's
        decoded scale is ``step`` (float64, same shape)."""
        raise NotImplementedError


class E4M3Encoding(ElementEncoding):
    """e4m3 bytes: clamped to +-448 (a NaN to -448), rounded to nearest even by
    ``cvt.rn.satfinite.e4m3x2.f32``."""

    name = "E4M3"
    bits = 8
    max = FP8_MAX
    emax = FP8_EMAX
    words_stem = "fp8"
    ptx_must_contain = ("cvt.rn.satfinite.e4m3x2.f32",)

    def host_payload(self, values, live):
        return H.e4m3_codes(values, live).reshape(_rows(values))

    def host_values(self, rows):
        return H.e4m3_values(rows)

    def emit_words(self, r, values, live, prefix, words):
        return Q.e4m3_words(r, values, live, prefix, words)

    def error_bound(self, a, step):
        """``2^-4 a + 2^-10 step``: half an e4m3 step (3 mantissa bits; subnormal step
        ``2^-9``) in units of the group scale."""
        return 2.0 ** -4 * a + 2.0 ** -10 * step


class E2M1Encoding(ElementEncoding):
    """e2m1 codes, two per byte (the even element low): saturated to +-6, rounded to nearest
    even by one ``add.rn.f32`` (sm_90 has no e2m1 conversion), a NaN to +0."""

    name = "E2M1"
    bits = 4
    max = FP4_MAX
    emax = FP4_EMAX
    #: the rounding addition, and the saturation at 6 (``min.f32`` with 6.0, ``0f40C00000``)
    ptx_must_contain = ("add.rn.f32", "0f40C00000")

    def host_payload(self, values, live):
        return H.pack_nibbles(H.e2m1_codes(values, live).reshape(_rows(values)))

    def host_values(self, rows):
        return H.e2m1_values(H.unpack_nibbles(rows))

    def emit_words(self, r, values, live, prefix, words):
        return Q.e2m1_words(r, values, live, prefix, words)

    def error_bound(self, a, step):
        """``max(a/4, step/4, a - 6 step)``: half an e2m1 step is at most ``max(|q|/4, 1/4)``
        for ``|q| = a / step <= 6``, and past 6 the element saturates."""
        return np.maximum(np.maximum(a / 4, step / 4), a - self.max * step)


class ScaleRule:
    """How a group's scale is chosen from its ``|x|`` maximum and stored (``scale_bytes``
    each, host dtype ``host_dtype``)."""

    name = "abstract"
    scale_bytes = 1
    host_dtype = np.uint8
    dtype_name = "u8"
    #: the rule reads the global input scale (the ``input_scale`` launch argument)
    uses_input_scale = False
    ptx_must_contain: tuple[str, ...] = ()
    ptx_must_not_contain: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return self.name

    def host_scale(self, groups, amax, element: ElementEncoding, g):
        """(stored scales ``[T, groups]`` of ``host_dtype``, the scaled float32 elements, the
        groups' liveness or None) of float32 ``groups`` ``[T, groups, group_size]`` with maxima
        ``amax``; ``g`` the input scale (float32, or None when the rule uses none)."""
        raise NotImplementedError

    def host_decode(self, scales, g) -> np.ndarray:
        """float64 value of one element unit of each stored scale (``g``: as in
        ``host_scale``, a float)."""
        raise NotImplementedError

    def emit_scale(self, r, amax, element: ElementEncoding, prefix: str):
        """IR: (the stored scale: an f32 or a u32 holding a byte, ``scaled(x)`` giving the
        expression of a scaled element, the group's liveness or None)."""
        raise NotImplementedError


class Fp32PerGroup(ScaleRule):
    """A float32 scale per group, ``max(amax, 1e-4) / max``; elements divided by it."""

    name = "FP32 per group"
    scale_bytes = 4
    host_dtype = np.float32
    dtype_name = "f32"
    ptx_must_contain = ("div.rn.f32",)

    def host_scale(self, groups, amax, element, g):
        scale = H.fp32_group_scale(amax, element.max, MIN_AMAX)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = groups / scale[..., None]
        return scale.astype(np.float32), values, None

    def host_decode(self, scales, g):
        return scales.astype(np.float64)

    def emit_scale(self, r, amax, element, prefix):
        scale = Q.fp32_group_scale(r, amax, element.max, MIN_AMAX, prefix)
        return scale, lambda x: x / scale, None


class Fp32Pow2PerGroup(ScaleRule):
    """A float32 power-of-two scale per group, DeepEP's ``calculate_fp8_scales`` with
    ``round_scale=True``::

        v     = max(amax, 1e-4) * RN(1 / max)        (mul.rn.f32 by 0f3B124925 for e4m3)
        e     = ceil(log2(v))                         (exponent field - 127, +1 if mantissa != 0)
        scale = 2^e                                   (stored; dequantised x ~= q * scale)
        mult  = 2^-e                                  (exact; elements multiplied by it)

    ``v`` is a normal float32 for every finite ``amax`` (``1e-4 / 448`` to ``bf16 max /
    448``), so both powers of two are normal and the scale is never zero. No division: the
    rule's PTX has the multiply by the rounded inverse and no ``div.rn.f32``. An infinite
    ``amax`` gives ``e = 128``: the scale +inf (``0x7F800000``, DeepEP's ``scale_inv`` bits
    too) and a dead group (zero payload bytes, as MXFP8's code 0xFF). The scale's exponent
    byte (``bits >> 23``) is the e8m0 code of the same scale."""

    name = "FP32 power of two per group"
    scale_bytes = 4
    host_dtype = np.float32
    dtype_name = "f32"
    #: the multiply by RN(1/448) (e4m3's maximum: DeepEP's ``kFinfoAmaxInvE4M3``), no division
    ptx_must_contain = ("mul.rn.f32", "0f3B124925")
    ptx_must_not_contain = ("div.rn.f32",)

    def host_scale(self, groups, amax, element, g):
        scale, mult, live = H.fp32_pow2_group_scale(amax, element.max, MIN_AMAX)
        with np.errstate(invalid="ignore", over="ignore"):
            values = groups * mult[..., None]
        return scale, values, live

    def host_decode(self, scales, g):
        return scales.astype(np.float64)

    def emit_scale(self, r, amax, element, prefix):
        scale, mult, live = Q.fp32_pow2_group_scale(r, amax, element.max, MIN_AMAX, prefix)
        return scale, lambda x: x * mult, live


class E8M0Scale(ScaleRule):
    """A power-of-two scale per group, stored as an e8m0 byte; elements multiplied by its
    exact inverse. A group with an infinite maximum gets code 0xFF (e8m0's NaN) and zero
    elements (a "dead" block)."""

    host_dtype = np.uint8
    dtype_name = "e8m0 (u8 bits)"

    def host_codes(self, amax, element):
        """(e8m0 codes, float32 multipliers) of groups with maxima ``amax``."""
        raise NotImplementedError

    def host_scale(self, groups, amax, element, g):
        codes, mult = self.host_codes(amax, element)
        with np.errstate(invalid="ignore", over="ignore"):
            values = groups * mult[..., None]
        return codes, values, codes != E8M0_NAN

    def host_decode(self, scales, g):
        return H.e8m0_values(scales).astype(np.float64)


class E8M0Ceil(E8M0Scale):
    """``amax / max`` rounded UP to a power of two (the reference's e8m0 cast), so no element
    saturates; multiplier ``0 if amax == 0 else 1 / scale``."""

    name = "E8M0 rounded up"
    ptx_must_contain = ("div.rn.f32",)

    def host_codes(self, amax, element):
        return H.e8m0_ceil_group_scale(amax, element.max)

    def emit_scale(self, r, amax, element, prefix):
        code, mult, live = Q.e8m0_ceil_group_scale(r, amax, element.max, prefix)
        return code, lambda x: x * mult, live


class E8M0Ocp(E8M0Scale):
    """The OCP MX shared exponent: ``X = floor(log2(amax)) - emax`` of the element, code
    ``X + 127`` (clamped at 0: ``amax == 0`` and maxima below ``2^(emax - 127)`` get
    ``2^-127``); multiplier ``2^-X``, exact. Elements of ``|x| / 2^X`` in ``(max, 2^(emax+1))``
    saturate, as the OCP rule has them."""

    name = "E8M0 per OCP"
    ptx_must_not_contain = ("div.rn.f32",)

    def host_codes(self, amax, element):
        return H.e8m0_floor_group_scale(amax, element.emax)

    def emit_scale(self, r, amax, element, prefix):
        code, mult, live = Q.e8m0_floor_group_scale(r, amax, element.emax, prefix)
        return code, lambda x: x * mult, live


class E4M3Global(ScaleRule):
    """An e4m3 scale per group under a global input scale ``g``: ``e4m3((g * amax) / max)``
    (saturating at 448), multiplier ``0 if amax == 0 else g / float(scale)``; a scale value
    is worth ``float(scale) / g``."""

    name = "E4M3 with a global scale"
    host_dtype = np.uint8
    dtype_name = "e4m3 (u8 bits)"
    uses_input_scale = True
    ptx_must_contain = ("fma.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2",
                        "div.rn.f32")

    def host_scale(self, groups, amax, element, g):
        codes, mult = H.e4m3_global_group_scale(amax, g, element.max)
        with np.errstate(invalid="ignore", over="ignore"):
            values = groups * mult[..., None]
        return codes, values, None

    def host_decode(self, scales, g):
        return H.e4m3_values(scales) / g

    def emit_scale(self, r, amax, element, prefix):
        code, mult = Q.e4m3_global_group_scale(r, amax, element.max, prefix)
        return code, lambda x: x * mult, None


E4M3 = E4M3Encoding()
E2M1 = E2M1Encoding()
FP32_PER_GROUP = Fp32PerGroup()
FP32_POW2_PER_GROUP = Fp32Pow2PerGroup()
E8M0_CEIL = E8M0Ceil()
E8M0_OCP = E8M0Ocp()
E4M3_GLOBAL = E4M3Global()
