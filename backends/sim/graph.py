"""CUDA graphs by stream capture on ``backends.sim``: the counterpart of
``backends.cuda.graph`` (``capture(origin)``, ``GraphExec(graph)`` with ``launch(stream)``,
``update(graph)``, ``destroy()``), reached as ``machine.graph``.

As in CUDA: while a capture is open, launches on the origin stream and on every stream that
joined it are recorded as graph nodes (with the dependencies they had among recorded nodes;
work enqueued before the capture is not a dependency) and not run; at the end each stream
touched gets back its state from before the capture. Memory operations while capturing are
refused (as the stream-ordered pool refuses allocations in a capture). A replay launches the
nodes on the machine after the stream's earlier work, and the stream's next work waits for
all of them. ``update`` takes the parameters of a graph of the same shape (same kernels,
same edges) and refuses (returns False) any other.

What it does not model: one capture at a time per machine (CUDA allows one per stream),
and relaxed capture's other rules (e.g. which API calls a capture forbids) beyond the memory
operations above.
"""

from __future__ import annotations

import contextlib
import types


class Node:
    """One recorded launch (``shmem``: its dynamic shared memory bytes per block)."""

    def __init__(self, kernel, grid, params, deps, shmem: int = 0):
        self.kernel, self.grid, self.params, self.deps = kernel, grid, params, deps
        self.shmem = shmem


class AllOf:
    """What a stream waits on after a replay: every node's launch finished."""

    def __init__(self, launches):
        self.launches = launches

    @property
    def finished(self) -> bool:
        return all(la.finished for la in self.launches)


class Capture:
    """The open capture of a machine: the nodes recorded so far and the streams it touched,
    each with its state from before the capture."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.saved: dict = {}

    def touch(self, stream) -> None:
        if id(stream) not in self.saved:
            self.saved[id(stream)] = (stream, stream.last, list(stream.waits))
            stream.last, stream.waits = None, []


class GraphExec:
    """An instantiated graph (a list of ``Node``); ``instances``: every one made (tests
    count them)."""

    instances: list = []

    def __init__(self, nodes):
        self.nodes = list(nodes)
        self.replays = 0
        GraphExec.instances.append(self)

    def launch(self, stream) -> None:
        before = stream.take_dependencies()
        machine = stream.machine
        done = {}
        for node in self.nodes:
            after = [done[id(d)] for d in node.deps] if node.deps else before
            done[id(node)] = machine.sim.launch(node.kernel, node.grid, node.params,
                                                after=after, shmem=node.shmem)
        stream.last = AllOf(list(done.values()))
        self.replays += 1

    def update(self, nodes) -> bool:
        shape = [(n.kernel.name, [self.nodes.index(d) for d in n.deps]) for n in self.nodes]
        new = [(n.kernel.name, [nodes.index(d) for d in n.deps]) for n in nodes]
        if shape != new:
            return False
        self.nodes = list(nodes)
        return True

    def destroy(self) -> None:
        pass


def graph_api(machine) -> types.SimpleNamespace:
    """``machine.graph``: ``capture`` and ``GraphExec`` as ``backends.cuda.graph`` has them."""

    @contextlib.contextmanager
    def capture(origin):
        if machine.capture is not None:
            raise RuntimeError("sim: one capture at a time")
        machine.capture = Capture()
        machine.capture.touch(origin)
        cap = types.SimpleNamespace(graph=None, destroy=lambda: None)
        try:
            yield cap
            cap.graph = machine.capture.nodes
        finally:
            for stream, last, waits in machine.capture.saved.values():
                stream.last, stream.waits = last, waits
            machine.capture = None

    return types.SimpleNamespace(capture=capture, GraphExec=GraphExec)
