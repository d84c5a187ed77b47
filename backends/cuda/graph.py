"""CUDA graphs by stream capture, over the raw driver API (``cuda.bindings.driver``).

``capture(origin)`` is a context manager: between ``cuStreamBeginCapture`` (relaxed mode) and
``cuStreamEndCapture`` on ``origin``, work enqueued on ``origin``, and on any stream that
waits on an event recorded on a capturing stream, is recorded into a graph instead of run;
every stream so forked must be joined back into ``origin`` (an event recorded on it that
``origin`` waits on) before the block ends. The block yields a ``Captured`` whose ``graph``
is set on exit. ``GraphExec`` instantiates a graph (``cuGraphInstantiate``), replays it on a
stream (``cuGraphLaunch``) and takes the parameters of a topologically identical graph
(``cuGraphExecUpdate``). Every driver call's result is checked (``CudaError`` names it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import compat
from .errors import CudaError, check

__all__ = ["Captured", "GraphExec", "capture", "stream_handle"]


def stream_handle(stream):
    """The ``CUstream`` of a cuda.core ``Stream``."""
    return compat.driver().CUstream(int(stream.handle))


class Captured:
    """The graph a ``capture`` block recorded (``graph``: a ``CUgraph``, or None until the
    block ends); ``destroy()`` frees it (``cuGraphDestroy``)."""

    def __init__(self):
        self.graph = None

    def destroy(self) -> None:
        if self.graph is not None:
            check(compat.driver().cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.graph = None


@contextlib.contextmanager
def capture(origin) -> Iterator[Captured]:
    """Record the work enqueued inside the block into a graph (module docstring). When the
    block raises, the capture is ended and its graph discarded before the error propagates."""
    drv = compat.driver()
    h = stream_handle(origin)
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    origin.device.set_current()
    check(drv.cuStreamBeginCapture(h, mode), "cuStreamBeginCapture")
    out = Captured()
    try:
        yield out
    except BaseException:
        # leave capture mode so the stream stays usable; the block's own error is the one
        # to report, so these two results are not raised over it
        err, graph = drv.cuStreamEndCapture(h)
        if int(err) == 0 and graph is not None and int(graph) != 0:
            drv.cuGraphDestroy(graph)
        raise
    out.graph = check(drv.cuStreamEndCapture(h), "cuStreamEndCapture")
    if out.graph is None or int(out.graph) == 0:
        raise CudaError("cuStreamEndCapture returned no graph (a forked stream was not joined "
                        "back into the origin stream?)", call="cuStreamEndCapture")


class GraphExec:
    """An instantiated graph: ``launch(stream)`` replays it, ``update(graph)`` takes the node
    parameters of a topologically identical graph (False when the driver refuses: then
    instantiate again), ``destroy()`` frees it."""

    def __init__(self, graph):
        self.handle = check(compat.driver().cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self, stream) -> None:
        check(compat.driver().cuGraphLaunch(self.handle, stream_handle(stream)), "cuGraphLaunch")

    def update(self, graph) -> bool:
        drv = compat.driver()
        err, _info = drv.cuGraphExecUpdate(self.handle, graph)
        if int(err) == int(drv.CUresult.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE):
            return False
        check((err,), "cuGraphExecUpdate")
        return True

    def destroy(self) -> None:
        if self.handle is not None:
            check(compat.driver().cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
            self.handle = None
