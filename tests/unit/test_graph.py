"""``RoundTripGraph``'s host logic without a GPU: the capture's fork and join around the
world's launches, the ordering of a replay with the rank streams, frozen launch arguments,
and no re-capture ever (``ep_prod_reserve``'s generation advances on the device). The CUDA calls are fakes that log what they would
enqueue; tests/gpu/test_graph_gpu.py runs the real thing."""

from __future__ import annotations

import contextlib
import types

import pytest

from epgen.runtime import graph as G


class Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait(self, event):
        self.log.append(("wait", self.name, event))


class Buf:
    def __init__(self, ptr):
        self.ptr = ptr


class Rank:
    def __init__(self, r, log):
        self.rank, self.stream = r, Stream(f"rank{r}", log)
        self.tokens, self.topk_ids, self.n_tokens = Buf(100 + r), Buf(200 + r), 8
        self.wait_done = f"old{r}"


class World:
    def __init__(self, log, prod=False):
        self.log = log
        self.cfg = types.SimpleNamespace(ep_prod_reserve=prod)
        self.ranks = [Rank(r, log) for r in range(2)]
        self.timeout_ns, self.input_scale = 10, 1.0

    def enqueue_round_trip(self):
        for rk in self.ranks:
            assert rk.wait_done in (None, "captured"), "a capture waited on an outside event"
            self.log.append(("round trip", rk.rank))
            rk.wait_done = "captured"


@pytest.fixture
def fake(monkeypatch):
    log = []
    n = iter(range(1000))

    @contextlib.contextmanager
    def capture(origin):
        log.append(("begin capture", origin.name))
        cap = types.SimpleNamespace(graph=None, destroy=lambda: log.append(("destroy graph",)))
        yield cap
        cap.graph = f"graph{next(n)}"
        log.append(("end capture", cap.graph))

    class Exec:
        def __init__(self, graph):
            self.graph = graph
            log.append(("instantiate", graph))

        def launch(self, stream):
            log.append(("graph launch", stream.name, self.graph))

        def destroy(self):
            log.append(("destroy exec", self.graph))

    monkeypatch.setattr(G, "cuda_graph", types.SimpleNamespace(capture=capture,
                                                               GraphExec=Exec))
    import backends.cuda as cuda

    def record_event(stream):
        e = f"ev{next(n)}@{stream.name}"
        log.append(("record", stream.name, e))
        return e
    monkeypatch.setattr(cuda, "record_event", record_event)
    return log, Exec


def test_capture_forks_every_rank_and_joins_back(fake):
    log, _ = fake
    w = World(log)
    g = G.RoundTripGraph(w, calls=2, stream=Stream("origin", log))
    kinds = [e[0] for e in log]
    assert kinds[0] == "begin capture"
    fork = log[1][2]
    assert log[1][:2] == ("record", "origin")
    assert log[2:4] == [("wait", "rank0", fork), ("wait", "rank1", fork)]
    assert [e for e in log if e[0] == "round trip"] == [("round trip", r)
                                                        for _ in range(2) for r in range(2)]
    end = kinds.index("end capture")
    joins = [e for e in log[:end] if e[:2] == ("wait", "origin")]
    assert len(joins) == 2                          # every rank joined back into the origin
    assert kinds[end + 1:] == ["instantiate", "destroy graph"]
    assert [rk.wait_done for rk in w.ranks] == ["old0", "old1"]   # restored after the capture


def test_launch_orders_after_and_before_the_rank_streams(fake):
    log, _ = fake
    w = World(log)
    g = G.RoundTripGraph(w, stream=Stream("origin", log))
    del log[:]
    g.launch()
    kinds = [e[0] for e in log]
    i = kinds.index("graph launch")
    assert [e[:2] for e in log[:i] if e[0] == "wait"] == [("wait", "origin")] * 2
    done = log[i + 1]
    assert done[:2] == ("record", "origin")
    assert log[i + 2:] == [("wait", "rank0", done[2]), ("wait", "rank1", done[2])]
    assert [rk.wait_done for rk in w.ranks] == [done[2]] * 2
    assert "begin capture" not in kinds                # no re-capture without prod_reserve


CHANGES = {
    "rank 1 n_tokens": lambda w: setattr(w.ranks[1], "n_tokens", 4),
    "rank 0 tokens buffer": lambda w: setattr(w.ranks[0], "tokens", Buf(7)),
    "rank 1 topk_ids buffer": lambda w: setattr(w.ranks[1], "topk_ids", Buf(7)),
    "input_scale": lambda w: setattr(w, "input_scale", 2.0),
    "timeout_ns": lambda w: setattr(w, "timeout_ns", 0),
}


@pytest.mark.parametrize("name", CHANGES)
def test_changed_arguments_refused_before_anything_is_enqueued(fake, name):
    log, _ = fake
    w = World(log)
    g = G.RoundTripGraph(w, stream=Stream("origin", log))
    CHANGES[name](w)
    del log[:]
    with pytest.raises(ValueError, match=f"{name} changed since the capture"):
        g.launch()
    assert log == []


def test_prod_reserve_replays_the_graph_unchanged(fake):
    """The generation is the kernels' own: every replay is one graph launch, with no
    re-capture and no update."""
    log, _ = fake
    w = World(log, prod=True)
    g = G.RoundTripGraph(w, calls=2, stream=Stream("origin", log))
    del log[:]
    for _ in range(3):
        g.launch()
    kinds = [e[0] for e in log]
    assert kinds.count("graph launch") == 3
    assert not {"begin capture", "update", "instantiate"} & set(kinds)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_calls_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="calls must be a positive integer"):
        G.RoundTripGraph(None, calls=bad)


def test_launch_after_close_is_refused(fake):
    log, _ = fake
    g = G.RoundTripGraph(World(log), stream=Stream("origin", log))
    g.close()
    assert log[-1][0] == "destroy exec"
    with pytest.raises(ValueError, match="after close"):
        g.launch()


def test_with_block_closes_the_graph(fake):
    log, _ = fake
    with G.RoundTripGraph(World(log), stream=Stream("origin", log)) as g:
        g.launch()
        assert g.exec is not None
    assert g.exec is None and log[-1][0] == "destroy exec"
