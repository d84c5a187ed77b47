"""The combine round trip of an ``EmulatedWorld`` (docs/combine.md): per-rank combine buffers,
their peer pointer tables, the two launches and the results. BF16 over P2P only."""

from __future__ import annotations

import numpy as np

from ir import diag

from ..combine_layout import CombineLayout
from ..errors import EPInputError
from ..formats.bf16_codec import bf16_bits
from ..kernels import build_combine_module
from ..kernels.combine_async import KERNEL_NAME as C_ASYNC
from ..kernels.combine_wait import KERNEL_NAME as C_WAIT
from .program import Program

#: bytes after each rank's combine receive buffer that no kernel may write (the tests check
#: them: a bounds check that let a row through would land there or in another slot)
GUARD_BYTES = 4096


def check_supported(cfg) -> None:
    """``ValueError`` for the configurations combine does not take yet."""
    why = []
    if cfg.token_fmt.name != "BF16":
        why.append(f"format {cfg.token_fmt.name} (only BF16 so far)")
    for flag in ("ep_final_layout", "fused_shared_expert", "skip_a2a"):
        if getattr(cfg, flag):
            why.append(f"{flag} (not yet)")
    if why:
        raise ValueError("world.combine: not supported for this configuration: "
                         + "; ".join(why))


class CombineBuffers:
    """One rank's combine buffers: the receive buffer ``[max_tokens_per_rank, K, H]`` BF16
    (plus ``GUARD_BYTES``) and the ``R`` arrival words (both peer-visible), the expert
    outputs, the weights and the output."""

    def __init__(self, cuda, cfg, rk):
        fmt, lay = cfg.token_fmt, cfg.layout
        T, K, H = cfg.max_tokens_per_rank, fmt.top_k, fmt.hid_dim
        z = lambda shape, dt: cuda.zeros(shape, dt, device=rk.device, stream=rk.stream)  # noqa: E731
        clay = CombineLayout(cfg)
        self.recv_bytes = clay.recv_bytes
        self.recv = z(self.recv_bytes + GUARD_BYTES, np.uint8)
        self.arrival = z(clay.arrival_words, np.uint32)
        self.expert_out = z((lay.max_out_rows, H), np.uint16)
        self.weights = z((T, K), np.float32)
        self.residual = z((T, H), np.uint16)
        self.out = z(T * K * H, np.uint16)


def combine_sizes(cfg) -> dict:
    """Per rank: the combine buffers' sizes and counter words (``CombineLayout.describe``)."""
    return CombineLayout(cfg).describe()


class Combiner:
    """The combine side of a world: built on first use (``world.combine``); ``co_resident``:
    the world's rule for grids that must all be resident (``world.co_resident``)."""

    def __init__(self, world, co_resident):
        cfg = world.cfg
        check_supported(cfg)
        self.world = world
        module = co_resident(build_combine_module(cfg), len(world.rank_ids) * cfg.n_sms,
                             world.cuda.sm_count(world.device))
        self.program = Program(module, arch=world.program.arch, device=world.device,
                               backend=world.cuda)
        self.bufs = [CombineBuffers(world.cuda, cfg, rk) for rk in world.ranks]
        world.synchronize()
        table = lambda attr, r: world.cuda.to_device(  # noqa: E731
            np.array([getattr(self.bufs[q], attr).ptr for q in world.rank_ids], np.uint64),
            device=world.ranks[r].device)
        self.recv_ptrs = [table("recv", r) for r in range(len(world.ranks))]
        self.arrival_ptrs = [table("arrival", r) for r in range(len(world.ranks))]

    def run(self, expert_outputs, topk_weights=None, residual=None, *, src_info=None):
        """One combine of the world's last dispatch (module docstring of ``world.combine``).
        ``src_info``: test hook, per rank an array replacing that rank's ``src_info`` on the
        device before the launch (None entries: unchanged)."""
        w, cfg = self.world, self.world.cfg
        K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
        if residual is not None and topk_weights is None:
            raise EPInputError("residual: needs topk_weights (the unreduced rows take none)")
        if residual is not None and len(residual) != len(w.ranks):
            raise EPInputError(f"residual: one array per rank ({len(w.ranks)}), got "
                               f"{len(residual)}")
        n = len(w.ranks)
        if len(expert_outputs) != n:
            raise EPInputError(f"expert_outputs: one array per rank ({n}), got "
                               f"{len(expert_outputs)}")
        if topk_weights is not None and len(topk_weights) != n:
            raise EPInputError(f"topk_weights: one array per rank ({n}), got "
                               f"{len(topk_weights)}")
        lay = cfg.layout
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            y = bf16_bits(expert_outputs[i])
            if y.ndim != 2 or y.shape[1] != H or y.shape[0] > lay.max_out_rows:
                raise EPInputError(f"expert_outputs[{i}]: must be [rows <= {lay.max_out_rows}, "
                                   f"{H}] BF16, got shape {y.shape}")
            if y.shape[0]:
                b.expert_out[:y.shape[0]].copy_from_host(np.ascontiguousarray(y))
            if topk_weights is not None:
                wt = np.asarray(topk_weights[i], np.float32)
                if wt.shape != (rk.n_tokens, K):
                    raise EPInputError(f"topk_weights[{i}]: must be [{rk.n_tokens}, {K}] "
                                       f"float32, got {wt.shape}")
                if rk.n_tokens:
                    b.weights[:rk.n_tokens].copy_from_host(np.ascontiguousarray(wt))
            if residual is not None:
                rr = bf16_bits(residual[i])
                if rr.shape != (rk.n_tokens, H):
                    raise EPInputError(f"residual[{i}]: must be [{rk.n_tokens}, {H}] BF16, "
                                       f"got shape {rr.shape}")
                if rk.n_tokens:
                    b.residual[:rk.n_tokens].copy_from_host(np.ascontiguousarray(rr))
            if src_info is not None and src_info[i] is not None:
                s = np.ascontiguousarray(src_info[i], np.int32)
                rk.src_info[:len(s)].copy_from_host(s)
        done = [rk.wait_done for rk in w.ranks if rk.wait_done is not None]
        events = []
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            for ev in done:
                rk.stream.wait(ev)
            self.program.launch(C_ASYNC, cfg.n_sms, {
                "expert_out": b.expert_out, "src_info": rk.src_info,
                "counters": rk.counters.ptr, "combine_buf_ptrs": self.recv_ptrs[i],
                "arrival_ptrs": self.arrival_ptrs[i], "my_rank": rk.rank,
                "err_buf": w.err.ptr, "timeout_ns": w.timeout_ns}, rk.stream)
            events.append(w.cuda.record_event(rk.stream))
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            for ev in events:
                rk.stream.wait(ev)
            self.program.launch(C_WAIT, cfg.n_sms, {
                "combine_buf": b.recv, "arrival": b.arrival, "topk_ids": rk.topk_ids,
                "weights": b.weights, "weighted": int(topk_weights is not None),
                "residual": b.residual, "has_residual": int(residual is not None),
                "out": b.out, "n_tokens": rk.n_tokens, "counters": rk.counters.ptr,
                "my_rank": rk.rank, "err_buf": w.err.ptr, "timeout_ns": w.timeout_ns},
                rk.stream)
            rk.wait_done = w.cuda.record_event(rk.stream)
        w.synchronize()
        self._raise_bounds()
        try:
            w.err.check(self.program.module.kernels, "combine")
        except Exception:
            self._rearm()
            w.reset()
            raise
        out = []
        for rk, b in zip(w.ranks, self.bufs):
            flat = b.out.to_host()
            if topk_weights is None:
                out.append(flat[:rk.n_tokens * K * H].reshape(rk.n_tokens, K, H))
            else:
                out.append(flat[:rk.n_tokens * H].reshape(rk.n_tokens, H))
        return out

    def _raise_bounds(self):
        """``EPInputError`` naming every row combine_async refused (bounds records)."""
        words = self.world.err.array.to_host()
        recs = diag.decode_bounds(words)
        if not recs:
            return
        self.world.err.array.zero()
        self.world.synchronize()
        rows = "; ".join(f"rank {r['rank']} src_info[{r['row']}] = ({r['t']}, {r['k']})"
                         for r in recs)
        raise EPInputError(f"combine: out-of-range source slot, row not sent: {rows} "
                           f"(max_tokens_per_rank={self.world.cfg.max_tokens_per_rank}, "
                           f"top_k={self.world.cfg.token_fmt.top_k})")

    def _rearm(self):
        for b in self.bufs:
            b.arrival.zero()
