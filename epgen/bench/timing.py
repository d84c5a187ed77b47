"""Event timing behind a gate, and the statistics of the samples.

Every figure is the median of ``iters`` samples after ``warmup`` untimed ones. A sample is
the time between two CUDA events. Without a gate, it would include the Python time to
enqueue the launches (hundreds of microseconds for 16 launches, more than a decode round
trip); so a ``torch.cuda._sleep`` spin kernel (the ``Gate``) is enqueued ahead of the start
event, long enough that every launch is queued before the start event completes: the figure
is device time (kernels, launch latencies, inter-stream waits) without host enqueue time. A
sample whose start event had already completed when enqueueing finished is discarded and
the gate doubled (``sample``). Without a gate (``--no-gate``) times include host enqueue.

``fork_join`` times work spread over several streams (an ``EmulatedWorld``'s rank streams):
a timing stream waits for all work already on every rank stream, runs the gate and records
the start event; every rank stream waits on it; the measured calls are enqueued; every rank
stream records an event the timing stream waits on; the timing stream records the end event.
``timed_torch`` does the same on one torch stream. torch and ``backends.cuda`` are passed in
or imported inside the functions.
"""

from __future__ import annotations

import statistics


def summarize(samples_ms) -> dict:
    """Median, min, max, mean, p10, p90 (ms) and n of a list of timings."""
    s = sorted(float(x) for x in samples_ms)
    if not s:
        return {"n": 0}

    def q(p):
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]
    return {"n": len(s), "median_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1],
            "mean_ms": statistics.fmean(s), "p10_ms": q(0.1), "p90_ms": q(0.9)}


def rate(nbytes, ms, copy_gbps=None) -> tuple:
    """(GB/s, fraction of ``copy_gbps``) for ``nbytes`` moved in ``ms``; None when unknown."""
    if nbytes is None or not ms:
        return None, None
    gbps = nbytes / ms / 1e6
    return gbps, (gbps / copy_gbps if copy_gbps else None)


def sample(once, iters: int, warmup: int, gate) -> list[float]:
    """Run ``once(i) -> (ms, overran)`` for ``warmup`` + ``iters`` good iterations; an
    overrun is discarded and grows the gate."""
    times, i, good = [], 0, 0
    while good < warmup + iters:
        ms, overran = once(i)
        i += 1
        if overran:
            gate.grow()
            continue
        if good >= warmup:
            times.append(ms)
        good += 1
    return times


class Gate:
    """A ``torch.cuda._sleep`` spin kernel enqueued ahead of a start event (module
    docstring); ``grow()`` doubles it after an overrun."""

    MAX_MS = 500.0

    def __init__(self, torch, device_index: int, ms: float = 2.0):
        self.torch = torch
        self.device = torch.device("cuda", device_index)
        self.ms = ms
        self.overruns = 0
        s = torch.cuda.Stream(device=self.device)
        rates = []
        for cycles in (1_000_000, 4_000_000):
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            with torch.cuda.stream(s):
                e0.record(s)
                torch.cuda._sleep(cycles)
                e1.record(s)
            e1.synchronize()
            rates.append(cycles / max(e0.elapsed_time(e1), 1e-3))
        self.cycles_per_ms = rates[-1]
        self.initial_ms = ms
        self._external = {}

    def enqueue(self, torch_stream) -> None:
        with self.torch.cuda.stream(torch_stream):
            self.torch.cuda._sleep(int(self.ms * self.cycles_per_ms))

    def enqueue_core(self, core_stream) -> None:
        """Enqueue on a cuda.core stream (through a torch ``ExternalStream`` of its handle)."""
        h = int(core_stream.handle)
        ext = self._external.get(h)
        if ext is None:
            ext = self._external[h] = self.torch.cuda.ExternalStream(h, device=self.device)
        self.enqueue(ext)

    def grow(self) -> None:
        self.overruns += 1
        if self.ms >= self.MAX_MS:
            raise RuntimeError(f"the {self.ms:.0f} ms gate still expired before the host had "
                               "enqueued one iteration; use --no-gate")
        self.ms = min(2 * self.ms, self.MAX_MS)

    def describe(self) -> dict:
        return {"initial_ms": self.initial_ms, "final_ms": self.ms, "overruns": self.overruns,
                "cycles_per_ms": self.cycles_per_ms}


def timed_torch(torch, stream, gate, body) -> tuple[float, bool]:
    """(ms, overran) of ``body()`` enqueued on the torch ``stream`` behind ``gate``."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    if gate is not None:
        gate.enqueue(stream)
    with torch.cuda.stream(stream):
        start.record(stream)
        body()
        end.record(stream)
    overran = gate is not None and start.query()
    end.synchronize()
    return start.elapsed_time(end), overran


def event_done(event) -> bool:
    """Whether a cuda.core event has completed (``is_done``, else ``cuEventQuery``)."""
    done = getattr(event, "is_done", None)
    if done is not None:
        return bool(done)
    from backends.cuda import compat
    return int(compat.driver().cuEventQuery(event.handle)[0]) == 0


def from_idle(once, streams):
    """``once(i)`` after the host has waited for every stream of ``streams`` (the rank
    streams and the timing stream): each sample then starts from an idle device and includes
    the host's enqueue time (the P2P benchmark's epgen samples, timed as its NCCL job)."""
    def run(i):
        for s in streams:
            s.sync()
        return once(i)
    return run


def fork_join(timing_stream, streams, gate, body) -> tuple[float, bool]:
    """(ms, overran) of ``body()``, which enqueues work on the cuda.core ``streams``, timed on
    ``timing_stream`` (module docstring)."""
    from backends import cuda
    for s in streams:
        timing_stream.wait(cuda.record_event(s))
    if gate is not None:
        gate.enqueue_core(timing_stream)
    start = cuda.record(timing_stream)
    for s in streams:
        s.wait(start)
    body()
    for s in streams:
        timing_stream.wait(cuda.record_event(s))
    end = cuda.record(timing_stream)
    overran = gate is not None and event_done(start)
    return cuda.elapsed_ms(start, end), overran
