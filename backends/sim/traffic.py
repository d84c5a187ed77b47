"""The simulator's traffic counter: the bytes each owner's threads write into memory, by
(source owner, destination owner, destination buffer, kind), so a test can read the bytes
that crossed between GPUs (or between the ranks an emulated world keeps on one GPU) and
compare them with a model of the protocol (``epgen.bench.link_bytes``).

Off by default (``Machine.count_traffic()`` turns it on); while off the interpreter pays one
attribute test per global store or atomic. What it counts, at the moment a thread issues it:

* ``store``: a plain (weak, volatile or relaxed) store; ``release``: a release store;
  ``atomic``: an atomic read-modify-write or compare-and-swap (its operand's bytes, whether
  or not a CAS swaps);
* ``put``: the data of an NVSHMEM put; ``put_signal``: the 8-byte signal of a
  put-with-signal; ``signal``: an ``nvshmemx_signal_op``.

Owners: a launch's threads belong to its stream's owner, a byte to the owner of the
allocation that holds it; by default both are the GPU (the stream's device, the allocation's
device). ``Machine.assign_traffic_owner`` names other owners (an emulated world's ranks) and
buffer labels. Writes to memory no allocation of the machine holds (shared memory) are not
counted; a launch without a stream (a graph replay, ``GraphExec.launch``) counts as owner
None.
"""

from __future__ import annotations

import bisect
import collections

import attrs

KINDS = ("store", "release", "atomic", "put", "put_signal", "signal")
"""What a counted write is (module docstring)."""


class Ranges:
    """Disjoint address ranges ``[start, end)`` with an ``(owner, label)`` each, looked up by
    address."""

    def __init__(self):
        self._starts: list[int] = []
        self._rows: list[tuple[int, object, str | None]] = []     # end, owner, label

    def add(self, start: int, nbytes: int, owner, label: str | None = None) -> None:
        """Cover ``[start, start + nbytes)`` with ``(owner, label)``: a range with the same
        start is replaced; a partial overlap is a ``ValueError``."""
        end = start + max(int(nbytes), 1)
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            del self._starts[i], self._rows[i]
        if (i > 0 and self._rows[i - 1][0] > start) or \
                (i < len(self._starts) and self._starts[i] < end):
            raise ValueError(f"traffic: the range [{start:#x}, {end:#x}) overlaps another")
        self._starts.insert(i, start)
        self._rows.insert(i, (end, owner, label))

    def find(self, addr: int):
        """``(owner, label)`` of the range holding ``addr``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._rows[i][0]:
            return None
        return self._rows[i][1:]


@attrs.frozen
class Traffic:
    """Counted bytes by ``(source owner, destination owner, buffer label, kind)``."""

    records: dict

    def total(self, *, kinds=None, buffers=None, remote: bool | None = True) -> int:
        """Bytes of the records whose kind is in ``kinds`` and label in ``buffers`` (None:
        any); ``remote``: True counts only source != destination, False only source ==
        destination, None both."""
        n = 0
        for (src, dst, label, kind), b in self.records.items():
            if kinds is not None and kind not in kinds:
                continue
            if buffers is not None and label not in buffers:
                continue
            if remote is not None and (src != dst) != remote:
                continue
            n += b
        return n

    def by_pair(self, **filters) -> dict:
        """``{(source, destination): bytes}`` of the records ``total(**filters)`` counts."""
        out: dict = collections.defaultdict(int)
        for key, b in self.records.items():
            if Traffic({key: b}).total(**filters):
                out[key[:2]] += b
        return dict(out)


class TrafficCounter:
    """The running count (module docstring): ``allocations`` (a ``Ranges`` of every
    allocation's device) gives the default owners."""

    def __init__(self, allocations: Ranges):
        self.allocations = allocations
        self.assigned = Ranges()
        self.stream_owner: dict = {}
        self.counts: dict = collections.defaultdict(int)

    def assign(self, owner, streams=(), buffers=None) -> None:
        """``owner`` owns the launches of ``streams`` and the memory of ``buffers``
        (``{label: array}``; each array's ``ptr`` and ``nbytes``)."""
        for s in streams:
            self.stream_owner[s] = owner
        for label, arr in (buffers or {}).items():
            self.assigned.add(arr.ptr, arr.nbytes, owner, label)

    def owner_of_stream(self, stream):
        if stream is None:
            return None
        return self.stream_owner.get(stream, stream.device)

    def note(self, stream, addr: int, nbytes: int, kind: str) -> None:
        """A write of ``nbytes`` at ``addr`` by a thread of a launch on ``stream``."""
        hit = self.assigned.find(addr) or self.allocations.find(addr)
        if hit is None:
            return
        dst, label = hit
        self.counts[(self.owner_of_stream(stream), dst, label, kind)] += nbytes

    def read(self, reset: bool = False) -> Traffic:
        """The counts so far (then zero them with ``reset``)."""
        out = Traffic(dict(self.counts))
        if reset:
            self.counts.clear()
        return out
