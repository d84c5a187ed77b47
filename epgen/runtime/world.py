"""``EmulatedWorld``: every rank of an EP group on one GPU, each with its own buffers and
stream, running the generated dispatch kernels.

``skip_a2a`` (the reference instantiates it per device): ``EmulatedWorld(cfg, devices=D)`` runs ``D`` independent
devices, each with ``my_rank`` = its device id, its own buffers and pointer tables that hold only
its own buffers (whatever ``n_ranks`` and ``p2p_world_size``); inputs are one per device, with
global top-k ids, and the results compare with ``reference.dispatch(cfg, tokens, topk_ids,
ranks=list(range(D)))``.

Ordering between calls (buffer reuse): a rank's ``dispatch_async`` of call N+1
writes into every peer's receive buffers and count words, so it must not start before every
rank's ``dispatch_wait`` of call N has drained them and re-armed the sentinels. The world
enforces this on the device: each rank's stream waits on the events recorded after every
rank's previous ``dispatch_wait``. Nothing else is needed between calls: every counter the
kernels use is re-armed by the kernels themselves.

``EmulatedWorld(cfg, fused=True)`` runs each round trip as the single fused launch
``ep_dispatch`` per rank (async and wait in one grid) with the same ordering: each rank's launch
of call N+1 waits on the events recorded after every rank's launch of call N. With
``cfg.fused_shared_expert`` the world always uses the fused kernel (the standalone kernels do
not take the shared expert) and refuses ``fused=False``.

``ep_final_layout`` (docs/final-layout.md): sources write each rank's grouped output and
header array directly, so the world allocates both per rank and passes every kernel the
tables of all ranks' pointers; the same event ordering also keeps a call's rows from being
overwritten by the next call before the host has read them. ``ep_prod_reserve``: every call
tags its early counts and mailboxes with a new generation, which the kernels keep in a word
of each rank's prod buffer and advance themselves (``layout.prod_gen_word_offset``), so the
prod buffers never need re-arming and the host passes nothing per call.

Everything but the placement (one GPU, one program, one error buffer, the co-residency of
all ranks' grids) lives in ``RankWorld``, which ``P2PWorld`` (``p2p_world.py``: one GPU per
rank) and ``ShmemWorld`` (``shmem_world.py``: one process per rank) share.
"""

from __future__ import annotations

import attrs
import numpy as np

import ir

from .. import interop, reference
from ..layout import EP_DATA_READY_FLAG
from ..kernels import build_module, trace
from ..kernels.dispatch_async import KERNEL_NAME as ASYNC
from ..kernels.dispatch_fused import KERNEL_NAME as FUSED
from ..kernels.dispatch_wait import KERNEL_NAME as WAIT
from . import backend as backends_of
from . import call_args
from . import trace as runtime_trace
from .combine import Combiner
from .diagnostics import DiagBuffer
from .graph import RoundTripGraph
from .program import Program
from .world_args import check_world_args


#: Each rank's dispatch_wait is launched as a programmatic dependent launch (PDL) of its
#: dispatch_async, on the rank streams and inside a captured graph, where the device and
#: cuda-core allow it (``Program.programmatic_ok``: elsewhere a plain launch). dispatch_async
#: triggers implicitly (each block at its exit), so the wait's grid may start once every
#: async block has exited, before the async grid's completion is processed. The wait needs
#: nothing from that boundary: everything it reads from any rank's dispatch_async, its own
#: included, comes behind an acquire-polled count word or flag (the other ranks' asyncs are
#: never ordered before it by a kernel boundary either), so there is no
#: ``griddepcontrol.wait``. Measured on the H200 (docs/PERF.md's tuning table): decode round
#: trip 3-5 us faster on streams, prefill within noise, a graph replay unchanged.


class CapacityError(ValueError):
    """The ranks' grids cannot all be resident on the GPU at once (their spin-waits could
    deadlock): the message names the parameters to change."""


def region_a_blocks(region_a, L: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """``(counts[L, R], block_starts[L, R])`` from dispatch_wait's Region A (pair ``w = e*R +
    src``: ``[2w] = 1024 + end row``, ``[2w+1] = count``): where each (expert, source) block
    landed, which in the capacity-strided layout is the reservation order."""
    a = np.asarray(region_a[:2 * L * R]).astype(np.int64)
    counts = a[1::2].reshape(L, R)
    return counts.astype(np.int32), a[0::2].reshape(L, R) - EP_DATA_READY_FLAG - counts


def co_resident(module, blocks: int, sms: int):
    """``module`` with every kernel asking ptxas for ``ceil(blocks / sms)`` resident blocks
    per SM (``.minnctapersm``; it caps registers accordingly) when one per SM cannot hold
    ``blocks``: all emulated ranks' grids must be resident at once on the one GPU."""
    per_sm = -(-blocks // sms)
    if per_sm <= 1:
        return module
    return ir.Module(module.name, tuple(attrs.evolve(k, min_blocks_per_sm=per_sm)
                                        for k in module.kernels))


def participants(cfg, devices: int | None) -> list[int]:
    """The ``my_rank`` of each emulated participant: ranks ``0 .. n_ranks-1``, or under
    ``skip_a2a`` devices ``0 .. devices-1`` (default ``n_ranks``: one device per rank's slice
    of the experts, 1 in the per-device form). ``devices`` without ``skip_a2a`` is a
    ``ValueError``."""
    if not cfg.skip_a2a:
        if devices is not None:
            raise ValueError(f"EmulatedWorld: devices={devices!r} applies only with skip_a2a "
                             f"(independent devices); without it the world emulates "
                             f"n_ranks={cfg.n_ranks} ranks")
        return list(range(cfg.n_ranks))
    n = cfg.n_ranks if devices is None else devices
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"EmulatedWorld: devices must be a positive integer (skip_a2a "
                         f"devices on this GPU), got {devices!r}")
    if n * cfg.layout.n_local_experts > 65536:
        raise ValueError(f"EmulatedWorld: devices={n} x n_local_experts="
                         f"{cfg.layout.n_local_experts} global expert ids must be < 65536 "
                         f"(top-k ids travel as uint16)")
    return list(range(n))


def p2p_group(cfg, r: int) -> range:
    """The ranks of rank ``r``'s P2P group (``p2p_world_size`` consecutive ranks): the order
    of the entries of ``r``'s pointer tables (entry ``q % p2p_world_size`` is rank ``q``).
    Under ``skip_a2a`` a device reaches only itself, whatever ``p2p_world_size``: ``[r]``."""
    if cfg.skip_a2a:
        return range(r, r + 1)
    P = cfg.p2p_world_size
    return range((r // P) * P, (r // P) * P + P)


def resolve_fused(cfg, fused: bool | None, world: str) -> bool:
    """Whether a world runs the fused single launch: ``fused`` (None: exactly when
    ``cfg.fused_shared_expert``), refused where the kernels cannot do it (``world`` names
    the world in the message)."""
    if fused is None:
        fused = bool(cfg.fused_shared_expert)
    if cfg.fused_shared_expert and not fused:
        raise ValueError(f"{world}: fused=False with fused_shared_expert=True: the "
                         "shared expert is packed only by the fused dispatch kernel "
                         "(as in the reference); use fused=True (the default for this config)")
    if fused and cfg.ep_final_layout:
        raise ValueError(f"{world}: fused=True with ep_final_layout=True: the fused "
                         "single-launch kernel does not take ep_final_layout yet")
    return bool(fused)


class _Rank:
    """Device buffers of one rank on ``device``. The buffers other ranks write (receive
    buffers and count words; with ep_final_layout the grouped output and its scales, the
    header array and the prod buffer) come from ``memory_resource`` when one is given (a
    pool the peers' GPUs can access, ``P2PWorld``), else from the device's default one."""

    def __init__(self, cuda, cfg, rank, device, memory_resource=None,
                 send_memory_resource=None):
        lay, fmt = cfg.layout, cfg.token_fmt
        H, K, T = fmt.hid_dim, fmt.top_k, cfg.max_tokens_per_rank
        self.rank = rank
        self.device = device
        self.stream = cuda.create_stream(device)
        z = lambda shape, dt: cuda.zeros(shape, dt, device=device, stream=self.stream)  # noqa: E731
        peer = {} if memory_resource is None else {"memory_resource": memory_resource}
        zp = lambda shape, dt: cuda.zeros(shape, dt, device=device, stream=self.stream,  # noqa: E731
                                          **peer)
        self.tokens = z((T, H), np.uint16)
        self.topk_ids = z((T, K), np.int32)
        # the send buffer is read by SHMEM puts (ShmemWorld: symmetric memory)
        self.send_buf = (z(lay.send_buf_bytes, np.uint8) if send_memory_resource is None else
                         cuda.zeros(lay.send_buf_bytes, np.uint8, device=device, stream=self.stream,
                                    memory_resource=send_memory_resource))
        self.recv_buf = zp(lay.recv_buf_bytes, np.uint8)
        self.recv_count = cuda.to_device(lay.recv_count_initial(), device=device, stream=self.stream,
                                         **peer)
        self.counters = z(lay.counter_words, np.int32)
        self.out_tokens = zp((lay.max_out_rows, *fmt.out_row_shape), fmt.host_dtype)
        self.out_scales = (zp(fmt.out_scales_shape(lay.max_out_rows), fmt.scales_host_dtype)
                           if fmt.out_scales is not None else None)
        self.row_offsets = z(lay.n_groups + 1, np.uint32)
        self.expert_ids = z(lay.n_groups, np.int32)
        self.src_info = z((lay.max_out_rows, 2), np.int32)
        self.hdr_buf = zp(lay.hdr_buf_bytes, np.uint8)           # ep_final_layout
        self.prod_buf = zp(lay.prod_buf_words, np.uint64)        # ep_prod_reserve
        self.n_tokens = 0
        self.wait_done = None
        self.trace_bufs = {}        # kernel name -> trace buffer (kernels built with tracing)

    def counter_ptr(self, region) -> int:
        return self.counters.ptr + 4 * region.offset


class RankWorld:
    """What every world of per-rank buffers shares (``EmulatedWorld``, ``P2PWorld``): the
    pointer tables of each rank's P2P group, input loading, the launches of one round trip
    with the ordering between calls, the timeout check, re-arming and the results.

    A subclass's ``__init__`` sets ``cfg``, ``rank_ids`` (each participant's ``my_rank``),
    ``cuda``, ``fused``, ``timeout_ns``,
    ``input_scale``, ``program`` (a ``Program`` of the world's IR module), ``ranks``
    (``_Rank``), then calls ``_build_pointer_tables()`` (which allocates the trace buffers
    too). The hooks
    ``_program_of(rk)``, ``_err_of(rk)`` and ``_raise_timeouts(context)`` say which program
    launches a rank's kernels, which error buffer they report into, and how expired waits
    are collected; the defaults are those of one GPU (``program``, ``err``)."""

    #: every rank's grid in one launch (``EmulatedWorld(batched=True)``; one GPU only)
    batched = False

    def _init_common(self, cfg, fused, world: str, timeout_ns, input_scale,
                     backend="cuda", sim_seed=None, participants=None, n_gpus=1,
                     shmem_ok=False):
        """The constructor prologue every world shares: the ``fused`` rule, the transport
        check, the backend (``runtime.backend.resolve``: ``cuda`` is ``backends.cuda`` or a
        ``backends.sim.Machine``), and ``fused``, ``cfg``, ``cuda``, ``timeout_ns``,
        ``input_scale``."""
        cuda = backends_of.resolve(backend, cfg, world, participants=participants,
                                   sim_seed=sim_seed, n_gpus=n_gpus)
        fused = resolve_fused(cfg, fused, world)
        if cfg.needs_shmem and not shmem_ok and not getattr(cuda, "RUNS_IR", False):
            raise ValueError(
                f"{world}: p2p_world_size={cfg.p2p_world_size} < n_ranks={cfg.n_ranks} "
                f"(use_shmem): destinations outside a P2P group are reached through NVSHMEM, "
                f"which needs one process per PE: use ShmemWorld on the cuda backend "
                f"(backend='sim' models every PE in one process)")
        self.fused = fused
        self.cfg = cfg
        self.cuda = cuda
        self.timeout_ns = cfg.timeout_ns if timeout_ns is None else timeout_ns
        self.input_scale = input_scale

    # -- hooks -----------------------------------------------------------------------------------
    def _program_of(self, rk):
        """The ``Program`` that launches rank ``rk``'s kernels."""
        return self.program

    def _err_of(self, rk):
        """The ``DiagBuffer`` rank ``rk``'s kernels report expired waits into."""
        return self.err

    def _raise_timeouts(self, context: str):
        """After a synchronise: raise ``EPTimeoutError`` if any wait expired (re-arming)."""
        self.err.check(self.program.module.kernels, context)

    # -- pointer tables ------------------------------------------------------------------------
    def _pointer_table(self, r: int, attr: str):
        """Rank ``r``'s device table of the address of buffer ``attr`` on every rank of its
        P2P group (``p2p_group``), on rank ``r``'s device."""
        ptrs = [getattr(self.ranks[q], attr).ptr for q in p2p_group(self.cfg, r)]
        return self.cuda.to_device(np.array(ptrs, np.uint64), device=self.ranks[r].device)

    def _build_pointer_tables(self):
        """Every rank's tables: receive buffers, receive-count words, and the
        ``ep_final_layout`` ones (``_final_layout_tables``); then, for kernels built with trace
        points, every rank's trace buffers (``epgen.runtime.trace.allocate``)."""
        # under skip_a2a a device's group is itself, so its tables hold only its own buffers
        # (the host passes only local pointers)
        ids = self.rank_ids
        self.recv_buf_ptrs = [self._pointer_table(r, "recv_buf") for r in ids]
        self.recv_count_ptrs = [self._pointer_table(r, "recv_count") for r in ids]
        self.final_ptrs = {r: self._final_layout_tables(r) for r in ids}
        self._register_symmetric()
        runtime_trace.allocate(self)     # kernels built with trace points only

    def _register_symmetric(self):
        """``use_shmem`` with destinations outside the P2P group, on the simulator: every
        rank is a PE, and the buffers the kernels address symmetrically (the receive buffer
        and the receive-count words) are registered per PE with the machine's symmetric
        heap (``backends.sim.shmem``), so a put to this rank's own address of a buffer lands
        at the same offset of the target PE's."""
        if not self.cfg.needs_shmem or not getattr(self.cuda, "RUNS_IR", False):
            return
        heap = self.cuda.symmetric_heap()
        for r, rk in zip(self.rank_ids, self.ranks):
            for name in ("recv_buf", "recv_count"):
                buf = getattr(rk, name)
                heap.register(r, name, buf.ptr, buf.nbytes)

    def _final_layout_tables(self, r: int) -> dict:
        """``ep_final_layout`` pointer tables of rank ``r``: every P2P peer's grouped output,
        header array, output scales (a format with scales) and prod buffer (with
        ``ep_prod_reserve``)."""
        cfg = self.cfg
        if not cfg.ep_final_layout:
            return {}
        out = {"out_ptrs": self._pointer_table(r, "out_tokens"),
               "hdr_ptrs": self._pointer_table(r, "hdr_buf")}
        if cfg.token_fmt.out_scales is not None:
            out["scales_ptrs"] = self._pointer_table(r, "out_scales")
        if cfg.ep_prod_reserve:
            out["prod_ptrs"] = self._pointer_table(r, "prod_buf")
        return out

    # -- device-side steps ---------------------------------------------------------------------
    def load_inputs(self, tokens, topk_ids):
        """Validate and copy every rank's inputs to its buffers; nothing is copied when any
        input is invalid. Inputs: host numpy / ml_dtypes / torch CPU arrays, or device
        arrays (torch CUDA tensors, DLPack, ``__cuda_array_interface__``) whose strides are
        honoured (``epgen.interop``); device top-k ids are read back to the host for the
        checks (this API synchronises anyway)."""
        ranks = self.rank_ids if self.cfg.skip_a2a else None
        tokens = reference._as_list(tokens, "tokens")
        topk_ids = reference._as_list(topk_ids, "topk_ids")
        if len(topk_ids) == len(self.ranks):
            topk_ids = [self._host_ids(rk, i) for rk, i in zip(self.ranks, topk_ids)]
        counts = reference.validate_inputs(self.cfg, tokens, topk_ids, ranks=ranks)
        for r, x in enumerate(tokens):      # every device input's layout, before any copy
            info = interop.describe(x, f"tokens[{r}]")
            if info.on_device:
                interop.device_rows(info)
        for rk, x, ids, T in zip(self.ranks, tokens, topk_ids, counts):
            self._load_rank(rk, x, ids, T)

    @staticmethod
    def _host_ids(rk, ids):
        """Device top-k ids as a host array (read on ``rk``'s stream); host ids unchanged."""
        info = interop.describe(ids, f"topk_ids[{rk.rank}]")
        return interop.read_to_host(info, rk.stream) if info.on_device else ids

    def _load_rank(self, rk, x, ids, T: int):
        """Copy one rank's validated inputs (``T`` tokens) to its buffers; device tokens
        as ``interop.device_rows`` lays them out, after their producer."""
        rk.n_tokens = T
        if T == 0:
            return
        info = interop.describe(x, f"tokens[{rk.rank}]")
        if info.on_device:
            ptr, pitch, row_bytes, n_rows = interop.device_rows(info)
            interop.order_after_producer(info, rk.stream)
            if n_rows == 1:
                rk.tokens[:T].copy_from(ptr)
            else:
                rk.tokens[:T].copy_rows_from(ptr, pitch, row_bytes, n_rows)
        else:
            host = interop.host_array(info.obj, info.name)
            rk.tokens[:T].copy_from_host(np.ascontiguousarray(self.cfg.token_fmt.as_host_tokens(host)))
        rk.topk_ids[:T].copy_from_host(np.ascontiguousarray(interop.host_array(ids, "topk_ids"),
                                                            np.int32))

    @property
    def input_scale(self) -> float:
        """The global input scale of formats that use one (NVFP4's ``input_scale`` launch
        argument of dispatch_async; the reference's ``input_scales_wrapper``); a finite
        float32 > 0, default 1.0."""
        return self._input_scale

    @input_scale.setter
    def input_scale(self, value):
        self._input_scale = call_args.input_scale(value)

    def _format_args(self, kernel: str, rk) -> dict:
        """Arguments of the launch parameters a token format declared (quant_ir.kernel_param):
        ``input_scale``, ``output_scales``, ``output_scales_rows``."""
        names = {p.name for p in self.program.module.kernel(kernel).params}
        args = {"input_scale": np.float32(self.input_scale), "output_scales": rk.out_scales,
                "output_scales_rows": self.cfg.layout.max_out_rows}
        return {k: v for k, v in args.items() if k in names}

    def _trace_args(self, kernel: str, rk) -> dict:
        """``trace_buf`` when ``kernel`` was built with trace points (``epgen.kernels.trace``):
        rank ``rk``'s buffer of that kernel (``epgen.runtime.trace``)."""
        buf = rk.trace_bufs.get(kernel)      # allocated exactly for the traced kernels
        return {} if buf is None else {trace.PARAM: buf}

    def _async_args(self, rk, kernel: str = ASYNC) -> dict:
        """The arguments of rank ``rk``'s send side (dispatch_async's parameters)."""
        lay = self.cfg.layout
        return {**self._format_args(kernel, rk), **self._trace_args(kernel, rk),
                "input_tokens": rk.tokens, "topk_ids": rk.topk_ids, "n_tokens": rk.n_tokens,
                "send_buf_p": rk.send_buf, "recv_buf_ptrs": self.recv_buf_ptrs[rk.rank],
                "recv_count_ptrs": self.recv_count_ptrs[rk.rank],
                "counters": rk.counter_ptr(lay.dispatch_async_region), "my_rank": rk.rank,
                "err_buf": self._err_of(rk).ptr, "timeout_ns": self.timeout_ns}

    def _wait_args(self, rk, kernel: str = WAIT) -> dict:
        """The arguments of rank ``rk``'s receive side (dispatch_wait's parameters)."""
        lay = self.cfg.layout
        return {**self._format_args(kernel, rk), **self._trace_args(kernel, rk),
                "recv_buf_p": rk.recv_buf, "recv_count_p": rk.recv_count,
                "atomic_counter": rk.counter_ptr(lay.dispatch_wait_region),
                "output_tokens": rk.out_tokens, "row_offsets": rk.row_offsets,
                "expert_ids": rk.expert_ids, "src_info": rk.src_info, "my_rank": rk.rank,
                "err_buf": self._err_of(rk).ptr, "timeout_ns": self.timeout_ns}

    def _gen_word(self, rk) -> int:
        """Rank ``rk``'s generation word (``ep_prod_reserve``)."""
        return rk.prod_buf.ptr + 8 * self.cfg.layout.prod_gen_word_offset

    def prod_generations(self) -> list[int]:
        """Each rank's generation word (``ep_prod_reserve``): the tag of its last call, 0
        before the first. Synchronises; for tests and debugging."""
        self.synchronize()
        off = self.cfg.layout.prod_gen_word_offset
        return [int(rk.prod_buf.to_host()[off]) & 0xFFFFFFFF for rk in self.ranks]

    def set_prod_generations(self, value: int) -> None:
        """Set every rank's generation word to ``value`` (between calls; a test of the
        32-bit wrap starts near it). Synchronises."""
        self.synchronize()
        off = self.cfg.layout.prod_gen_word_offset
        for rk in self.ranks:
            words = rk.prod_buf.to_host()
            words[off] = value
            rk.prod_buf.copy_from_host(words)
        self.synchronize()

    def async_rows(self) -> list[dict]:
        """Every rank's dispatch_async arguments by parameter name (the same every call)."""
        lay = self.cfg.layout
        rows = []
        for rk in self.ranks:
            args = self._async_args(rk)
            args.update(self.final_ptrs[rk.rank])
            if self.cfg.ep_prod_reserve:
                args.update(prod_gen_p=rk.prod_buf.ptr + 8 * lay.prod_mailbox_offset,
                            prod_gen_word=self._gen_word(rk))
            elif self.cfg.ep_final_layout:
                args.update(base_handoff_p=rk.counter_ptr(lay.final_layout_region))
            rows.append(args)
        return rows

    def wait_rows(self) -> list[dict]:
        """Every rank's dispatch_wait arguments by parameter name."""
        rows = []
        for rk in self.ranks:
            args = self._wait_args(rk)
            if self.cfg.ep_final_layout:
                args["hdr_p"] = rk.hdr_buf
            if self.cfg.ep_prod_reserve:
                args["prod_gen_word"] = self._gen_word(rk)
            rows.append(args)
        return rows

    def fused_rows(self) -> list[dict]:
        """Every rank's fused ``ep_dispatch`` arguments by parameter name."""
        kernel = self.program.module.kernel(FUSED)
        rows = []
        for rk in self.ranks:
            args = {**self._async_args(rk, FUSED), **self._wait_args(rk, FUSED)}
            if any(p.name == "allreduce_world_size" for p in kernel.params):
                args["allreduce_world_size"] = len(self.rank_ids)
            rows.append(args)
        return rows

    def _after_previous_call(self):
        for rk in self.ranks:
            for ev in [r.wait_done for r in self.ranks if r.wait_done is not None]:
                rk.stream.wait(ev)

    def dispatch_async(self):
        """Enqueue every rank's dispatch_async (after every rank's previous dispatch_wait)."""
        self._after_previous_call()
        self._launch_ranks(ASYNC, self.async_rows(), first=True)

    def dispatch_wait(self):
        """Enqueue every rank's dispatch_wait (a programmatic dependent launch of its
        dispatch_async where possible)."""
        self._launch_ranks(WAIT, self.wait_rows(), last=True, programmatic=True)

    def dispatch_fused(self):
        """Enqueue every rank's fused ``ep_dispatch`` (after every rank's previous call)."""
        self._after_previous_call()
        self._launch_ranks(FUSED, self.fused_rows(), first=True, last=True)

    def _launch_ranks(self, kernel: str, rows: list, *, first: bool = False,
                      last: bool = False, programmatic: bool = False):
        """Every rank's launch of ``kernel`` (``rows[i]``: the arguments of ``ranks[i]``):
        one per rank on its own stream, ``last`` recording each rank's ``wait_done``. A
        ``batched`` world makes one launch of every rank's blocks (``Program.launch_ranks``)
        on the first rank's stream: ``first``, after every rank stream's work so far (its
        inputs); ``last``, with every other rank stream waiting for it and ``wait_done`` the
        event after it. ``programmatic``: where the program can (``programmatic_ok``)."""
        if not self.batched:
            for rk, args in zip(self.ranks, rows):
                program = self._program_of(rk)
                program.launch(kernel, self.cfg.n_sms, args, rk.stream,
                               programmatic=programmatic and program.programmatic_ok)
                if last:
                    rk.wait_done = self.cuda.record_event(rk.stream)
            return
        lead = self.ranks[0].stream
        if first:
            for rk in self.ranks[1:]:
                lead.wait(self.cuda.record_event(rk.stream))
        self.program.launch_ranks(kernel, self.cfg.n_sms, rows, lead,
                                  programmatic=programmatic and self.program.programmatic_ok)
        if last:
            done = self.cuda.record_event(lead)
            for rk in self.ranks:
                if rk.stream is not lead:
                    rk.stream.wait(done)
                rk.wait_done = done

    def enqueue_round_trip(self):
        """Enqueue one round trip on every rank's stream: the fused single launch, or
        dispatch_async then dispatch_wait (no host synchronisation)."""
        if self.fused:
            self.dispatch_fused()
        else:
            self.dispatch_async()
            self.dispatch_wait()

    def capture_round_trip(self, calls: int = 1, stream=None):
        """A ``RoundTripGraph`` of ``calls`` round trips of every rank (``graph.py``): the
        launches ``enqueue_round_trip`` makes, recorded once and replayed by
        ``graph.launch()`` with one ``cuGraphLaunch``."""
        return RoundTripGraph(self, calls, stream)

    def synchronize(self):
        for rk in self.ranks:
            rk.stream.sync()

    def check(self, context: str = "dispatch"):
        """Synchronise and raise ``EPTimeoutError`` if a wait expired (then re-arm)."""
        self.synchronize()
        try:
            self._raise_timeouts(context)
        except Exception:
            self.reset()
            raise

    def check_with(self, program, context: str):
        """``check`` for a test kernel of another ``program`` launched on this world's buffers
        (one GPU, the world's error buffer): its records are named by either program's
        kernels."""
        self.synchronize()
        try:
            self.err.check(tuple(self.program.module.kernels) + tuple(program.module.kernels),
                           context)
        except Exception:
            self.reset()
            raise

    def reset(self):
        """Re-arm every buffer a failed call may have left half-used; the prod buffers
        (``ep_prod_reserve``) are zeroed, so every rank's generation starts again from 0
        (a failed call may have advanced some ranks' and not others')."""
        lay = self.cfg.layout
        for rk in self.ranks:
            rk.recv_count.copy_from_host(lay.recv_count_initial())
            rk.counters.zero()
            if self.cfg.ep_prod_reserve:
                rk.prod_buf.zero()
            rk.wait_done = None
        self.synchronize()

    # -- the public round trip ---------------------------------------------------------------
    def dispatch(self, tokens, topk_ids, input_scale: float | None = None) -> list:
        """One dispatch round trip; returns a ``reference.RankResult`` per rank.
        ``input_scale`` (formats that use one) replaces ``self.input_scale`` from this call
        on."""
        if input_scale is not None:
            self.input_scale = input_scale
        self.load_inputs(tokens, topk_ids)
        self.enqueue_round_trip()
        self.check()
        return self.results()

    def dispatch_replayed(self, tokens, topk_ids, graph=None) -> tuple:
        """``dispatch`` as a replay of ``graph`` (a ``RoundTripGraph`` of this world; None:
        captured now, after the inputs are loaded): returns ``(graph, results)``, the graph
        to pass to the next call (same token counts; see ``RoundTripGraph``)."""
        self.load_inputs(tokens, topk_ids)
        if graph is None:
            graph = self.capture_round_trip()
        graph.launch()
        self.check()
        return graph, self.results()

    def results(self) -> list:
        cfg, lay = self.cfg, self.cfg.layout
        L, R = lay.n_local_experts, cfg.n_ranks
        out = []
        for rk in self.ranks:
            row_offsets = rk.row_offsets.to_host()
            n = int(row_offsets[-1])
            ctr = rk.counters.to_host()
            region_a = ctr[lay.dispatch_wait_region.offset:][:2 * L * R]
            counts, starts = region_a_blocks(region_a, L, R)
            se_start, se_tokens = 0, 0
            if cfg.fused_shared_expert:
                se_start, se_tokens = reference.se_slice(
                    rk.n_tokens, rk.rank, len(self.rank_ids) if cfg.skip_a2a else None)
            scales = None if rk.out_scales is None else \
                cfg.token_fmt.scales_from_device(rk.out_scales.to_host(), n)
            out.append(reference.RankResult.from_outputs(
                cfg, rk.rank, rk.out_tokens.to_host()[:n], row_offsets,
                rk.expert_ids.to_host(), rk.src_info.to_host()[:n], counts,
                se_tokens=se_tokens, se_token_start=se_start, out_scales=scales,
                block_starts=starts if cfg.ep_final_layout else None))
        return out


class EmulatedWorld(RankWorld):
    """All ``cfg.n_ranks`` ranks on one GPU (under ``skip_a2a``: ``devices`` independent
    devices, see the module docstring). ``dispatch(tokens, topk_ids)`` runs one round
    trip (dispatch_async then dispatch_wait on every rank, or the fused ``ep_dispatch`` with
    ``fused=True``; default: fused exactly when ``cfg.fused_shared_expert``) and returns, per
    rank, the same ``reference.RankResult`` structure as ``epgen.reference.dispatch`` (with
    the output scales of the quantising formats; compare against ``reference.dispatch(...,
    input_scale=world.input_scale)``).

    ``batched=True`` launches every rank's grid of a kernel as one grid (``ir.batch_ranks``:
    each rank's arguments travel by value in one table; ``Program.launch_ranks``) on the
    first rank's stream, instead of one launch per rank stream. On one GPU the eight launches
    of a call start their blocks one after another, about 1.5 us apart on the H200 (measured
    with the trace points), a delay that ranks on their own GPUs do not have; one launch starts every
    rank's blocks together.

    ``backend="sim"`` runs the same kernels' IR on the CPU (``backends.sim``; ``sim_seed``
    fixes the simulator's interleaving, default 0), with the same results; a configuration
    too large to simulate is refused with a ``ValueError`` (``runtime.backend.sim_work``).
    ``backend`` may also be a ``backends.sim.Machine``."""

    def __init__(self, cfg, arch: str | None = None, device=None, timeout_ns: int | None = None,
                 fused: bool | None = None, input_scale: float = 1.0,
                 devices: int | None = None, batched: bool = False, backend="cuda",
                 sim_seed: int | None = None):
        check_world_args("EmulatedWorld", timeout_ns=timeout_ns, device=device)
        self.rank_ids = participants(cfg, devices)
        self._init_common(cfg, fused, "EmulatedWorld", timeout_ns, input_scale, backend,
                          sim_seed, participants=len(self.rank_ids))
        if not isinstance(batched, bool):
            raise ValueError(f"EmulatedWorld: batched must be a bool, got {batched!r}")
        self.batched = batched
        cuda = self.cuda
        module = co_resident(build_module(cfg), len(self.rank_ids) * cfg.n_sms,
                             cuda.sm_count(device))
        if batched:
            module = ir.batch_ranks(module, len(self.rank_ids), cfg.n_sms)
        self.program = Program(module, arch=arch, device=device, backend=cuda)
        self.device = self.program.device
        self._check_capacity()
        self.ranks = [_Rank(cuda, cfg, r, self.device) for r in self.rank_ids]
        self.err = DiagBuffer(self.device, cuda=cuda)
        self._build_pointer_tables()
        self.synchronize()

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_outputs, topk_weights=None, residual=None, *, _src_info=None):
        """Combine the last ``dispatch`` (docs/combine.md): ``expert_outputs[d]``, rank
        ``d``'s expert output rows ``[rows, H]`` BF16 (one per row of its grouped output),
        go back to their sources' slots; returns per rank its ``[T, H]`` BF16 bits reduced
        with ``topk_weights[s]`` (``[T, K]`` float32), or with None the unreduced ``[T, K,
        H]``; ``residual[s]`` (``[T, H]`` BF16, with weights) is added before the rounding.
        BF16 over P2P only (``ValueError`` otherwise). An
        out-of-range ``src_info`` row is an ``EPInputError`` naming it (nothing written for
        it). ``_src_info``: test hook (``runtime.combine.Combiner.run``)."""
        call_args.check_combine(self, expert_outputs, topk_weights, residual)
        return self.combiner().run(expert_outputs, topk_weights, residual, src_info=_src_info)

    def combiner(self):
        """The world's combine side (``runtime.combine.Combiner``), built on first use."""
        if getattr(self, "_combiner", None) is None:
            self._combiner = Combiner(self, co_resident)
        return self._combiner

    def capture_moe(self, calls: int = 1, stream=None, *, weighted: bool = True,
                    residual: bool = False) -> RoundTripGraph:
        """A ``RoundTripGraph`` of ``calls`` dispatch + combine round trips of every rank
        (``graph.py``; docs/combine.md "CUDA graphs"): per call the launches of
        ``enqueue_round_trip`` then those of ``Combiner.enqueue``, in one graph. ``weighted``
        / ``residual``: the combine's launch arguments frozen into it (each replay's
        ``graph.combiner.load`` must make the same choice). ``ValueError`` for a
        configuration combine does not take (``runtime.combine.check_supported``)."""
        if not isinstance(weighted, bool) or not isinstance(residual, bool):
            raise ValueError(f"capture_moe: weighted and residual must be bools, got "
                             f"{weighted!r}, {residual!r}")
        if residual and not weighted:
            raise ValueError("capture_moe: residual=True needs weighted=True (the unreduced "
                             "rows take no residual)")
        comb = self.combiner()
        comb.weighted, comb.has_residual = weighted, residual
        return RoundTripGraph(self, calls, stream, combiner=comb)

    # -- capacity ----------------------------------------------------------------------------
    def _check_capacity(self):
        cfg = self.cfg
        sms = self.cuda.sm_count(self.device)
        for name in ((FUSED,) if self.fused else (ASYNC, WAIT)):
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
