"""The FP8 combine's device steps (docs/combine.md, "FP8 combine"): its kernels
``ep_combine_async_fp8``, ``ep_combine_wait_fp8`` and ``ep_combine_fp8`` are the BF16
combine's builders (``combine_async``, ``combine_wait``, ``combine_fused``) given an
``Fp8Wire``, which changes two things and nothing else:

- **The send** (``Fp8Wire.send_row``): the warp that owns a row quantises it with the
  BlockwiseFP8 format's own device quantiser (``emit_broadcast_token`` of
  ``combine_fp8.wire_format``: the group maximum by shuffles, ``div.rn.f32`` of the scale,
  ``cvt.rn.satfinite.e4m3x2.f32``), unstaged (lane ``l`` items ``l, l + 32, ...``,
  ``Tuning.quant_items_in_flight`` of them loaded before any is quantised, one
  ``st.global.v2.b32`` of 8 codes per item, one ``st.global.b32`` per group scale by the
  group's first lane), straight into slot ``(t, k)`` of the source's FP8 receive buffer
  through the peer table. Under the SHMEM transport the warp quantises into its row's slot
  of the local send staging (``fp8_stage``, one slot per grouped-output row), then
  ``bar.warp.sync`` and the BF16 combine's ``send_row`` of the whole slot (codes and scales
  contiguous): a peer copy to an in-group source, ONE ``nvshmemx_putmem_signal_nbi_warp`` to
  a remote one, so the row's 1 in the arrival word is delivered after its codes and its
  scales alike.
- **The reduce** (``Fp8SlotReader``): chunk ``c`` (8 elements) of a slot is one
  ``ld.global.v2.b32`` of codes and one ``ld.global.f32`` of its group's scale (group ``c //
  16``); each code is widened exactly (``cvt.rn.f16x2.e4m3x2``, ``cvt.f32.f16``) and
  multiplied by the scale (``mul.rn.f32``); then the BF16 combine's ``fma.rn.f32`` chain.
  Unreduced (``weighted = 0``), the dequantised values round to BF16
  (``combine_wait.f32_to_bf16``).
"""

from __future__ import annotations

import ir
from ir import types as T

from .. import combine_fp8
from ..formats.quant_ir import e4m3_to_f32_by_cvt, kernel_param
from .combine_shmem import send_row
from .combine_wait import f32_to_bf16

#: the kernel names' suffix: ``ep_combine_async`` -> ``ep_combine_async_fp8``
SUFFIX = "_fp8"

VEC2 = T.vec(T.u32, 2)


class Fp8SlotReader:
    """How the FP8 reduce reads slot ``(t, k)``'s chunk ``c`` (module docstring); the twin of
    ``combine_wait.Bf16SlotReader``."""

    def __init__(self, cfg):
        self.hid_dim = cfg.token_fmt.hid_dim
        self.slot_bytes = combine_fp8.slot_bytes(cfg)
        self.chunks_per_group = combine_fp8.GROUP // 8

    def load(self, r: ir.RoleBuilder, buf, slot, c, name: str):
        """(the chunk's 8 codes as a ``v2.u32``, its group's f32 scale), both loads issued."""
        base = r.let(f"{name}_slot", buf + ir.as_expr(slot).cast(T.u64) * self.slot_bytes)
        codes = r.load(base + c.cast(T.u64) * 8, VEC2, name=name)
        scale = r.load(base + (self.hid_dim + (c // self.chunks_per_group).cast(T.u64) * 4),
                       T.f32, name=f"{name}_s")
        return codes, scale

    def values(self, r: ir.RoleBuilder, loaded, name: str) -> list:
        """The chunk's 8 dequantised f32 values: ``mul.rn.f32(e4m3 value, scale)``, element
        ``i`` from byte ``i % 4`` of word ``i // 4`` (little-endian)."""
        codes, scale = loaded
        out = []
        for q in range(2):
            w = r.let(f"{name}w{q}", ir.Extract(codes, q))
            for b in range(4):
                code = (w >> (8 * b)) if b else w
                v = e4m3_to_f32_by_cvt(r, code, f"{name}e{4 * q + b}")
                out.append(r.let(f"{name}v{4 * q + b}", v * scale))
        return out

    def add(self, r: ir.RoleBuilder, acc: list, loaded, k: int, weight, valid):
        """``acc[j] = fma.rn.f32(weight, y[j], acc[j])`` for the 8 dequantised ``y``, only
        where ``valid`` (``selp``)."""
        for a, y in zip(acc, self.values(r, loaded, f"yq{k}_")):
            r.assign(a, ir.Select(valid, ir.Fma(weight, y, a), a))

    def bf16_words(self, r: ir.RoleBuilder, loaded, k: int) -> tuple:
        """The unreduced form: the 8 dequantised values rounded to BF16 (nearest even, NaN
        quiet), packed two to a u32 word."""
        o = [f32_to_bf16(r, y, f"uq{k}_{j}")
             for j, y in enumerate(self.values(r, loaded, f"uq{k}_"))]
        return tuple(o[2 * q] | (o[2 * q + 1] << 16) for q in range(4))


class Fp8Wire:
    """The FP8 combine's choices for the BF16 combine's builders (module docstring):
    ``slot_bytes``, ``send_row`` (the send), ``reader`` (the reduce) and the kernel names."""

    #: every row crosses (the partial-reduce wire sums a token's rows first)
    reduces_at_destination = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.fmt = combine_fp8.wire_format(cfg)
        self.slot_bytes = combine_fp8.slot_bytes(cfg)
        self.reader = Fp8SlotReader(cfg)

    @staticmethod
    def name(bf16_name: str) -> str:
        """The FP8 twin's kernel name."""
        return bf16_name + SUFFIX

    def quantise(self, r: ir.RoleBuilder, src, dst, part=None):
        """The whole warp: BF16 row ``src`` quantised into the slot at ``dst`` (its codes at
        ``dst``, its scales at ``dst + H``): the format's ``emit_broadcast_token`` to the one
        destination, unstaged, ``Tuning.quant_items_in_flight`` items in flight per lane (the
        dispatch's choice; at 2 the default preset's kernels spill nothing, at 4 they do);
        ``part = (share, shares)``: this warp's every ``shares``-th run of 32 items from run
        ``share``."""
        self.fmt.emit_broadcast_token(r, src, [ir.Cast(T.u64, dst)], part=part,
                                      tuning=self.cfg.tuning, stage_bytes=0)

    def send_row(self, r: ir.RoleBuilder, cfg, p, s: int, dst, src, row, sig=None,
                 issued=None, part=None):
        """Row ``row`` (at ``src``) into slot ``dst`` of source ``s`` (module docstring):
        quantised straight into it (``part``: this warp's share, P2P only), or under the
        SHMEM transport into the row's staging slot and then sent whole by
        ``combine_shmem.send_row``."""
        if not cfg.needs_shmem:
            self.quantise(r, src, dst, part)
            return
        if part is not None:
            raise ValueError("Fp8Wire.send_row: a shared row under the SHMEM transport")
        stage = kernel_param(r, "fp8_stage", T.ptr_global)
        staged = r.let("fp8_staged", stage + ir.as_expr(row).cast(T.u64) * self.slot_bytes)
        self.quantise(r, src, staged)
        r.warp_sync()
        send_row(r, cfg, p, s, dst, staged, self.slot_bytes, self.slot_bytes // 16, sig,
                 issued)


__all__ = ["Fp8Wire", "Fp8SlotReader", "SUFFIX"]
