"""``BlockScaledCodec``: the host side of the quantising formats (``BlockScaledFormat``): the
inputs are bfloat16 (uint16 bits), ``quantize`` does exactly what the kernel does (the
format's scale rule, then its element encoding: their numpy steps, ``scaling``),
``encode_payload``/``decode_payload`` place the payload
and the scales as the message does, ``dequantize`` and ``error_bound`` give the values back
and the stated tolerance. ``decode_payload`` returns the scales one row per token
(``[n, n_scale_groups]``), whatever the device layout of the output scales
(``scales_from_device``/``scales_to_device`` convert)."""

from __future__ import annotations

import numpy as np

from .bf16_codec import bf16_bits
from .codec import HostCodec, ml_dtypes


class BlockScaledCodec(HostCodec):
    """Numpy side of a ``BlockScaledFormat``, from its ``element`` and ``scale_rule``."""

    def scale_groups(self, x):
        """``x`` as float32 scale groups ``[T, n_scale_groups, group_size]`` and each group's
        absolute maximum (``[T, n_scale_groups]``, NaN ignored as ``fmax`` does, 0 for an
        all-zero group): the first step of every format's ``quantize``."""
        f = self.fmt
        x = np.asarray(x, dtype=np.float32).reshape(-1, f.hid_dim)
        g = x.reshape(x.shape[0], f.n_scale_groups, f.group_size)
        return g, np.fmax.reduce(np.abs(g), axis=2, initial=np.float32(0))

    def scales_from_device(self, scales, n: int) -> np.ndarray:
        """The first ``n`` rows' scales, one row per output row (``[n, n_scale_groups]``),
        from the device tensor (host copy) of ``out_scales_shape``."""
        f = self.fmt
        scales = np.asarray(scales)
        out = scales[:, :n].T if f.scales_transposed else scales[:n]
        return np.ascontiguousarray(out)

    def scales_to_device(self, row_scales, rows: int) -> np.ndarray:
        """Inverse of ``scales_from_device``: per-row scales ``[n, groups]`` placed in a zeroed
        device-layout tensor of ``rows`` rows."""
        f = self.fmt
        row_scales = np.asarray(row_scales, dtype=f.scales_host_dtype)
        out = np.zeros(f.out_scales_shape(rows), dtype=f.scales_host_dtype)
        n = row_scales.shape[0]
        if f.scales_transposed:
            out[:, :n] = row_scales.T
        else:
            out[:n] = row_scales
        return out

    def as_host_tokens(self, tokens) -> np.ndarray:
        return bf16_bits(tokens)

    def to_f32(self, tokens) -> np.ndarray:
        """Input tokens (bf16 bits) as float32 ``[T, H]`` (exact)."""
        bits = np.ascontiguousarray(self.as_host_tokens(tokens)).reshape(-1, self.fmt.hid_dim)
        return bits.view(ml_dtypes().bfloat16).astype(np.float32)

    def check_input_scale(self, input_scale) -> np.float32:
        """``input_scale`` as float32; ``ValueError`` unless finite and > 0."""
        f = self.fmt
        try:
            with np.errstate(over="ignore"):
                s = np.float32(input_scale)
        except (TypeError, ValueError):
            s = np.float32("nan")
        if not (np.isfinite(s) and s > 0):
            raise ValueError(f"{f.name}: input_scale must be a finite float32 > 0, got "
                             f"{input_scale!r}")
        return s

    def _rule_input_scale(self, input_scale):
        """``input_scale`` checked, as float32, for a scale rule that uses one; else None
        (the argument is then ignored)."""
        return self.check_input_scale(input_scale) if self.fmt.uses_input_scale else None

    def quantize(self, x: np.ndarray, input_scale=1.0) -> tuple[np.ndarray, np.ndarray]:
        """float32 ``[T, H]`` -> (payload uint8 ``[T, payload_bytes]``, per-row scales
        ``[T, n_scale_groups]`` of ``scales_host_dtype``), exactly as the kernel does: the
        scale rule's scales and scaled elements, then the element encoding's bytes."""
        f = self.fmt
        groups, amax = self.scale_groups(x)
        scales, values, live = f.scale_rule.host_scale(groups, amax, f.element,
                                                       self._rule_input_scale(input_scale))
        return f.element.host_payload(values, live), scales

    def decoded_scales(self, scales: np.ndarray, input_scale=1.0) -> np.ndarray:
        """float64 value of one element unit of each stored scale (``[n, groups]``)."""
        g = self._rule_input_scale(input_scale)
        return self.fmt.scale_rule.host_decode(scales, None if g is None else float(g))

    def dequantize_groups(self, q: np.ndarray, scales: np.ndarray, input_scale) -> np.ndarray:
        """float64 ``[n, groups, group_size]`` values of payload rows ``q`` with ``scales``."""
        return q * self.decoded_scales(scales, input_scale)[..., None]

    def encode_payload(self, tokens, input_scale=1.0) -> np.ndarray:
        f = self.fmt
        x = self.to_f32(tokens)
        payload, scales = self.quantize(x, input_scale)
        out = np.zeros((x.shape[0], f.token_size), dtype=np.uint8)
        out[:, :f.payload_bytes] = payload
        so, n = f.scales_offset, f.n_scale_groups * f.scale_bytes
        out[:, so:so + n] = np.ascontiguousarray(scales, dtype=f.scales_host_dtype) \
            .view(np.uint8).reshape(x.shape[0], n)
        return out

    def decode_payload(self, payload):
        f = self.fmt
        payload = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1, f.token_size)
        rows = np.ascontiguousarray(payload[:, :f.payload_bytes])
        so, n = f.scales_offset, f.n_scale_groups * f.scale_bytes
        scales = np.ascontiguousarray(payload[:, so:so + n]).view(f.scales_host_dtype)
        return rows, scales.reshape(-1, f.n_scale_groups).copy()

    def dequantize(self, rows, scales, input_scale=1.0) -> np.ndarray:
        """Output rows (uint8 ``[n, payload_bytes]``) and their per-row scales back to
        float64 ``[n, H]``."""
        f = self.fmt
        rows = np.asarray(rows, dtype=np.uint8).reshape(-1, f.payload_bytes)
        n, g = rows.shape[0], f.n_scale_groups
        q = self.element_values(rows).reshape(n, g, f.group_size)
        scales = np.asarray(scales, dtype=f.scales_host_dtype).reshape(n, g)
        return self.dequantize_groups(q, scales, input_scale).reshape(n, f.hid_dim)

    def element_values(self, rows: np.ndarray) -> np.ndarray:
        """float64 ``[n, H]`` values of the payload codes (before scaling)."""
        return self.fmt.element.host_values(rows)

    def error_bound(self, x: np.ndarray, input_scale=1.0) -> np.ndarray:
        """The stated tolerance, per element, of ``|dequantize(quantize(x)) - x|`` for the
        float32 tokens ``x`` [T, H] (docs/formats.md): the element encoding's bound with each
        group's decoded scale."""
        f = self.fmt
        x = np.asarray(x, dtype=np.float32).reshape(-1, f.hid_dim)
        _, scales = self.quantize(x, input_scale)
        step = np.repeat(self.decoded_scales(scales, input_scale), f.group_size, axis=1)
        return f.element.error_bound(np.abs(x.astype(np.float64)), step)
