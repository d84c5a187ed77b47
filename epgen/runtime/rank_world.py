"""``RankWorld``: what every world of per-rank buffers is (``EmulatedWorld``: every rank on one
GPU; ``P2PWorld``: one GPU per rank, one process; ``ShmemWorld``: one process per rank), on
either backend, and the one placement interface they all provide.

A world holds some ranks of an EP group (``ranks``: each a ``RankBuffers``, its device
buffers and stream), loads the kernels on the GPUs those ranks run on, builds each rank's
pointer tables, and runs the round trip with the ordering between calls. What differs
between the worlds is the placement alone, and every part of it is a public, documented
member of ``RankWorld`` that the subclasses set or override:

- **where**: ``rank_ids`` and ``ranks`` (each rank's ``device`` and ``stream``),
  ``gpu_shares()`` (how many ranks' grids each GPU runs at once), ``memory_of(device)``
  (where the buffers peers write and SHMEM puts read come from);
- **programs**: ``load(module)`` (a ``placement.RankPrograms``: the module on every GPU of
  the world, lowered once per architecture), ``programs`` (the dispatch kernels'),
  ``program_of(rk)``, ``co_resident(module)``;
- **pointer tables**: ``pointer_table(i, peers, buffers)`` (entry ``j``: rank
  ``peers[j]``'s copy of a buffer as ``ranks[i]`` reaches it), ``register_symmetric``;
- **checks**: ``check_resident`` (the co-residency rule, ``placement.residency_problems``),
  ``err_of(rk)`` and ``error_buffers()`` (where expired waits are recorded),
  ``raise_timeouts`` (one ``EPTimeoutError`` from every error buffer);
- **launch arguments**: ``async_args``, ``wait_args``, ``trace_args`` and the rows of
  every rank, ``after_previous_call()`` (the ordering between calls).

The combine side (``runtime.combine.Combiner``), ``epgen.torch`` and the test-kernel runners
use only these members.

Ordering between calls (buffer reuse): a rank's ``dispatch_async`` of call N+1 writes into
every peer's receive buffers and count words, so it must not start before every rank's
``dispatch_wait`` of call N has drained them and re-armed the sentinels. The world enforces
this on the device: each rank's stream waits on the events recorded after every rank's
previous ``dispatch_wait`` (across GPUs too: ``cuStreamWaitEvent`` accepts another GPU's
event; across processes ``ShmemWorld`` adds a host barrier). Nothing else is needed between
calls: every counter the kernels use is re-armed by the kernels themselves.

Each rank's dispatch_wait is launched as a programmatic dependent launch (PDL) of its
dispatch_async, on the rank streams and inside a captured graph, where the device and
cuda-core allow it (``Program.programmatic_ok``: elsewhere a plain launch). dispatch_async
triggers implicitly (each block at its exit), so the wait's grid may start once every async
block has exited, before the async grid's completion is processed. The wait needs nothing
from that boundary: everything it reads from any rank's dispatch_async, its own included,
comes behind an acquire-polled count word or flag (the other ranks' asyncs are never ordered
before it by a kernel boundary either), so there is no ``griddepcontrol.wait``. Measured on
the H200 (docs/PERF.md's tuning table): decode round trip 3-5 us faster on streams, prefill
within noise, a graph replay unchanged.
"""

from __future__ import annotations

import abc
import threading

import numpy as np

from .. import interop, reference
from ..errors import EPInputError, EPTimeoutError
from ..kernels import trace
from ..kernels.dispatch_async import KERNEL_NAME as ASYNC
from ..kernels.dispatch_fused import KERNEL_NAME as FUSED
from ..kernels.dispatch_wait import KERNEL_NAME as WAIT
from . import backend as backends_of
from . import call_args
from . import trace as runtime_trace
from .combine import Combiner
from .diagnostics import DiagBuffer
from .graph import RoundTripGraph
from .placement import (CapacityError, RankPrograms, co_resident, ordinal, p2p_group,
                        residency_problems)
from .rank_buffers import RankBuffers
from .rank_masks import RankMasks
from .results import rank_result
from .token_major import TokenMajorReceiver
from .token_major_combine import TokenMajorCombine
from .world_args import check_mask_args


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
    if fused and cfg.ep_rank_mask:
        raise ValueError(f"{world}: fused=True with ep_rank_mask=True: the fused "
                         "single-launch kernels do not take the rank mask yet")
    return bool(fused)


class RankWorld(abc.ABC):
    """What every world shares and the placement interface it provides (module docstring).

    Attributes: ``cfg``, ``cuda`` (the backend: ``backends.cuda`` or a
    ``backends.sim.Machine``), ``world_name`` (for messages), ``fused``, ``timeout_ns``,
    ``input_scale``; ``rank_ids`` (each held rank's ``my_rank``) and ``ranks`` (their
    ``RankBuffers``, in that order); ``programs`` (``placement.RankPrograms`` of the
    dispatch module), ``program`` (the first GPU's) and ``device`` (its GPU); ``errs`` (the
    ``DiagBuffer`` of each GPU, by ordinal); ``recv_buf_ptrs``, ``recv_count_ptrs`` and
    ``final_ptrs`` (each rank's pointer tables, by ``my_rank``).

    A subclass's ``__init__`` calls ``_init_common``, sets ``rank_ids`` and whatever its
    ``gpu_shares`` and ``memory_of`` read, then ``_load_dispatch(module)`` and
    ``_allocate(devices)``."""

    #: every rank's grid in one launch (``EmulatedWorld(batched=True)``; one GPU only)
    batched = False

    def _init_common(self, cfg, fused, world: str, timeout_ns, input_scale,
                     backend="cuda", sim_seed=None, participants=None, n_gpus=1,
                     shmem_ok=False, shrink=False):
        """The constructor prologue every world shares: the ``fused`` rule, the transport
        check, the rank mask's (``shrink``), the backend (``runtime.backend.resolve``:
        ``cuda`` is ``backends.cuda`` or a ``backends.sim.Machine``), and ``world_name``,
        ``fused``, ``cfg``, ``cuda``, ``timeout_ns``, ``input_scale``."""
        check_mask_args(cfg, world, shrink, batched=self.batched)
        cuda = backends_of.resolve(backend, cfg, world, participants=participants,
                                   sim_seed=sim_seed, n_gpus=n_gpus)
        fused = resolve_fused(cfg, fused, world)
        if cfg.needs_shmem and not shmem_ok and not getattr(cuda, "RUNS_IR", False):
            raise ValueError(
                f"{world}: p2p_world_size={cfg.p2p_world_size} < n_ranks={cfg.n_ranks} "
                f"(use_shmem): destinations outside a P2P group are reached through NVSHMEM, "
                f"which needs one process per PE: use ShmemWorld on the cuda backend "
                f"(backend='sim' models every PE in one process)")
        self.world_name = world
        self.fused = fused
        self.cfg = cfg
        self.cuda = cuda
        self.timeout_ns = cfg.timeout_ns if timeout_ns is None else timeout_ns
        self.input_scale = input_scale
        self._combiner = None
        self._token_receiver = None
        self._token_combiner = None
        #: held while a part built on first use (the combiner and its FP8 and partial-reduce
        #: sides, the token-major receiver and combine) is made: one thread per rank (the
        #: DeepEP API's ``EmulatedGroup``, an engine's rank threads) may ask for it at once,
        #: and every rank must get the same buffers and pointer tables
        self.build_lock = threading.RLock()
        #: the last dispatch's ``topk_weights`` (``load_weights``; None: none given)
        self.last_weights = None
        self._shrink = shrink
        #: ``ep_rank_mask``: the world's rank masks (``rank_masks.RankMasks``), else None
        self.masks = None

    def _load_dispatch(self, module, arch: str | None = None):
        """Load the dispatch ``module`` on the world's GPUs (for ``arch``; default each
        GPU's own) into ``programs``, ``program`` and ``device``, and check that its grids
        fit (``check_resident``)."""
        self.programs = self.load(module, lambda device: arch or self.cuda.arch(device))
        self.program = self.programs.first
        self.device = self.program.device
        self.check_resident(self.programs, self.dispatch_kernels(), self.world_name)

    def _allocate(self, devices):
        """Every held rank's buffers on its GPU (``devices[i]`` for ``rank_ids[i]``), each
        GPU's error buffer, the pointer tables; then wait until every copy has landed."""
        self.ranks = [RankBuffers(self.cuda, self.cfg, r, d, **self.memory_of(d))
                      for r, d in zip(self.rank_ids, devices)]
        gpus = {ordinal(d): d for d in devices}
        self.errs = {o: DiagBuffer(d, cuda=self.cuda) for o, d in gpus.items()}
        self.build_pointer_tables()
        if self.cfg.ep_rank_mask:
            self.masks = RankMasks(self, self._shrink)
        self.synchronize()
        for d in gpus.values():          # the error buffers' default-stream copies
            self.cuda.get_device(d).sync()

    # -- placement: where --------------------------------------------------------------------------
    @abc.abstractmethod
    def gpu_shares(self) -> list:
        """One ``placement.GpuShare`` per GPU of the world: how many ranks' grids it runs at
        once (every world says; the first GPU is the first rank's)."""

    def memory_of(self, device) -> dict:
        """Where the buffers of a rank on ``device`` come from: ``peer_memory`` (those peers
        write) and ``send_memory`` (those SHMEM puts read), as keyword arguments of
        ``RankBuffers`` and ``combine.CombineBuffers``; empty: the device's default memory
        (one GPU, one process)."""
        return {}

    # -- placement: programs -------------------------------------------------------------------------
    def dispatch_kernels(self) -> tuple[str, ...]:
        """The dispatch kernels one call launches: the fused ``ep_dispatch``, or
        ``ep_dispatch_async`` and ``ep_dispatch_wait``."""
        return (FUSED,) if self.fused else (ASYNC, WAIT)

    def load(self, module, arch_of=None) -> RankPrograms:
        """``module`` loaded on every GPU of the world (``gpu_shares``), lowered once per
        architecture: ``arch_of(device)`` (default: the architecture of the dispatch
        programs on that GPU)."""
        if arch_of is None:
            arch_of = lambda device: self.programs[device].arch  # noqa: E731
        return RankPrograms(module, [s.device for s in self.gpu_shares()], self.cuda, arch_of)

    def program_of(self, rk):
        """The ``Program`` that launches rank ``rk``'s dispatch kernels (its GPU's)."""
        return self.programs.of(rk)

    def co_resident(self, module):
        """``module`` asking ptxas for enough resident blocks per SM for the grids of every
        GPU (``placement.co_resident`` of ``gpu_shares``)."""
        return co_resident(module, self.cfg, self.gpu_shares(), self.cuda.sm_count)

    def check_resident(self, programs, kernels, what: str, shmem: int = 0) -> None:
        """``CapacityError`` (its message starting with ``what``) unless every GPU holds all
        its ranks' grids of each kernel of ``kernels`` at once (``programs``: the
        ``RankPrograms`` they launch from; ``shmem``: dynamic shared-memory bytes per
        block)."""
        problems = residency_problems(
            self.cfg, self.gpu_shares(), kernels,
            lambda name, device: programs.blocks_per_sm(name, device, shmem),
            self.cuda.sm_count)
        if problems:
            raise CapacityError(f"{what}: " + "; ".join(problems))

    # -- placement: pointer tables -------------------------------------------------------------------
    def pointer_table(self, i: int, peers, buffers):
        """Rank ``ranks[i]``'s device table of a per-rank buffer (on its GPU): entry ``j`` is
        the address of rank ``peers[j]``'s copy as ``ranks[i]`` reaches it; ``buffers[k]`` is
        ``ranks[k]``'s copy. In one address space (one process holding every rank) that is
        the copy's own address. The copy is enqueued on the rank's stream: a builder's
        ``synchronize`` after its tables is what makes them safe for kernels on any other
        stream (a caller's torch stream does not wait for the default stream)."""
        ptrs = [buffers[self.rank_ids.index(q)].ptr for q in peers]
        return self.cuda.to_device(np.array(ptrs, np.uint64), device=self.ranks[i].device,
                                   stream=self.ranks[i].stream)

    def build_pointer_tables(self):
        """Every held rank's tables of its P2P group (``p2p_group``): receive buffers,
        receive-count words, and the ``ep_final_layout`` ones (grouped output, header array,
        output scales of a format with scales, prod buffer with ``ep_prod_reserve``); the
        symmetric buffers registered (``register_symmetric``); the rank masks' tables
        (``ep_rank_mask``, once made); then, for kernels built with trace points, every rank's
        trace buffers (``epgen.runtime.trace.allocate``)."""
        cfg = self.cfg
        self.recv_buf_ptrs, self.recv_count_ptrs, self.final_ptrs = {}, {}, {}
        for i, rk in enumerate(self.ranks):
            group = p2p_group(cfg, rk.rank)

            def table(attr, i=i, group=group):
                return self.pointer_table(i, group, [getattr(x, attr) for x in self.ranks])
            self.recv_buf_ptrs[rk.rank] = table("recv_buf")
            self.recv_count_ptrs[rk.rank] = table("recv_count")
            final = {}
            if cfg.ep_final_layout:
                final = {"out_ptrs": table("out_tokens"), "hdr_ptrs": table("hdr_buf")}
                if cfg.token_fmt.out_scales is not None:
                    final["scales_ptrs"] = table("out_scales")
                if cfg.ep_prod_reserve:
                    final["prod_ptrs"] = table("prod_buf")
            self.final_ptrs[rk.rank] = final
        for name in ("recv_buf", "recv_count"):
            self.register_symmetric(name, [getattr(rk, name) for rk in self.ranks])
        if self.masks is not None:       # the rank masks' tables of the peers' views
            self.masks.build_tables()
        runtime_trace.allocate(self)     # kernels built with trace points only

    def register_symmetric(self, name: str, buffers) -> None:
        """``use_shmem`` with destinations outside the P2P group, on the simulator: every
        rank is a PE, and a buffer the kernels address symmetrically is registered per PE
        (``buffers[k]``: ``ranks[k]``'s copy) under ``name`` with the machine's symmetric
        heap (``backends.sim.shmem``), so a put or signal to this rank's own address of it
        lands at the same offset of the target PE's. Elsewhere nothing."""
        if not self.cfg.needs_shmem or not getattr(self.cuda, "RUNS_IR", False):
            return
        heap = self.cuda.symmetric_heap()
        for rk, buf in zip(self.ranks, buffers):
            heap.register(rk.rank, name, buf.ptr, buf.nbytes)

    # -- placement: checks ---------------------------------------------------------------------------
    def err_of(self, rk) -> DiagBuffer:
        """The ``DiagBuffer`` rank ``rk``'s kernels report expired waits into (its GPU's)."""
        return self.errs[ordinal(rk.device)]

    def error_buffers(self) -> list:
        """Every error buffer of the world (one per GPU)."""
        return list(self.errs.values())

    def raise_timeouts(self, kernels, context: str) -> list:
        """After a synchronise: read every error buffer (``kernels`` name the records),
        re-arming each used one, and raise one ``EPTimeoutError`` holding all their records
        if any wait expired anywhere. Returns the mask records (``ir.diag.MaskRecord``:
        ``ep_rank_mask`` under shrink, a rank masked instead of a wait expiring) when none
        did."""
        records, masks, expired = [], [], False
        for err in self.error_buffers():
            got = err.take_report(kernels)
            expired |= got.expired
            records += got.timeouts
            masks += got.masks
        if expired:
            raise EPTimeoutError(records, context)
        return masks

    @property
    def allreduce_world_size(self) -> int | None:
        """The devices that split the shared expert's tokens under ``skip_a2a`` (the
        kernels' ``allreduce_world_size``); None without ``skip_a2a`` (every rank packs all
        its tokens: ``reference.se_slice``)."""
        return len(self.rank_ids) if self.cfg.skip_a2a else None

    # -- device-side steps ---------------------------------------------------------------------
    def load_inputs(self, tokens, topk_ids):
        """Validate and copy every rank's inputs to its buffers; nothing is copied when any
        input is invalid. Forgets the last dispatch's weights (``last_weights``:
        ``load_weights`` sets them after). Inputs: host numpy / ml_dtypes / torch CPU arrays, or device
        arrays (torch CUDA tensors, DLPack, ``__cuda_array_interface__``) whose strides are
        honoured (``epgen.interop``); device top-k ids are read back to the host for the
        checks (this API synchronises anyway)."""
        ranks = self.rank_ids if self.cfg.skip_a2a else None
        self.last_weights = None        # new inputs: the weights, if any, come after them
        tokens = reference.per_rank_list(tokens, "tokens")
        topk_ids = reference.per_rank_list(topk_ids, "topk_ids")
        tokens, topk_ids = self._sitting_out(tokens, topk_ids)
        if len(topk_ids) == len(self.ranks):
            topk_ids = [self._host_ids(rk, i) for rk, i in zip(self.ranks, topk_ids)]
        counts = reference.validate_inputs(self.cfg, tokens, topk_ids, ranks=ranks)
        for r, x in enumerate(tokens):      # every device input's layout, before any copy
            info = interop.describe(x, f"tokens[{r}]")
            if info.on_device:
                interop.device_rows(info)
        for rk, x, ids, T in zip(self.ranks, tokens, topk_ids, counts):
            if rk.calling:
                self._load_rank(rk, x, ids, T)

    def _sitting_out(self, tokens, topk_ids) -> tuple[list, list]:
        """``ep_rank_mask``: which held ranks take part in this call (``RankBuffers.calling``):
        not a ``dead`` one (``RankMasks``), nor one whose tokens and ids are both None (it
        makes no call: a rank that is down, or late); such a rank's inputs are not read or
        copied (they stand as empty arrays for the checks), its kernels not launched, its
        results None, and its previous call not waited for. Without the flag every rank
        calls (a None input is refused by the checks)."""
        if self.masks is None or len(tokens) != len(self.ranks) \
                or len(topk_ids) != len(self.ranks):
            return tokens, topk_ids
        fmt, K = self.cfg.token_fmt, self.cfg.token_fmt.top_k
        tokens, topk_ids = list(tokens), list(topk_ids)
        for i, rk in enumerate(self.ranks):
            absent = tokens[i] is None and topk_ids[i] is None
            rk.calling = not absent and rk.rank not in self.masks.dead
            if not rk.calling:
                rk.wait_done = None
                tokens[i] = np.zeros((0, fmt.hid_dim), np.uint16)
                topk_ids[i] = np.zeros((0, K), np.int32)
        return tokens, topk_ids

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

    # -- launch arguments --------------------------------------------------------------------------
    def _format_args(self, kernel: str, rk) -> dict:
        """Arguments of the launch parameters a token format declared (quant_ir.kernel_param):
        ``input_scale``, ``output_scales``, ``output_scales_rows``."""
        names = {p.name for p in self.program.module.kernel(kernel).params}
        args = {"input_scale": np.float32(self.input_scale), "output_scales": rk.out_scales,
                "output_scales_rows": self.cfg.layout.max_out_rows}
        return {k: v for k, v in args.items() if k in names}

    def trace_args(self, kernel: str, rk) -> dict:
        """``trace_buf`` when ``kernel`` was built with trace points (``epgen.kernels.trace``):
        rank ``rk``'s buffer of that kernel (``epgen.runtime.trace``); else nothing."""
        buf = rk.trace_bufs.get(kernel)      # allocated exactly for the traced kernels
        return {} if buf is None else {trace.PARAM: buf}

    def async_args(self, rk, kernel: str = ASYNC) -> dict:
        """The arguments of rank ``rk``'s send side (dispatch_async's parameters; those of
        the send half of ``kernel``)."""
        lay = self.cfg.layout
        return {**self._format_args(kernel, rk), **self.trace_args(kernel, rk),
                **self.mask_args(rk, waits=False),
                "input_tokens": rk.tokens, "topk_ids": rk.topk_ids, "n_tokens": rk.n_tokens,
                "send_buf_p": rk.send_buf, "recv_buf_ptrs": self.recv_buf_ptrs[rk.rank],
                "recv_count_ptrs": self.recv_count_ptrs[rk.rank],
                "counters": rk.counter_ptr(lay.dispatch_async_region), "my_rank": rk.rank,
                "err_buf": self.err_of(rk).ptr, "timeout_ns": self.timeout_ns,
                **self.dedup_args(rk, "topk_weights")}

    def dedup_args(self, rk, name: str) -> dict:
        """``ep_rank_dedup``: rank ``rk``'s ``topk_weights`` (the send side) or ``row_map``
        (the receive side) buffer as the argument ``name``; else nothing."""
        return {name: getattr(rk, name)} if self.cfg.ep_rank_dedup else {}

    def mask_args(self, rk, waits: bool) -> dict:
        """``ep_rank_mask``: rank ``rk``'s arguments of the mask parameters
        (``rank_masks.RankMasks.args``; ``waits``: a kernel that waits for other ranks);
        else nothing."""
        return {} if self.masks is None else self.masks.args(rk, waits)

    def wait_args(self, rk, kernel: str = WAIT) -> dict:
        """The arguments of rank ``rk``'s receive side (dispatch_wait's parameters; those of
        the receive half of ``kernel``)."""
        lay = self.cfg.layout
        return {**self._format_args(kernel, rk), **self.trace_args(kernel, rk),
                **self.mask_args(rk, waits=True),
                "recv_buf_p": rk.recv_buf, "recv_count_p": rk.recv_count,
                "atomic_counter": rk.counter_ptr(lay.dispatch_wait_region),
                "output_tokens": rk.out_tokens, "row_offsets": rk.row_offsets,
                "expert_ids": rk.expert_ids, "src_info": rk.src_info, "my_rank": rk.rank,
                "err_buf": self.err_of(rk).ptr, "timeout_ns": self.timeout_ns,
                **self.dedup_args(rk, "row_map"),
                **({"wait_time": rk.wait_time} if rk.wait_time is not None else {})}

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
            args = self.async_args(rk)
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
            args = self.wait_args(rk)
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
            args = {**self.async_args(rk, FUSED), **self.wait_args(rk, FUSED)}
            if any(p.name == "allreduce_world_size" for p in kernel.params):
                args["allreduce_world_size"] = self.allreduce_world_size
            rows.append(args)
        return rows

    # -- launches ----------------------------------------------------------------------------------
    def after_previous_call(self):
        """Every calling rank's stream waits for the end of every rank's previous call (its
        ``wait_done``; a rank that sat a call out has none): what a call's first launch
        needs (module docstring)."""
        for rk in self.calling_ranks():
            for ev in [r.wait_done for r in self.ranks if r.wait_done is not None]:
                rk.stream.wait(ev)

    def calling_ranks(self) -> list:
        """The held ranks that take part in the current call (``RankBuffers.calling``: every
        one, unless ``ep_rank_mask`` lets a rank sit out)."""
        return [rk for rk in self.ranks if rk.calling]

    def dispatch_async(self):
        """Enqueue every rank's dispatch_async (after every rank's previous dispatch_wait)."""
        self.after_previous_call()
        self._launch_ranks(ASYNC, self.async_rows(), first=True)

    def dispatch_wait(self):
        """Enqueue every rank's dispatch_wait (a programmatic dependent launch of its
        dispatch_async where possible)."""
        self._launch_ranks(WAIT, self.wait_rows(), last=True, programmatic=True)

    def dispatch_fused(self):
        """Enqueue every rank's fused ``ep_dispatch`` (after every rank's previous call)."""
        self.after_previous_call()
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
                if not rk.calling:
                    continue
                program = self.program_of(rk)
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
        """Wait until every held rank's stream has finished its work."""
        for rk in self.ranks:
            rk.stream.sync()

    def check(self, context: str = "dispatch", *, raise_masked: bool = False) -> list[int]:
        """Synchronise and raise ``EPTimeoutError`` if a wait expired (then re-arm). Returns
        the ranks the kernels masked in the call (``ep_rank_mask`` under shrink; sorted,
        empty otherwise); ``raise_masked``: raise an ``EPTimeoutError`` naming them instead
        (the world has masked them all the same)."""
        return self.check_with(None, context, raise_masked=raise_masked)

    def check_with(self, program, context: str, *, raise_masked: bool = False) -> list[int]:
        """``check`` after launches of another ``program`` (a test kernel's ``Program`` or
        ``RankPrograms``, or None) on this world's buffers and error buffers: its records
        are named by either program's kernels."""
        self.synchronize()
        kernels = tuple(self.program.module.kernels)
        if program is not None:
            kernels += tuple(program.module.kernels)
        if self._combiner is not None:
            kernels += self._combiner.all_kernels()
        if self._token_receiver is not None:
            kernels += self._token_receiver.kernels()
        if self._token_combiner is not None:
            kernels += self._token_combiner.kernels()
        try:
            masks = self.raise_timeouts(kernels, context)
        except Exception:
            self.reset()
            raise
        return self.note_masked(masks, context, raise_masked)

    def note_masked(self, records, context: str, raise_masked: bool = False) -> list[int]:
        """The mask records of a checked call (``raise_timeouts``) into the rank masks
        (``RankMasks.note``): returns the ranks masked, or with ``raise_masked`` raises an
        ``EPTimeoutError`` holding the records when there are some."""
        if self.masks is None:
            return []
        masked = self.masks.note(records)
        if masked and raise_masked:
            raise EPTimeoutError(records, f"{context} (ranks {masked} masked)")
        return masked

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
    def dispatch(self, tokens, topk_ids, input_scale: float | None = None, *,
                 topk_weights=None) -> list:
        """One dispatch round trip; returns a ``reference.RankResult`` per rank.
        ``input_scale`` (formats that use one) replaces ``self.input_scale`` from this call
        on. ``topk_weights`` (``ep_rank_dedup`` only; one ``[T, K]`` float32 array per rank):
        the router weights the messages carry, for a ``combine(partial_reduce=True)``
        (``load_weights``)."""
        if input_scale is not None:
            self.input_scale = input_scale
        weights = self.check_weights(topk_weights, topk_ids)
        self.load_inputs(tokens, topk_ids)
        self.load_weights(weights)
        self.enqueue_round_trip()
        self.check()
        return self.results()

    def check_weights(self, topk_weights, topk_ids) -> list | None:
        """The dispatch's ``topk_weights`` as float32 host arrays, one per rank (None: none
        given), checked before anything is copied: ``EPInputError`` unless the
        configuration has ``ep_rank_dedup`` (only its messages carry weights) and each
        rank's array is ``[T, K]`` with ``T`` its ``topk_ids``' rows."""
        if topk_weights is None:
            return None
        if not self.cfg.ep_rank_dedup:
            raise EPInputError("topk_weights: the dispatch carries router weights only with "
                               "ep_rank_dedup=True (the partial-reduce combine reads them); "
                               "pass them to combine instead")
        ws = reference.per_rank_list(topk_weights, "topk_weights")
        ids = reference.per_rank_list(topk_ids, "topk_ids")
        if len(ws) != len(ids):
            raise EPInputError(f"topk_weights: one array per rank ({len(ids)}), got {len(ws)}")
        K = self.cfg.token_fmt.top_k
        out = []
        for q, (w, i) in enumerate(zip(ws, ids)):
            if w is None and i is None:     # a rank sitting the call out (ep_rank_mask)
                out.append(np.zeros((0, K), np.float32))
                continue
            w = interop.host_float32(w, f"topk_weights[{q}]")
            T = int(tuple(i.shape)[0]) if hasattr(i, "shape") else len(i)
            if w.shape != (T, K):
                raise EPInputError(f"topk_weights[{q}]: must be [{T}, {K}] float32 (one row "
                                   f"per token of topk_ids[{q}]), got shape {w.shape}")
            out.append(np.ascontiguousarray(w, np.float32))
        return out

    def load_weights(self, weights) -> None:
        """``ep_rank_dedup``: every calling rank's weights buffer := its ``weights`` (from
        ``check_weights``), or zero when None; ``last_weights`` remembers them for the
        partial-reduce combine. Without the flag nothing (and ``weights`` is None)."""
        self.last_weights = weights
        if not self.cfg.ep_rank_dedup:
            return
        K = self.cfg.token_fmt.top_k
        for i, rk in enumerate(self.ranks):
            if not rk.calling or rk.n_tokens == 0:
                continue
            w = np.zeros((rk.n_tokens, K), np.float32) if weights is None else weights[i]
            rk.topk_weights[:rk.n_tokens].copy_from_host(w)

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
        """Every held rank's ``reference.RankResult`` of the last call (``results.rank_result``
        of its buffers; the caller has synchronised)."""
        region = self.cfg.layout.dispatch_wait_region
        return [None if not rk.calling else rank_result(
            self.cfg, rk.rank, n_tokens=rk.n_tokens, out_tokens=rk.out_tokens.to_host(),
            row_offsets=rk.row_offsets.to_host(), expert_ids=rk.expert_ids.to_host(),
            src_info=rk.src_info.to_host(), region_a=rk.counters.to_host()[region.offset:],
            out_scales=None if rk.out_scales is None else rk.out_scales.to_host(),
            allreduce_world_size=self.allreduce_world_size) for rk in self.ranks]

    # -- rank masks (ep_rank_mask) -------------------------------------------------------------
    def _masks(self, what: str):
        if self.masks is None:
            raise ValueError(f"{what}: the rank mask needs a configuration with "
                             f"ep_rank_mask=True (docs/flags.md)")
        return self.masks

    def update_mask(self, rank: int, masked: bool = True, *, on=None) -> None:
        """Mask (``masked``) or unmask ``rank`` in the views of the held ranks ``on`` (None:
        every held rank, and the world stops or resumes launching it: ``RankMasks.update``).
        Synchronises; unmasking re-arms the words the others read from ``rank`` once its
        own work has finished (docs/design.md, "Rank masks")."""
        self._masks("update_mask").update(rank, masked, on)

    def query_mask(self, rank: int | None = None):
        """``[n_ranks]`` int32, 1 where masked: held rank ``rank``'s view, or (None) every
        rank some launched rank masks and every rank the world no longer launches
        (``RankMasks.query``). Synchronises."""
        return self._masks("query_mask").query(rank)

    def clean_mask(self, *, on=None) -> None:
        """Unmask every rank in the views of the held ranks ``on`` (None: every held rank,
        and every rank the world stopped launching rejoins). Synchronises."""
        self._masks("clean_mask").clean(on)

    @property
    def shrink(self) -> bool:
        """``ep_rank_mask``'s shrink switch: a bounded wait for another rank that expires
        masks that rank (``check()`` returns it) instead of aborting the call. Settable
        (synchronises)."""
        return self._masks("shrink").shrink

    @shrink.setter
    def shrink(self, on: bool) -> None:
        self._masks("shrink").set_shrink(on)

    @property
    def last_masked(self) -> list[int]:
        """The ranks the kernels masked in the last checked call (dispatch's ``check`` or a
        combine), sorted; empty without ``ep_rank_mask``."""
        return [] if self.masks is None else list(self.masks.last)

    @property
    def masked_ranks(self) -> list[int]:
        """The ranks this world no longer launches (masked for every held rank, or by the
        kernels under shrink), sorted; empty without ``ep_rank_mask``."""
        return [] if self.masks is None else sorted(self.masks.dead)

    # -- the token-major receive (DeepEP's normal mode) --------------------------------------
    def token_receiver(self) -> TokenMajorReceiver:
        """The world's token-major receive (``runtime.token_major.TokenMajorReceiver``),
        built on first use; ``ValueError`` for a configuration it does not take."""
        with self.build_lock:
            if self._token_receiver is None:
                self._token_receiver = TokenMajorReceiver(self)
            return self._token_receiver

    def dispatch_tokens(self, tokens, topk_ids, pad_rows=0, topk_weights=None) -> list:
        """One dispatch received token-major (docs/deepep.md, "Normal mode"; an
        ``ep_rank_dedup`` configuration): ``ep_dispatch_async`` then
        ``ep_dispatch_wait_tokens`` on every rank. Returns a
        ``token_major.TokenMajorResult`` per rank: each token with an expert on the rank
        once, source-major, in token order. ``pad_rows``: rows up to which the rows past the
        received ones get ``-1`` ids (DeepEP's ``num_worst_tokens``). ``topk_weights`` (one
        ``[T, K]`` float32 array per rank, None: zeros) travel in the messages and come back
        per row (``0.0`` in the slots of other ranks' experts)."""
        return self.token_receiver().run(tokens, topk_ids, pad_rows, topk_weights)

    def token_combiner(self) -> TokenMajorCombine:
        """The world's normal-mode combine (``runtime.token_major_combine``), built on first
        use (with the combiner whose buffers it uses), the names built handed to
        ``sides_built`` (``"combine"``, ``"tokens"``); ``ValueError`` for a configuration it
        does not take."""
        with self.build_lock:
            built = [] if self._token_combiner is not None else \
                ["combine"] * (self._combiner is None) + ["tokens"]
            if self._token_combiner is None:
                self._token_combiner = TokenMajorCombine(self)
        self.sides_built(built)
        return self._token_combiner

    def combine_tokens(self, xs, topk_weights=None, bias=None) -> list:
        """The normal-mode combine of the last ``dispatch_tokens`` (docs/deepep.md, "Normal
        mode"): rank ``d`` returns its token-major rows ``xs[d]`` ``[N, H]`` BF16 (and
        ``topk_weights[d]`` ``[N, K]`` float32); each source token becomes the sum of the
        rows of the ranks that received it plus ``bias[s]`` (0 to 2 ``[T, H]`` BF16 arrays),
        rounded to BF16, and the sum of their weight rows. Returns per rank ``(x, w)``
        (``TokenMajorCombine.run``)."""
        return self.token_combiner().run(xs, topk_weights, bias)

    # -- combine -----------------------------------------------------------------------------
    def combiner(self) -> Combiner:
        """The world's combine side (``runtime.combine.Combiner``), built on first use."""
        with self.build_lock:
            if self._combiner is None:
                self._combiner = Combiner(self)
            return self._combiner

    def prepare_combine(self, fp8: bool = False, partial: bool = False) -> Combiner:
        """The combiner with its FP8 side (``fp8``) and partial-reduce side (``partial``),
        each built unless it exists; then ``sides_built`` of the names built now (``"combine"``,
        ``"fp8"``, ``"partial"``), in that order (``token_combiner`` reports ``"tokens"``). Every path that combines calls it (the
        world's ``combine``, ``epgen.torch.EPBuffer``), so a world whose peers write into
        these buffers from other processes meets them before any peer may write."""
        with self.build_lock:
            built = [] if self._combiner is not None else ["combine"]
            comb = self.combiner()
            if fp8 and comb.prepare_fp8():
                built.append("fp8")
            if partial and comb.prepare_partial():
                built.append("partial")
        self.sides_built(built)
        return comb

    def sides_built(self, names: list) -> None:
        """Called by ``prepare_combine`` with the combine sides it built now: nothing to do
        where every rank is in this process (their buffers were armed before this returns);
        ``ShmemWorld`` meets the other PEs."""

    def combiner_if_built(self) -> Combiner | None:
        """The world's combine side if a combine built it, else None."""
        return self._combiner

    def combine(self, expert_outputs, topk_weights=None, residual=None, *, fp8: bool = False,
                partial_reduce: bool = False, _src_info=None):
        """Combine the last ``dispatch`` (docs/combine.md): ``expert_outputs[d]``, rank
        ``d``'s expert output rows ``[rows, H]`` BF16 (one per row of its grouped output),
        go back to their sources' slots; returns per rank its ``[T, H]`` BF16 bits reduced
        with ``topk_weights[s]`` (``[T, K]`` float32), or with None the unreduced ``[T, K,
        H]``; ``residual[s]`` (``[T, H]`` BF16, with weights) is added before the rounding.
        An out-of-range ``src_info`` row is an ``EPInputError`` naming it (nothing written
        for it). With ``ep_rank_mask`` a rank whose expert outputs are None sits the combine
        out (its result None; under shrink the others mask it). ``fp8``: the FP8 combine
        (docs/combine.md, "FP8 combine": rows cross as E4M3 with a float32 scale per 128
        elements; ``hid_dim`` a multiple of 128). ``partial_reduce`` (``ep_rank_dedup``, after
        a dispatch given ``topk_weights``; no ``topk_weights`` here): each destination sums
        its local experts' weighted rows of a token and sends one row back (docs/combine.md,
        "Partial reduce"). ``_src_info``: test hook (``runtime.combine.Combiner.run``)."""
        call_args.combine_fp8_flag(self.cfg, fp8)
        call_args.combine_partial_flag(self.cfg, partial_reduce, topk_weights, fp8,
                                       self.last_weights is not None)
        self._combine_sitting_out(expert_outputs)
        call_args.check_combine(self, expert_outputs, topk_weights, residual,
                                reduced=partial_reduce)
        return self.combiner().run(expert_outputs, topk_weights, residual, src_info=_src_info,
                                   fp8=fp8, partial_reduce=partial_reduce)

    def _combine_sitting_out(self, expert_outputs) -> None:
        """``ep_rank_mask``: a rank whose expert outputs are None sits the combine out (not
        launched, its result None, its last call not waited for), as a rank that sat the
        dispatch out does (``_sitting_out``)."""
        if self.masks is None or not isinstance(expert_outputs, (list, tuple)) \
                or len(expert_outputs) != len(self.ranks):
            return
        for rk, y in zip(self.ranks, expert_outputs):
            if y is None and rk.calling:
                rk.calling = False
                rk.wait_done = None


__all__ = ["RankWorld", "resolve_fused"]
