"""``Buffer``: DeepEP's ``deep_ep.Buffer`` low-latency API on epgen's kernels, and the normal
mode's ``get_dispatch_layout``, ``dispatch`` and ``combine`` (``normal``; docs/deepep.md).

One ``Buffer`` is one rank's, as in DeepEP: built from a ``torch.distributed`` process group
(one process per GPU, ``ShmemWorld``: NVSHMEM, direct stores inside the P2P group and puts
outside it) or from a rank of an ``EmulatedGroup`` (every rank in this process, on one GPU
or on the CPU simulator). Each call's shape (``shapes.LowLatencyShape``) has its own pair of
epgen worlds, made on first use: the two result slots. Dispatches alternate between the
slots; a combine runs on its dispatch's slot.

The rules epgen states where DeepEP's differ (each enforced with an error naming the
argument):

- A dispatch's results (``recv_x``, ``recv_count``, the handle) are valid until its combine
  (read them before it, in stream order) or, for a dispatch that is never combined, until
  this rank's next dispatch. At most two results are outstanding: combining a handle whose
  slot a later dispatch reused raises, and so does combining one dispatch twice (epgen's
  protocol orders a combine after a dispatch, not after another combine).
- A combine's result (its own tensor, unless ``out`` is given) is valid until the next
  combine of the same slot.
- ``return_recv_hook``: the call enqueues the sending kernel; ``hook()`` enqueues the
  receiving one. A slot's next call waits for its hook: calling it is required.
- ``async_finish``: the kernels run on the caller's current stream (DeepEP uses its own
  communication stream); the event marks their end, for other streams.
- Shrink mode (``enable_shrink``, the mask calls) on a process group and on an
  ``EmulatedGroup`` on the simulator: the worlds have rank masks (``ep_rank_mask`` with
  shrink, docs/deepep.md "Shrink mode"); a rank's mask spans every world of its group
  (``emulated.MaskBook``; ``ShmemSource`` on a process group).
- The wait-cost statistics (``dispatch_wait_recv_cost_stats``,
  ``combine_wait_recv_cost_stats``, ``[num_ranks]`` int64) accumulate nanoseconds of
  ``%globaltimer`` per source rank (``Tuning.wait_times``, ``kernels.wait_time``) where
  DeepEP's accumulate ``clock64`` cycles: the dispatch's sum over this rank's local experts'
  count words, the combine's arrival word.
- Not available (refused with the reason): ``use_logfmt``, ``enable_shrink``
  on a GPU ``EmulatedGroup``, FP8 input to the normal mode, ``comm`` (an MPI communicator).
- ``num_nvl_bytes``, ``num_rdma_bytes``, ``num_qps_per_rank`` and ``allow_mnnvl`` are
  accepted and not used: epgen sizes its own buffers per shape
  (``get_low_latency_rdma_size_hint`` says how much), and ``ignored_arguments`` lists them.
  ``allow_nvlink_for_low_latency_mode=False`` (every peer by NVSHMEM puts) is refused for
  now: the put path does not take the final layout yet (``shmem_source``).
"""

from __future__ import annotations

from ..errors import EPInputError
from . import dispatch_layout, events, normal, shapes, views
from .config import Config
from .emulated import EmulatedRank
from .handle import LowLatencyHandle
from .shmem_source import ShmemSource


def _torch():
    try:
        import torch
    except ImportError as exc:     # pragma: no cover - depends on the machine
        raise ImportError("epgen.deepep needs PyTorch (pip install torch)") from exc
    return torch


class _EmulatedSource:
    """Where an ``EmulatedGroup`` rank's ports come from (``shrink``: the buffer's
    ``enable_shrink``)."""

    def __init__(self, member: EmulatedRank, shrink: bool = False):
        self.group, self.rank, self.size = member.group, member.rank(), member.size()
        self.on_cuda = not member.group.sim
        self.shrink = shrink

    def port(self, torch, shape, slot: int):
        return self.group.port(torch, shape, slot, self.rank, shrink=self.shrink)

    def normal_port(self, torch, shape, slot: int):
        """The port of the normal-mode world of ``shape`` (``normal.NormalShape``)."""
        return self.group.normal_port(torch, shape, slot, self.rank)

    def update_mask(self, q: int, masked: bool) -> None:
        """Shrink mode: this rank's mask of rank ``q`` (the group's ``MaskBook``)."""
        self.group.mask_book.update(self.rank, q, masked)

    def masked_ranks(self) -> set[int]:
        """Shrink mode: the ranks this rank masks (its calls' and its kernels')."""
        return self.group.mask_book.of(self.rank)

    def clean_mask(self) -> None:
        """Shrink mode: unmask every rank."""
        self.group.mask_book.clean(self.rank)

    def close(self) -> None:
        """The group owns the worlds."""


class _Outstanding:
    """One result slot's state: ``generation`` (dispatches so far), the port and shape of
    its last dispatch, whether that dispatch awaits its hook (``receiving``), was combined,
    or its combine awaits its hook (``combine_receiving``)."""

    def __init__(self):
        self.generation = 0
        self.port = self.shape = None
        self.receiving = False
        self.combined = False
        self.combine_receiving = False


class Buffer:
    """DeepEP's ``Buffer`` (low-latency mode) for one rank (module docstring). DeepEP's
    arguments first; epgen's own, keyword-only: ``n_sms`` and ``num_threads`` (the kernels'
    grid; default from the GPU), ``timeout_ns`` (the kernels' bounded waits),
    ``p2p_world_size`` (a process group's ranks that store into each other directly;
    ``shmem_source``)."""

    #: DeepEP's SM count of its normal-mode kernels (kept for ``set_num_sms``)
    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 n_sms: int | None = None, num_threads: int | None = None,
                 timeout_ns: int | None = None, p2p_world_size: int | None = None,
                 num_max_dispatch_tokens_per_rank: int | None = None):
        self.torch = _torch()
        if comm is not None:
            raise EPInputError("comm: an MPI communicator is not supported; pass a "
                               "torch.distributed process group")
        if enable_shrink and isinstance(group, EmulatedRank) and not group.group.sim:
            raise EPInputError("enable_shrink: rank masks (shrink mode) are available on a "
                               "process group and on an epgen.deepep.EmulatedGroup on the "
                               "simulator, not on a GPU EmulatedGroup (whose ranks' threads "
                               "would change a shared world's masks under each other's "
                               "calls); use EmulatedWorld or P2PWorld with ep_rank_mask there")
        if isinstance(group, EmulatedRank):
            self._source = _EmulatedSource(group, bool(enable_shrink))
        elif group is None:
            raise EPInputError("group: required (a torch.distributed process group, or a "
                               "rank of an epgen.deepep.EmulatedGroup)")
        else:
            self._source = ShmemSource(group, n_sms=n_sms, num_threads=num_threads,
                                       timeout_ns=timeout_ns,
                                       allow_nvlink=allow_nvlink_for_low_latency_mode,
                                       p2p_world_size=p2p_world_size,
                                       shrink=bool(enable_shrink))
        self.group = group
        self.rank, self.group_size = self._source.rank, self._source.size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        #: DeepEP arguments this buffer accepted and does not use (module docstring)
        self.ignored_arguments = {
            "num_nvl_bytes": num_nvl_bytes, "num_rdma_bytes": num_rdma_bytes,
            "num_qps_per_rank": num_qps_per_rank, "allow_mnnvl": allow_mnnvl}
        self.on_cuda = self._source.on_cuda
        self._slots = [_Outstanding(), _Outstanding()]
        self._next_slot = 0
        self._ports = set()
        #: the dispatch shapes checked so far, by their scalar arguments (``dispatch_shape``)
        self._shapes = {}
        self._destroyed = False
        #: get_dispatch_layout results captured into a CUDA graph, checked by check()
        self._layout_checks = []
        if num_max_dispatch_tokens_per_rank is not None:
            if isinstance(num_max_dispatch_tokens_per_rank, bool) \
                    or not isinstance(num_max_dispatch_tokens_per_rank, int) \
                    or num_max_dispatch_tokens_per_rank < 1:
                raise EPInputError(f"num_max_dispatch_tokens_per_rank: must be a positive "
                                   f"int, got {num_max_dispatch_tokens_per_rank!r}")
        #: the normal mode's calls (``normal.NormalMode``)
        self._normal = normal.NormalMode(self, num_max_dispatch_tokens_per_rank)

    # -- DeepEP's static helpers ---------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """epgen generates its kernels for the GPU it runs on (sm_90 and later)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's normal-mode SM count (even); the low-latency kernels take ``n_sms``."""
        if new_num_sms % 2:
            raise EPInputError(f"new_num_sms: {new_num_sms} must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> events.EventOverlap:
        """An event recorded now on the current CUDA stream."""
        torch = _torch()
        return events.record(torch, torch.cuda.is_available())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of peer-visible memory epgen allocates per rank for one BF16 shape, both
        result slots (``shapes.peer_bytes``): what a DeepEP caller sizes
        ``num_rdma_bytes`` with (epgen allocates it itself)."""
        shape = shapes.LowLatencyShape(num_ranks, num_experts,
                                       num_max_dispatch_tokens_per_rank, hidden, 1, "BF16")
        return 2 * shapes.peer_bytes(shape)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A normal-mode ``Config`` (its size hints are 0: ``config``)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A normal-mode ``Config`` (its size hints are 0: ``config``)."""
        return Config(Buffer.num_sms)

    def get_comm_stream(self):
        """epgen has no communication stream of its own: the current stream."""
        return self.torch.cuda.current_stream()

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise NotImplementedError("get_local_buffer_tensor: epgen's buffers are per shape "
                                  "and slot; there is no single raw buffer")

    # -- the checks every call shares ----------------------------------------------------------
    def _require_ll(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"{what}: the buffer was destroyed")
        if not self.low_latency_mode:
            raise EPInputError(f"{what}: needs low_latency_mode=True (the normal mode is not "
                               f"available yet)")

    def _finish_pending(self, slot: _Outstanding, what: str) -> None:
        if slot.receiving:
            raise RuntimeError(f"{what}: the previous call on this result slot returned a "
                               f"receive hook that was not called; call it first")
        if slot.combine_receiving:
            raise RuntimeError(f"{what}: the previous combine on this result slot returned a "
                               f"receive hook that was not called; call it first")

    # -- dispatch ------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send ``x`` ``[T, hidden]`` BF16 to the experts ``topk_idx`` ``[T, top_k]`` names
        (``-1``: no expert) and receive this rank's experts' tokens. Returns ``(recv_x,
        recv_count, handle, event, hook)`` as DeepEP does (``views``): ``recv_x`` ``[L,
        R * T_max, hidden]`` BF16, or with ``use_fp8`` the pair (``float8_e4m3fn``, scales
        ``[L, R*T_max, hidden/128]`` float32, or with ``use_ue8m0`` packed int32 ``[..,
        hidden/512]``; column-major last two dimensions); ``recv_count`` ``[L]`` int32;
        ``handle`` (``LowLatencyHandle``); ``event`` (``EventOverlap``, with
        ``async_finish``); ``hook`` (with ``return_recv_hook``, else None). Only the first
        ``recv_count[e]`` rows of expert ``e`` are valid."""
        torch = self.torch
        self._require_ll("low_latency_dispatch")
        shape = shapes.dispatch_shape(
            torch, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            n_ranks=self.group_size, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, on_cuda=self.on_cuda, known=self._shapes)
        if dispatch_wait_recv_cost_stats is not None:
            shapes.check_tensor(torch, dispatch_wait_recv_cost_stats,
                                "dispatch_wait_recv_cost_stats", dtypes=(torch.int64,),
                                shape=(self.group_size,), on_cuda=self.on_cuda,
                                device=x.device)
        L = shape.n_local_experts
        if cumulative_local_expert_recv_stats is not None:
            shapes.check_tensor(torch, cumulative_local_expert_recv_stats,
                                "cumulative_local_expert_recv_stats", dtypes=(torch.int32,),
                                shape=(L,), on_cuda=self.on_cuda, device=x.device)
        index = self._next_slot
        slot = self._slots[index]
        self._finish_pending(slot, "low_latency_dispatch")
        port = self._source.port(torch, shape, index)
        self._ports.add(port)
        port.dispatch(x, topk_idx, receive=not return_recv_hook)
        self._next_slot ^= 1
        slot.generation += 1
        slot.port, slot.shape, slot.combined = port, shape, False
        raw = port.raw
        recv_x, count, src_info, packed = _result_views(torch, port, shape,
                                                        use_fp8 and use_ue8m0)

        def after_receive():
            if packed is not None:
                packed.copy_(views.ue8m0_scales(torch, raw.scales, L, shape.rows_per_expert)
                             .transpose(1, 2))
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(count)
            if dispatch_wait_recv_cost_stats is not None:
                dispatch_wait_recv_cost_stats.add_(port.dispatch_wait_ns())
        handle = LowLatencyHandle(src_info,
                                  lambda: views.layout_range(torch, raw, shape), shape,
                                  owner=self, slot=index, generation=slot.generation)
        def receive_hook():
            if not slot.receiving or slot.generation != handle.generation:
                raise RuntimeError("hook: this dispatch was already received")
            slot.receiving = False
            port.receive()
            after_receive()
        if return_recv_hook:
            slot.receiving = True
        else:
            after_receive()
        hook = receive_hook if return_recv_hook else None
        event = events.record(torch, self.on_cuda, (x, topk_idx)) if async_finish \
            else events.EventOverlap()
        return recv_x, count, handle, event, hook

    # -- combine -------------------------------------------------------------------------------
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None,
                            combine_wait_recv_cost_stats=None, use_fp8: bool = False):
        """Send the experts' outputs ``x`` ``[L, R * T_max, hidden]`` BF16 (the dispatch's
        layout; with ``zero_copy`` the tensor ``get_next_low_latency_combine_buffer``
        gave, filled) back to their source tokens and reduce them there with
        ``topk_weights`` ``[T, top_k]`` float32 (a ``-1`` slot weighs nothing). Returns
        ``(combined_x [T, hidden] BF16, event, hook)``; with ``out`` the result is written
        into it. ``use_fp8`` (epgen's own extension, not DeepEP's): the FP8 combine, rows
        sent as E4M3 with a float32 scale per 128 elements and reduced in fp32 at the source
        (docs/deepep.md; every rank passes the same value; ``hidden`` a multiple of 128)."""
        torch = self.torch
        self._require_ll("low_latency_combine")
        if use_logfmt:
            raise EPInputError("use_logfmt: the LogFMT compressed combine is not available; "
                               "pass use_logfmt=False")
        slot = self._check_handle(handle)
        shape, port = slot.shape, slot.port
        L, RT, H, K = shape.n_local_experts, shape.rows_per_expert, shape.hidden, shape.top_k
        if not isinstance(use_fp8, bool):
            raise EPInputError(f"use_fp8: must be True or False, got {use_fp8!r}")
        if use_fp8 and H % shapes.FP8_GROUP:
            raise EPInputError(f"use_fp8: the FP8 combine needs hidden to be a multiple of "
                               f"{shapes.FP8_GROUP} (one float32 scale per {shapes.FP8_GROUP} "
                               f"elements), got hidden={H}")
        shapes.check_tensor(torch, x, "x", dtypes=(torch.bfloat16,), shape=(L, RT, H),
                            on_cuda=self.on_cuda)
        T = port.n_tokens
        shapes.check_tensor(torch, topk_idx, "topk_idx", dtypes=(torch.int64, torch.int32),
                            shape=(T, K), on_cuda=self.on_cuda, device=x.device,
                            contiguous=False)
        shapes.check_tensor(torch, topk_weights, "topk_weights", dtypes=(torch.float32,),
                            shape=(T, K), on_cuda=self.on_cuda, device=x.device,
                            contiguous=False)
        if out is not None:
            shapes.check_tensor(torch, out, "out", dtypes=(torch.bfloat16,), shape=(T, H),
                                on_cuda=self.on_cuda, device=x.device)
        stats = combine_wait_recv_cost_stats
        if stats is not None:
            shapes.check_tensor(torch, stats, "combine_wait_recv_cost_stats",
                                dtypes=(torch.int64,), shape=(self.group_size,),
                                on_cuda=self.on_cuda, device=x.device)
        rows = port.combine_input() if zero_copy else x.view(L * RT, H)
        result = port.combine(rows, topk_weights.contiguous(), out,
                              receive=not return_recv_hook, fp8=use_fp8)
        slot.combined = True
        if stats is not None and not return_recv_hook:
            stats.add_(port.combine_wait_ns())

        def receive_hook():
            if not slot.combine_receiving:
                raise RuntimeError("hook: this combine was already received")
            slot.combine_receiving = False
            port.combine_receive()
            if stats is not None:
                stats.add_(port.combine_wait_ns())
        slot.combine_receiving = return_recv_hook
        hook = receive_hook if return_recv_hook else None
        event = events.record(torch, self.on_cuda, (x, topk_idx, topk_weights)) \
            if async_finish else events.EventOverlap()
        return result, event, hook

    def _check_handle_owner(self, handle) -> int:
        """``handle``'s result slot index, after checking that it is this buffer's."""
        if not isinstance(handle, LowLatencyHandle):
            raise EPInputError(f"handle: must be the handle low_latency_dispatch returned, "
                               f"got {type(handle).__name__}")
        if handle.owner is not self:
            raise EPInputError("handle: from another buffer")
        return handle.slot

    def _check_handle(self, handle) -> _Outstanding:
        """The result slot of ``handle``, after checking that it is this buffer's, of the
        slot's last dispatch, received and not yet combined."""
        slot = self._slots[self._check_handle_owner(handle)]
        if slot.generation != handle.generation:
            raise EPInputError("handle: its result slot was reused by a later dispatch (at "
                               "most two dispatch results are outstanding: combine each "
                               "before the second dispatch after it)")
        if slot.receiving:
            raise EPInputError("handle: its dispatch was sent with return_recv_hook and the "
                               "hook was not called; call it first")
        if slot.combined:
            raise EPInputError("handle: already combined (epgen combines each dispatch once; "
                               "dispatch again to combine again)")
        self._finish_pending_combine(slot)
        return slot

    @staticmethod
    def _finish_pending_combine(slot: _Outstanding) -> None:
        if slot.combine_receiving:
            raise RuntimeError("low_latency_combine: the previous combine on this result "
                               "slot returned a receive hook that was not called")

    def get_next_low_latency_combine_buffer(self, handle):
        """The ``[L, R * T_max, hidden]`` BF16 tensor the next ``zero_copy`` combine of
        ``handle`` reads: fill it with the experts' outputs instead of passing them."""
        slot = self._check_handle(handle)
        s = slot.shape
        return slot.port.combine_input().view(s.n_local_experts, s.rows_per_expert, s.hidden)

    def epbuffer_of(self, handle):
        """epgen's own ``epgen.torch.EPBuffer`` of the world that served ``handle`` (a CUDA
        buffer): the same kernels and buffers, for comparisons (``epgen bench --api
        deepep``). Calling it changes that world's outputs under this buffer's results."""
        slot = self._slots[self._check_handle_owner(handle)]
        if not self.on_cuda:
            raise RuntimeError("epbuffer_of: the simulator's worlds have no EPBuffer")
        return slot.port.ep

    # -- upkeep --------------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: epgen's kernels re-arm every word they use at the end of each
        call, and a failed call's ``check()`` re-arms its world. The arguments are checked.
        In shrink mode on the simulator the ranks meet on every world this buffer used, and a
        rank that does not come is masked by the others, as DeepEP's clean-up barrier masks
        a rank that times out (on a GPU nothing is exchanged: such a rank is masked at the
        next dispatch, when the waits for it expire)."""
        self._require_ll("clean_low_latency_buffer")
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EPInputError(f"{name}: must be a positive int, got {v!r}")
        if self.enable_shrink:
            for port in self._ports_in_order():
                port.clean()

    def check(self) -> None:
        """epgen's own: synchronise and raise what the kernels of this rank recorded (bad
        top-k ids, naming rank, token and slot; expired waits) and the bad top-k ids of
        ``get_dispatch_layout`` calls captured into a CUDA graph, and the normal mode's
        checks that could not read the device at the call (``num_worst_tokens``, CUDA
        graphs: ``normal.NormalMode.check``)."""
        for port in list(self._ports):
            port.check()
        for res in self._layout_checks:
            res.raise_if_bad()
        self._normal.check()

    # -- shrink mode: the rank mask ------------------------------------------------------------
    def _require_shrink(self, what: str) -> None:
        self._require_ll(what)
        if not self.enable_shrink:
            raise EPInputError(f"{what}: needs a buffer built with enable_shrink=True (the "
                               f"mask buffer)")

    def _ports_in_order(self) -> list:
        """This buffer's ports, one per world, in the order of the worlds' shapes and slots
        (every rank's alike)."""
        key = lambda p: (repr(p.world.cfg), id(p.rv) if hasattr(p, "rv") else 0)  # noqa
        return sorted(self._ports, key=key)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Mask (``mask``) or unmask ``rank_to_mask``: this rank sends nothing to a masked
        rank, waits for nothing from it, and its tokens' slots on that rank's experts weigh
        nothing in combine (docs/deepep.md, "Shrink mode"). Applies from this rank's next call
        on, on every world (``emulated.MaskBook``; a process group's ``ShmemSource``)."""
        self._require_shrink("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) \
                or not 0 <= rank_to_mask < self.group_size:
            raise EPInputError(f"rank_to_mask: must be a rank in [0, {self.group_size}), got "
                               f"{rank_to_mask!r}")
        if not isinstance(mask, bool):
            raise EPInputError(f"mask: must be a bool, got {mask!r}")
        self._source.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """Write this rank's mask into ``mask_status`` (``[num_ranks]`` int32, 1 = masked):
        the ranks its calls masked and those its worlds' kernels masked when a wait for them
        expired (``emulated.MaskBook``; a process group's ``ShmemSource``, which
        synchronises)."""
        self._require_shrink("low_latency_query_mask_buffer")
        torch = self.torch
        shapes.check_tensor(torch, mask_status, "mask_status", dtypes=(torch.int32,),
                            shape=(self.group_size,), on_cuda=self.on_cuda)
        status = torch.zeros((self.group_size,), dtype=torch.int32)
        for q in self._source.masked_ranks():
            status[q] = 1
        mask_status.copy_(status.to(mask_status.device))

    def low_latency_clean_mask_buffer(self):
        """Unmask every rank in this rank's mask, from its next call on."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._source.clean_mask()

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's ``get_dispatch_layout``: ``(num_tokens_per_rank, None,
        num_tokens_per_expert, is_token_in_rank, event)`` of this rank's ``topk_idx``
        (``dispatch_layout``), computed on the caller's stream after ``previous_event``.
        A top-k id outside ``[-1, num_experts)`` raises ``EPInputError`` here (one host read
        of a count), or at ``check()`` when the call was captured into a CUDA graph."""
        torch = self.torch
        dispatch_layout.check_arguments(torch, topk_idx, num_experts, self.group_size,
                                        on_cuda=self.on_cuda)
        if previous_event is not None:
            previous_event.current_stream_wait()
        res = dispatch_layout.dispatch_layout(torch, topk_idx, num_experts, self.group_size)
        if self.on_cuda and torch.cuda.is_current_stream_capturing():
            self._layout_checks.append(res)
        else:
            res.raise_if_bad()
        event = events.record(torch, self.on_cuda, None) if async_finish else events.EventOverlap()
        return (res.num_tokens_per_rank, None, res.num_tokens_per_expert, res.is_token_in_rank,
                event)

    def source_for_normal_mode(self):
        """Where the normal mode's ports come from (its ``normal_port``): an
        ``EmulatedGroup`` rank's source or a process group's ``ShmemSource``;
        ``RuntimeError`` for a destroyed buffer."""
        if self._destroyed:
            raise RuntimeError("dispatch: the buffer was destroyed")
        return self._source

    def dispatch(self, x, handle=None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's normal-mode dispatch (docs/deepep.md, "Normal mode"; ``normal``): send
        ``x`` ``[T, hidden]`` BF16 once to each rank that holds one of its ``topk_idx``
        experts and receive this rank's tokens. Returns ``(recv_x, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``: ``recv_x``
        ``[N, hidden]`` (each received token once, grouped by source rank in rank order,
        in token order inside a source), ``recv_topk_idx`` ``[N, K]`` int64 local ids
        (``-1``: not this rank's), ``recv_topk_weights`` ``[N, K]`` float32 (the
        ``topk_weights`` ``[T, K]`` float32 given, ``0.0`` where the id is ``-1``; None
        without them), the per-local-expert counts aligned up to ``expert_alignment`` (empty with
        ``num_worst_tokens``), the handle (``normal.NormalHandle``) and the event. With
        ``num_worst_tokens`` the outputs have that many rows (the padding rows' ids ``-1``)
        and nothing is read on the host; without it ``N`` is read (one synchronisation, as
        DeepEP's). With ``handle`` (and no top-k) a cached dispatch re-sends ``x`` with the
        handle's routing (``topk_weights`` None): ``(recv_x, None, None, None, None,
        event)``. The results are
        valid until the second dispatch after this one. ``config`` and
        ``allocate_on_comm_stream`` are accepted and not used."""
        return self._normal.dispatch(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
            num_worst_tokens, previous_event, async_finish)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP's normal-mode combine (docs/deepep.md, "Normal mode"; ``normal``): ``x``
        ``[N, hidden]`` BF16, this rank's received rows (``dispatch``'s ``recv_x`` order, the
        local experts already weighted and reduced; rows past the received ones are not
        read), go back to their sources, where each token becomes the plain sum of the rows
        of the ranks that received it plus ``bias`` (None, one or two ``[T, hidden]`` BF16
        tensors), rounded to BF16. Returns ``(combined_x [T, hidden] BF16,
        combined_topk_weights, event)``: the sum of the ``topk_weights`` ``[N, K]`` float32
        rows likewise (None without them). The handle's latest dispatch (its own or a
        cached one with it) is combined, once; the result is valid until the next combine
        of the same result slot. ``config`` and ``allocate_on_comm_stream`` are accepted and
        not used."""
        return self._normal.combine(x, handle, topk_weights, bias, previous_event,
                                    async_finish)

    def destroy(self) -> None:
        """Release the buffer's worlds (``explicitly_destroy=True`` required, as in DeepEP);
        idempotent."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: the buffer was built without explicitly_destroy=True")
        if self._destroyed:
            return
        self._destroyed = True
        self._ports.clear()
        self._source.close()


_UE8M0 = "ue8m0_packed"
_VIEWS = "result_views"


def _result_views(torch, port, shape, ue8m0: bool):
    """``(recv_x, recv_count, src_info, packed)`` of ``port``'s results as DeepEP returns
    them (``views``; ``packed``: with ``ue8m0`` the tensor the hook fills with the packed
    UE8M0 scales, else None). Views of the port's own buffers, so made once per port and
    scale form and returned by every later dispatch on it."""
    key = (_VIEWS, ue8m0)
    got = port.extras.get(key)
    if got is None:
        raw = port.raw
        count = views.recv_count(raw, shape)
        packed = None
        if ue8m0:
            x_view, _ = views.recv_x(torch, raw, shape, use_ue8m0=False)
            packed = _ue8m0_holder(torch, port, shape)
            recv_x = (x_view, packed.transpose(1, 2))
        else:
            recv_x = views.recv_x(torch, raw, shape, use_ue8m0=False)
        got = port.extras[key] = (recv_x, count, views.src_info(raw, shape), packed)
    return got


def _ue8m0_holder(torch, port, shape):
    """The ``[L, P, R*T_max]`` int32 tensor that receives ``port``'s packed UE8M0 scales
    (one per port, made on first use)."""
    held = port.extras
    if _UE8M0 not in held:
        L, RT, G = shape.n_local_experts, shape.rows_per_expert, shape.hidden // shapes.FP8_GROUP
        held[_UE8M0] = torch.zeros((L, G // shapes.UE8M0_PACK, RT), dtype=torch.int32,
                                   device=port.raw.tokens.device)
    return held[_UE8M0]


__all__ = ["Buffer"]
