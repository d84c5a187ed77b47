"""``ep_dispatch``: the fused single-launch dispatch kernel: dispatch_async
and dispatch_wait in one grid, as roles in kernel order (a thread runs its roles one after the
other).

    phase 1  blocks [0, n_signal_sms)         monitor   monitor_and_signal_completion
             blocks [n_signal_sms, grid)      comm      copy_and_send_tokens
                                                        (+ publish_send_buf_ready with SE)
             (warp send path: monitor [0, n_signal_sms) count_and_reserve, comm [0, grid),
             signal [0, n_signal_sms) signal_after_sends: dispatch_async.add_send_phase)
    phase 2  block  grid - 1                  aux       wait_for_arrivals_and_compute_offsets
             blocks [0, grid - 1)             pack      pack_shared_expert_inputs (SE only)
                                              copy      copy_received_tokens_to_output

Every wait is on other blocks of this grid or of the peers' grids (the comm blocks wait on
nothing), so the kernel needs every block of every rank's grid resident at once; the
world's capacity check covers it. Parameters: those of both halves (``my_rank``, ``err_buf``
and ``timeout_ns`` once), ``recv_buf_p``/``recv_count_p`` being this rank's own receive
buffers (the reference's ``recv_*_ptrs[my_p2p_rank]``); with ``fused_shared_expert`` and
``skip_a2a``, ``allreduce_world_size`` too.
"""

from __future__ import annotations

import ir
from ir import types as T

from . import dispatch_async, dispatch_wait, trace
from .shared_expert import (pack_shared_expert_inputs, publish_send_buf_ready,
                            se_token_slice, send_buf_ready_ptr)
from .sm_map import DEFAULT_SMS

KERNEL_NAME = "ep_dispatch"


class SharedParams:
    """A view of a ``KernelBuilder`` whose ``param`` returns the parameter already declared
    under that name (same type and peer flag), so both halves' ``declare_params`` can run on
    one kernel and share ``my_rank``, ``err_buf`` and ``timeout_ns``."""

    def __init__(self, kb: ir.KernelBuilder):
        self._kb = kb

    def __getattr__(self, name):
        return getattr(self._kb, name)

    def param(self, name, dtype, peer: bool = False):
        for p in self._kb.params:
            if p.name == name:
                if (p.dtype, p.peer) != (dtype, peer):
                    raise ValueError(f"kernel {self._kb.name}: parameter {name!r} declared "
                                     f"as {p.dtype} peer={p.peer} and as {dtype} peer={peer}")
                return p
        return self._kb.param(name, dtype, peer)

    def diagnostics(self, err_buf=None, timeout_ns=None, rank=0):
        if self._kb.diag is not None and timeout_ns is None:
            timeout_ns = self._kb.diag["timeout_ns"]
        return self._kb.diagnostics(err_buf, timeout_ns, rank)


def build_dispatch_fused(cfg, sms=DEFAULT_SMS, name: str = KERNEL_NAME) -> ir.Kernel:
    """The fused entry point ``ep_dispatch`` (module docstring). ``sms``
    (``sm_map.SMMap``): each role's blocks and the SM arguments of its builder, default the
    ones above; ``name``: the kernel's name (a remapped test kernel's own)."""
    if cfg.ep_final_layout:
        raise ValueError("ep_final_layout: the fused single-launch kernel does not take the "
                         "final layout yet; build the standalone kernels "
                         "(build_dispatch_async, build_dispatch_wait)")
    lay = cfg.layout
    se = bool(cfg.fused_shared_expert)
    kb = ir.KernelBuilder(name, cfg.num_threads)
    view = SharedParams(kb)
    pa = dispatch_async.declare_params(view, cfg)
    pw = dispatch_wait.declare_params(view, cfg)
    world = kb.param("allreduce_world_size", T.u32) if se and cfg.skip_a2a else None
    trace.instrument(kb, cfg, pa.my_rank)
    n_sig = lay.n_signal_sms
    last = ir.SRegRead(ir.SReg.NCTAID_X) - 1

    def se_slice(r):
        return se_token_slice(r, cfg, pa.n_tokens, pa.my_rank, world)

    def role(name, start, stop):
        return kb.role(name, blocks=sms.blocks(cfg, name, start, stop))

    dispatch_async.add_send_phase(
        kb, cfg, pa, comm_tail=(lambda r: publish_send_buf_ready(
            r, cfg, pw.atomic_counter, se_slice(r)[1])) if se else None, sms=sms)
    with role("aux", last, None) as r:
        dispatch_wait.wait_for_arrivals_and_compute_offsets(
            r, cfg, pw, reserved_shared_expert_tokens=se_slice(r)[1] if se else None,
            **sms.args(cfg, "aux", r))
    if se:
        with role("pack", 0, last) as r:
            row0, t_se = se_slice(r)
            pack_args = sms.args(cfg, "pack", r)
            if not pack_args:   # the standalone mapping: the highest blocks pack
                n_active = r.let("n_active_comm", r.n_blocks - 1)
                pack_args = dict(pack_sm_id=r.let("pack_sm_id", n_active - 1 - r.block),
                                 n_active_comm_sms=n_active, n_send_sms=r.n_blocks - n_sig)
            send_rows = pa.send_buf_p if not cfg.skip_a2a else \
                r.let("se_rows", pa.send_buf_p + row0.cast(T.u64) * lay.send_buf_row_bytes)
            pack_shared_expert_inputs(
                r, cfg, send_rows=send_rows,
                output_tokens=pw.output_tokens,
                fused_se_counter=send_buf_ready_ptr(cfg, pw.atomic_counter),
                shared_expert_token_count=t_se, err_buf=pw.err_buf, **pack_args)
    with role("copy", 0, last) as r:
        dispatch_wait.copy_received_tokens_to_output(r, cfg, pw, **sms.args(cfg, "copy", r),
                                                      copy_trace=trace.copy_trace(kb))
    return kb.build()


__all__ = ["build_dispatch_fused", "KERNEL_NAME"]
