"""One rank's access to one epgen world, as the DeepEP API uses it (``Buffer``): send and
receive a dispatch, send and receive a combine, and the rank's outputs as torch tensors
(``views.RawOutputs``). Two kinds:

- ``DevicePort``: a CUDA world (``EmulatedWorld`` rank, ``ShmemWorld``) through
  ``epgen.torch.EPBuffer(world, rank=r)``: everything enqueued on the caller's stream, no
  host synchronisation; the outputs are views of the rank's buffers.
- ``SimPort``: an ``EmulatedWorld`` on the CPU simulator, which runs every rank of a call at
  once: each rank's call hands its inputs to the world's ``Rendezvous``, the last rank's
  call runs the world (``world.dispatch`` / ``world.combine``), and every rank's outputs are
  copied into its CPU tensors. A call that receives waits (bounded) for the others, so the
  ranks' calls come from one thread each (``EmulatedGroup.run``), as one process each would.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import EPInputError
from ..runtime.bootstrap import BootstrapTimeoutError
from ..torch import tensors
from ..torch.buffer import EPBuffer
from .views import RawOutputs


class DevicePort:
    """Rank ``rank`` of the CUDA world ``world`` (module docstring)."""

    on_cuda = True

    def __init__(self, torch, world, rank: int):
        self.torch, self.world, self.rank = torch, world, rank
        self.ep = EPBuffer(world, rank=rank)
        cfg, rk = world.cfg, self.ep.ranks[0]
        lay = cfg.layout
        L, R, E = lay.n_local_experts, cfg.n_ranks, cfg.n_experts
        out = self.ep.outputs[0]
        region_b = tensors.view(torch, rk.counters, shape=(L * R,),
                                byte_offset=4 * (lay.dispatch_wait_region.offset + 2 * E))
        self.raw = RawOutputs(tokens=out.tokens, scales=out.scales, src_info=out.src_info,
                              region_a=out.region_a, region_b=region_b)
        self.device = self.ep.device
        self._combine_in = None
        self._dispatch_waits = self._combine_waits = None     # views, made on first use
        #: tensors the API layer keeps per port (e.g. packed UE8M0 scales)
        self.extras = {}

    @property
    def n_tokens(self) -> int:
        """This rank's token count in its last dispatch."""
        return self.ep.ranks[0].n_tokens

    def dispatch(self, x, topk_idx, *, receive: bool) -> None:
        self.ep.dispatch(x, topk_idx, receive=receive)

    def receive(self) -> None:
        self.ep.receive()

    def combine(self, expert_out, weights, into, *, receive: bool, fp8: bool = False):
        """Enqueue the combine of this port's last dispatch (``fp8``: the FP8 combine);
        returns the result tensor (``into`` when given)."""
        return self.ep.combine(expert_out, self.ep.outputs[0], weights, into=into,
                               receive=receive, fp8=fp8)

    def combine_receive(self) -> None:
        self.ep.combine_receive()

    def combine_input(self):
        """The ``[M, H]`` BF16 tensor a zero-copy combine reads (allocated on first use)."""
        if self._combine_in is None:
            cfg = self.world.cfg
            self._combine_in = self.torch.zeros(
                (cfg.layout.max_out_rows, cfg.token_fmt.hid_dim), dtype=self.torch.bfloat16,
                device=f"cuda:{self.device}")
        return self._combine_in

    def dispatch_wait_ns(self):
        """``[R]`` int64 on the device: how long this rank's last dispatch_wait waited for
        each source rank (ns, ``Tuning.wait_times``: the sum over its local experts' count
        words), computed on the current stream."""
        if self._dispatch_waits is None:
            self._dispatch_waits = tensors.view(self.torch, self.ep.ranks[0].wait_time,
                                                dtype="int64")
        return _per_source(self._dispatch_waits, self.world.cfg)

    def combine_wait_ns(self):
        """``[R]`` int64 on the device: how long this rank's last combine_wait waited for each
        destination's rows (ns, ``Tuning.wait_times``)."""
        if self._combine_waits is None:
            bufs = self.world.combiner().bufs[self.ep.index[0]]
            self._combine_waits = tensors.view(self.torch, bufs.wait_time, dtype="int64")
        return self._combine_waits

    def check(self) -> None:
        self.ep.check()

    def clean(self) -> None:
        """Shrink mode's clean-up: nothing is exchanged on a GPU; a rank that is gone is
        masked at the next call, when the waits for it expire."""


class PeerFailedError(RuntimeError):
    """A simulator rank's call cannot complete: another rank failed (``Rendezvous.abort``)."""


class Rendezvous:
    """The meeting point of an emulated world's ranks on the simulator: the ``n``-th call of
    every rank is one step of the world, run by whichever rank arrives last
    (``run(op, payloads)``, payloads in rank order); a rank that waits for a step gets its
    error, if it raised. Waits are bounded by ``timeout_s`` (``BootstrapTimeoutError``
    naming the ranks that never arrived). A rank that ``leave``s (it makes no more calls:
    with rank masks, a rank that is down) is absent from every later step: its payload is
    None."""

    def __init__(self, n_ranks: int, run, timeout_s: float):
        self.n, self.run, self.timeout_s = n_ranks, run, timeout_s
        self.cv = threading.Condition()
        self.next_step = [0] * n_ranks
        self.arrived: dict[int, dict] = {}
        self.done: dict[int, BaseException | None] = {}
        self.failed: tuple[int, BaseException] | None = None
        self.left: dict[int, int] = {}      # rank -> the first step it is absent from

    def leave(self, rank: int) -> None:
        """Rank ``rank`` makes no more calls: the steps from its next one on run without it
        (those now complete run here)."""
        with self.cv:
            self.left.setdefault(rank, self.next_step[rank])
            for step in sorted(self.arrived):
                self._run_if_complete(step)
            self.cv.notify_all()

    def _present(self, step: int) -> set[int]:
        return {r for r in range(self.n) if r not in self.left or self.left[r] > step}

    def _run_if_complete(self, step: int) -> None:
        calls = self.arrived.get(step)
        if calls is None or set(calls) != self._present(step):
            return
        del self.arrived[step]
        self.done[step] = self._run(step, calls)
        live = [n for r, n in enumerate(self.next_step) if r not in self.left] or [step]
        for old in [s for s in self.done if s < min(live) - 2]:
            del self.done[old]

    def abort(self, rank: int, error: BaseException) -> None:
        """Rank ``rank`` failed outside the world (it will make no more calls): every wait
        ends with an error naming it."""
        with self.cv:
            if self.failed is None:
                self.failed = (rank, error)
            self.cv.notify_all()

    def arrive(self, rank: int, op: str, payload) -> int:
        """Hand in rank ``rank``'s call ``op``; returns its step number."""
        with self.cv:
            step = self.next_step[rank]
            self.next_step[rank] += 1
            calls = self.arrived.setdefault(step, {})
            calls[rank] = (op, payload)
            self._run_if_complete(step)
            self.cv.notify_all()
            return step

    def _run(self, step: int, calls: dict):
        ops = {r: op for r, (op, _) in calls.items()}
        if len(set(ops.values())) != 1:
            listed = ", ".join(f"rank {r}: {op}" for r, op in sorted(ops.items()))
            return RuntimeError(f"step {step}: the ranks made different calls ({listed}); "
                                f"every rank must make the same sequence of calls")
        try:
            self.run(next(iter(ops.values())),
                     [calls[r][1] if r in calls else None for r in range(self.n)])
        except BaseException as e:          # every rank of the step raises it
            return e
        return None

    def wait(self, rank: int, step: int, what: str) -> None:
        """Wait until step ``step`` has run; raise its error."""
        with self.cv:
            if not self.cv.wait_for(lambda: step in self.done or self.failed is not None,
                                    self.timeout_s):
                missing = [r for r in range(self.n) if self.next_step[r] <= step]
                raise BootstrapTimeoutError(
                    f"rank {rank}: {what} (step {step}) waited {self.timeout_s:g} s for "
                    f"rank(s) {missing}, which never made their call (each rank's calls "
                    f"must come from its own thread: EmulatedGroup.run)",
                    f"{what} step {step}", missing)
            if step not in self.done:
                failed, why = self.failed
                raise PeerFailedError(f"rank {rank}: {what} (step {step}) cannot complete: rank "
                                   f"{failed} failed ({type(why).__name__}: {why})")
            error = self.done[step]
        if error is not None:
            raise error


class SimPort:
    """Rank ``rank`` of the simulator world ``world``, meeting the others at ``rendezvous``
    (module docstring). ``ports``: every rank's port of the world, filled after a step."""

    on_cuda = False

    def __init__(self, torch, world, rank: int, rendezvous: Rendezvous):
        self.torch, self.world, self.rank, self.rv = torch, world, rank, rendezvous
        cfg = world.cfg
        lay, fmt = cfg.layout, cfg.token_fmt
        L, R, M, H = lay.n_local_experts, cfg.n_ranks, lay.max_out_rows, fmt.hid_dim
        z = lambda shape, dt: torch.zeros(shape, dtype=dt)  # noqa: E731
        scales = fmt.out_scales_shape(M) if fmt.out_scales is not None else None
        self.raw = RawOutputs(
            tokens=z((M, H), torch.bfloat16) if scales is None else z((M, H), torch.uint8),
            scales=None if scales is None else z(scales, torch.float32),
            src_info=z((M, 2), torch.int32), region_a=z((2 * L * R,), torch.int32),
            region_b=z((L * R,), torch.int32))
        self.result = {}                  # shape -> CPU tensor of the combine's result
        self._combine_in = None
        self._step = None
        self._combine_step = None
        self.extras = {}

    @property
    def n_tokens(self) -> int:
        """This rank's token count in its last dispatch."""
        return self.world.ranks[self.rank].n_tokens

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, *, receive: bool) -> None:
        bits = x.view(self.torch.int16).numpy().view(np.uint16).copy()
        self._step = self.rv.arrive(self.rank, "dispatch",
                                    (bits, topk_idx.to(self.torch.int32).numpy().copy()))
        if receive:
            self.receive()

    def receive(self) -> None:
        self.rv.wait(self.rank, self._step, "dispatch")

    def fill(self, rk) -> None:
        """Copy rank buffers ``rk`` of the world into this port's tensors (after a step)."""
        cfg = self.world.cfg
        lay, E = cfg.layout, cfg.n_experts
        L, R = lay.n_local_experts, cfg.n_ranks
        words = rk.counters.to_host()[lay.dispatch_wait_region.offset:]
        out = rk.out_tokens.to_host()
        np_view = lambda t: t.view(self.torch.int16).numpy() if t.dtype == self.torch.bfloat16 \
            else t.numpy()  # noqa: E731
        np.copyto(np_view(self.raw.tokens), out.view(np_view(self.raw.tokens).dtype))
        if self.raw.scales is not None:
            np.copyto(self.raw.scales.numpy(), rk.out_scales.to_host())
        np.copyto(self.raw.src_info.numpy(), rk.src_info.to_host())
        np.copyto(self.raw.region_a.numpy(), words[:2 * L * R])
        np.copyto(self.raw.region_b.numpy(), words[2 * E:2 * E + L * R])

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out, weights, into, *, receive: bool, fp8: bool = False):
        T = self.n_tokens
        H = self.world.cfg.token_fmt.hid_dim
        result = into
        if result is None:
            result = self.result.get(T)
            if result is None:
                result = self.result[T] = self.torch.zeros((T, H), dtype=self.torch.bfloat16)
        bits = expert_out.reshape(-1, H).view(self.torch.int16).numpy().view(np.uint16).copy()
        self._combine_step = self.rv.arrive(self.rank, "combine",
                                            (bits, weights.to(self.torch.float32).numpy()
                                             .copy(), result, bool(fp8)))
        if receive:
            self.combine_receive()
        return result

    def combine_receive(self) -> None:
        self.rv.wait(self.rank, self._combine_step, "combine")

    def combine_input(self):
        if self._combine_in is None:
            cfg = self.world.cfg
            self._combine_in = self.torch.zeros(
                (cfg.layout.max_out_rows, cfg.token_fmt.hid_dim), dtype=self.torch.bfloat16)
        return self._combine_in

    def dispatch_wait_ns(self):
        """``DevicePort.dispatch_wait_ns`` on the CPU (the step this rank waited for has run
        and the next cannot start before this rank's next call)."""
        words = self.world.ranks[self.rank].wait_time.to_host().astype(np.int64)
        return _per_source(self.torch.from_numpy(words), self.world.cfg)

    def combine_wait_ns(self):
        """``DevicePort.combine_wait_ns`` on the CPU."""
        words = self.world.combiner().bufs[self.rank].wait_time.to_host().astype(np.int64)
        return self.torch.from_numpy(words)

    def check(self) -> None:
        """Nothing to check: the simulator raised at the call."""

    def clean(self) -> None:
        """Rank masks: meet the other ranks (``run_sim_step``'s ``clean``), waiting for the
        step."""
        step = self.rv.arrive(self.rank, "clean", ())
        self.rv.wait(self.rank, step, "clean")


def _per_source(words, cfg):
    """dispatch_wait's wait times ``[E]`` (count word ``e * R + src``) summed per source
    rank: ``[R]``."""
    return words.view(cfg.layout.n_local_experts, cfg.n_ranks).sum(0)


def run_sim_step(world, ports, op: str, payloads, mask_book=None) -> None:
    """Run one step of the simulator world ``world`` for every rank (``Rendezvous.run``):
    a dispatch of every rank's ``(tokens, ids)``, then each port's tensors filled; or a
    combine of every rank's ``(expert rows, weights, result tensor, fp8)`` (every rank
    present must pass the same ``fp8``); or (rank masks) a
    ``clean``: every rank present masks the absent ones, as DeepEP's clean-up barrier does
    when they do not come. An absent rank's payload is None (``Rendezvous.leave``): it sits
    the call out (``ep_rank_mask``), the others mask it when their waits for it expire.
    ``mask_book`` (shrink mode, ``emulated.MaskBook``): the present ranks' masks applied to
    the world before the step, what its kernels masked learned after it."""
    present = [r for r, p in enumerate(payloads) if p is not None]
    if mask_book is not None:
        mask_book.apply(world, present)
    _run_step(world, ports, op, payloads, present)
    if mask_book is not None:
        mask_book.learn(world, present)


def _run_step(world, ports, op: str, payloads, present) -> None:
    def part(p, i):
        return None if p is None else p[i]
    if op == "clean":
        for r, p in enumerate(payloads):
            if p is None:
                world.update_mask(r, True, on=present)
        return
    if op == "dispatch":
        world.dispatch([part(p, 0) for p in payloads], [part(p, 1) for p in payloads])
        for port, rk, p in zip(ports, world.ranks, payloads):
            if p is not None:
                port.fill(rk)
        return
    fp8 = {part(payloads[r], 3) for r in present}
    if len(fp8) > 1:
        raise EPInputError("use_fp8: every rank of a combine must pass the same value, got "
                           + ", ".join(f"rank {r}: {payloads[r][3]}" for r in present))
    outs = world.combine([part(p, 0) for p in payloads], [part(p, 1) for p in payloads],
                         fp8=bool(fp8 and fp8.pop()))
    for p, out in zip(payloads, outs):
        if p is not None and out is not None:
            result = p[2]
            np.copyto(result.view(ports[0].torch.int16).numpy(),
                      np.asarray(out).view(np.int16).reshape(result.shape))


__all__ = ["DevicePort", "SimPort", "Rendezvous", "PeerFailedError", "run_sim_step"]
