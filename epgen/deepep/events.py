"""``EventOverlap``: DeepEP's event wrapper, returned by every call with ``async_finish``
and by ``Buffer.capture()``.

epgen enqueues its kernels on the caller's current stream (DeepEP launches on its own
communication stream), so a call's work is already ordered before whatever the current
stream runs next; the event marks the end of the call's kernels, so another stream can wait
for them (``current_stream_wait`` from that stream). On the simulator (CPU tensors) calls are
synchronous and the event is empty.
"""

from __future__ import annotations


class EventOverlap:
    """An optional CUDA event (``torch.cuda.Event``) and the tensors to keep alive until it
    has been waited for (``extra_tensors``)."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (nothing to wait for on the CPU)."""
        if self.event is not None:
            import torch
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """DeepEP's ``with event:`` overlap idiom: the current stream waits at the exit."""
        self.current_stream_wait()
        return False


def record(torch, on_cuda: bool, tensors=None) -> EventOverlap:
    """An ``EventOverlap`` of an event recorded now on the current stream (an empty one on
    the CPU)."""
    if not on_cuda:
        return EventOverlap(None, tensors)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event, tensors)


__all__ = ["EventOverlap", "record"]
