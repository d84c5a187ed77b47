"""The combine round trip of a world (docs/combine.md): per-rank combine buffers, their
pointer tables, the launches (the split ``ep_combine_async`` + ``ep_combine_wait``, or the
fused ``ep_combine`` when the world runs the fused dispatch) and the results. Every dispatch
format and layout, ``skip_a2a`` and ``fused_shared_expert``; P2P peer stores, and NVSHMEM
to the sources outside a P2P group (``use_shmem``)."""

from __future__ import annotations

import numpy as np

from ir import diag

from ..combine_layout import CombineLayout
from ..errors import EPInputError, EPTimeoutError
from ..kernels import build_combine_module
from ..kernels.combine_async import KERNEL_NAME as C_ASYNC
from ..kernels.combine_fused import KERNEL_NAME as C_FUSED
from ..kernels.combine_wait import KERNEL_NAME as C_WAIT
from . import call_args
from . import trace as runtime_trace
from .program import Program

#: bytes after each rank's combine receive buffer that no kernel may write (the tests check
#: them: a bounds check that let a row through would land there or in another slot)
GUARD_BYTES = 4096


def check_supported(cfg) -> None:
    """``ValueError`` for the configurations combine does not take (yet)."""
    why = []
    if cfg.token_fmt.hid_dim % 8:
        why.append(f"hid_dim={cfg.token_fmt.hid_dim} (must be a multiple of 8: the reduce "
                   f"reads 16-byte chunks of 8 BF16 elements)")
    if why:
        raise ValueError("world.combine: not supported for this configuration: "
                         + "; ".join(why))


class CombineBuffers:
    """One rank's combine buffers: the receive buffer ``[max_tokens_per_rank, K, H]`` BF16
    (plus ``GUARD_BYTES``) and the ``R`` arrival words (u32, or u64 under the SHMEM
    transport), which peers write, the expert outputs (the source of the SHMEM puts), the
    weights, the residual and the output. ``peer_memory``: where the peer-written buffers
    come from (a peer-accessible pool, ``P2PWorld``; the symmetric heap, ``ShmemWorld``);
    ``send_memory``: where the expert outputs come from (the symmetric heap, ``ShmemWorld``);
    None: the device's default memory."""

    def __init__(self, cuda, cfg, rk, peer_memory=None, send_memory=None):
        fmt, lay = cfg.token_fmt, cfg.layout
        T, K, H = cfg.max_tokens_per_rank, fmt.top_k, fmt.hid_dim

        def z(shape, dt, memory=None):
            kw = {} if memory is None else {"memory_resource": memory}
            return cuda.zeros(shape, dt, device=rk.device, stream=rk.stream, **kw)
        clay = CombineLayout(cfg)
        self.recv_bytes = clay.recv_bytes
        self.recv = z(self.recv_bytes + GUARD_BYTES, np.uint8, peer_memory)
        self.arrival = z(clay.arrival_words,
                         np.uint64 if clay.arrival_word_bytes == 8 else np.uint32, peer_memory)
        self.expert_out = z((lay.max_out_rows, H), np.uint16, send_memory)
        self.weights = z((T, K), np.float32)
        self.residual = z((T, H), np.uint16)
        self.out = z(T * K * H, np.uint16)


def combine_sizes(cfg) -> dict:
    """Per rank: the combine buffers' sizes and counter words (``CombineLayout.describe``)."""
    return CombineLayout(cfg).describe()


class Combiner:
    """The combine side of a world: built on first use (``world.combine``); ``co_resident``:
    the world's rule for grids that must all be resident (``world.co_resident``). ``fused``
    follows the world's dispatch (``world.fused``): the fused ``ep_combine`` when dispatch
    runs the fused ``ep_dispatch`` (always with ``fused_shared_expert``), else the split
    kernels.

    The placement hooks (``_load``, ``_memory``, ``_peer_address``, ``_program_of``) are
    those of one process that holds every rank (``EmulatedWorld``); ``P2PWorld`` and
    ``ShmemWorld`` override them. Entry ``q`` of rank ``r``'s tables (``recv_ptrs``,
    ``arrival_ptrs``: one entry per source) is ``q``'s buffer as ``r`` reaches it when ``q`` is
    in ``r``'s P2P group, and ``r``'s own buffer otherwise: the symmetric address the kernel's
    NVSHMEM calls name (``kernels.combine_shmem``). Under ``skip_a2a`` each device is its own
    world: its tables hold its own buffers alone."""

    def __init__(self, world, co_resident):
        cfg = world.cfg
        check_supported(cfg)
        self.world = world
        self.fused = bool(world.fused)
        module = co_resident(build_combine_module(cfg), len(world.rank_ids) * cfg.n_sms,
                             world.cuda.sm_count(world.device))
        self._load(module)
        runtime_trace.allocate(world, module)     # kernels built with trace rings only
        if self.fused:
            self._check_capacity()
        self.bufs = [CombineBuffers(world.cuda, cfg, rk, **self._memory(rk))
                     for rk in world.ranks]
        world.synchronize()
        self._register_symmetric()
        self.build_tables()
        self.weighted = self.has_residual = False    # set by ``load``

    def _check_capacity(self):
        """``ValueError`` when the GPU cannot hold every rank's ``ep_combine`` grid at once
        (its reduce waits for the other grids' sends)."""
        w, cfg = self.world, self.world.cfg
        per_sm = self.program.blocks_per_sm(C_FUSED)
        sms = w.cuda.sm_count(w.device)
        need = len(w.rank_ids) * cfg.n_sms
        if need > per_sm * sms:
            raise ValueError(
                f"world.combine: {len(w.rank_ids)} ranks x n_sms={cfg.n_sms} blocks of "
                f"{C_FUSED} need {need} co-resident blocks, but this GPU holds "
                f"{per_sm * sms} ({per_sm} per SM x {sms} SMs at "
                f"num_threads={cfg.num_threads}); lower n_sms or num_threads")

    # -- placement hooks ---------------------------------------------------------------------
    def _load(self, module):
        """Load ``module`` (``self.program``; one GPU)."""
        w = self.world
        self.program = Program(module, arch=w.program.arch, device=w.device, backend=w.cuda)

    def _program_of(self, rk):
        """The ``Program`` that launches rank ``rk``'s combine kernels."""
        return self.program

    def _memory(self, rk) -> dict:
        """``CombineBuffers``' memory resources for rank ``rk`` (default memory)."""
        return {}

    def _peer_address(self, i: int, q: int, attr: str) -> int:
        """The address of rank ``q``'s buffer ``attr`` as ``ranks[i]`` reaches it (one
        address space: the buffer's own)."""
        return getattr(self.bufs[self.world.rank_ids.index(q)], attr).ptr

    # -- tables ------------------------------------------------------------------------------
    def build_tables(self):
        """Every rank's ``recv_ptrs`` and ``arrival_ptrs`` (class docstring)."""
        n = len(self.world.ranks)
        self.recv_ptrs = [self._table(i, "recv") for i in range(n)]
        self.arrival_ptrs = [self._table(i, "arrival") for i in range(n)]

    def _table(self, i: int, attr: str):
        w, cfg = self.world, self.world.cfg
        r, P = w.ranks[i].rank, cfg.p2p_world_size
        own = getattr(self.bufs[i], attr).ptr
        if cfg.skip_a2a:
            return w.cuda.to_device(np.array([own], np.uint64), device=w.ranks[i].device)
        ptrs = [self._peer_address(i, q, attr) if not cfg.needs_shmem or q // P == r // P
                else own for q in range(cfg.n_ranks)]
        return w.cuda.to_device(np.array(ptrs, np.uint64), device=w.ranks[i].device)

    def _register_symmetric(self):
        """On the simulator, under the SHMEM transport: every rank's receive buffer and
        arrival words with the machine's symmetric heap (``backends.sim.shmem``), so a put or
        signal to this rank's own address lands at the same offset of the target PE's."""
        w = self.world
        if not w.cfg.needs_shmem or not getattr(w.cuda, "RUNS_IR", False):
            return
        heap = w.cuda.symmetric_heap()
        for rk, b in zip(w.ranks, self.bufs):
            for name in ("recv", "arrival"):
                buf = getattr(b, name)
                heap.register(rk.rank, f"combine_{name}", buf.ptr, buf.nbytes)

    # -- errors ------------------------------------------------------------------------------
    def _errs(self) -> list:
        """The world's error buffers (one per GPU of ``P2PWorld``), each once."""
        out = {}
        for rk in self.world.ranks:
            err = self.world._err_of(rk)
            out.setdefault(id(err), err)
        return list(out.values())

    def _raise_timeouts(self):
        """After the synchronise: one ``EPTimeoutError`` with every error buffer's records
        if any wait expired (each used buffer re-armed)."""
        records, expired = [], False
        for err in self._errs():
            got = err.take(self.program.module.kernels)
            if got is not None:
                expired = True
                records += got
        if expired:
            raise EPTimeoutError(records, "combine")

    def run(self, expert_outputs, topk_weights=None, residual=None, *, src_info=None):
        """One combine of the world's last dispatch (module docstring of ``world.combine``):
        ``load``, ``enqueue``, then ``finish`` (synchronises and returns every rank's output).
        ``src_info``: test hook (``load``)."""
        self.load(expert_outputs, topk_weights, residual, src_info=src_info)
        self.enqueue()
        return self.finish()

    def load(self, expert_outputs, topk_weights=None, residual=None, *, src_info=None):
        """Validate the host inputs and copy them into the combine buffers (rank streams).
        Sets what the next ``enqueue`` passes (weighted or not, residual or not).
        ``src_info``: test hook, per rank an array replacing that rank's ``src_info`` on the
        device (None entries: unchanged)."""
        w = self.world
        expert_outputs, topk_weights, residual = call_args.combine_inputs(
            w, expert_outputs, topk_weights, residual)
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            y = expert_outputs[i]
            if y.shape[0]:
                b.expert_out[:y.shape[0]].copy_from_host(np.ascontiguousarray(y))
            if topk_weights is not None and rk.n_tokens:
                b.weights[:rk.n_tokens].copy_from_host(np.ascontiguousarray(topk_weights[i]))
            if residual is not None and rk.n_tokens:
                b.residual[:rk.n_tokens].copy_from_host(np.ascontiguousarray(residual[i]))
            if src_info is not None and src_info[i] is not None:
                s = np.ascontiguousarray(src_info[i], np.int32)
                rk.src_info[:len(s)].copy_from_host(s)
        self.weighted = topk_weights is not None
        self.has_residual = residual is not None

    def enqueue(self):
        """Enqueue every rank's ``ep_combine_async`` (after every rank's last dispatch_wait),
        then every rank's ``ep_combine_wait`` (after every rank's combine_async); or, fused,
        every rank's ``ep_combine`` (after every rank's last dispatch); no host
        synchronisation. Each rank's ``wait_done`` is the end of its last combine launch."""
        w, cfg = self.world, self.world.cfg
        done = [rk.wait_done for rk in w.ranks if rk.wait_done is not None]
        if self.fused:
            for i, rk in enumerate(w.ranks):
                for ev in done:
                    rk.stream.wait(ev)
                self._program_of(rk).launch(C_FUSED, cfg.n_sms, self.fused_args(i), rk.stream)
                rk.wait_done = w.cuda.record_event(rk.stream)
            return
        events = []
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            for ev in done:
                rk.stream.wait(ev)
            self._program_of(rk).launch(C_ASYNC, cfg.n_sms, self.async_args(i), rk.stream)
            events.append(w.cuda.record_event(rk.stream))
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            for ev in events:
                rk.stream.wait(ev)
            self._program_of(rk).launch(C_WAIT, cfg.n_sms, self.wait_args(i), rk.stream)
            rk.wait_done = w.cuda.record_event(rk.stream)

    def async_args(self, i: int) -> dict:
        """``ep_combine_async``'s launch arguments for rank index ``i``."""
        w = self.world
        rk, b = w.ranks[i], self.bufs[i]
        return {**w._trace_args(C_ASYNC, rk), "expert_out": b.expert_out,
                "src_info": rk.src_info,
                "counters": rk.counters.ptr, "combine_buf_ptrs": self.recv_ptrs[i],
                "arrival_ptrs": self.arrival_ptrs[i], "my_rank": rk.rank,
                "err_buf": w._err_of(rk).ptr, "timeout_ns": w.timeout_ns}

    def wait_args(self, i: int) -> dict:
        """``ep_combine_wait``'s launch arguments for rank index ``i`` (the last ``load``'s
        weighted / residual choice)."""
        w = self.world
        rk, b = w.ranks[i], self.bufs[i]
        return {**w._trace_args(C_WAIT, rk), "combine_buf": b.recv, "arrival": b.arrival,
                "topk_ids": rk.topk_ids,
                "weights": b.weights, "weighted": int(self.weighted),
                "residual": b.residual, "has_residual": int(self.has_residual),
                "out": b.out, "n_tokens": rk.n_tokens, "counters": rk.counters.ptr,
                "my_rank": rk.rank, "err_buf": w._err_of(rk).ptr, "timeout_ns": w.timeout_ns}

    def fused_args(self, i: int) -> dict:
        """``ep_combine``'s launch arguments for rank index ``i``: both halves', and under
        ``skip_a2a`` with the shared expert the devices' count (``allreduce_world_size``, as
        for ``ep_dispatch``)."""
        args = {**self.async_args(i), **self.wait_args(i),
                **self.world._trace_args(C_FUSED, self.world.ranks[i])}
        names = {p.name for p in self.program.module.kernel(C_FUSED).params}
        if "allreduce_world_size" in names:
            args["allreduce_world_size"] = len(self.world.rank_ids)
        return args

    def finish(self):
        """Synchronise the world, raise what the kernels reported (refused rows:
        ``EPInputError``; expired waits), and return every rank's output: ``[T, H]`` BF16
        bits when the last ``load`` had weights, else ``[T, K, H]``."""
        w, cfg = self.world, self.world.cfg
        K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
        w.synchronize()
        self._raise_bounds()
        try:
            self._raise_timeouts()
        except Exception:
            self._rearm()
            w.reset()
            raise
        out = []
        for rk, b in zip(w.ranks, self.bufs):
            flat = b.out.to_host()
            if not self.weighted:
                out.append(flat[:rk.n_tokens * K * H].reshape(rk.n_tokens, K, H))
            else:
                out.append(flat[:rk.n_tokens * H].reshape(rk.n_tokens, H))
        return out

    def _raise_bounds(self):
        """``EPInputError`` naming every row combine_async refused (bounds records of every
        error buffer)."""
        recs = []
        for err in self._errs():
            got = diag.decode_bounds(err.array.to_host())
            if got:
                recs += got
                err.array.zero()
        if not recs:
            return
        self.world.synchronize()
        rows = "; ".join(f"rank {r['rank']} src_info[{r['row']}] = ({r['t']}, {r['k']})"
                         for r in recs)
        raise EPInputError(f"combine: out-of-range source slot, row not sent: {rows} "
                           f"(max_tokens_per_rank={self.world.cfg.max_tokens_per_rank}, "
                           f"top_k={self.world.cfg.token_fmt.top_k})")

    def _rearm(self):
        for b in self.bufs:
            b.arrival.zero()
