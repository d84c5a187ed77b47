"""Streams and events of ``backends.sim``, with CUDA's ordering.

A ``Stream`` remembers its last launch (``last``) and the events it was told to wait for
since (``waits``); the next launch on it depends on both, so launches of one stream run in
order and a launch after ``stream.wait(event)`` starts only once the work the event stands
for has finished. An ``Event`` (``stream.record()``, ``record_event(stream)``) stands for the
recording stream's last launch at that moment. ``sync()`` runs every queued launch of the
machine (not only the stream's: the simulator has one queue).

What it does not model: time (no event timing, no priorities), and concurrency beyond the
dependencies: launches without an ordering between them run interleaved, thread by thread,
in the machine's seeded order, which is as much overlap as the GPU allows and more.
"""

from __future__ import annotations


class Event:
    """The work a stream had enqueued when the event was recorded (None: nothing)."""

    def __init__(self, launch):
        self.launch = launch


class Stream:
    """A stream of GPU ``device`` of ``machine``."""

    def __init__(self, machine, device: int = 0):
        self.machine = machine
        self.device = int(device)
        self.last = None            # the last launch (or recorded graph node, or replay)
        self.waits: list = []       # what the next launch waits for besides ``last``

    def __repr__(self) -> str:
        return f"sim.Stream(device={self.device})"

    def wait(self, event: Event) -> None:
        self.machine.touch(self)
        if event.launch is not None:
            self.waits.append(event.launch)

    def record(self) -> Event:
        self.machine.touch(self)
        return Event(self.last)

    def take_dependencies(self) -> list:
        """What the next launch on this stream waits for (the waits are consumed)."""
        self.machine.touch(self)
        deps = ([self.last] if self.last is not None else []) + self.waits
        self.waits = []
        return deps

    def sync(self) -> None:
        self.machine.drain()


def record_event(stream: Stream) -> Event:
    return stream.record()
