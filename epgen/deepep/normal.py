"""DeepEP's normal-mode ``Buffer.dispatch`` and ``Buffer.combine`` on the deduplicated
transport (docs/deepep.md, "Normal mode").

A call's shape (``NormalShape``: ranks, experts, the buffer's worst-case tokens per rank,
hidden, top-k) names one ``EPConfig`` with ``ep_rank_dedup`` and BF16 tokens. Each shape has
two worlds, one per result slot, made on first use by the ``EmulatedGroup``; dispatches
alternate between them, so a result is valid until the second dispatch after it (the same
rule as the low-latency mode; the alternation is also what orders a rank's send after every
rank's receive two calls before on the same world: the receive between them waits for every
rank's count words, which each rank publishes only after its own previous receive).

A call sends with ``ep_dispatch_async`` unchanged and receives with
``ep_dispatch_wait_tokens`` (``kernels.dispatch_tokens``): each token with an expert on the
rank once, source-major. Two kinds of port reach a world, as for the low-latency calls
(``ports``): ``NormalSimPort`` (the CPU simulator; every rank's call meets at a
``Rendezvous`` and the last runs ``world.dispatch_tokens``) and ``NormalDevicePort`` (a GPU
world; ``EPBuffer.send`` then the prepared receive launch on the caller's stream).

A combine runs on the world of its handle's latest dispatch: ``ep_combine_async_tokens``
then ``ep_combine_wait_partial`` (``runtime.token_major_combine``; on the simulator as a
``"combine"`` step of the same ``Rendezvous``, on a GPU as two prepared launches made with
the port), then, with weights, their reduce (torch on the caller's stream).
"""

from __future__ import annotations

import attrs
import numpy as np

from backends import sim as sim_backend

from ..config import EPConfig
from ..errors import EPInputError
from ..formats import make_format
from ..kernels.dispatch_tokens import KERNEL_NAME, TokensLayout
from ..runtime import token_major_combine
from ..runtime.world import EmulatedWorld
from ..torch import tensors
from ..torch.buffer import EPBuffer
from . import dispatch_layout, events
from .ports import Rendezvous
from .shapes import check_tensor, kernel_grid


@attrs.frozen
class NormalShape:
    """One normal-mode configuration: ``n_ranks``, ``num_experts``, ``max_tokens`` (the
    buffer's ``num_max_dispatch_tokens_per_rank``), ``hidden``, ``top_k``."""

    n_ranks: int
    num_experts: int
    max_tokens: int
    hidden: int
    top_k: int

    @property
    def n_local_experts(self) -> int:
        return self.num_experts // self.n_ranks

    @property
    def rows(self) -> int:
        """``R * max_tokens``: the receive rows (every source's every token)."""
        return self.n_ranks * self.max_tokens

    def grid(self, n_sms: int | None, num_threads: int | None, sim: bool) -> tuple[int, int]:
        """``(n_sms, num_threads)``: ``shapes.kernel_grid``'s, with ``num_threads`` default
        at least 64 on the simulator and 512 on a GPU."""
        return kernel_grid(self.num_experts, self.n_local_experts, n_sms, num_threads,
                           min_threads=64 if sim else 512)

    def config(self, n_sms: int, num_threads: int) -> EPConfig:
        """The ``EPConfig`` of this shape: ``ep_rank_dedup``, BF16, one P2P group."""
        return EPConfig(num_threads=num_threads, n_sms=n_sms, n_experts=self.num_experts,
                        n_ranks=self.n_ranks, max_tokens_per_rank=self.max_tokens,
                        p2p_world_size=self.n_ranks, use_shmem=False, ep_rank_dedup=True,
                        token_fmt=make_format("BF16", self.hidden, self.top_k))


@attrs.frozen
class NormalOutputs:
    """A port's receive buffers as torch tensors: ``x`` ``[rows, H]`` BF16, ``topk``
    ``[rows, K]`` int64, ``weights`` ``[rows, K]`` float32, ``src`` ``[rows, 2]`` int32,
    ``meta`` int32 (``TokensLayout``)."""

    x: object
    topk: object
    weights: object
    src: object
    meta: object


class NormalSimPort:
    """Rank ``rank`` of the simulator world ``world`` (module docstring), meeting the other
    ranks at ``rendezvous``; its outputs are CPU tensors filled after each step."""

    on_cuda = False

    def __init__(self, torch, world, rank: int, rendezvous: Rendezvous):
        self.torch, self.world, self.rank, self.rv = torch, world, rank, rendezvous
        tl, fmt = TokensLayout(world.cfg), world.cfg.token_fmt
        self.layout = tl
        self.out = NormalOutputs(
            x=torch.zeros((tl.rows, fmt.hid_dim), dtype=torch.bfloat16),
            topk=torch.zeros((tl.rows, fmt.top_k), dtype=torch.int64),
            weights=torch.zeros((tl.rows, fmt.top_k), dtype=torch.float32),
            src=torch.zeros((tl.rows, 2), dtype=torch.int32),
            meta=torch.zeros((tl.meta_words,), dtype=torch.int32))

    def send(self, x, topk_idx, pad_rows: int, topk_weights=None) -> None:
        """This rank's dispatch of ``x`` / ``topk_idx`` / ``topk_weights`` (None: zeros)
        (received by the step that the last rank's call runs; waits for it)."""
        bits = x.view(self.torch.int16).numpy().view(np.uint16).copy()
        ids = topk_idx.to(self.torch.int32).numpy().copy()
        w = None if topk_weights is None else topk_weights.numpy().astype(np.float32)
        step = self.rv.arrive(self.rank, "tokens", (bits, ids, int(pad_rows), w))
        self.rv.wait(self.rank, step, "dispatch")

    def fill(self, bufs) -> None:
        """Copy this rank's token-major buffers (``token_major.TokenMajorBuffers``) into its
        tensors (after a step)."""
        np.copyto(self.out.x.view(self.torch.int16).numpy(),
                  bufs.out_x.to_host().view(np.int16))
        np.copyto(self.out.topk.numpy(), bufs.out_topk.to_host())
        np.copyto(self.out.weights.numpy(), bufs.out_weights.to_host())
        np.copyto(self.out.src.numpy(), bufs.out_src.to_host())
        np.copyto(self.out.meta.numpy(), bufs.meta.to_host())

    def combine(self, x, topk_weights, residual, n_tokens: int):
        """This rank's combine of its token-major rows ``x`` (``topk_weights``: None or its
        rows' weights; ``residual``: None or the one BF16 bias ``[T, H]``), run by the step
        of the last rank's call. Returns ``(combined_x [T, H] BF16, combined weights [T, K]
        float32 or None)`` (CPU tensors of their own)."""
        torch = self.torch
        bits = x.view(torch.int16).numpy().view(np.uint16).copy()
        w = None if topk_weights is None else topk_weights.numpy().astype(np.float32)
        res = () if residual is None else (residual.view(torch.int16).numpy()
                                           .view(np.uint16).copy(),)
        step = self.rv.arrive(self.rank, "combine", (bits, w, res))
        self.rv.wait(self.rank, step, "combine")
        cx, cw = self.combined
        out_x = torch.from_numpy(cx.view(np.int16).copy()).view(torch.bfloat16)
        return out_x, None if topk_weights is None else torch.from_numpy(cw.copy())

    def check(self) -> None:
        """Nothing to check: the simulator raised at the call."""


def run_tokens_step(world, ports, op: str, payloads) -> None:
    """One simulator step (``Rendezvous.run``): every rank's ``(tokens, ids, pad_rows,
    weights)`` dispatched and received token-major (``world.dispatch_tokens``), each port
    filled; or (``op == "combine"``) every rank's ``(rows, weights, bias)`` combined
    (``world.combine_tokens``; weights of the ranks that gave none count as zeros), each
    port's ``combined`` set."""
    if op == "combine" and all(p is not None for p in payloads):
        ws = [p[1] for p in payloads]
        if all(w is None for w in ws):
            ws = None
        else:
            ws = [np.zeros((len(p[0]), world.cfg.token_fmt.top_k), np.float32)
                  if w is None else w for p, w in zip(payloads, ws)]
        out = world.combine_tokens([p[0] for p in payloads], ws, [p[2] for p in payloads])
        for port, res in zip(ports, out):
            port.combined = res
        return
    if op != "tokens" or any(p is None for p in payloads):
        raise RuntimeError(f"normal mode: unexpected step {op!r} (every rank must make the "
                           f"same calls)")
    weights = [p[3] for p in payloads]
    world.dispatch_tokens([p[0] for p in payloads], [p[1] for p in payloads],
                          pad_rows=[p[2] for p in payloads],
                          topk_weights=None if all(w is None for w in weights) else
                          [np.zeros(p[1].shape, np.float32) if w is None else w
                           for p, w in zip(payloads, weights)])
    for port, bufs in zip(ports, world.token_receiver().bufs):
        port.fill(bufs)


class NormalDevicePort:
    """Rank ``rank`` of the GPU world ``world`` (module docstring): the send through
    ``EPBuffer(world, rank=rank).send``, the receive as one prepared launch of
    ``ep_dispatch_wait_tokens`` (``receiver``: the world's ``TokenMajorReceiver``), both on
    the caller's current stream; the outputs view the receiver's buffers."""

    on_cuda = True

    def __init__(self, torch, world, rank: int, receiver):
        self.torch, self.world, self.rank = torch, world, rank
        self.ep = EPBuffer(world, rank=rank)
        i = [rk.rank for rk in world.ranks].index(rank)
        rk, b = world.ranks[i], receiver.bufs[i]
        self.launch = receiver.programs.of(rk).prepare(KERNEL_NAME, world.cfg.n_sms,
                                                       receiver.args(i, 0))
        self.layout = receiver.layout
        self.world_index = i
        tc = world.token_combiner()          # made with the port: never inside a capture
        prog = tc.programs.of(rk)
        self.combine_launches = (
            prog.prepare(token_major_combine.KERNEL_NAME, world.cfg.n_sms, tc.async_args(i)),
            prog.prepare(token_major_combine.WAIT_NAME, world.cfg.n_sms, tc.wait_args(i)))
        self.out = NormalOutputs(x=tensors.view(torch, b.out_x, dtype="bfloat16"),
                                 topk=tensors.view(torch, b.out_topk),
                                 weights=tensors.view(torch, b.out_weights),
                                 src=tensors.view(torch, b.out_src),
                                 meta=tensors.view(torch, b.meta))
        self.device = self.ep.device

    def send(self, x, topk_idx, pad_rows: int, topk_weights=None) -> None:
        """Enqueue this rank's dispatch of ``x`` / ``topk_idx`` / ``topk_weights`` (None:
        zeros) on the current stream: the id check and ``dispatch_async``, then the
        token-major receive."""
        self.ep.send(x, topk_idx, topk_weights)
        self.launch.set("pad_rows", int(pad_rows))
        self.launch.launch(int(self.torch.cuda.current_stream(self.device).cuda_stream))

    def combine(self, x, topk_weights, residual, n_tokens: int):
        """Enqueue this rank's combine on the current stream: ``ep_combine_async_tokens``
        of its rows ``x`` (``topk_weights``: their weights or None), then
        ``ep_combine_wait_partial`` with ``residual`` (the one BF16 bias or None) into the
        Combiner's output; then, with weights, their reduce over the lead slots
        (``token_major_combine.reduce_weights``, torch on the stream). Returns ``(combined_x
        [T, H] BF16, combined weights or None)``, views of the world's buffers (the weights
        a tensor of their own)."""
        torch, w, i = self.torch, self.world, self.world_index
        tc = w.token_combiner()
        send, wait = self.combine_launches
        send.set("x_rows", x.data_ptr())
        send.set("in_weights", topk_weights.data_ptr() if topk_weights is not None
                 else tc.in_weights[i].ptr)
        send.set("has_weights", int(topk_weights is not None))
        b = tc.combiner.bufs[i]
        wait.set("residual", residual.data_ptr() if residual is not None else b.residual.ptr)
        wait.set("has_residual", int(residual is not None))
        wait.set("n_tokens", int(n_tokens))
        stream = int(torch.cuda.current_stream(self.device).cuda_stream)
        send.launch(stream)
        wait.launch(stream)
        cfg = w.cfg
        H, K = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
        out_x = tensors.view(torch, b.out, dtype="bfloat16", shape=(n_tokens, H))
        if topk_weights is None:
            return out_x, None
        slots = tensors.view(torch, tc.weight_slots[i], shape=(cfg.max_tokens_per_rank, K, K))
        lead = self.lead(n_tokens)
        return out_x, token_major_combine.reduce_weights(
            slots[:n_tokens], lead, torch.where,
            torch.zeros((n_tokens, K), dtype=torch.float32, device=x.device))

    def lead(self, n_tokens: int):
        """``[T, K]`` bool on the device: the lead slots of this rank's dispatched top-k ids
        (``token_major_combine.lead_mask``, in torch)."""
        torch, cfg = self.torch, self.world.cfg
        rk = self.world.ranks[self.world_index]
        ids = tensors.view(torch, rk.topk_ids)[:n_tokens].to(torch.int64)
        return token_major_combine.lead_mask(ids, cfg.n_experts, cfg.layout.n_local_experts,
                                             torch.where, torch.stack)

    def check(self) -> None:
        self.ep.check()


def make_ports(torch, shape: NormalShape, *, sim: bool, n_sms, num_threads, timeout_ns,
               sim_seed: int, rendezvous_timeout_s: float, device: int) -> list:
    """Every rank's port of a new world of ``shape`` (an ``EmulatedWorld`` on the simulator
    or on GPU ``device``)."""
    n_sms, threads = shape.grid(n_sms, num_threads, sim)
    cfg = shape.config(n_sms, threads)
    if sim:
        world = EmulatedWorld(cfg, backend=sim_backend.Machine(sim_seed), timeout_ns=timeout_ns,
                              fused=False)
        world.token_receiver()
        ports = []
        rv = Rendezvous(shape.n_ranks, lambda op, p: run_tokens_step(world, ports, op, p),
                        rendezvous_timeout_s)
        ports.extend(NormalSimPort(torch, world, r, rv) for r in range(shape.n_ranks))
        return ports
    world = EmulatedWorld(cfg, device=device, timeout_ns=timeout_ns, fused=False)
    return [device_port(torch, world, r) for r in range(shape.n_ranks)]


def device_port(torch, world, rank: int) -> NormalDevicePort:
    """Rank ``rank``'s port of the CUDA world ``world`` (an ``EmulatedWorld`` of every rank,
    or this process's ``ShmemWorld``), its token-major receive and combine built first
    (on a ``ShmemWorld`` the PEs meet once their buffers are armed: ``sides_built``)."""
    receiver = world.token_receiver()
    world.token_combiner()
    return NormalDevicePort(torch, world, rank, receiver)


class NormalHandle(tuple):
    """The handle of a normal-mode dispatch: DeepEP's tuple ``(rank_prefix_matrix,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)``, with ``None`` where epgen has nothing of the kind (channels, send heads).

    - ``rank_prefix_matrix`` ``[R, R]`` int32: this rank's column ``[:, rank]`` holds the
      received rows from sources ``0 .. i`` (DeepEP's); the other columns are ``-1``
      (epgen does not exchange them);
    - ``recv_src_idx`` ``[N]`` int32: each received row's source token;
    - ``is_token_in_rank``: the dispatch's argument.

    epgen's own attributes: ``recv_src`` ``[N, 2]`` int32 (source rank, source token) per
    row (what a combine needs), ``topk_idx`` (the routing a cached dispatch re-sends with),
    ``n_rows`` (``N``, a host int, or None when ``num_worst_tokens`` kept it on the device),
    ``shape``, ``owner``, and the result slot and generation of the handle's latest dispatch
    (``slot``, ``generation``: its first or a cached one), which a combine returns the rows
    of; ``combined``: that dispatch was combined."""

    def __new__(cls, rank_prefix_matrix, recv_src, is_token_in_rank, *, topk_idx, n_rows,
                shape, owner, slot, generation):
        self = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src[:, 1],
                                     is_token_in_rank, None))
        self.recv_src, self.topk_idx, self.n_rows = recv_src, topk_idx, n_rows
        self.shape, self.owner = shape, owner
        self.slot, self.generation, self.combined = slot, generation, False
        return self

    def __repr__(self) -> str:
        s = self.shape
        return (f"NormalHandle(n_rows={self.n_rows}, num_experts={s.num_experts}, "
                f"hidden={s.hidden}, top_k={s.top_k})")


class _DeferredCheck:
    """A device-side count of bad inputs, raised at ``Buffer.check()`` (or at once)."""

    def __init__(self, count, message):
        self.count, self.message = count, message

    def raise_if_bad(self) -> None:
        n = int(self.count.item())
        if n:
            raise EPInputError(self.message(n))


def _int_arg(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise EPInputError(f"{name}: must be an int >= {low}, got {value!r}")
    return value


class NormalMode:
    """The normal-mode calls of one ``Buffer`` (``buffer``: its torch module, rank, group
    size, port source and ``on_cuda``); ``max_tokens``: the buffer's
    ``num_max_dispatch_tokens_per_rank`` (None: not given, the calls are refused)."""

    def __init__(self, buffer, max_tokens: int | None):
        self.buffer, self.max_tokens = buffer, max_tokens
        self.next_slot = 0
        #: per result slot: the dispatches made on it (a handle's combine checks that its
        #: dispatch is the slot's latest)
        self.generations = [0, 0]
        #: per result slot: the port of its latest dispatch
        self.slot_ports = [None, None]
        self.ports = set()
        #: device-side checks of eager calls that could not read the device
        #: (num_worst_tokens), raised once by ``check()``
        self.deferred = []
        #: those of calls captured into a CUDA graph, raised by every ``check()`` (each
        #: replay rewrites their counts)
        self.graph_checks = []

    def check(self) -> None:
        """Synchronise each port's world and raise what was recorded (``Buffer.check``)."""
        for port in list(self.ports):
            port.check()
        deferred, self.deferred = self.deferred, []
        for d in deferred + self.graph_checks:
            d.raise_if_bad()

    # -- the checks of a call ----------------------------------------------------------------
    def _source_port(self, shape, slot: int):
        source = self.buffer.source_for_normal_mode()
        return source.normal_port(self.buffer.torch, shape, slot)

    def _shape(self, x, topk_idx, num_experts: int) -> NormalShape:
        """The call's shape after DeepEP's checks of ``x`` and ``topk_idx`` and epgen's
        limits (``EPInputError`` naming the argument)."""
        b, torch = self.buffer, self.buffer.torch
        if isinstance(x, tuple):
            raise EPInputError("x: FP8 input (x_e4m3, scales) is not available: epgen's "
                               "dispatch quantises BF16 tokens itself and has no format that "
                               "passes pre-quantised bytes and scales through (it would "
                               "quantise twice); pass BF16 tokens")
        check_tensor(torch, x, "x", dtypes=(torch.bfloat16,), dim=2, on_cuda=b.on_cuda)
        check_tensor(torch, topk_idx, "topk_idx", dtypes=(torch.int64, torch.int32), dim=2,
                     on_cuda=b.on_cuda, device=x.device, contiguous=False)
        T, H = x.shape
        K = topk_idx.shape[1]
        if self.max_tokens is None:
            raise EPInputError("num_max_dispatch_tokens_per_rank: the normal mode needs the "
                               "buffer's worst-case tokens per rank (epgen sizes its receive "
                               "buffers by it): Buffer(..., num_max_dispatch_tokens_per_rank="
                               "T_max)")
        if topk_idx.shape[0] != T:
            raise EPInputError(f"topk_idx: {topk_idx.shape[0]} rows, must be one per token of "
                               f"x ({T})")
        if T > self.max_tokens:
            raise EPInputError(f"x: {T} tokens, more than the buffer's "
                               f"num_max_dispatch_tokens_per_rank ({self.max_tokens})")
        if H % 8:
            raise EPInputError(f"x: hidden {H} must be a multiple of 8 (16-byte copies)")
        if not 1 <= K <= 32:
            raise EPInputError(f"topk_idx: top-k {K} must be in [1, 32] (one lane per slot)")
        if K > num_experts:
            raise EPInputError(f"topk_idx: top-k {K} must be <= num_experts ({num_experts})")
        return NormalShape(b.group_size, num_experts, self.max_tokens, H, K)

    def _check_layout(self, x, topk_idx, num_tokens_per_rank, is_token_in_rank,
                      num_tokens_per_expert) -> _DeferredCheck:
        """DeepEP's required layout arguments (``get_dispatch_layout``'s results of
        ``topk_idx``): their dtypes and shapes here, their values on the device (a count of
        mismatches and bad ids, ``_DeferredCheck``)."""
        b, torch = self.buffer, self.buffer.torch
        R = b.group_size
        for name, v in (("num_tokens_per_rank", num_tokens_per_rank),
                        ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if v is None:
                raise EPInputError(f"{name}: required with topk_idx (get_dispatch_layout's "
                                   f"result)")
        T = x.shape[0]
        check_tensor(torch, num_tokens_per_rank, "num_tokens_per_rank", dtypes=(torch.int32,),
                     shape=(R,), on_cuda=b.on_cuda, device=x.device, contiguous=False)
        check_tensor(torch, is_token_in_rank, "is_token_in_rank", dtypes=(torch.bool,),
                     shape=(T, R), on_cuda=b.on_cuda, device=x.device, contiguous=False)
        check_tensor(torch, num_tokens_per_expert, "num_tokens_per_expert",
                     dtypes=(torch.int32,), dim=1, on_cuda=b.on_cuda, device=x.device,
                     contiguous=False)
        E = num_tokens_per_expert.shape[0]
        ref = dispatch_layout.dispatch_layout(torch, topk_idx, E, R)
        wrong = (ref.bad.sum() + (ref.num_tokens_per_rank != num_tokens_per_rank).sum()
                 + (ref.is_token_in_rank != is_token_in_rank).sum()
                 + (ref.num_tokens_per_expert != num_tokens_per_expert).sum())
        return _DeferredCheck(wrong.reshape(1), lambda n: (
            f"topk_idx: {n} mismatch(es) between topk_idx and num_tokens_per_rank / "
            f"is_token_in_rank / num_tokens_per_expert, or ids outside [-1, num_experts) "
            f"(pass get_dispatch_layout's results of the same topk_idx)"))

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                 is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, previous_event, async_finish):
        """``Buffer.dispatch`` (its docstring), the arguments as DeepEP names them."""
        b, torch = self.buffer, self.buffer.torch
        expert_alignment = _int_arg(expert_alignment, "expert_alignment", 1)
        num_worst_tokens = _int_arg(num_worst_tokens, "num_worst_tokens", 0)
        if num_tokens_per_rdma_rank is not None:
            raise EPInputError("num_tokens_per_rdma_rank: must be None (every rank reaches "
                               "every other directly; epgen has no RDMA-rank level)")
        if b.enable_shrink:
            raise EPInputError("enable_shrink: the normal mode does not take rank masks; "
                               "use a buffer without enable_shrink")
        cached = handle is not None
        checks = []
        if cached:
            if topk_idx is not None:
                raise EPInputError("topk_idx: a cached dispatch (handle given) re-sends with "
                                   "the handle's routing; pass topk_idx=None")
            if topk_weights is not None:
                raise EPInputError("topk_weights: a cached dispatch (handle given) returns "
                                   "no weights (DeepEP's passes none); pass None")
            if not isinstance(handle, NormalHandle) or handle.owner is not b:
                raise EPInputError("handle: must be a handle this buffer's dispatch returned")
            topk_idx = handle.topk_idx
            if not isinstance(x, tuple) and isinstance(x, torch.Tensor) and x.dim() == 2 \
                    and x.shape[0] != topk_idx.shape[0]:
                raise EPInputError(f"x: {x.shape[0]} tokens, the handle's dispatch had "
                                   f"{topk_idx.shape[0]}")
            shape = self._shape(x, topk_idx, handle.shape.num_experts)
            if shape != handle.shape:
                raise EPInputError(f"x: hidden {x.shape[1]}, the handle's dispatch had "
                                   f"{handle.shape.hidden}")
        else:
            if topk_idx is None:
                raise EPInputError("topk_idx: required (epgen routes by expert: a dispatch "
                                   "by is_token_in_rank alone is not available; a cached "
                                   "dispatch passes handle=)")
            if not isinstance(num_tokens_per_expert, torch.Tensor) \
                    or num_tokens_per_expert.dim() != 1:
                raise EPInputError("num_tokens_per_expert: required with topk_idx, a 1-D "
                                   "int32 tensor (get_dispatch_layout's result)")
            E = num_tokens_per_expert.shape[0]
            if E < 1 or E % b.group_size:
                raise EPInputError(f"num_tokens_per_expert: {E} experts, must be a positive "
                                   f"multiple of the group size ({b.group_size})")
            shape = self._shape(x, topk_idx, E)
            checks.append(self._check_layout(x, topk_idx, num_tokens_per_rank,
                                             is_token_in_rank, num_tokens_per_expert))
            if topk_weights is not None:
                check_tensor(torch, topk_weights, "topk_weights", dtypes=(torch.float32,),
                             shape=tuple(topk_idx.shape), on_cuda=b.on_cuda, device=x.device)
        if num_worst_tokens > shape.rows:
            raise EPInputError(f"num_worst_tokens: {num_worst_tokens} exceeds the receive "
                               f"rows num_ranks * num_max_dispatch_tokens_per_rank = "
                               f"{shape.rows}")
        # on a GPU a check that reads the device waits for the host read DeepEP makes
        # anyway, or, without one (num_worst_tokens, a CUDA graph), for check()
        capturing = b.on_cuda and torch.cuda.is_current_stream_capturing()
        deferred = capturing or (b.on_cuda and num_worst_tokens > 0)
        if not deferred:
            for c in checks:
                c.raise_if_bad()
        if previous_event is not None:
            previous_event.current_stream_wait()
        slot = self.next_slot
        port = self._source_port(shape, slot)
        self.ports.add(port)
        port.send(x, topk_idx, num_worst_tokens, topk_weights)
        self.next_slot ^= 1
        self.generations[slot] += 1
        self.slot_ports[slot] = port
        if cached:          # the handle's combine now returns this dispatch's rows
            handle.slot, handle.generation = slot, self.generations[slot]
            handle.combined = False
        out, tl = port.out, port.layout
        R, L = shape.n_ranks, shape.n_local_experts
        meta = out.meta
        after = []
        if num_worst_tokens:
            after.append(_DeferredCheck(
                (meta[tl.N_ROWS] > num_worst_tokens).to(torch.int64).reshape(1),
                lambda _: f"num_worst_tokens: {num_worst_tokens} is fewer than the tokens "
                          f"this rank received"))
        if cached:
            n, n_rows, counts_list = num_worst_tokens or len(handle.recv_src), None, None
        elif num_worst_tokens:
            n, n_rows, counts_list = num_worst_tokens, None, []
        else:
            host = meta.cpu()              # one host read (DeepEP synchronises here too)
            n = n_rows = int(host[tl.N_ROWS])
            counts = host[tl.expert_count_offset:tl.expert_count_offset + L].tolist()
            a = expert_alignment
            counts_list = [-(-c // a) * a for c in counts]
        if deferred:
            (self.graph_checks if capturing else self.deferred).extend(checks + after)
        else:
            for c in after:
                c.raise_if_bad()
        recv_x = out.x[:n]
        prefix = torch.full((R, R), -1, dtype=torch.int32, device=meta.device)
        prefix[:, b.rank] = meta[tl.rank_prefix_offset:tl.rank_prefix_offset + R]
        event = events.record(torch, b.on_cuda, (x,)) if async_finish \
            else events.EventOverlap()
        if cached:
            return recv_x, None, None, None, None, event
        new_handle = NormalHandle(prefix, out.src[:n], is_token_in_rank,
                                  topk_idx=topk_idx.clone(), n_rows=n_rows, shape=shape,
                                  owner=b, slot=slot, generation=self.generations[slot])
        recv_w = None if topk_weights is None else out.weights[:n]
        return recv_x, out.topk[:n], recv_w, counts_list, new_handle, event


    # -- combine -----------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, bias, previous_event, async_finish):
        """``Buffer.combine`` (its docstring), the arguments as DeepEP names them."""
        b, torch = self.buffer, self.buffer.torch
        b.source_for_normal_mode()          # a destroyed buffer, a process group: refused
        if isinstance(x, tuple):
            raise EPInputError("x: FP8 input is not available: the normal-mode combine "
                               "returns BF16 rows (DeepEP's takes BF16 only)")
        if not isinstance(handle, NormalHandle):
            raise EPInputError(f"handle: must be the handle this buffer's normal-mode "
                               f"dispatch returned, got {type(handle).__name__}")
        if handle.owner is not b:
            raise EPInputError("handle: from another buffer")
        if self.generations[handle.slot] != handle.generation:
            raise EPInputError("handle: its result slot was reused by a later dispatch (at "
                               "most two results are outstanding; a cached dispatch with "
                               "the handle makes it current again)")
        if handle.combined:
            raise EPInputError("handle: already combined (epgen combines each dispatch once; "
                               "dispatch again, e.g. cached with handle=, to combine again)")
        shape = handle.shape
        H, K = shape.hidden, shape.top_k
        check_tensor(torch, x, "x", dtypes=(torch.bfloat16,), dim=2, on_cuda=b.on_cuda)
        rows = handle.recv_src.shape[0]
        if x.shape[1] != H or not rows <= x.shape[0] <= shape.rows:
            raise EPInputError(f"x: shape {tuple(x.shape)}, must be [N, {H}] with N from the "
                               f"handle's {rows} received rows up to {shape.rows}")
        if topk_weights is not None:
            check_tensor(torch, topk_weights, "topk_weights", dtypes=(torch.float32,),
                         shape=(x.shape[0], K), on_cuda=b.on_cuda, device=x.device)
        T = handle.topk_idx.shape[0]
        residual = unpack_bias(torch, bias, T, H, b.on_cuda, x.device)
        if previous_event is not None:
            previous_event.current_stream_wait()
        port = self.slot_ports[handle.slot]
        combined_x, combined_w = port.combine(x, topk_weights, residual, T)
        handle.combined = True
        self.keep = (x, topk_weights, residual)      # alive while the kernels read them
        event = events.record(torch, b.on_cuda, (x,)) if async_finish \
            else events.EventOverlap()
        return combined_x, combined_w, event

def unpack_bias(torch, bias, T: int, H: int, on_cuda: bool, device):
    """DeepEP's ``_unpack_bias`` of ``bias`` (None, a tensor, or a pair of tensors or None),
    each checked as ``[T, H]`` BF16: the one BF16 residual the combine adds (None, the one,
    or the two's ``a + b``, summed in float32 and rounded to BF16 by torch)."""
    if bias is None:
        parts = ()
    elif isinstance(bias, torch.Tensor):
        parts = (bias,)
    elif isinstance(bias, tuple) and len(bias) == 2:
        parts = tuple(b for b in bias if b is not None)
    else:
        raise EPInputError("bias: must be None, a [num_tokens, hidden] BF16 tensor or a pair "
                           "of them (DeepEP's _unpack_bias)")
    for j, b in enumerate(parts):
        check_tensor(torch, b, f"bias[{j}]", dtypes=(torch.bfloat16,), shape=(T, H),
                     on_cuda=on_cuda, device=device)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


__all__ = ["NormalShape", "NormalHandle", "NormalMode", "NormalSimPort", "NormalDevicePort",
           "make_ports", "run_tokens_step"]
