"""The partial-reduce combine's device steps (``ep_rank_dedup`` only; docs/combine.md,
"Partial reduce"): its kernels ``ep_combine_async_partial``, ``ep_combine_wait_partial`` and
``ep_combine_partial`` are the BF16 combine's builders (``combine_async``, ``combine_wait``,
``combine_fused``) given a ``PartialWire``, which changes three things:

- **The send** (``PartialWire.send_token_row``), per grouped-output row with ``src_info =
  (t, k)`` from source ``s``, the whole warp: lanes ``j < K`` read the top-k ids of message
  ``m = dedup_msg_row(s, t)`` of this rank's dispatch receive buffer (the header's u16 ids)
  and the lowest slot ``k_lead`` whose expert is local (``vote.sync.ballot``). Only the row
  with ``k == k_lead`` is sent: lanes ``j`` read ``row_map[m * K + j]`` and the message's
  weight ``j`` (``dedup_weights_offset``), broadcast by ``shfl.sync.idx``; per 16-byte chunk
  (lane-strided) ``acc = 0``; for ``j = 0 .. K-1`` over the local slots ``acc =
  fma.rn.f32(w[j], y[row_map[m * K + j]], acc)`` (BF16 widened exactly); rounded to BF16 as
  the BF16 combine rounds (nearest even, NaN quiet) and stored into slot ``(t, k_lead)`` of
  the source's receive buffer. Under the SHMEM transport the warp writes the row into its
  send staging (``pr_stage``, one BF16 row per grouped-output row), ``bar.warp.sync``, then
  the BF16 combine's ``send_row`` (a peer copy in the group, one put-with-signal outside).
  The other rows of the token send nothing.
- **The count**: the rows actually sent. Each warp counts its rows to ``s`` (sent, and
  under the SHMEM transport refused ones, whose 1 ``skip_row`` signals) and adds ``1 +
  (count << COUNT_SHIFT)`` to done counter ``s``; the warp whose add brings the low
  ``COUNT_SHIFT`` bits to the grid's warp count publishes the high bits as the rows
  (``done_increment``, ``done_split``). ``check_config`` refuses grids and token counts
  that do not fit.
- **The reduce** at the source: per token, only the slots that *lead* their rank (no
  earlier valid slot of the token on the same rank) are read, and added, ``acc = add.rn.f32
  (acc, partial)`` in ``k`` order; the weights are not read (``combine_wait``'s ``partial``).
"""

from __future__ import annotations

import ir
from ir import CacheHint, ShflMode
from ir import types as T

from ..formats.quant_ir import kernel_param
from .combine_shmem import send_row
from .combine_wait import add_chunk, f32_to_bf16
from .common import VEC, word

#: the kernel names' suffix: ``ep_combine_async`` -> ``ep_combine_async_partial``
SUFFIX = "_partial"
#: done-counter bits of the warp count; the rows sent count above them
COUNT_SHIFT = 13


def check_config(cfg) -> None:
    """``ValueError`` unless ``cfg`` can take the partial-reduce combine: ``ep_rank_dedup``
    (the messages carry the weights, dispatch_wait fills the row map), the grid's warps
    below ``2 ** COUNT_SHIFT`` and ``max_tokens_per_rank`` below ``2 ** (32 -
    COUNT_SHIFT)`` (the packed done counter: ``done_increment``)."""
    if not cfg.ep_rank_dedup:
        raise ValueError("partial_reduce: needs ep_rank_dedup=True (the destination reads "
                         "each token's weights and rows from the deduplicated dispatch)")
    warps = cfg.n_sms * (cfg.num_threads // 32)
    if warps >= 1 << COUNT_SHIFT:
        raise ValueError(f"partial_reduce: n_sms * num_threads / 32 = {warps} warps, must be "
                         f"< {1 << COUNT_SHIFT} (the done counter's warp count field)")
    if cfg.max_tokens_per_rank >= 1 << (32 - COUNT_SHIFT):
        raise ValueError(f"partial_reduce: max_tokens_per_rank={cfg.max_tokens_per_rank} "
                         f"must be < {1 << (32 - COUNT_SHIFT)} (the done counter's row field)")


def done_increment(sent) -> ir.Expr:
    """A warp's add to its done counter: one warp, ``sent`` rows."""
    return (ir.as_expr(sent) << COUNT_SHIFT) + 1


def done_split(total) -> tuple[ir.Expr, ir.Expr]:
    """``(warps counted, rows counted)`` of a done-counter value."""
    total = ir.as_expr(total)
    return total & ((1 << COUNT_SHIFT) - 1), total >> COUNT_SHIFT


class PartialWire:
    """The partial-reduce combine's choices for the BF16 combine's builders (module
    docstring)."""

    reduces_at_destination = True

    def __init__(self, cfg):
        check_config(cfg)
        self.cfg = cfg
        self.slot_bytes = cfg.token_fmt.hid_dim * 2
        self.reader = None           # the BF16 combine's slots

    @staticmethod
    def name(bf16_name: str) -> str:
        """The partial-reduce twin's kernel name."""
        return bf16_name + SUFFIX

    def send_token_row(self, r: ir.RoleBuilder, p, s: int, dst_buf, row, t, k, sent,
                       sig=None, issued=None, part=None) -> None:
        """Grouped-output row ``row`` (``src_info = (t, k)``, in bounds) of source ``s``
        (module docstring): when ``k`` leads the token's local slots, the warp sums them and
        sends one row into slot ``(t, k)`` of ``dst_buf``, ``sent`` += 1. ``part = (share,
        shares)`` (P2P only): this warp sums and stores chunks ``32 share + lane`` in steps
        of ``32 shares``, and only share 0 counts the row sent."""
        if part is not None and self.cfg.needs_shmem:
            raise ValueError("PartialWire.send_token_row: a shared row under the SHMEM "
                             "transport")
        cfg = self.cfg
        lay, fmt = cfg.layout, cfg.token_fmt
        K, L, H = lay.top_k, lay.n_local_experts, fmt.hid_dim
        row_bytes = H * 2
        recv = kernel_param(r, "dedup_recv_buf", T.ptr_global)
        row_map = kernel_param(r, "row_map", T.ptr_global)
        m = r.let("pr_msg_row", lay.dedup_msg_row(s, t.cast(T.u32)))
        msg = r.let("pr_msg", recv + m.cast(T.u64) * lay.dedup_row_bytes)
        gid = r.var("pr_gid", T.u32, 0xFFFF)
        with r.if_(r.lane < K):
            r.assign(gid, r.load(msg + fmt.topk_info_offset + (r.lane * 2).cast(T.u64), T.u16,
                                 cache=CacheHint.NC, name="pr_gid_ld").cast(T.u32))
        local = r.ballot((r.lane < K) & (gid // L).eq(p.my_rank), name="pr_local")
        lead_k = r.let("pr_lead", ir.Const(1, T.u32) << k.cast(T.u32))
        # k leads when no local slot lies below it
        with r.if_((local & (lead_k - 1)).eq(0)):
            src_row = r.var("pr_row", T.u32, row)
            w = r.var("pr_w", T.f32, ir.Const(0.0, T.f32))
            with r.if_((r.lane < K) & ((local >> r.lane) & 1).ne(0)):
                r.assign(src_row, r.load(word(row_map, m * K + r.lane), T.u32,
                                         name="pr_map"))
                r.assign(w, r.load(msg + lay.dedup_weights_offset + (r.lane * 4).cast(T.u64),
                                   T.f32, cache=CacheHint.NC, name="pr_w_ld"))
            rows = [r.shfl(ShflMode.IDX, src_row, j, name=f"pr_row{j}") for j in range(K)]
            ws = [r.shfl(ShflMode.IDX, w, j, name=f"pr_w{j}") for j in range(K)]
            on = [r.let(f"pr_on{j}", ((local >> j) & 1).ne(0)) for j in range(K)]
            dst = r.let("pr_dst", dst_buf + (t.cast(T.u32) * K + k.cast(T.u32)).cast(T.u64)
                        * row_bytes, peer=True)
            out = dst
            if cfg.needs_shmem:
                stage = kernel_param(r, "pr_stage", T.ptr_global)
                out = r.let("pr_staged", stage + ir.as_expr(row).cast(T.u64) * row_bytes)
            expert_out = p.expert_out
            first, step = (r.lane, 32) if part is None else \
                (r.lane + (part[0] << 5), 32 * part[1])
            with r.for_range("pr_c", first, H // 8, step) as c:
                acc = [r.var(f"pr_acc{j}", T.f32, ir.Const(0.0, T.f32)) for j in range(8)]
                ys = [r.load(expert_out + (rows[j].cast(T.u64) * row_bytes
                                           + c.cast(T.u64) * 16), VEC, name=f"pr_y{j}")
                      for j in range(K)]
                for j in range(K):
                    add_chunk(r, acc, ys[j], f"pr_yf{j}_", ws[j], on[j])
                o = [f32_to_bf16(r, a, f"pr_o{j}") for j, a in enumerate(acc)]
                words = tuple(o[2 * q] | (o[2 * q + 1] << 16) for q in range(4))
                r.store(out + c.cast(T.u64) * 16, ir.Pack(VEC, words))
            if cfg.needs_shmem:
                r.warp_sync()
                send_row(r, cfg, p, s, dst, out, row_bytes, row_bytes // 16, sig, issued)
            if part is None:
                r.assign(sent, sent + 1)
            else:
                with r.if_(part[0].eq(0)):
                    r.assign(sent, sent + 1)


__all__ = ["PartialWire", "check_config", "done_increment", "done_split", "SUFFIX",
           "COUNT_SHIFT"]
