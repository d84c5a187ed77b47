"""``RoundTripGraph``: a world's round trip captured once as a CUDA graph and replayed with one
``cuGraphLaunch`` (CUDA-graph capture of the round trip, part of the public API)::

    world = EmulatedWorld(cfg)
    world.load_inputs(tokens, topk_ids)
    graph = world.capture_round_trip()      # records the launches; nothing runs
    graph.launch()                          # every rank's round trip, one launch
    world.check()
    results = world.results()
    world.load_inputs(tokens2, topk_ids2)   # same token counts: the same graph serves
    graph.launch()

What is captured: the launches ``enqueue_round_trip`` makes (every rank's dispatch_async
then dispatch_wait, or the fused ``ep_dispatch``), ``calls`` times, with the world's ordering
between calls (each rank's dispatch_async of call n+1 after every rank's call n); inside the
graph that ordering and each rank's async -> wait are graph edges, not events between
streams. The launch arguments are frozen: each rank's input buffers and token count, the
input scale, the timeout. New inputs loaded into the world's buffers with ``load_inputs``
replay as they are; a changed token count, input buffer, input scale or timeout makes
``launch`` raise ``ValueError`` (capture again).

Dispatch and combine in one graph (``world.capture_moe()``, docs/combine.md "CUDA
graphs"): each call records the round trip, then the world's combine (``Combiner.enqueue``:
every rank's ep_combine_async, then every rank's ep_combine_wait)::

    graph = world.capture_moe()             # weighted=True, residual=False
    world.load_inputs(tokens, topk_ids)
    graph.combiner.load(expert_outputs, topk_weights)
    graph.launch()
    outputs = graph.combiner.finish()       # synchronises; every rank's [T, H] BF16 bits
    results = world.results()               # the dispatch of the same replay

The combine's choice of weights and residual is a launch argument too: frozen at the
capture, and a ``Combiner.load`` with another choice makes the next ``launch`` raise.

Ordering with the rest of the world: a replay starts after everything already enqueued on
the world's rank streams, and every rank stream waits for its end, so stream calls
(``dispatch``, ``enqueue_round_trip``), ``check``, ``results`` and replays mix freely.

``ep_prod_reserve``: the kernels advance each call's generation on the device (a word of
each rank's prod buffer), so a replay needs no update either.
"""

from __future__ import annotations

import numbers

from backends.cuda import graph as cuda_graph


class RoundTripGraph:
    """``calls`` round trips of every rank of ``world`` as one instantiated CUDA graph (module
    docstring). ``launch(stream=None)`` replays it (on its own stream by default);
    ``close()`` (or the end of a ``with`` block) frees it."""

    def __init__(self, world, calls: int = 1, stream=None, combiner=None):
        if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 1:
            raise ValueError(f"calls must be a positive integer (round trips per replay), "
                             f"got {calls!r}")
        from backends import cuda
        self.world = world
        self.calls = int(calls)
        #: the world's ``Combiner`` whose launches follow each round trip (None: dispatch only)
        self.combiner = combiner
        self.cuda = getattr(world, "cuda", cuda)       # the world's backend
        #: the backend's graphs: backends.cuda.graph, or a simulator's (``machine.graph``)
        self.graphs = cuda_graph if self.cuda is cuda else self.cuda.graph
        self.stream = stream if stream is not None else self.cuda.create_stream(world.device)
        self.frozen = self._state()
        self.exec = self._instantiate()

    # -- capture ---------------------------------------------------------------------------------
    def _state(self) -> dict:
        """What the captured launches froze, by name (compared at every launch)."""
        w = self.world
        out = {"timeout_ns": w.timeout_ns, "input_scale": w.input_scale}
        for rk in w.ranks:
            out[f"rank {rk.rank} n_tokens"] = rk.n_tokens
            out[f"rank {rk.rank} tokens buffer"] = rk.tokens.ptr
            out[f"rank {rk.rank} topk_ids buffer"] = rk.topk_ids.ptr
        if self.combiner is not None:
            c = self.combiner
            out["combine weighted"] = c.weighted
            out["combine has_residual"] = c.has_residual
            out["combine fp8"] = c.fp8
            out["combine partial_reduce"] = c.partial
            for rk, b in zip(w.ranks, c.bufs):
                out[f"rank {rk.rank} expert_out buffer"] = b.expert_out.ptr
        return out

    def _record(self):
        """The ``Captured`` graph of ``calls`` round trips: the origin stream forks into every
        rank stream, the world enqueues its launches, every rank stream joins back. The rank
        streams' last-call events are set aside during the capture (a captured stream may
        not wait on an event recorded outside it) and put back after."""
        w, cuda = self.world, self.cuda
        saved = [rk.wait_done for rk in w.ranks]
        for rk in w.ranks:
            rk.wait_done = None
        try:
            with self.graphs.capture(self.stream) as cap:
                fork = cuda.record_event(self.stream)
                for rk in w.ranks:
                    rk.stream.wait(fork)
                for _ in range(self.calls):
                    w.enqueue_round_trip()
                    if self.combiner is not None:
                        self.combiner.enqueue()
                for rk in w.ranks:
                    self.stream.wait(cuda.record_event(rk.stream))
        finally:
            for rk, ev in zip(w.ranks, saved):
                rk.wait_done = ev
        return cap

    def _instantiate(self):
        cap = self._record()
        try:
            return self.graphs.GraphExec(cap.graph)
        finally:
            cap.destroy()

    # -- launch ----------------------------------------------------------------------------------
    def check_unchanged(self) -> None:
        """``ValueError`` naming the first launch argument that changed since the capture."""
        now = self._state()
        for key, was in self.frozen.items():
            if now[key] != was:
                raise ValueError(f"RoundTripGraph: {key} changed since the capture ({was!r} -> "
                                 f"{now[key]!r}); the graph's launch arguments are frozen: "
                                 f"capture again (world.capture_round_trip() or "
                                 f"world.capture_moe())")

    def refresh(self) -> None:
        """Before a replay: ``check_unchanged`` (the graph itself never needs an update)."""
        self.check_unchanged()

    def follow_world(self, stream) -> None:
        """``stream`` waits for everything already enqueued on the world's rank streams."""
        for rk in self.world.ranks:
            stream.wait(self.cuda.record_event(rk.stream))

    def replay(self, stream) -> None:
        """Enqueue the graph on ``stream`` (``cuGraphLaunch``) and nothing else."""
        self.exec.launch(stream)

    def lead_world(self, stream) -> None:
        """Every rank stream waits for ``stream``'s work so far (the replay): later stream
        calls, ``check`` and ``results`` come after it."""
        done = self.cuda.record_event(stream)
        for rk in self.world.ranks:
            rk.stream.wait(done)
            rk.wait_done = done

    def launch(self, stream=None) -> None:
        """One replay: ``refresh``, then on ``stream`` (default: the graph's own)
        ``follow_world``, ``replay``, ``lead_world``. Asynchronous, like ``enqueue_round_trip``;
        ``world.check()`` synchronises and reports expired waits."""
        if self.exec is None:
            raise ValueError("RoundTripGraph: launch after close()")
        stream = self.stream if stream is None else stream
        self.refresh()
        self.follow_world(stream)
        self.replay(stream)
        self.lead_world(stream)

    def close(self) -> None:
        """Free the instantiated graph (a replay still running finishes first: the driver
        frees an in-flight graph on completion). ``with world.capture_round_trip() as g:``
        closes it at the end of the block."""
        if self.exec is not None:
            self.exec.destroy()
            self.exec = None

    def __enter__(self) -> RoundTripGraph:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
