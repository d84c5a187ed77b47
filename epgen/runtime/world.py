"""``EmulatedWorld``: every rank of an EP group on one GPU, each with its own buffers and
stream, running the generated dispatch kernels.

``skip_a2a`` (protocol 7.3): ``EmulatedWorld(cfg, devices=D)`` runs ``D`` independent
devices, each with ``my_rank`` = its device id, its own buffers and pointer tables that hold only
its own buffers (the kernels are built with ``n_ranks = 1``); inputs are one per device, with
global top-k ids, and the results compare with ``reference.dispatch(cfg, tokens, topk_ids,
ranks=list(range(D)))``.

Ordering between calls (DESIGN.md section 8, reuse): a rank's ``dispatch_async`` of call N+1
writes into every peer's receive buffers and count words, so it must not start before every
rank's ``dispatch_wait`` of call N has drained them and re-armed the sentinels. The world
enforces this on the device: each rank's stream waits on the events recorded after every
rank's previous ``dispatch_wait``. Nothing else is needed between calls: every counter the
kernels use is re-armed by the kernels themselves.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from ..kernels import build_module
from ..kernels.dispatch_async import KERNEL_NAME as ASYNC
from ..kernels.dispatch_wait import KERNEL_NAME as WAIT
from .diagnostics import DiagBuffer
from .program import Program


class CapacityError(ValueError):
    """The ranks' grids cannot all be resident on the GPU at once (their spin-waits could
    deadlock): the message names the parameters to change."""


def participants(cfg, devices: int | None) -> list[int]:
    """The ``my_rank`` of each emulated participant: ranks ``0 .. n_ranks-1``, or under
    ``skip_a2a`` devices ``0 .. devices-1`` (default 1). ``devices`` without ``skip_a2a`` is
    a ``ValueError``."""
    if not cfg.skip_a2a:
        if devices is not None:
            raise ValueError(f"EmulatedWorld: devices={devices!r} applies only with skip_a2a "
                             f"(independent devices); without it the world emulates "
                             f"n_ranks={cfg.n_ranks} ranks")
        return list(range(cfg.n_ranks))
    n = 1 if devices is None else devices
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"EmulatedWorld: devices must be a positive integer (skip_a2a "
                         f"devices on this GPU), got {devices!r}")
    if n * cfg.layout.n_local_experts > 65536:
        raise ValueError(f"EmulatedWorld: devices={n} x n_local_experts="
                         f"{cfg.layout.n_local_experts} global expert ids must be < 65536 "
                         f"(top-k ids travel as uint16)")
    return list(range(n))


class _Rank:
    """Device buffers of one emulated rank."""

    def __init__(self, cuda, cfg, rank, device):
        lay, fmt = cfg.layout, cfg.token_fmt
        H, K, T = fmt.hid_dim, fmt.top_k, cfg.max_tokens_per_rank
        self.rank = rank
        self.stream = cuda.create_stream(device)
        z = lambda shape, dt: cuda.zeros(shape, dt, device=device, stream=self.stream)  # noqa: E731
        self.tokens = z((T, H), np.uint16)
        self.topk_ids = z((T, K), np.int32)
        self.send_buf = z(lay.send_buf_bytes, np.uint8)
        self.recv_buf = z(lay.recv_buf_bytes, np.uint8)
        self.recv_count = cuda.to_device(lay.recv_count_initial(), device=device, stream=self.stream)
        self.counters = z(lay.counter_words, np.int32)
        self.out_tokens = z((lay.max_out_rows, H), np.uint16)
        self.row_offsets = z(lay.n_groups + 1, np.uint32)
        self.expert_ids = z(lay.n_groups, np.int32)
        self.src_info = z((lay.max_out_rows, 2), np.int32)
        self.n_tokens = 0
        self.wait_done = None

    def counter_ptr(self, region) -> int:
        return self.counters.ptr + 4 * region.offset


class EmulatedWorld:
    """All ``cfg.n_ranks`` ranks on one GPU (under ``skip_a2a``: ``devices`` independent
    devices, see the module docstring). ``dispatch(tokens, topk_ids)`` runs one round
    trip (dispatch_async then dispatch_wait on every rank) and returns, per rank, the same
    ``reference.RankResult`` structure as ``epgen.reference.dispatch``."""

    def __init__(self, cfg, arch: str | None = None, device=None, timeout_ns: int | None = None,
                 devices: int | None = None):
        from backends import cuda
        cfg.require_p2p_only()
        self.cfg = cfg
        self.rank_ids = participants(cfg, devices)
        self.cuda = cuda
        self.timeout_ns = cfg.timeout_ns if timeout_ns is None else timeout_ns
        self.program = Program(build_module(cfg), arch=arch, device=device)
        self.device = self.program.device
        self._check_capacity()
        self.ranks = [_Rank(cuda, cfg, r, self.device) for r in self.rank_ids]
        self.err = DiagBuffer(self.device)
        P = cfg.p2p_world_size
        self.recv_buf_ptrs, self.recv_count_ptrs = [], []
        # each rank's tables hold its P2P group's buffers; under skip_a2a P == 1, so a
        # device's tables hold only its own (the host passes only local pointers)
        for r in self.rank_ids:
            group = range((r // P) * P, (r // P) * P + P)
            self.recv_buf_ptrs.append(cuda.to_device(
                np.array([self.ranks[q].recv_buf.ptr for q in group], np.uint64), device=self.device))
            self.recv_count_ptrs.append(cuda.to_device(
                np.array([self.ranks[q].recv_count.ptr for q in group], np.uint64), device=self.device))
        self.synchronize()

    # -- capacity ----------------------------------------------------------------------------
    def _check_capacity(self):
        cfg = self.cfg
        sms = self.cuda.sm_count(self.device)
        for name in (ASYNC, WAIT):
            per_sm = self.program.blocks_per_sm(name)
            capacity = per_sm * sms
            n = len(self.rank_ids)
            need = n * cfg.n_sms
            if need > capacity:
                raise CapacityError(
                    f"EmulatedWorld: {n} ranks x n_sms={cfg.n_sms} blocks of "
                    f"{name} need {need} co-resident blocks, but this GPU holds {capacity} "
                    f"({per_sm} per SM x {sms} SMs at num_threads={cfg.num_threads}); lower "
                    f"n_sms to at most {capacity // n} or num_threads")

    # -- device-side steps ---------------------------------------------------------------------
    def load_inputs(self, tokens, topk_ids):
        """Validate and copy every rank's inputs (host numpy or device arrays) to its buffers;
        nothing is copied when any input is invalid."""
        ranks = self.rank_ids if self.cfg.skip_a2a else None
        counts = reference.validate_inputs(self.cfg, tokens, topk_ids, ranks=ranks)
        fmt = self.cfg.token_fmt
        for rk, x, ids, T in zip(self.ranks, tokens, topk_ids, counts):
            rk.n_tokens = T
            if T == 0:
                continue
            if hasattr(x, "__cuda_array_interface__"):
                rk.tokens[:T].copy_from(x)
            else:
                rk.tokens[:T].copy_from_host(np.ascontiguousarray(fmt.as_host_tokens(x)))
            rk.topk_ids[:T].copy_from_host(np.ascontiguousarray(np.asarray(ids), np.int32))

    def dispatch_async(self):
        """Enqueue every rank's dispatch_async (after every rank's previous dispatch_wait)."""
        lay = self.cfg.layout
        waits = [rk.wait_done for rk in self.ranks if rk.wait_done is not None]
        for rk in self.ranks:
            for ev in waits:
                rk.stream.wait(ev)
            self.program.launch(ASYNC, self.cfg.n_sms, {
                "input_tokens": rk.tokens, "topk_ids": rk.topk_ids, "n_tokens": rk.n_tokens,
                "send_buf_p": rk.send_buf, "recv_buf_ptrs": self.recv_buf_ptrs[rk.rank],
                "recv_count_ptrs": self.recv_count_ptrs[rk.rank],
                "counters": rk.counter_ptr(lay.dispatch_async_region), "my_rank": rk.rank,
                "err_buf": self.err.ptr, "timeout_ns": self.timeout_ns}, rk.stream)

    def dispatch_wait(self):
        """Enqueue every rank's dispatch_wait."""
        lay = self.cfg.layout
        for rk in self.ranks:
            self.program.launch(WAIT, self.cfg.n_sms, {
                "recv_buf_p": rk.recv_buf, "recv_count_p": rk.recv_count,
                "atomic_counter": rk.counter_ptr(lay.dispatch_wait_region),
                "output_tokens": rk.out_tokens, "row_offsets": rk.row_offsets,
                "expert_ids": rk.expert_ids, "src_info": rk.src_info, "my_rank": rk.rank,
                "err_buf": self.err.ptr, "timeout_ns": self.timeout_ns}, rk.stream)
            rk.wait_done = rk.stream.record()

    def synchronize(self):
        for rk in self.ranks:
            rk.stream.sync()

    def check(self, context: str = "dispatch"):
        """Synchronise and raise ``EPTimeoutError`` if a wait expired (then re-arm)."""
        self.synchronize()
        try:
            self.err.check(self.program.module.kernels, context)
        except Exception:
            self.reset()
            raise

    def reset(self):
        """Re-arm every buffer a failed call may have left half-used."""
        lay = self.cfg.layout
        for rk in self.ranks:
            rk.recv_count.copy_from_host(lay.recv_count_initial())
            rk.counters.zero()
            rk.wait_done = None
        self.synchronize()

    # -- the public round trip ---------------------------------------------------------------
    def dispatch(self, tokens, topk_ids) -> list:
        """One dispatch round trip; returns a ``reference.RankResult`` per rank."""
        self.load_inputs(tokens, topk_ids)
        self.dispatch_async()
        self.dispatch_wait()
        self.check()
        return self.results()

    def results(self) -> list:
        cfg, lay = self.cfg, self.cfg.layout
        L, R = lay.n_local_experts, cfg.n_ranks
        out = []
        for rk in self.ranks:
            row_offsets = rk.row_offsets.to_host()
            n = int(row_offsets[-1])
            ctr = rk.counters.to_host()
            region_a = ctr[lay.dispatch_wait_region.offset:][:2 * L * R]
            counts = region_a[1::2].reshape(L, R).astype(np.int32)
            out.append(reference.RankResult.from_outputs(
                cfg, rk.rank, rk.out_tokens.to_host()[:n], row_offsets,
                rk.expert_ids.to_host(), rk.src_info.to_host()[:n], counts))
        return out
