"""The FP8 combine's wire format and its host model (docs/combine.md, "FP8 combine").

Under ``fp8=True`` each destination quantises every expert-output row with the BlockwiseFP8
rule (``epgen.formats.fp8.BlockwiseFP8Format``: E4M3 elements, one float32 scale
``max(amax, 1e-4) / 448`` per 128 elements) before it crosses the link, and the source
dequantises it. The wire format *is* that format's message payload, so the quantiser is the
dispatch format's, on the host (``quantize_rows``: its codec) and on the device (its emitter):

    slot (t, k), ``slot_bytes`` = ``align_up(H, 16) + align_up(4 * H / 128, 16)`` bytes:
    [0, H)                 the E4M3 codes, element i at byte i
    [H, H + 4 * H / 128)   the float32 scales, group g at H + 4 g
    (to slot_bytes)        padding (H not a multiple of 512), never written or read

Dequantisation at the source, per element: ``y = mul.rn.f32(e4m3_value(code), scale)``; the
reduce then sums the ``y`` as the BF16 combine sums its widened rows
(``epgen.reference.combine(..., fp8=True)``).
"""

from __future__ import annotations

import numpy as np

from backends.sim.numerics import canonical_nan_f32

from .formats.fp8 import BlockwiseFP8Format
from .formats.quant_host import e4m3_values

#: elements per scale (BlockwiseFP8's group)
GROUP = BlockwiseFP8Format.group_size


def check_hid_dim(hid_dim: int, where: str = "combine") -> None:
    """``ValueError`` naming ``hid_dim`` unless it is a multiple of 128 (one scale per 128
    elements)."""
    if hid_dim % GROUP:
        raise ValueError(f"{where}: fp8=True needs hid_dim to be a multiple of {GROUP} (one "
                         f"float32 scale per {GROUP} elements), got hid_dim={hid_dim}")


def wire_format(cfg) -> BlockwiseFP8Format:
    """The BlockwiseFP8 format whose message payload is one FP8 combine slot of ``cfg``
    (``hid_dim`` checked by ``check_hid_dim``; alignment 16)."""
    fmt = cfg.token_fmt
    check_hid_dim(fmt.hid_dim)
    return BlockwiseFP8Format(fmt.hid_dim, fmt.top_k)


def slot_bytes(cfg) -> int:
    """Bytes of one FP8 combine slot (module docstring): the format's payload + scales."""
    return wire_format(cfg).token_size


def quantize_rows(cfg, bits) -> tuple[np.ndarray, np.ndarray]:
    """BF16 rows (uint16 bits ``[n, H]``) -> (E4M3 codes uint8 ``[n, H]``, float32 scales
    ``[n, H / 128]``): the BlockwiseFP8 codec's ``quantize``, the kernel's bits."""
    fmt = wire_format(cfg)
    x = (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)
    codes, scales = fmt.quantize(x.reshape(-1, fmt.hid_dim))
    return codes, np.asarray(scales, np.float32)


def dequantize_rows(codes, scales) -> np.ndarray:
    """float32 ``[n, H]``: each code's value (exact in float32) times its group's scale,
    ``mul.rn.f32`` (one rounding; a NaN is the GPU's canonical one)."""
    codes = np.asarray(codes, np.uint8)
    n, h = codes.shape
    q = e4m3_values(codes).astype(np.float32).reshape(n, h // GROUP, GROUP)
    with np.errstate(invalid="ignore", over="ignore"):
        y = q * np.asarray(scales, np.float32).reshape(n, h // GROUP, 1)
    return canonical_nan_f32(y).reshape(n, h)


def wire_values(cfg, bits) -> np.ndarray:
    """What the source reduces for BF16 rows ``bits`` ``[n, H]`` sent under ``fp8=True``:
    ``dequantize_rows(quantize_rows(bits))`` (float32)."""
    bits = np.asarray(bits, np.uint16)
    shape = bits.shape
    return dequantize_rows(*quantize_rows(cfg, bits.reshape(-1, shape[-1]))).reshape(shape)


def link_bytes_ratio(hid_dim: int) -> float:
    """Bytes of an FP8 slot over a BF16 row's: ``(H + 4 H / 128) / (2 H)`` (0.5156 at any
    multiple of 512; the slot's padding counted otherwise)."""
    check_hid_dim(hid_dim)
    return BlockwiseFP8Format(hid_dim, 1).token_size / (2 * hid_dim)


__all__ = ["GROUP", "check_hid_dim", "wire_format", "slot_bytes", "quantize_rows",
           "dequantize_rows", "wire_values", "link_bytes_ratio"]
