"""``EPBuffer``: dispatch and combine of a world's ranks on torch tensors, enqueued on the
caller's CUDA stream with no host synchronisation and no host read of device data.

Each kernel launch of each rank is prepared once (``Program.prepare``: the parameters
packed, one ``cuLaunchKernelEx`` per call); a call rewrites only what changed (the input
pointers, the token count) and enqueues. Where the launches go:

- a handle of one rank (``ShmemWorld``, ``P2PWorld(rank=...)``-style use, or one rank of an
  ``EmulatedWorld`` called from that rank's own stream): on the caller's stream itself;
- a handle of several ranks: the id check of every rank in one launch on the caller's
  stream (``ep_check_ids_ranks{n}``, when the ranks share one GPU), then each rank's
  kernels on its own stream, forked from the caller's stream by an event and joined back,
  so the ranks run at once (the fused kernels and ``ep_prod_reserve``'s send kernels wait
  for each other; the others would otherwise run one rank after another) and the caller's
  stream waits for every rank: whatever it runs next sees the outputs, and the next call of
  any rank starts after every rank's last.

Outputs are tensors that view the rank's output buffers: they are valid until the next call
on this buffer (``DispatchOutput.clone()`` copies them). Errors the kernels record (expired
waits, refused rows) surface at ``check()``, which synchronises.
"""

from __future__ import annotations

import weakref

import attrs

from ir import diag

from .. import interop
from ..errors import EPInputError
from ..kernels.check_ids import KERNEL_NAME as CHECK
from ..kernels.check_ids import (blocks_per_rank, build_check_ids_module, id_bound,
                                 kernel_name, param_name)
from ..kernels.dispatch_async import KERNEL_NAME as ASYNC
from ..kernels.dispatch_fused import KERNEL_NAME as FUSED
from ..kernels.dispatch_wait import KERNEL_NAME as WAIT
from ..runtime import call_args
from ..runtime.combine import C_ASYNC, C_FUSED, C_WAIT
from ..runtime.results import rank_result
from . import streams, tensors


def _torch():
    try:
        import torch
    except ImportError as exc:     # pragma: no cover - depends on the machine
        raise ImportError("epgen.torch needs PyTorch (pip install torch)") from exc
    return torch


@attrs.define(eq=False)
class DispatchOutput:
    """One rank's dispatch outputs as device tensors viewing its buffers (valid until the
    next call on the ``EPBuffer``): ``tokens`` ``[max_out_rows, ...]`` (BF16, or the
    format's codes), ``scales`` (quantising formats, else None), ``row_offsets`` int32
    ``[G + 1]`` (group ``j``'s rows are ``[row_offsets[j], row_offsets[j + 1])``),
    ``expert_ids`` int32 ``[G]``, ``src_info`` int32 ``[max_out_rows, 2]`` (source token,
    top-k slot), ``counts`` int32 ``[L, R]`` (tokens from source ``r`` to local expert
    ``e``; a strided view of the counter words). ``rank``; ``n_tokens`` this rank's token
    count; ``topk_ids`` and ``topk_weights`` the inputs combine needs;
    ``allreduce_world_size`` the world's (``RankWorld.allreduce_world_size``: how the shared
    expert's tokens are split under ``skip_a2a``)."""

    rank: int
    tokens: object
    scales: object
    row_offsets: object
    expert_ids: object
    src_info: object
    counts: object
    n_tokens: int = 0
    topk_ids: object = None
    topk_weights: object = None
    #: dispatch_wait's Region A words ``[2 * L * R]`` (``[2w] = 1024 + end row``, ``[2w + 1]
    #: = count``, ``w = e * R + s``), of which ``counts`` is a view
    region_a: object = None
    allreduce_world_size: int | None = None

    def to_reference(self, cfg):
        """This output as the host ``reference.RankResult`` (synchronises: for tests and
        debugging), comparable with ``epgen.reference.dispatch`` by
        ``reference.assert_match``."""
        torch = _torch()
        row_offsets = self.row_offsets.cpu().numpy().view("uint32")
        toks = self.tokens[:int(row_offsets[-1])]        # only the rows written travel
        host_tokens = (toks.view(torch.int16).cpu().numpy().view("uint16")
                       if toks.dtype == torch.bfloat16 else toks.cpu().numpy())
        return rank_result(
            cfg, self.rank, n_tokens=self.n_tokens, out_tokens=host_tokens,
            row_offsets=row_offsets, expert_ids=self.expert_ids.cpu().numpy(),
            src_info=self.src_info.cpu().numpy(), region_a=self.region_a.cpu().numpy(),
            out_scales=None if self.scales is None else self.scales.cpu().numpy(),
            allreduce_world_size=self.allreduce_world_size)

    def clone(self) -> DispatchOutput:
        """A copy whose tensors outlive the next call (``Tensor.clone`` on the current
        stream)."""
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        region = c(self.region_a)
        L, R = self.counts.shape
        return DispatchOutput(self.rank, c(self.tokens), c(self.scales), c(self.row_offsets),
                              c(self.expert_ids), c(self.src_info),
                              region.view(L, R, 2)[..., 1], self.n_tokens, c(self.topk_ids),
                              c(self.topk_weights), region, self.allreduce_world_size)


def _outputs_of(torch, world, rk) -> DispatchOutput:
    """Rank ``rk``'s outputs of ``world`` as tensors viewing its buffers."""
    cfg = world.cfg
    lay, fmt = cfg.layout, cfg.token_fmt
    L, R = lay.n_local_experts, cfg.n_ranks
    tok_dtype = "bfloat16" if fmt.name == "BF16" else None
    region_a = tensors.view(torch, rk.counters, shape=(2 * L * R,),
                            byte_offset=4 * lay.dispatch_wait_region.offset)
    return DispatchOutput(
        rank=rk.rank, tokens=tensors.view(torch, rk.out_tokens, dtype=tok_dtype),
        scales=None if rk.out_scales is None else tensors.view(torch, rk.out_scales),
        row_offsets=tensors.view(torch, rk.row_offsets, dtype="uint32"),
        expert_ids=tensors.view(torch, rk.expert_ids),
        src_info=tensors.view(torch, rk.src_info), counts=region_a.view(L, R, 2)[..., 1],
        region_a=region_a, allreduce_world_size=world.allreduce_world_size)


def _address(value, info) -> int:
    """The device address of a checked input: a torch tensor's (``info`` None, as the input
    checks give for torch), else the other library's array's."""
    return value.data_ptr() if info is None else info.ptr


class _HotParams:
    """The parameters a call rewrites in one rank's prepared launches: each value name's
    slots (``PreparedLaunch.slot``) in every launch that takes it, written only when the
    value differs from the one last written (the buffer owns these launches: nothing else
    writes them). ``launches``: ``(launch, {value name: its parameter name there})`` pairs;
    a name the mapping leaves out is its own parameter name."""

    def __init__(self, launches, names):
        slots = {n: [] for n in names}
        for pl, rename in launches:
            for n in names:
                pn = rename.get(n, n)
                if pn in pl.params:
                    slots[n].append(pl.slot(pn))
        self.slots = {n: ss for n, ss in slots.items() if ss}
        self.last = dict.fromkeys(self.slots)

    def write(self, values: dict) -> None:
        last = self.last
        for name, slots in self.slots.items():
            v = values[name]
            if last[name] != v:
                for slot in slots:
                    slot[0] = v
                last[name] = v


#: world -> {n_ranks: the id check's ``RankPrograms``}, shared by every handle of a world
_CHECK_PROGRAMS = weakref.WeakKeyDictionary()


def _check_programs(world, n_ranks: int = 1):
    """``ep_check_ids`` (its ``n_ranks`` form) loaded on the world's GPUs (``world.load``),
    once per world (every handle shares it)."""
    cache = _CHECK_PROGRAMS.setdefault(world, {})
    if n_ranks not in cache:
        cache[n_ranks] = world.load(build_check_ids_module(world.cfg, n_ranks))
    return cache[n_ranks]


class EPBuffer:
    """Dispatch and combine of ``world``'s ranks on torch CUDA tensors (module docstring).
    ``rank``: only that rank (one handle per rank of an ``EmulatedWorld``, as one process
    per rank would have: every rank's handle must be called for a call to complete, each
    from its own stream, since a rank's receive kernel waits for every rank's send kernel);
    default every rank the world holds (one for a ``ShmemWorld``). The buffer owns the world's kernels while it is used: do not mix
    its calls with the world's numpy calls (``world.dispatch``) without a ``check()``."""

    def __init__(self, world, rank: int | None = None):
        torch = _torch()
        if getattr(world.cuda, "RUNS_IR", False):
            raise ValueError("epgen.torch: the world runs on the CPU simulator; the torch API "
                             "takes CUDA tensors (use world.dispatch with numpy arrays there)")
        self.torch, self.world, self.cfg = torch, world, world.cfg
        if getattr(world, "batched", False):
            raise ValueError("epgen.torch: a batched world (one launch of every rank's grid) "
                             "is not supported; make the world with batched=False")
        if rank is None:
            self.ranks = list(world.ranks)
        else:
            self.ranks = [rk for rk in world.ranks if rk.rank == rank]
            if not self.ranks:
                raise ValueError(f"rank {rank}: the world holds ranks "
                                 f"{[rk.rank for rk in world.ranks]}")
        self.index = [world.ranks.index(rk) for rk in self.ranks]
        self.fused = world.fused
        # several ranks run at once on their own streams: the fused kernels and
        # ep_prod_reserve's send kernels wait for each other, and the others would run one
        # rank after another on one stream
        self.on_caller_stream = len(self.ranks) == 1
        self.device = self.ranks[0].stream.device.device_id
        self.outputs = [_outputs_of(torch, world, rk) for rk in self.ranks]
        self.lanes = None if self.on_caller_stream else streams.Lanes(
            [rk.stream for rk in self.ranks])
        self._keep = ()            # this call's converted inputs, alive until the next call
        self.producers = streams.Producers(self.ranks[0].stream.device)
        # the current stream's raw handle without building a torch Stream (what Triton uses)
        self._raw_current = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        # every launch prepared now (the first call must not compile: the other ranks'
        # kernels would wait for it): (kernel name, [prepared launch per handled rank])
        self._prepare_dispatch()
        #: per ``fp8`` choice, the combine launches prepared on its first combine (which
        #: builds the combine side) and their hot parameters
        self._combine, self._combine_hot = {}, {}
        self._results = {}     # (handled rank, shape): the tensor viewing its output buffer
        self._pending_receive = None          # dispatch_wait steps of a split dispatch
        self._pending_combine = None          # combine_wait steps of a split combine

    # -- launches ---------------------------------------------------------------------------
    def _prepare_dispatch(self):
        """Every handled rank's launches, prepared: the id check (``ep_check_ids`` per rank,
        or one ``ep_check_ids_ranks{n}`` of every rank when the handle holds several ranks
        of one GPU with one error buffer: ``_check_all``, launched on the caller's stream
        before the fork), then dispatch_async and dispatch_wait, or the fused
        ``ep_dispatch``."""
        w, n = self.world, self.cfg.n_sms
        steps, self._check_all, check_renames = [], None, []
        errs = {id(w.err_of(rk)) for rk in self.ranks}
        if not self.on_caller_stream and self.lanes.one_device and len(errs) == 1:
            self._check_all, check_renames = self._prepare_check_all()
        else:
            steps.append((CHECK, self._prepare_checks()))
        if self.fused:
            rows = w.fused_rows()
            steps.append((FUSED, [w.program_of(w.ranks[i]).prepare(FUSED, n, rows[i])
                                  for i in self.index]))
        else:
            a, b = w.async_rows(), w.wait_rows()
            steps.append((ASYNC, [w.program_of(w.ranks[i]).prepare(ASYNC, n, a[i])
                                  for i in self.index]))
            steps.append((WAIT, [w.program_of(w.ranks[i]).prepare(WAIT, n, b[i],
                                                                  programmatic=True)
                                 for i in self.index]))
        self._dispatch = steps
        hot = ("input_tokens", "ids_in", "ids_wide", "n_tokens", "topk_weights")
        self._hot = [_HotParams([(ls[j], {}) for _, ls in steps]
                                + ([(self._check_all, check_renames[j])] if check_renames
                                   else []), hot)
                     for j in range(len(self.ranks))]

    @staticmethod
    def _check_args(rk) -> dict:
        """Rank ``rk``'s id-check arguments (by ``check_ids.RANK_PARAMS`` name): its own id
        buffer in and out until a call sets the input."""
        return {"ids_in": rk.topk_ids, "ids_wide": 0, "ids_out": rk.topk_ids, "n_tokens": 0,
                "my_rank": rk.rank}

    def _prepare_checks(self) -> list:
        """One ``ep_check_ids`` launch per handled rank (the ids into the rank's id buffer)."""
        w = self.world
        return [_check_programs(w).of(rk).prepare(
                    CHECK, blocks_per_rank(self.cfg),
                    {**self._check_args(rk), "err_buf": w.err_of(rk).ptr,
                     "timeout_ns": w.timeout_ns})
                for rk in self.ranks]

    def _prepare_check_all(self):
        """The one ``ep_check_ids_ranks{n}`` launch of every handled rank, and each rank's
        renaming of the hot values to its parameters."""
        w, k = self.world, len(self.ranks)
        args = {param_name(name, j, k): v for j, rk in enumerate(self.ranks)
                for name, v in self._check_args(rk).items()}
        renames = [{v: param_name(v, j, k) for v in ("ids_in", "ids_wide", "n_tokens")}
                   for j in range(k)]
        args.update(err_buf=w.err_of(self.ranks[0]).ptr, timeout_ns=w.timeout_ns)
        prog = _check_programs(w, k).of(self.ranks[0])
        return prog.prepare(kernel_name(k), k * blocks_per_rank(self.cfg), args), renames

    def _enqueue(self, steps, stream_handle: int, first=None):
        """``first`` (a prepared launch, or None) on the caller's stream, then ``steps``
        (each rank's launches in order) on the caller's stream or on the rank streams."""
        if first is not None:
            first.launch(stream_handle)
        if self.on_caller_stream:
            for _, launches in steps:
                for pl in launches:
                    pl.launch(stream_handle)
            return
        self.lanes.fork(stream_handle)
        for _, launches in steps:
            for pl, rk in zip(launches, self.ranks):
                pl.launch(rk.stream)
        self.lanes.join(stream_handle)

    def _stream(self, stream) -> int:
        """The raw handle of ``stream``, default torch's current stream on the device."""
        if stream is None:
            if self._raw_current is not None:
                return self._raw_current(self.device)
            stream = self.torch.cuda.current_stream(self.device)
        return int(stream.cuda_stream) if hasattr(stream, "cuda_stream") else int(stream)

    # -- dispatch ---------------------------------------------------------------------------
    def dispatch(self, x, topk_ids, topk_weights=None, *, stream=None, receive=True):
        """Enqueue one dispatch: ``x`` ``[T, hid_dim]`` BF16 tokens and ``topk_ids``
        ``[T, top_k]`` (int32, or a torch integer tensor) of each handled rank (a tensor for
        a one-rank handle, else a list in rank order); ``topk_weights`` ``[T, top_k]``
        (kept for ``combine``). Returns the ``DispatchOutput`` (a list for several ranks).
        Checks only what the host knows; the ids are not read here.

        ``receive=False`` enqueues only the sending half (the id check and
        ``dispatch_async``): the outputs are filled once ``receive()`` has enqueued
        ``dispatch_wait`` and it has run (a world of the staged kernels; the fused kernel
        cannot be split)."""
        if not receive and self.fused:
            raise ValueError("dispatch(receive=False): the world runs the fused single-launch "
                             "kernel, which cannot be split; make it with fused=False")
        if self._pending_receive is not None:
            raise RuntimeError("dispatch: the previous dispatch was sent with receive=False "
                               "and not received: call receive() first")
        torch, cfg = self.torch, self.cfg
        xs, ids, ws = self._per_rank(x, "x"), self._per_rank(topk_ids, "topk_ids"), \
            self._per_rank(topk_weights, "topk_weights", optional=True)
        K = cfg.token_fmt.top_k
        checked, infos = [], []     # infos: None for a torch tensor, else its producer to order
        for rk, xi, ii, wi in zip(self.ranks, xs, ids, ws):
            xt, xinfo = tensors.tokens_input(torch, xi, f"x[{rk.rank}]", cfg, self.device)
            T = xt.shape[0] if xinfo is None else xinfo.shape[0]
            it, iinfo = tensors.ids_input(torch, ii, f"topk_ids[{rk.rank}]", T, K, self.device)
            wt, winfo = (None, None) if wi is None else tensors.weights_input(
                torch, wi, f"topk_weights[{rk.rank}]", T, K, self.device)
            checked.append((xt, xinfo, it, iinfo, wt, T, winfo))
            infos += (xinfo, iinfo, winfo)
        s = self._stream(stream)
        for info in infos:
            self.producers.order(info, s)
        outs = []
        for j, (rk, (xt, xinfo, it, iinfo, wt, T, winfo)) in enumerate(zip(self.ranks,
                                                                          checked)):
            # ep_rank_dedup: the weights the messages carry (the world's zeros without them)
            zero_w = 0 if rk.topk_weights is None else rk.topk_weights.ptr
            if T == 0:
                values = {"input_tokens": rk.tokens.ptr, "ids_in": rk.topk_ids.ptr,
                          "ids_wide": 0, "n_tokens": 0, "topk_weights": zero_w}
            else:
                values = {"input_tokens": xt.data_ptr() if xinfo is None
                          else self._token_pointer(rk, xinfo, T, s),
                          "ids_in": it.data_ptr() if iinfo is None else iinfo.ptr,
                          "ids_wide": int((it.element_size() if iinfo is None
                                           else iinfo.itemsize) == 8),
                          "n_tokens": T,
                          "topk_weights": zero_w if wt is None else _address(wt, winfo)}
            self._hot[j].write(values)
            rk.n_tokens = T
            out = self.outputs[j]
            out.n_tokens, out.topk_ids, out.topk_weights = T, it, wt
            outs.append(out)
        self._keep = checked
        if receive:
            self._enqueue(self._dispatch, s, self._check_all)
        else:
            self._enqueue(self._dispatch[:-1], s, self._check_all)
            self._pending_receive = self._dispatch[-1:]
        return outs[0] if len(outs) == 1 and not isinstance(x, (list, tuple)) else outs

    def send(self, x, topk_ids, topk_weights=None, *, stream=None):
        """Enqueue the sending half of a dispatch (the id check and ``dispatch_async``) for a
        caller that receives with a kernel of its own on the same world (the DeepEP normal
        mode's token-major receive, ``runtime.token_major``): ``dispatch(receive=False)``
        with nothing left pending (``topk_weights``: what the messages carry). Returns the
        ``DispatchOutput`` (its grouped tensors are not filled by this call)."""
        out = self.dispatch(x, topk_ids, topk_weights, stream=stream, receive=False)
        self._pending_receive = None
        return out

    def receive(self, *, stream=None) -> None:
        """Enqueue the receiving half (``dispatch_wait``) of the last dispatch, which was
        sent with ``receive=False``; it may run on another stream than the send (default
        the current one), which then orders itself after the send's stream by the
        caller's means (as the same stream does)."""
        if self._pending_receive is None:
            raise RuntimeError("receive: no dispatch sent with receive=False is waiting")
        steps, self._pending_receive = self._pending_receive, None
        self._enqueue(steps, self._stream(stream))

    # -- combine ----------------------------------------------------------------------------
    def _prepare_combine(self, fp8: bool = False, partial: bool = False):
        """The world's combine side (built as ``world.combine`` builds it; with ``fp8`` its
        FP8 side too, ``Combiner.prepare_fp8``, with ``partial`` its partial-reduce side,
        ``Combiner.prepare_partial``) and every handled rank's combine launches of the BF16,
        FP8 or partial-reduce kernels, prepared (``self._combine[mode]``,
        ``_combine_hot[mode]``, ``mode = (fp8, partial)``)."""
        # built once for the world; a world of other processes' peers meets them here
        c = self.world.prepare_combine(fp8, partial)
        mode = (fp8, partial)
        n, steps = self.cfg.n_sms, []
        prog = lambda i: c.program_of(self.world.ranks[i], *mode)  # noqa: E731
        name = lambda bf16_name: c.kernel_name(bf16_name, *mode)  # noqa: E731
        if c.fused:
            steps.append((name(C_FUSED), [prog(i).prepare(name(C_FUSED), n,
                                                          c.fused_args(i, *mode))
                                          for i in self.index]))
        else:
            steps.append((name(C_ASYNC), [prog(i).prepare(name(C_ASYNC), n,
                                                          c.async_args(i, *mode))
                                          for i in self.index]))
            steps.append((name(C_WAIT), [prog(i).prepare(name(C_WAIT), n,
                                                         c.wait_args(i, *mode))
                                         for i in self.index]))
        self._combiner = c
        self._combine[mode] = steps
        hot = ("expert_out", "weights", "weighted", "residual", "has_residual", "n_tokens",
               "out")
        self._combine_hot[mode] = [_HotParams([(ls[j], {}) for _, ls in steps], hot)
                                  for j in range(len(self.ranks))]

    def combine(self, expert_out, out, topk_weights=None, *, residual=None, stream=None,
                into=None, receive=True, fp8: bool = False, partial_reduce: bool = False):
        """Enqueue the combine of the last dispatch: ``expert_out`` ``[max_out_rows,
        hid_dim]`` BF16, the experts' outputs on the grouped rows ``out`` (that dispatch's
        ``DispatchOutput``) delivered, one row per row of ``out.tokens`` (the delivered count
        stays on the device: ``tensors.expert_rows_input``), per handled rank (a list for
        several). The router weights are
        ``topk_weights`` or those given to ``dispatch``; with weights the result is each
        source token's ``sum_k w[t, k] * y[t, k]`` (+ ``residual[t]``) ``[T, hid_dim]`` BF16,
        without them the unreduced ``[T, top_k, hid_dim]``: a tensor viewing the rank's
        output buffer, valid until the next combine.

        ``into`` (with weights): a contiguous ``[T, hid_dim]`` BF16 CUDA tensor per handled
        rank that the kernel writes the result into instead (no copy), returned as the
        result. ``receive=False`` enqueues only ``ep_combine_async`` (the rows are sent);
        ``combine_receive()`` enqueues ``ep_combine_wait``, after which the result is
        filled (the staged kernels only).

        ``fp8=True``: the FP8 combine (docs/combine.md, "FP8 combine"; epgen's own): each row
        crosses as E4M3 with a float32 scale per 128 elements (the BlockwiseFP8 rule) and is
        dequantised and reduced in fp32 at the source, in the BF16 combine's order; the
        result is BF16 as without it (unreduced: the dequantised rows rounded to BF16).
        ``hid_dim`` must be a multiple of 128. Its first use builds and loads the FP8
        kernels; later calls switch per call.

        ``partial_reduce=True`` (``ep_rank_dedup``, after a dispatch given ``topk_weights``;
        no ``topk_weights`` here): each destination sums its local experts' weighted rows of
        a token in fp32 and sends one BF16 row per (token, rank) back; the source adds the
        partial sums (docs/combine.md, "Partial reduce"). Built and loaded on first use."""
        torch, cfg = self.torch, self.cfg
        fp8 = call_args.combine_fp8_flag(cfg, fp8)
        if not receive and self.fused:
            raise ValueError("combine(receive=False): the world runs the fused single-launch "
                             "kernel, which cannot be split; make it with fused=False")
        if self._pending_combine is not None:
            raise RuntimeError("combine: the previous combine was sent with receive=False "
                               "and not received: call combine_receive() first")
        H, K = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
        ys = self._per_rank(expert_out, "expert_out")
        outs = self._per_rank(out, "out")
        ws = self._per_rank(topk_weights, "topk_weights", optional=True)
        rs = self._per_rank(residual, "residual", optional=True)
        intos = self._per_rank(into, "into", optional=True)
        call_args.check_dispatch_outputs(outs, self.ranks)
        partial = call_args.combine_partial_flag(
            cfg, partial_reduce, topk_weights, fp8,
            all(o.topk_weights is not None for o in outs))
        mode = (fp8, partial)
        if mode not in self._combine:
            self._prepare_combine(fp8, partial)
        checked = []
        for rk, y, o, w, res in zip(self.ranks, ys, outs, ws, rs):
            T = o.n_tokens
            y, yinfo = tensors.expert_rows_input(torch, y, f"expert_out[{rk.rank}]", cfg,
                                                 self.device)
            winfo = None
            if w is None:
                w = o.topk_weights
                if w is not None and not isinstance(w, torch.Tensor):
                    winfo = interop.describe(w, f"topk_weights[{rk.rank}]")
            else:
                w, winfo = tensors.weights_input(torch, w, f"topk_weights[{rk.rank}]", T, K,
                                                 self.device)
            rinfo = None
            if res is not None:
                if w is None:
                    raise EPInputError(f"residual[{rk.rank}]: needs router weights (the "
                                       f"unreduced rows take none)")
                res, rinfo = tensors.rows_input(torch, res, f"residual[{rk.rank}]", T, H,
                                                self.device)
            if intos[len(checked)] is not None:
                if w is None:
                    raise EPInputError(f"into[{rk.rank}]: needs router weights (the "
                                       f"unreduced rows go to the buffer's own output)")
                tensors.output_rows(torch, intos[len(checked)], f"into[{rk.rank}]", T, H,
                                    self.device)
            checked.append((y, w, res, T, (yinfo, winfo, rinfo)))
        s = self._stream(stream)
        for *_, infos in checked:
            for info in infos:
                self.producers.order(info, s)
        results = []
        for j, (rk, (y, w, res, T, infos)) in enumerate(zip(self.ranks, checked)):
            b = self._combiner.bufs[self.index[j]]
            values = {"expert_out": _address(y, infos[0]),
                      "weights": _address(w, infos[1]) if w is not None else b.weights.ptr,
                      "weighted": int(w is not None),
                      "residual": _address(res, infos[2]) if res is not None
                      else b.residual.ptr,
                      "has_residual": int(res is not None), "n_tokens": T,
                      "out": b.out.ptr if intos[j] is None else intos[j].data_ptr()}
            self._combine_hot[mode][j].write(values)
            shape = (T, H) if w is not None else (T, K, H)
            view = intos[j] if intos[j] is not None else self._results.get((j, shape))
            if view is None:
                view = self._results[j, shape] = tensors.view(torch, b.out, dtype="bfloat16",
                                                              shape=shape)
            results.append(view)
        self._keep_combine = (checked, intos)
        steps = self._combine[mode]
        if receive:
            self._enqueue(steps, s)
        else:
            self._enqueue(steps[:-1], s)
            self._pending_combine = steps[-1:]
        return results[0] if len(results) == 1 and not isinstance(out, (list, tuple)) \
            else results

    def combine_receive(self, *, stream=None) -> None:
        """Enqueue the receiving half (``ep_combine_wait``, or its FP8 twin) of the last
        combine, which was
        sent with ``receive=False`` (as ``receive`` for dispatch)."""
        if self._pending_combine is None:
            raise RuntimeError("combine_receive: no combine sent with receive=False is waiting")
        steps, self._pending_combine = self._pending_combine, None
        self._enqueue(steps, self._stream(stream))

    def _token_pointer(self, rk, info, T: int, stream_handle: int) -> int:
        """The address the send kernel reads the tokens from: the input itself when
        contiguous, else the rank's input buffer after a packing 2-D copy on the stream."""
        ptr, pitch, row_bytes, rows = interop.device_rows(info)
        if rows == 1 or T == 0:
            return ptr or rk.tokens.ptr
        streams.copy_rows(rk.tokens[:T].ptr, ptr, pitch, row_bytes, rows, stream_handle,
                          rk.stream.device)
        return rk.tokens.ptr

    def _per_rank(self, v, name: str, optional: bool = False) -> list:
        n = len(self.ranks)
        if v is None:
            if optional:
                return [None] * n
            raise EPInputError(f"{name}: required")
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise EPInputError(f"{name}: one entry per handled rank ({n}), got {len(v)}")
            return list(v)
        if n != 1:
            raise EPInputError(f"{name}: this buffer handles {n} ranks: pass a list")
        return [v]

    # -- errors -----------------------------------------------------------------------------
    def check(self, context: str = "dispatch") -> None:
        """Synchronise the caller's stream and the ranks' streams, then raise what the
        kernels recorded: bad top-k ids (``EPInputError`` naming rank, token, slot and id;
        each such slot was dropped), expired waits (``EPTimeoutError``)."""
        self.torch.cuda.current_stream(self.device).synchronize()
        self.world.synchronize()
        errs = {id(b): b for b in (self.world.err_of(rk) for rk in self.ranks)}.values()
        bad = [rec for b in errs for rec in diag.decode_ids(b.array.to_host())]
        if bad:
            for b in errs:
                b.array.zero()
            self.world.synchronize()
            bound = id_bound(self.cfg)
            listed = "; ".join(f"rank {r['rank']} token {r['t']} slot {r['k']}: id {r['id']}"
                               for r in bad[:10])
            more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
            raise EPInputError(f"topk_ids: {len(bad)} bad expert id(s), each slot dropped "
                               f"(ids must be in [0, {bound}) and unique within a token, or "
                               f"-1 for a masked slot): "
                               f"{listed}{more}")
        self.world.check(context)


__all__ = ["EPBuffer", "DispatchOutput"]
