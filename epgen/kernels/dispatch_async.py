"""``dispatch_async``: declares the kernel's parameters and composes its roles. The monitor
(aux) blocks count tokens per expert and publish the receive counts (``monitor``); the comm
blocks copy each token to its destinations (reference page: ``monitor_and_signal_completion``,
``copy_and_send_tokens``). Each role has its module:

- ``monitor``: counting, reservation, completion (``monitor_and_signal_completion``, and its
  split around the sends: ``count_and_reserve``, ``signal_after_sends``);
- ``send_policy``: which send path a build takes (``uses_warp_send`` is the rule);
- ``send_warp``: the warp path (``warp_broadcast_tokens``, the stock one): each warp reads a
  token once and stores it from registers to its ``K`` destinations;
- ``send_staged``: the block-staged paths: ``broadcast_tokens`` (shared-memory staging, the
  staged variants' prefill path and ``ep_send_join_named``) and the send-buffer staging with
  a warp per destination (``ep_copy_role_split``, the shared expert, the final layout of
  formats with ragged scale rows);
- ``destination``: where the rows go, chosen once from the configuration when the
  parameters are declared (``AsyncParams.dest``): the staged receive buffer (``staged``) or
  the final layout's rows (``final_layout``).
"""

from __future__ import annotations

import attrs

import ir
from ir import types as T

from . import destination, rank_mask, trace
from .monitor import count_and_reserve, monitor_and_signal_completion, signal_after_sends
from .rank_mask import MaskParams
from .send_policy import (send_warps_per_token, sends_from_every_block, uses_block_broadcast,
                          uses_warp_send)
from .send_staged import broadcast_tokens, send_buffer_tokens
from .send_warp import warp_broadcast_tokens
from .sm_map import DEFAULT_SMS
from .staged import StagedDestination

KERNEL_NAME = "ep_dispatch_async"


@attrs.frozen
class AsyncParams:
    """Kernel parameters of dispatch_async, named as the reference method arguments."""

    input_tokens: ir.Param
    topk_ids: ir.Param
    n_tokens: ir.Param
    send_buf_p: ir.Param
    recv_buf_ptrs: ir.Param
    recv_count_ptrs: ir.Param
    counters: ir.Param
    my_rank: ir.Param
    err_buf: ir.Param
    #: the destination strategy (``destination.declare_send``), with its own parameters
    dest: StagedDestination | None = None
    #: ``ep_rank_mask``: the rank mask's parameters (``rank_mask.declare``)
    mask: MaskParams | None = None


def declare_params(kb: ir.KernelBuilder, cfg) -> AsyncParams:
    """dispatch_async's parameters on ``kb``, then the rank mask's (``ep_rank_mask``:
    ``rank_mask``), its destination strategy's (``destination.declare_send``: the final
    layout's with ``ep_final_layout``), and its diagnostics (``err_buf``, ``my_rank``)."""
    p = AsyncParams(
        input_tokens=kb.param("input_tokens", T.ptr_global),
        topk_ids=kb.param("topk_ids", T.ptr_global),
        n_tokens=kb.param("n_tokens", T.u32),
        send_buf_p=kb.param("send_buf_p", T.ptr_global),
        recv_buf_ptrs=kb.param("recv_buf_ptrs", T.ptr_global),
        recv_count_ptrs=kb.param("recv_count_ptrs", T.ptr_global),
        counters=kb.param("counters", T.ptr_global),
        my_rank=kb.param("my_rank", T.u32),
        err_buf=kb.param("err_buf", T.ptr_global),
    )
    p = attrs.evolve(p, mask=rank_mask.declare(kb, cfg, waits=False))
    p = attrs.evolve(p, dest=destination.declare_send(kb, cfg, p))
    kb.diagnostics(err_buf=p.err_buf, rank=p.my_rank)
    return p


def copy_and_send_tokens(r: ir.RoleBuilder, cfg, p: AsyncParams, n_signal_sms: int,
                         token_warps: int = 1, sm_id=None, n_active_send_sms=None):
    """Comm blocks: every token to its ``K`` destinations, by the send path the policy picks
    (``send_policy``): the warp path (``send_warp.warp_broadcast_tokens``, ``token_warps``
    warps per token), the block-staged broadcast (``send_staged.broadcast_tokens``) or the
    send-buffer staging with a warp per destination (``send_staged.send_buffer_tokens``).
    ``n_signal_sms``: the first sending block; the role's context (``kb.role``) gives its
    threads and barrier (``comm_sync``).
    Under ``skip_a2a`` destinations other than ``my_rank`` are skipped. ``sm_id`` and
    ``n_active_send_sms`` (u32 IR values): this block's index among the sending blocks and
    their count, default ``block - n_signal_sms`` and ``grid - n_signal_sms``
    (``common.send_sm``), so a fused kernel can send from remapped blocks."""
    sms = dict(sm_id=sm_id, n_active_send_sms=n_active_send_sms)
    if uses_warp_send(cfg):
        return warp_broadcast_tokens(r, cfg, p, n_signal_sms, token_warps, **sms)
    if uses_block_broadcast(cfg):
        return broadcast_tokens(r, cfg, p, n_signal_sms, **sms)
    return send_buffer_tokens(r, cfg, p, n_signal_sms, **sms)


def add_send_phase(kb: ir.KernelBuilder, cfg, p: AsyncParams, comm_tail=None,
                   sms=DEFAULT_SMS):
    """The dispatch_async roles of a kernel (the standalone kernel, and phase 1 of the fused
    one). Staged send paths: ``monitor`` blocks ``[0, n_signal_sms)``
    (``monitor_and_signal_completion``) and ``comm`` blocks ``[n_signal_sms, grid)``
    (``copy_and_send_tokens``, then ``comm_tail(r)`` if given). Warp send path
    (``uses_warp_send``): the monitor blocks send too, so their work is split around the
    sends: ``monitor`` ``[0, n_signal_sms)`` (``count_and_reserve``), ``comm`` ``[0, grid)``
    (``copy_and_send_tokens`` over every block), ``signal`` ``[0, n_signal_sms)``
    (``signal_after_sends``); a thread runs its roles in that order. The block-staged
    broadcast does the same (``sends_from_every_block``). ``sms`` (``sm_map.SMMap``): each
    role's blocks and SM arguments, default the ones above."""
    n_sig = cfg.layout.n_signal_sms

    def role(name, start, stop):
        return kb.role(name, blocks=sms.blocks(cfg, name, start, stop))

    if sends_from_every_block(cfg):
        if comm_tail is not None:
            raise ValueError("add_send_phase: comm_tail needs comm blocks that do not "
                             "monitor (the shared expert's staged path)")
        with role("monitor", 0, n_sig) as r:
            count_and_reserve(r, cfg, p, **sms.args(cfg, "monitor", r))
        token_warps = send_warps_per_token(cfg) if uses_warp_send(cfg) else 1
        with role("comm", 0, None) as r:
            copy_and_send_tokens(r, cfg, p, 0, token_warps=token_warps,
                                 **sms.args(cfg, "comm", r))
        with role("signal", 0, n_sig) as r:
            signal_after_sends(r, cfg, p, token_warps, **sms.args(cfg, "signal", r))
        return
    with role("monitor", 0, n_sig) as r:
        monitor_and_signal_completion(r, cfg, p, **sms.args(cfg, "monitor", r))
    with role("comm", n_sig, None) as r:
        copy_and_send_tokens(r, cfg, p, n_sig, **sms.args(cfg, "comm", r))
        if comm_tail is not None:
            comm_tail(r)


def build_dispatch_async(cfg) -> ir.Kernel:
    """The dispatch_async entry point (``add_send_phase``)."""
    kb = ir.KernelBuilder(KERNEL_NAME, cfg.num_threads)
    p = declare_params(kb, cfg)
    trace.instrument(kb, cfg, p.my_rank)
    add_send_phase(kb, cfg, p)
    return kb.build()


__all__ = ["build_dispatch_async", "declare_params", "copy_and_send_tokens", "add_send_phase",
           "monitor_and_signal_completion", "AsyncParams", "KERNEL_NAME"]
