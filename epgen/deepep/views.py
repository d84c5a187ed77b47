"""DeepEP's low-latency results as views of one rank's epgen outputs (``RawOutputs``).

In the capacity-strided final layout (``shapes``) the grouped output already is DeepEP's
``[L, R * T_max, H]``; everything here is a view except where a layout has no view:

- ``recv_x``: the output rows, ``[L, R*T_max, H]`` BF16 or ``float8_e4m3fn``.
- FP8 scales: epgen writes them transposed, ``[H/128, M]`` float32 (``M = L * R * T_max``);
  DeepEP's ``[L, R*T_max, H/128]`` with the last two dimensions column-major is the strided
  view ``(e, t, g) -> g*M + e*R*T_max + t`` (strides ``(R*T_max, 1, M)``): the tokens of a
  scale group are contiguous, as TMA wants; ``.contiguous()`` gives DeepEP's own strides.
- UE8M0 scales (``use_ue8m0``): the exponent byte of each power-of-two scale
  (``bits >> 23``), four groups to an int32 (group ``4p + i`` in byte ``i``), as DeepEP's
  ``[L, R*T_max, H/512]`` int32 with column-major last dimensions. This one is computed: a
  few device operations over every row's scales, on the current stream.
- ``recv_count`` ``[L]`` int32: the last entry of each expert's within-expert prefix over
  sources (dispatch_wait's Region B), a strided view.
- ``src_info`` ``[L, R*T_max]`` int32: the source token index of each row, a strided view of
  column 0 of epgen's ``src_info`` ``[M, 2]`` (column 1 is the top-k slot).
- ``layout_range`` ``[L, R]`` int64, ``begin << 32 | count`` per source rank (``begin``
  within the expert's rows): computed from dispatch_wait's Region A (``end = word - 1024``,
  ``begin = end - count - e * R * T_max``) when first read (``handle.LowLatencyHandle``).
"""

from __future__ import annotations

import attrs

from ..layout import EP_DATA_READY_FLAG
from .shapes import UE8M0_PACK, LowLatencyShape


@attrs.define
class RawOutputs:
    """One rank's epgen dispatch outputs as torch tensors (device views of its buffers, or
    the simulator's host copies): ``tokens`` ``[M, H]`` (BF16, or uint8 e4m3 codes),
    ``scales`` (the FP8 formats' transposed ``[H/128, M]`` float32, else None),
    ``src_info`` ``[M, 2]`` int32, ``region_a`` ``[2 * L * R]`` int32, ``region_b``
    ``[L * R]`` int32."""

    tokens: object
    scales: object
    src_info: object
    region_a: object
    region_b: object


def recv_x(torch, raw: RawOutputs, shape: LowLatencyShape, use_ue8m0: bool):
    """The received tokens as DeepEP returns them: a BF16 tensor, or the (e4m3, scales)
    pair (module docstring)."""
    L, RT, H = shape.n_local_experts, shape.rows_per_expert, shape.hidden
    if raw.scales is None:
        return raw.tokens.view(L, RT, H)
    x = raw.tokens.view(torch.float8_e4m3fn).view(L, RT, H)
    G, M = raw.scales.shape
    if not use_ue8m0:
        return x, raw.scales.as_strided((L, RT, G), (RT, 1, M))
    return x, ue8m0_scales(torch, raw.scales, L, RT)


def ue8m0_scales(torch, scales, L: int, RT: int):
    """Power-of-two float32 scales ``[G, L * RT]`` as DeepEP's packed UE8M0 ``[L, RT, G/4]``
    int32, column-major last dimensions (module docstring). Computed on the scales' device."""
    G = scales.shape[0]
    P = G // UE8M0_PACK
    exps = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)       # [G, M]
    packed = exps.view(P, UE8M0_PACK, L, RT).permute(2, 0, 3, 1).contiguous()  # [L, P, RT, 4]
    return packed.view(torch.int32).view(L, P, RT).transpose(1, 2)


def recv_count(raw: RawOutputs, shape: LowLatencyShape):
    """``[L]`` int32: tokens each local expert received (a view)."""
    R = shape.n_ranks
    return raw.region_b.view(shape.n_local_experts, R)[:, R - 1]


def src_info(raw: RawOutputs, shape: LowLatencyShape):
    """``[L, R * T_max]`` int32: each row's token index at its source (a view)."""
    L, RT = shape.n_local_experts, shape.rows_per_expert
    return raw.src_info.as_strided((L, RT), (2 * RT, 2))


def layout_range(torch, raw: RawOutputs, shape: LowLatencyShape):
    """``[L, R]`` int64 ``begin << 32 | count`` per (local expert, source rank), computed
    from Region A (module docstring)."""
    L, R, RT = shape.n_local_experts, shape.n_ranks, shape.rows_per_expert
    a = raw.region_a.view(L, R, 2).to(torch.int64)
    count = a[..., 1]
    base = torch.arange(L, dtype=torch.int64, device=a.device).view(L, 1) * RT
    begin = a[..., 0] - EP_DATA_READY_FLAG - count - base
    return (begin << 32) | count


__all__ = ["RawOutputs", "recv_x", "ue8m0_scales", "recv_count", "src_info", "layout_range"]
