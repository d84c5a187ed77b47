"""``backends.cuda.graph`` over a fake driver: the capture ends (and its graph is freed) when
the block raises, a capture that yields no graph is an error naming the call, every failing
driver call raises ``CudaError`` with its name, and a refused update is ``False``."""

from __future__ import annotations

import enum
import types

import pytest

from backends.cuda import CudaError, compat
from backends.cuda import graph as G


class R(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910


class FakeDriver:
    CUresult = R

    class CUstreamCaptureMode(enum.IntEnum):
        CU_STREAM_CAPTURE_MODE_RELAXED = 2

    def __init__(self):
        self.calls = []
        self.end_graph = 77
        self.fail = set()

    def CUstream(self, h):
        return h

    def _r(self, name, *out):
        self.calls.append(name)
        err = R.CUDA_ERROR_INVALID_VALUE if name in self.fail else R.CUDA_SUCCESS
        return (err, *out)

    def cuStreamBeginCapture(self, h, mode):
        return self._r("begin")

    def cuStreamEndCapture(self, h):
        return self._r("end", self.end_graph)

    def cuGraphDestroy(self, g):
        return self._r("destroy")

    def cuGraphInstantiate(self, g, flags):
        return self._r("instantiate", 5)

    def cuGraphLaunch(self, e, h):
        return self._r("launch")

    def cuGraphExecUpdate(self, e, g):
        self.calls.append("update")
        return (R.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE if "update" in self.fail
                else R.CUDA_SUCCESS, None)

    def cuGraphExecDestroy(self, e):
        return self._r("exec destroy")

    def cuGetErrorName(self, err):
        return (R.CUDA_SUCCESS, R(err).name.encode())

    def cuGetErrorString(self, err):
        return (R.CUDA_SUCCESS, b"fake")


@pytest.fixture
def drv(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(compat, "driver", lambda: d)
    return d


STREAM = types.SimpleNamespace(handle=3, device=types.SimpleNamespace(set_current=lambda: None))


def test_capture_records_a_graph(drv):
    with G.capture(STREAM) as cap:
        assert drv.calls == ["begin"]
    assert cap.graph == 77
    cap.destroy()
    assert drv.calls == ["begin", "end", "destroy"] and cap.graph is None


def test_an_error_inside_ends_the_capture_and_frees_its_graph(drv):
    with pytest.raises(KeyError, match="inside"):
        with G.capture(STREAM):
            raise KeyError("inside")
    assert drv.calls == ["begin", "end", "destroy"]


def test_no_graph_is_an_error(drv):
    drv.end_graph = 0
    with pytest.raises(CudaError, match="returned no graph"):
        with G.capture(STREAM):
            pass


@pytest.mark.parametrize("call,name", [("begin", "cuStreamBeginCapture"),
                                       ("end", "cuStreamEndCapture")])
def test_failing_capture_calls_raise(drv, call, name):
    drv.fail.add(call)
    with pytest.raises(CudaError, match=f"{name}: CUDA_ERROR_INVALID_VALUE"):
        with G.capture(STREAM):
            pass


def test_exec_launch_update_destroy(drv):
    e = G.GraphExec(77)
    e.launch(STREAM)
    assert e.update(78) is True
    drv.fail.add("update")
    assert e.update(79) is False
    e.destroy()
    e.destroy()                                     # a second destroy does nothing
    assert drv.calls == ["instantiate", "launch", "update", "update", "exec destroy"]
    drv.fail.add("launch")
    with pytest.raises(CudaError, match="cuGraphLaunch"):
        G.GraphExec(77).launch(STREAM)
