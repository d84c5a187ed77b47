"""Stream plumbing of the torch API on raw CUDA stream handles (what torch gives:
``torch.cuda.Stream.cuda_stream``): forking the ranks' streams from the caller's stream and
joining them back with events made once, and the packing 2-D copy of a strided input."""

from __future__ import annotations

from backends.cuda import compat, raw_driver
from backends.cuda.errors import check


class Lanes:
    """The rank streams ``streams`` (cuda.core streams, possibly on several GPUs) as lanes
    of a caller's stream: ``fork(handle)`` makes each wait for the caller's work so far,
    ``join(handle)`` makes the caller wait for each (``cuEventRecord`` +
    ``cuStreamWaitEvent`` through ``raw_driver`` on raw handles; non-timing events created
    once, each in its stream's context). Inside a stream capture the fork and the join are
    the capture's edges."""

    def __init__(self, streams):
        drv = compat.driver()
        self.streams = list(streams)
        self.handles = [int(s.handle) for s in self.streams]
        #: every lane on one GPU
        self.one_device = len({s.device.device_id for s in self.streams}) == 1
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._events = []          # the cuda-bindings objects, which own the events
        for s in self.streams:
            s.device.set_current()
            self._events.append(check(drv.cuEventCreate(flags), "cuEventCreate"))
        self.streams[0].device.set_current()
        self._events.append(check(drv.cuEventCreate(flags), "cuEventCreate"))
        self.join_events = [int(e) for e in self._events[:-1]]
        self.fork_event = int(self._events[-1])

    def fork(self, caller: int) -> None:
        raw_driver.event_record(self.fork_event, caller)
        for h in self.handles:
            raw_driver.stream_wait_event(h, self.fork_event)

    def join(self, caller: int) -> None:
        for h, ev in zip(self.handles, self.join_events):
            raw_driver.event_record(ev, h)
            raw_driver.stream_wait_event(caller, ev)


class Producers:
    """Orders a caller's stream after the producers of another library's inputs: a DLPack
    object is asked to order its stream before the caller's (``__dlpack__(stream=caller)``),
    a ``__cuda_array_interface__`` array that names its stream is waited on with an event
    (one non-timing event, made on first use and re-recorded). A torch tensor needs nothing:
    its producer is torch's current stream, the caller's stream by torch's rules."""

    def __init__(self, device):
        self.device, self.event = device, None

    def order(self, info, caller: int) -> None:
        """``info``: an ``interop.ArrayInfo`` of a device input (None: a torch tensor)."""
        if info is None:
            return
        if isinstance(info.obj, tuple):
            # DLPack names the legacy default stream 1 (0 is not allowed)
            info.obj[0].__dlpack__(stream=caller or 1)
            return
        if info.stream is None:
            return
        if self.event is None:
            drv = compat.driver()
            self.device.set_current()
            self._event = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                                "cuEventCreate")
            self.event = int(self._event)
        raw_driver.event_record(self.event, int(info.stream))
        raw_driver.stream_wait_event(caller, self.event)


def copy_rows(dst: int, src: int, pitch: int, row_bytes: int, rows: int, stream: int,
              device) -> None:
    """Pack ``rows`` rows of ``row_bytes`` bytes, ``pitch`` apart from ``src``, to ``dst``
    on the raw stream ``stream`` (``cuMemcpy2DAsync``)."""
    drv = compat.driver()
    m = drv.CUDA_MEMCPY2D()
    m.srcMemoryType = m.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcDevice, m.srcPitch = int(src), int(pitch)
    m.dstDevice, m.dstPitch = int(dst), int(row_bytes)
    m.WidthInBytes, m.Height = int(row_bytes), int(rows)
    device.set_current()
    check(drv.cuMemcpy2DAsync(m, drv.CUstream(stream)), "cuMemcpy2DAsync")


__all__ = ["Lanes", "Producers", "copy_rows"]
