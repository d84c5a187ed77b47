"""What the benchmarks' host-synchronised measurements do on the simulator, recorded: every
``Stream.sync`` and every timed sample, in order (``record_syncs``), so a test can check that
each sample's streams were synchronised just before it."""

from __future__ import annotations

from backends.sim import stream as sim_stream


def record_syncs(monkeypatch):
    """``(events, timer)``: ``events`` gets ``("sync", id(stream))`` for every stream sync and
    ``("sample", ids of the sample's streams)`` for every sample the returned ``timer`` (the
    benchmarks' ``timer`` hook: it runs the body and reports 0.5 ms) takes."""
    events = []
    real_sync = sim_stream.Stream.sync
    monkeypatch.setattr(sim_stream.Stream, "sync",
                        lambda s: (events.append(("sync", id(s))), real_sync(s))[1])

    def timer(ts, streams, gate, body):
        events.append(("sample", tuple(id(s) for s in (*streams, ts))))
        body()
        return 0.5, False
    return events, timer
