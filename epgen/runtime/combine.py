"""The combine round trip of a world (docs/combine.md): per-rank combine buffers, their
pointer tables, the launches (the split ``ep_combine_async`` + ``ep_combine_wait``, or the
fused ``ep_combine`` when the world runs the fused dispatch) and the results. Every dispatch
format and layout, ``skip_a2a`` and ``fused_shared_expert``; P2P peer stores, and NVSHMEM
to the sources outside a P2P group (``use_shmem``)."""

from __future__ import annotations

import numpy as np

from ir import diag

from ..combine_layout import CombineLayout
from ..errors import EPInputError
from ..kernels import build_combine_module
from ..kernels.combine_async import KERNEL_NAME as C_ASYNC
from ..kernels.combine_fused import KERNEL_NAME as C_FUSED
from ..kernels.combine_wait import KERNEL_NAME as C_WAIT
from . import call_args
from .combine_fp8 import Fp8Combine
from .combine_partial import PartialCombine
from . import trace as runtime_trace
from .placement import p2p_group

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
        # Tuning.wait_times (ours): combine_wait's time waited for each arrival word, ns
        self.wait_time = z(clay.arrival_words, np.uint64) if cfg.tuning.wait_times else None


def combine_sizes(cfg) -> dict:
    """Per rank: the combine buffers' sizes and counter words (``CombineLayout.describe``)."""
    return CombineLayout(cfg).describe()


class Combiner:
    """The combine side of a world (``world.combiner()``, built on first use), placed through
    the world's placement interface alone (``rank_world.RankWorld``): the combine module,
    made co-resident like the dispatch kernels (``world.co_resident``), is loaded on the
    world's GPUs (``world.load``; ``programs``, ``program`` the first GPU's), its grids
    checked (``world.check_resident``), each rank's buffers allocated where the world says
    (``world.memory_of``) and its tables built by ``world.pointer_table``. ``fused`` follows
    the world's dispatch (``world.fused``): the fused ``ep_combine`` when dispatch runs the
    fused ``ep_dispatch`` (always with ``fused_shared_expert``), else the split kernels.

    Entry ``q`` of rank ``r``'s tables (``recv_ptrs``, ``arrival_ptrs``: one entry per
    source) is ``q``'s buffer as ``r`` reaches it when ``q`` is in ``r``'s P2P group, and
    ``r``'s own buffer otherwise: the symmetric address the kernel's NVSHMEM calls name
    (``kernels.combine_shmem``). Under ``skip_a2a`` each device is its own world: its tables
    hold its own buffers alone (``table_ranks``)."""

    def __init__(self, world):
        cfg = world.cfg
        check_supported(cfg)
        self.world = world
        self.fused = bool(world.fused)
        self.programs = world.load(world.co_resident(build_combine_module(cfg)))
        self.program = self.programs.first
        world.check_resident(self.programs, self.bf16_kernels(),
                             f"{world.world_name}.combine")
        runtime_trace.allocate(world, self.program.module)   # kernels built with trace rings only
        self.bufs = [CombineBuffers(world.cuda, cfg, rk, **world.memory_of(rk.device))
                     for rk in world.ranks]
        world.synchronize()
        for name in ("recv", "arrival"):
            world.register_symmetric(f"combine_{name}", [getattr(b, name) for b in self.bufs])
        self.build_tables()
        world.synchronize()           # the tables landed before any stream's kernel reads them
        self.weighted = self.has_residual = self.fp8 = False    # set by ``load``
        self.partial = False                                     # set by ``load``
        #: the FP8 combine's programs and buffers (``combine_fp8.Fp8Combine``), made by the
        #: first ``fp8=True`` call (``prepare_fp8``)
        self.fp8_side = None
        #: the partial-reduce combine's (``combine_partial.PartialCombine``), made by the
        #: first ``partial_reduce=True`` call (``prepare_partial``)
        self.partial_side = None

    def kernels(self) -> tuple[str, ...]:
        """The combine kernels one call launches: ``ep_combine``, or ``ep_combine_async``
        and ``ep_combine_wait`` (their ``_fp8`` twins when the last ``load`` chose
        ``fp8``)."""
        return tuple(self.kernel_name(n) for n in self.bf16_kernels())

    def bf16_kernels(self) -> tuple[str, ...]:
        """The BF16 kernels' names one call launches (the FP8 ones are their twins)."""
        return (C_FUSED,) if self.fused else (C_ASYNC, C_WAIT)

    def _fp8(self, fp8) -> bool:
        """``fp8`` of an argument method: the last ``load``'s choice when None."""
        return self.fp8 if fp8 is None else bool(fp8)

    def _side(self, fp8, partial):
        """The side whose kernels a launch runs: the partial-reduce one (``partial``), the
        FP8 one (``fp8``), or None (the BF16 module); None arguments: the last ``load``'s
        choice."""
        if (self.partial if partial is None else bool(partial)):
            return self.partial_side
        return self.fp8_side if self._fp8(fp8) else None

    def kernel_name(self, bf16_name: str, fp8: bool | None = None,
                    partial: bool | None = None) -> str:
        """The kernel a launch of ``bf16_name`` runs: itself, its FP8 twin with ``fp8``, or
        its partial-reduce twin with ``partial`` (None: the last ``load``'s choice)."""
        if (self.partial if partial is None else bool(partial)):
            return PartialCombine.wire_name(bf16_name)
        return Fp8Combine.wire_name(bf16_name) if self._fp8(fp8) else bf16_name

    def all_kernels(self) -> tuple:
        """Every loaded combine kernel (``ir.Kernel``: the BF16 module's, and the FP8
        module's once loaded), naming the records of the error buffers."""
        kernels = tuple(self.program.module.kernels)
        for side in (self.fp8_side, self.partial_side):
            if side is not None:
                kernels += tuple(side.program.module.kernels)
        return kernels

    def prepare_fp8(self) -> bool:
        """Make the FP8 side (``combine_fp8.Fp8Combine``) unless it exists; True when it was
        made now (``ShmemWorld`` then meets the other PEs before a kernel writes its
        buffers). ``ValueError`` naming ``hid_dim`` unless it is a multiple of 128."""
        with self.world.build_lock:         # rank threads may ask at once (RankWorld)
            if self.fp8_side is not None:
                return False
            self.fp8_side = Fp8Combine(self, GUARD_BYTES)
            return True

    def prepare_partial(self) -> bool:
        """Make the partial-reduce side (``combine_partial.PartialCombine``) unless it
        exists; True when it was made now. ``ValueError`` for a configuration it does not
        take (``kernels.combine_partial.check_config``)."""
        with self.world.build_lock:
            if self.partial_side is not None:
                return False
            self.partial_side = PartialCombine(self)
            return True

    def program_of(self, rk, fp8: bool | None = None, partial: bool | None = None):
        """The ``Program`` that launches rank ``rk``'s combine kernels (its GPU's; the FP8
        module's with ``fp8``, the partial-reduce one's with ``partial``; None: the last
        ``load``'s choice)."""
        side = self._side(fp8, partial)
        return (self.programs if side is None else side.programs).of(rk)

    # -- tables ------------------------------------------------------------------------------
    def table_ranks(self, rk) -> list[int]:
        """Whose buffer each entry of rank ``rk``'s tables addresses (class docstring): per
        source ``q``, ``q`` inside ``rk``'s P2P group and ``rk.rank`` outside it; under
        ``skip_a2a`` the one entry ``rk.rank``."""
        if self.world.cfg.skip_a2a:
            return [rk.rank]
        group = p2p_group(self.world.cfg, rk.rank)
        return [q if q in group else rk.rank for q in range(self.world.cfg.n_ranks)]

    def build_tables(self):
        """Every rank's ``recv_ptrs`` and ``arrival_ptrs`` (class docstring)."""
        w = self.world
        self.recv_ptrs, self.arrival_ptrs = [], []
        for i, rk in enumerate(w.ranks):
            whose = self.table_ranks(rk)
            self.recv_ptrs.append(w.pointer_table(i, whose, [b.recv for b in self.bufs]))
            self.arrival_ptrs.append(w.pointer_table(i, whose, [b.arrival for b in self.bufs]))

    def run(self, expert_outputs, topk_weights=None, residual=None, *, src_info=None,
            fp8: bool = False, partial_reduce: bool = False):
        """One combine of the world's last dispatch (module docstring of ``world.combine``):
        ``load``, ``enqueue``, then ``finish`` (synchronises and returns every rank's output).
        ``src_info``: test hook (``load``); ``fp8``: the FP8 combine, ``partial_reduce``: the
        partial-reduce combine (``load``)."""
        self.load(expert_outputs, topk_weights, residual, src_info=src_info, fp8=fp8,
                  partial_reduce=partial_reduce)
        self.enqueue()
        return self.finish()

    def load(self, expert_outputs, topk_weights=None, residual=None, *, src_info=None,
             fp8: bool = False, partial_reduce: bool = False):
        """Validate the host inputs and copy them into the combine buffers (rank streams).
        Sets what the next ``enqueue`` passes (weighted or not, residual or not, the BF16 or
        the FP8 kernels: ``fp8``, whose first use makes the FP8 side, ``prepare_fp8``).
        ``src_info``: test hook, per rank an array replacing that rank's ``src_info`` on the
        device (None entries: unchanged). ``partial_reduce``: the partial-reduce combine
        (``call_args.combine_partial_flag``: the weights are the last dispatch's), whose
        first use makes its side (``prepare_partial``)."""
        w = self.world
        fp8 = call_args.combine_fp8_flag(w.cfg, fp8)
        partial = call_args.combine_partial_flag(w.cfg, partial_reduce, topk_weights, fp8,
                                                 w.last_weights is not None)
        expert_outputs, topk_weights, residual = call_args.combine_inputs(
            w, expert_outputs, topk_weights, residual, reduced=partial)
        if fp8:
            self.prepare_fp8()
        if partial:
            self.prepare_partial()
        for i, (rk, b) in enumerate(zip(w.ranks, self.bufs)):
            if not rk.calling:
                continue
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
        self.weighted = topk_weights is not None or partial
        self.has_residual = residual is not None
        self.fp8 = fp8
        self.partial = partial

    def enqueue(self):
        """Enqueue every rank's ``ep_combine_async`` (after every rank's last dispatch_wait),
        then every rank's ``ep_combine_wait`` (after every rank's combine_async); or, fused,
        every rank's ``ep_combine`` (after every rank's last dispatch); no host
        synchronisation. Each rank's ``wait_done`` is the end of its last combine launch. With
        ``ep_rank_mask`` a rank that sat the dispatch out (``RankBuffers.calling`` false)
        launches nothing, and each rank's ``ep_combine_wait`` follows its own
        ``ep_combine_async`` only: the arrival words order the ranks (docs/combine.md, "World
        ordering"), and a rank that stops in its combine_async must not keep the others'
        waits from starting (and masking it)."""
        w, cfg = self.world, self.world.cfg
        if self.fused:
            done = [rk.wait_done for rk in w.ranks if rk.wait_done is not None]
            for i, rk in enumerate(w.ranks):
                if not rk.calling:
                    continue
                for ev in done:
                    rk.stream.wait(ev)
                self.program_of(rk).launch(self.kernel_name(C_FUSED), cfg.n_sms,
                                           self.fused_args(i), rk.stream)
                rk.wait_done = w.cuda.record_event(rk.stream)
            return
        self.enqueue_reduce(self.enqueue_send())

    def enqueue_send(self) -> list:
        """The split kernels' first half: every calling rank's ``ep_combine_async`` after
        every rank's last dispatch_wait (``enqueue``). Returns the events ``enqueue_reduce``
        orders the reduces after (none with ``ep_rank_mask``). The benchmark times each half
        on its own (``epgen.bench.combine``)."""
        w, cfg = self.world, self.world.cfg
        if self.fused:
            raise ValueError("enqueue_send: the fused combine is one kernel; use enqueue()")
        done = [rk.wait_done for rk in w.ranks if rk.wait_done is not None]
        events = []
        for i, rk in enumerate(w.ranks):
            if not rk.calling:
                continue
            for ev in done:
                rk.stream.wait(ev)
            self.program_of(rk).launch(self.kernel_name(C_ASYNC), cfg.n_sms, self.async_args(i),
                                       rk.stream)
            events.append(w.cuda.record_event(rk.stream))
        # ep_rank_mask: a rank that stops must not hold the others' waits back
        return [] if cfg.ep_rank_mask else events

    def enqueue_reduce(self, sends: list) -> None:
        """The second half: every calling rank's ``ep_combine_wait`` after the events
        ``sends`` (``enqueue_send``'s); each rank's ``wait_done`` becomes its end."""
        w, cfg = self.world, self.world.cfg
        for i, rk in enumerate(w.ranks):
            if not rk.calling:
                continue
            for ev in sends:
                rk.stream.wait(ev)
            self.program_of(rk).launch(self.kernel_name(C_WAIT), cfg.n_sms, self.wait_args(i),
                                       rk.stream)
            rk.wait_done = w.cuda.record_event(rk.stream)

    def async_args(self, i: int, fp8: bool | None = None, partial: bool | None = None) -> dict:
        """``ep_combine_async``'s launch arguments for rank index ``i`` (its FP8 twin's with
        ``fp8``: ``Fp8Combine.async_args``; its partial-reduce twin's with ``partial``:
        ``PartialCombine.async_args``; None: the last ``load``'s choice)."""
        w, side = self.world, self._side(fp8, partial)
        rk, b = w.ranks[i], self.bufs[i]
        args = {**w.trace_args(self.kernel_name(C_ASYNC, fp8, partial), rk),
                **w.mask_args(rk, waits=False),
                "expert_out": b.expert_out,
                "src_info": rk.src_info,
                "counters": rk.counters.ptr, "combine_buf_ptrs": self.recv_ptrs[i],
                "arrival_ptrs": self.arrival_ptrs[i], "my_rank": rk.rank,
                "err_buf": w.err_of(rk).ptr, "timeout_ns": w.timeout_ns}
        if side is not None:
            args.update(side.async_args(i))
        return args

    def wait_args(self, i: int, fp8: bool | None = None, partial: bool | None = None) -> dict:
        """``ep_combine_wait``'s launch arguments for rank index ``i`` (the last ``load``'s
        weighted / residual choice)."""
        w, side = self.world, self._side(fp8, partial)
        rk, b = w.ranks[i], self.bufs[i]
        args = {**w.trace_args(self.kernel_name(C_WAIT, fp8, partial), rk),
                **w.mask_args(rk, waits=True),
                "combine_buf": b.recv, "arrival": b.arrival,
                "topk_ids": rk.topk_ids,
                "weights": b.weights, "weighted": int(self.weighted),
                "residual": b.residual, "has_residual": int(self.has_residual),
                "out": b.out, "n_tokens": rk.n_tokens, "counters": rk.counters.ptr,
                "my_rank": rk.rank, "err_buf": w.err_of(rk).ptr, "timeout_ns": w.timeout_ns}
        if b.wait_time is not None:
            args["wait_time"] = b.wait_time
        if side is not None:
            args.update(side.wait_args(i))
        return args

    def fused_args(self, i: int, fp8: bool | None = None, partial: bool | None = None) -> dict:
        """``ep_combine``'s launch arguments for rank index ``i``: both halves', and under
        ``skip_a2a`` with the shared expert the devices' count (``allreduce_world_size``, as
        for ``ep_dispatch``)."""
        side = self._side(fp8, partial)
        name = self.kernel_name(C_FUSED, fp8, partial)
        args = {**self.async_args(i, fp8, partial), **self.wait_args(i, fp8, partial),
                **self.world.trace_args(name, self.world.ranks[i])}
        program = self.program if side is None else side.program
        names = {p.name for p in program.module.kernel(name).params}
        if "allreduce_world_size" in names:
            args["allreduce_world_size"] = self.world.allreduce_world_size
        return args

    def finish(self):
        """Synchronise the world, raise what the kernels reported (refused rows:
        ``EPInputError``; expired waits), and return every rank's output: ``[T, H]`` BF16
        bits when the last ``load`` had weights, else ``[T, K, H]`` (None for a rank that sat
        the call out). The ranks the kernels masked (``ep_rank_mask`` under shrink) are the
        world's ``last_masked``."""
        w, cfg = self.world, self.world.cfg
        K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
        w.synchronize()
        self._raise_bounds()
        try:
            masks = w.raise_timeouts(self.all_kernels(), "combine")
        except Exception:
            self._rearm()
            w.reset()
            raise
        w.note_masked(masks, "combine")
        out = []
        for rk, b in zip(w.ranks, self.bufs):
            if not rk.calling:
                out.append(None)
                continue
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
        for err in self.world.error_buffers():
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
