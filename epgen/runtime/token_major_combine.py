"""The normal-mode combine of a world (``world.combine_tokens``; docs/deepep.md, "Normal
mode"): after a token-major receive (``world.dispatch_tokens``), every rank's
``ep_combine_async_tokens`` sends each of its token-major rows into its source's lead slot
(``kernels.combine_tokens``), then every rank's ``ep_combine_wait_partial`` (the
partial-reduce combine's source half, unchanged) sums the lead slots, adds the bias and
rounds to BF16.

The combine receive buffers, arrival words, counters, residual and output are the world's
``Combiner``'s; the destination reads the token receiver's buffers (row sources, local ids,
row count). This module adds each rank's weight slots (``[max_tokens_per_rank, K, K]``
float32: the ``K`` weights a destination returns, in the token's lead slot) and their
pointer tables (the slots in symmetric memory on a ``ShmemWorld``, whose peers in other
processes store into them), and, for host inputs, a staging copy of the rows and weights. The combined
weights are the sum of the lead slots' weight rows in ``k`` order (``reduce_weights``),
computed after the kernels on the host here and by torch on the caller's stream in the
DeepEP API (``epgen.deepep.normal``).
"""

from __future__ import annotations

import numpy as np

from ..kernels.combine_tokens import KERNEL_NAME, build_combine_tokens_module, check_supported
from ..kernels.combine_partial import PartialWire
from ..kernels.combine_wait import KERNEL_NAME as WAIT_BF16
from ..reference_tokens import combined_bias
from . import trace as runtime_trace

#: the source half's kernel: the partial-reduce combine's wait
WAIT_NAME = PartialWire.name(WAIT_BF16)


def lead_mask(ids, n_experts: int, n_local: int, where, stack):
    """``[T, K]`` bool: the lead slots of top-k ids ``ids`` ``[T, K]`` (int64, numpy or
    torch): valid (in ``[0, n_experts)``) with no earlier valid slot on the same rank (``id
    // n_local``), where the rank that received the token returned its row. ``where`` and
    ``stack`` are the library's (``stack(columns, 1)``)."""
    valid = (ids >= 0) & (ids < n_experts)
    rank = where(valid, ids // n_local, -1)
    cols = []
    for k in range(ids.shape[1]):
        col = valid[:, k]
        for j in range(k):
            col = col & ~(valid[:, j] & (rank[:, j] == rank[:, k]))
        cols.append(col)
    return stack(cols, 1)


def reduce_weights(slots, lead, where, zeros):
    """The combined weights ``[T, K]``: ``acc = 0``, then for ``k`` ascending ``acc = acc +
    slots[:, k, :]`` where ``lead[:, k]`` (float32 adds, in this order). ``slots`` ``[T, K,
    K]`` and ``lead`` ``[T, K]`` bool are numpy or torch arrays; ``where`` and ``zeros`` the
    library's ``where`` and a zero ``[T, K]`` float32 array of it."""
    acc = zeros
    for k in range(lead.shape[1]):
        acc = where(lead[:, k:k + 1], acc + slots[:, k, :], acc)
    return acc


class TokenMajorCombine:
    """The normal-mode combine of ``world`` (module docstring; ``world.token_combiner()``).
    ``ValueError`` for a configuration it does not take (``combine_tokens.check_supported``
    and the partial-reduce combine's ``check_config``)."""

    #: whether every rank's ``ep_combine_wait_partial`` starts after every rank's
    #: ``ep_combine_async_tokens`` (events). False leaves each rank's two kernels in its own
    #: stream's order only, as separate processes run them: the arrival words alone then
    #: order the rows before their reads (the ordering checker runs it so, to see them).
    halves_ordered: bool = True

    def __init__(self, world):
        cfg = world.cfg
        check_supported(cfg)
        PartialWire(cfg)                    # its limits (the done counter's fields)
        self.world = world
        self.receiver = world.token_receiver()
        self.combiner = world.combiner()
        self.programs = world.load(world.co_resident(build_combine_tokens_module(cfg)))
        self.program = self.programs.first
        world.check_resident(self.programs, (KERNEL_NAME, WAIT_NAME),
                             f"{world.world_name}.combine_tokens")
        runtime_trace.allocate(world, self.program.module)
        K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
        rows = self.receiver.layout.rows
        z = world.cuda.zeros

        def peer_written(rk, n):
            # the weight slots take the destinations' stores: symmetric memory on a
            # ShmemWorld (``memory_of``), as the combiner's receive buffers
            mem = world.memory_of(rk.device).get("peer_memory")
            kw = {} if mem is None else {"memory_resource": mem}
            return z(n, np.float32, device=rk.device, stream=rk.stream, **kw)
        self.weight_slots = [peer_written(rk, cfg.max_tokens_per_rank * K * K)
                             for rk in world.ranks]
        self.in_x = [z((rows, H), np.uint16, device=rk.device, stream=rk.stream)
                     for rk in world.ranks]
        self.in_weights = [z((rows, K), np.float32, device=rk.device, stream=rk.stream)
                           for rk in world.ranks]
        # every PE's slots allocated (and zeroed) before their addresses are looked up
        world.synchronize()
        self.weight_ptrs = [world.pointer_table(i, self.combiner.table_ranks(rk),
                                                self.weight_slots)
                            for i, rk in enumerate(world.ranks)]
        world.synchronize()

    def kernels(self) -> tuple:
        """The loaded kernels (``ir.Kernel``), naming the error buffers' records."""
        return tuple(self.program.module.kernels)

    def async_args(self, i: int, x_rows=None, weights=None) -> dict:
        """``ep_combine_async_tokens``'s arguments for rank index ``i``: ``x_rows`` and
        ``weights`` the addresses of its rows and weights (None: the staging buffers;
        ``weights`` None also means ``has_weights = 0`` when ``x_rows`` is given)."""
        w, c = self.world, self.combiner
        rk, b = w.ranks[i], self.receiver.bufs[i]
        staged = x_rows is None
        return {"x_rows": self.in_x[i] if staged else x_rows,
                "in_weights": self.in_weights[i] if weights is None else weights,
                "has_weights": int(weights is not None),
                "out_src": b.out_src, "out_topk": b.out_topk, "meta": b.meta,
                "counters": rk.counters.ptr, "combine_buf_ptrs": c.recv_ptrs[i],
                "weight_buf_ptrs": self.weight_ptrs[i], "arrival_ptrs": c.arrival_ptrs[i],
                "my_rank": rk.rank, "err_buf": w.err_of(rk).ptr, "timeout_ns": w.timeout_ns}

    def wait_args(self, i: int, residual=None, out=None) -> dict:
        """``ep_combine_wait_partial``'s arguments for rank index ``i``: the Combiner's
        (its receive buffer, arrival words, the dispatch's top-k ids and token count),
        ``residual`` the address of the bias rows (None: none) and ``out`` of the output
        (None: the Combiner's)."""
        w, c = self.world, self.combiner
        rk, b = w.ranks[i], c.bufs[i]
        args = c.wait_args(i, fp8=False, partial=True)
        args.update({**w.trace_args(WAIT_NAME, rk), "weighted": 1,
                     "residual": b.residual if residual is None else residual,
                     "has_residual": int(residual is not None), "n_tokens": rk.n_tokens,
                     "out": b.out if out is None else out})
        return args

    def run(self, xs, weights=None, bias=None) -> list:
        """The combine of the world's last ``dispatch_tokens`` (``world.combine_tokens``):
        per rank ``xs[d]`` ``[rows, H]`` BF16 bits (its rows past the received ones are not
        read), ``weights[d]`` ``[rows, K]`` float32 (None: none), ``bias[s]`` a tuple of 0
        to 2 ``[T_s, H]`` BF16 arrays (``reference_tokens.combined_bias``). Returns per rank
        ``(x [T, H] BF16 bits, w [T, K] float32 or None)``."""
        w, cfg = self.world, self.world.cfg
        H, K = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
        R = len(w.ranks)
        bias = [()] * R if bias is None else bias
        residual = []
        for i, rk in enumerate(w.ranks):
            n = self.receiver.result(i).n_rows
            x = np.ascontiguousarray(xs[i], np.uint16)
            if x.ndim != 2 or x.shape[1] != H or x.shape[0] < n:
                raise ValueError(f"xs[{i}]: must be [N, {H}] BF16 bits with N >= the "
                                 f"{n} rows rank {rk.rank} received, got {x.shape}")
            if n:
                self.in_x[i][:n].copy_from_host(x[:n])
                if weights is not None:
                    self.in_weights[i][:n].copy_from_host(
                        np.ascontiguousarray(weights[i][:n], np.float32))
            res = combined_bias(bias[i])
            if res is not None and rk.n_tokens:
                self.combiner.bufs[i].residual[:rk.n_tokens].copy_from_host(
                    np.ascontiguousarray(res, np.uint16))
            residual.append(res is not None)
        self.enqueue(weights is not None, residual)
        w.synchronize()
        try:
            w.raise_timeouts(self.kernels(), "combine_tokens")
        except Exception:
            for b in self.combiner.bufs:
                b.arrival.zero()
            w.reset()
            raise
        out = []
        for i, rk in enumerate(w.ranks):
            T = rk.n_tokens
            x = self.combiner.bufs[i].out.to_host()[:T * H].reshape(T, H)
            cw = None
            if weights is not None:
                slots = self.weight_slots[i].to_host()[:T * K * K].reshape(T, K, K)
                ids = rk.topk_ids.to_host()[:T].astype(np.int64)
                lead = lead_mask(ids, cfg.n_experts, cfg.layout.n_local_experts, np.where,
                                 np.stack)
                cw = reduce_weights(slots, lead, np.where, np.zeros((T, K), np.float32))
            out.append((x, cw))
        return out

    def enqueue(self, has_weights: bool, residual) -> None:
        """Every rank's ``ep_combine_async_tokens`` (after every rank's receive), then every
        rank's ``ep_combine_wait_partial`` (after every rank's send, unless
        ``halves_ordered`` is False), on the ranks' streams;
        the staging buffers' rows and weights, ``residual[i]``: whether rank ``i``'s
        Combiner residual holds its bias."""
        w, cfg = self.world, self.world.cfg
        done = [rk.wait_done for rk in w.ranks if rk.wait_done is not None]
        events = []
        for i, rk in enumerate(w.ranks):
            for ev in done:
                rk.stream.wait(ev)
            args = self.async_args(i)
            args["has_weights"] = int(has_weights)
            self.programs.of(rk).launch(KERNEL_NAME, cfg.n_sms, args, rk.stream)
            events.append(w.cuda.record_event(rk.stream))
        for i, rk in enumerate(w.ranks):
            for ev in events if self.halves_ordered else ():
                rk.stream.wait(ev)
            args = self.wait_args(i)
            args["has_residual"] = int(residual[i])
            self.programs.of(rk).launch(WAIT_NAME, cfg.n_sms, args, rk.stream)
            rk.wait_done = w.cuda.record_event(rk.stream)


__all__ = ["TokenMajorCombine", "lead_mask", "reduce_weights", "WAIT_NAME"]
