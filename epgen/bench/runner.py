"""The device measurements of one run: the device-to-device copy, and an ``EmulatedWorld``
of one configuration timed on staged inputs (dispatch_async, dispatch_wait, the round trip)
with its correctness checks against the reference model.

Inputs: the sets are staged on the device once; iteration ``i`` uses set ``i % n``, swapped
into each rank's ``tokens``/``topk_ids`` slots (the kernels take them as pointers), so
nothing is copied inside or between timed calls and the world's own input buffers are left
alone (they are put back afterwards). ``dispatch_async`` alone: the round trip's
dispatch_wait is enqueued after the join, untimed. ``dispatch_wait`` alone: dispatch_async is
enqueued before the fork (the fork waits for it), so only the receive side is timed.

Copy: ``copy_`` of a buffer in torch (and ``b[...] = a`` in CuPy when CuPy imports), bytes =
read + written; the larger bandwidth is the reference the fractions use.
"""

from __future__ import annotations

import warnings

import gc
import time

import numpy as np

from .. import reference
from .memory import trim_memory_pool
from .timing import fork_join, from_idle, sample, summarize, timed_torch


class StagedInputs:
    """Input sets on the device; ``use(i)`` points every rank's input slots at set
    ``i % n``; ``restore()`` puts the world's own buffers back."""

    def __init__(self, world, sets):
        cuda = world.cuda            # backends.cuda, or the simulator's machine
        self.world = world
        self.orig = [(rk.tokens, rk.topk_ids, rk.n_tokens) for rk in world.ranks]
        self.sets = []
        for toks, ids in sets:
            per_rank = []
            for rk, x, a in zip(world.ranks, toks, ids):
                dx = cuda.to_device(np.ascontiguousarray(x, dtype=np.uint16),
                                    device=rk.device, stream=rk.stream)
                da = cuda.to_device(np.ascontiguousarray(a, dtype=np.int32),
                                    device=rk.device, stream=rk.stream)
                per_rank.append((dx, da, x.shape[0]))
            self.sets.append(per_rank)
        world.synchronize()
        self.current = None

    def use(self, i: int) -> int:
        j = i % len(self.sets)
        for rk, (dx, da, T) in zip(self.world.ranks, self.sets[j]):
            rk.tokens, rk.topk_ids, rk.n_tokens = dx, da, T
        self.current = j
        return j

    def restore(self) -> None:
        for rk, (x, a, T) in zip(self.world.ranks, self.orig):
            rk.tokens, rk.topk_ids, rk.n_tokens = x, a, T


def emulated_world(cfg, **options):
    """``EmulatedWorld(cfg, **options)`` (the world the benchmark runs by default)."""
    from ..runtime.world import EmulatedWorld
    return EmulatedWorld(cfg, **options)


def measure_world(cfg, sets, iters: int, warmup: int, gate, *, device=None, arch=None,
                  post_check: bool = True, progress, fused: bool | None = None,
                  graph: bool = False, batched: bool = False, world_factory=None,
                  host_sync: bool = False, timer=fork_join) -> dict:
    """Build the world (``world_factory()``, default an ``EmulatedWorld`` on ``device``,
    single-launch with ``fused``, every rank in one launch with ``batched``), check it against the reference on set 0, time
    dispatch_async, dispatch_wait and the round trip (fork/join over the rank streams,
    rotated staged inputs; the timing stream on ``world.device``; the fused world has only
    the round trip), check the last round trip's output. Raises when a check fails.

    With ``graph`` only the round trip is timed, as the replay of a ``RoundTripGraph``
    (one captured per input set, ``world.capture_round_trip``) on the timing stream.

    ``host_sync`` (with ``gate`` None): every sample starts from an idle device, the host
    having waited for every rank stream and the timing stream, so it includes the host's
    enqueue time, as a baseline that synchronises the host before its events does (the P2P
    benchmark's NCCL job). ``timer``: the fork/join timing (``timing.fork_join``)."""
    if host_sync and gate is not None:
        raise ValueError("measure_world: host_sync times host enqueue; it takes no gate")
    from ..runtime.world import EmulatedWorld
    res = {}
    t0 = time.perf_counter()
    world = (world_factory or (lambda: EmulatedWorld(cfg, arch=arch, device=device,
                                                      fused=fused, batched=batched)))()
    device = world.device
    res["build_s"] = time.perf_counter() - t0
    staged = None
    graphs = []
    try:
        progress("  epgen: correctness check on set 0 (world.dispatch vs reference.dispatch)")
        reference.assert_match(cfg, reference.dispatch(cfg, *sets[0]), world.dispatch(*sets[0]))
        res["check"] = "ok"

        staged = StagedInputs(world, sets)
        ts = world.cuda.create_stream(device)
        streams = [rk.stream for rk in world.ranks]

        def async_once(i):
            staged.use(i)
            ms, over = timer(ts, streams, gate, world.dispatch_async)
            world.dispatch_wait()                  # untimed: drains the buffers
            return ms, over

        def wait_once(i):
            staged.use(i)
            world.dispatch_async()                 # untimed: the fork waits for it
            return timer(ts, streams, gate, world.dispatch_wait)

        def round_once(i):
            staged.use(i)
            return timer(ts, streams, gate, world.enqueue_round_trip)

        if graph:
            for j in range(len(staged.sets)):
                staged.use(j)
                graphs.append(world.capture_round_trip(stream=ts))

        def graph_once(i):
            g = graphs[staged.use(i)]
            g.refresh()
            g.follow_world(ts)
            ms, over = timer(ts, [], gate, lambda: g.replay(ts))
            g.lead_world(ts)
            return ms, over

        def idle(once):
            return from_idle(once, (*streams, ts)) if host_sync else once

        phases = (("round_trip", graph_once),) if graph else \
            (("round_trip", round_once),) if world.fused else (
            ("dispatch_async", async_once), ("dispatch_wait", wait_once),
            ("round_trip", round_once))
        for name, once in phases:
            progress(f"  epgen: timing {name} ({warmup} warm-up + {iters} iterations)")
            res[name] = summarize(sample(idle(once), iters, warmup, gate))
            world.check(f"benchmark {name}")
        if post_check:
            last = staged.current
            progress(f"  epgen: checking the last round trip's output (set {last})")
            reference.assert_match(cfg, reference.dispatch(cfg, *sets[last]), world.results())
            res["post_check"] = "ok"
    finally:
        if staged is not None:
            staged.restore()
        world.synchronize()
        for g in graphs:
            g.close()
        staged = world = None                # drop the buffers before trimming the pool
        gc.collect()
        device.sync()
        trim_memory_pool(device, progress)
    return res


def measure_copy(torch, device_index: int, mib: int, iters: int, gate) -> dict:
    """Device-to-device copy bandwidth (read + write bytes) in torch and, when it imports, in
    CuPy; ``gbps`` is the larger."""
    n = mib << 20
    res = {"bytes_per_copy": 2 * n, "size_mib": mib}
    dev = torch.device("cuda", device_index)
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        a = torch.empty(n, dtype=torch.uint8, device=dev).fill_(7)
        b = torch.empty_like(a)
    stream.synchronize()
    t = sample(lambda i: timed_torch(torch, stream, gate, lambda: b.copy_(a)), iters, 3, gate)
    res["torch"] = summarize(t)
    res["torch"]["gbps"] = 2 * n / res["torch"]["median_ms"] / 1e6
    a = b = None
    torch.cuda.empty_cache()
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001
        res["cupy"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    else:
        with cupy.cuda.Device(device_index):
            ca = cupy.full(n, 7, dtype=cupy.uint8)
            cb = cupy.empty_like(ca)
            with warnings.catch_warnings():   # CuPy 14 deprecates it for Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                cs = cupy.cuda.ExternalStream(stream.cuda_stream)

            def cp_copy():
                with cs:
                    cb[...] = ca
            t = sample(lambda i: timed_torch(torch, stream, gate, cp_copy), iters, 3, gate)
            res["cupy"] = summarize(t)
            res["cupy"]["gbps"] = 2 * n / res["cupy"]["median_ms"] / 1e6
            ca = cb = None
            cupy.get_default_memory_pool().free_all_blocks()
    res["gbps"] = max(v["gbps"] for v in (res["torch"], res["cupy"]) if "gbps" in v)
    return res
