"""CUDA graphs on the simulator: a stand-in for ``backends.cuda.graph`` that
``epgen.runtime.graph`` uses in the simulator tests (``sim_world``), so ``RoundTripGraph``
runs the real kernels' IR without a GPU.

As in CUDA: while a capture is open, launches on the origin stream and on every stream that
joined it are recorded as graph nodes (with the dependencies they had among recorded nodes;
work enqueued before the capture is not a dependency) and not run; at the end each stream
touched gets back its state from before the capture. A replay launches the nodes on the
simulator after the stream's earlier work, and the stream's next work waits for all of them.
``update`` takes the parameters of a graph of the same shape.
"""

from __future__ import annotations

import contextlib
import types


class Node:
    """One recorded launch."""

    def __init__(self, kernel, grid, params, deps):
        self.kernel, self.grid, self.params, self.deps = kernel, grid, params, deps


class AllOf:
    """What a stream waits on after a replay: every node's launch finished."""

    def __init__(self, launches):
        self.launches = launches

    @property
    def finished(self) -> bool:
        return all(la.finished for la in self.launches)


class Recorder:
    """The open capture (``nodes`` is None when there is none) and the streams it touched,
    each with its state from before the capture."""

    nodes = None
    saved: dict = {}

    @classmethod
    def touch(cls, stream):
        if cls.nodes is not None and id(stream) not in cls.saved:
            cls.saved[id(stream)] = (stream, stream.last, list(stream.waits))
            stream.last, stream.waits = None, []


def launch(sim, stream, kernel, grid, params):
    """``FakeProgram.launch``'s body: run on the simulator, or record while capturing."""
    Recorder.touch(stream)
    deps = ([stream.last] if stream.last is not None else []) + stream.waits
    stream.waits = []
    if Recorder.nodes is None:
        stream.last = sim.launch(kernel, grid, params, after=deps)
        return
    node = Node(kernel, grid, params, [d for d in deps if isinstance(d, Node)])
    Recorder.nodes.append(node)
    stream.last = node


def wait(stream, event_launch):
    """``FakeStream.wait``'s body."""
    Recorder.touch(stream)
    if event_launch is not None:
        stream.waits.append(event_launch)


@contextlib.contextmanager
def capture(origin):
    if Recorder.nodes is not None:
        raise RuntimeError("sim_graph: one capture at a time")
    Recorder.nodes, Recorder.saved = [], {}
    Recorder.touch(origin)
    cap = types.SimpleNamespace(graph=None, destroy=lambda: None)
    try:
        yield cap
        cap.graph = Recorder.nodes
    finally:
        for stream, last, waits in Recorder.saved.values():
            stream.last, stream.waits = last, waits
        Recorder.nodes, Recorder.saved = None, {}


class GraphExec:
    instances = []             # every GraphExec made (tests count them)

    def __init__(self, nodes):
        self.nodes = list(nodes)
        self.replays = 0
        GraphExec.instances.append(self)

    def launch(self, stream):
        before = ([stream.last] if stream.last is not None else []) + stream.waits
        stream.waits = []
        sim = stream.sim
        done = {}
        for node in self.nodes:
            after = [done[id(d)] for d in node.deps] if node.deps else before
            done[id(node)] = sim.launch(node.kernel, node.grid, node.params, after=after)
        stream.last = AllOf(list(done.values()))
        self.replays += 1

    def update(self, nodes) -> bool:
        shape = [(n.kernel.name, [self.nodes.index(d) for d in n.deps]) for n in self.nodes]
        new = [(n.kernel.name, [nodes.index(d) for d in n.deps]) for n in nodes]
        if shape != new:
            return False
        self.nodes = list(nodes)
        return True

    def destroy(self):
        pass


module = types.SimpleNamespace(capture=capture, GraphExec=GraphExec)
