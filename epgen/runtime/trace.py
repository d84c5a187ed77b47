"""The host side of the kernels' trace rings (``epgen.kernels.trace``): each rank's trace
buffers, armed before a call and decoded after it into a ``Timeline``.

A world whose kernels declare ``trace_buf`` (built with ``cfg.tuning.trace``) allocates each
rank's buffer of each such kernel when it is made (``allocate``; the combine side when it is
built) and passes it; ``arm(world)`` zeroes every buffer (the rings' cursors) and
``read(world)`` decodes them once the world has synchronised. ``epgen.runtime.trace_export``
writes timelines as a Chrome trace-event (Perfetto) file; ``format_rows`` as a text table."""

from __future__ import annotations

import statistics

import numpy as np

from ..kernels import trace

#: one ring event as the kernels store it (``epgen.kernels.trace``)
EVENT_DTYPE = np.dtype([("t", "<u8"), ("event", "<u4"), ("rank", "<u4"), ("block", "<u4"),
                        ("warp", "<u4"), ("payload", "<u8")])
assert EVENT_DTYPE.itemsize == trace.EVENT_BYTES == trace.HEADER_BYTES
UNSTAMPED = np.uint64(np.iinfo(np.uint64).max)


def buffer_words(cfg) -> int:
    """u64 words of one kernel's trace buffer on one rank: ``n_sms * trace_rings_per_cta``
    rings of ``trace_ring_capacity`` events."""
    tuning = cfg.tuning
    n_rings = cfg.n_sms * tuning.trace_rings_per_cta
    return n_rings * trace.ring_bytes(tuning.trace_ring_capacity) // 8


def allocate(world, module=None) -> None:
    """Every rank's zeroed trace buffer of each kernel of ``module`` (default the world's
    dispatch module) that declares ``trace_buf``: made when the world (or its combine side)
    is, as no allocation may happen while a round trip is being captured as a graph."""
    module = module if module is not None else world.program.module
    host = np.zeros(buffer_words(world.cfg), np.uint64)
    for kernel in module.kernels:
        if any(p.name == trace.PARAM for p in kernel.params):
            for rk in world.ranks:
                rk.trace_bufs[kernel.name] = world.cuda.to_device(host, device=rk.device,
                                                                  stream=rk.stream)


def arm(world) -> None:
    """Zero every trace buffer of ``world`` (after its launches have finished)."""
    host = np.zeros(buffer_words(world.cfg), np.uint64)
    for rk in world.ranks:
        for buf in rk.trace_bufs.values():
            buf.copy_from_host(host)


def decode(words: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """One buffer's events (``EVENT_DTYPE``, ring by ring, in claim order) and how many a full
    ring dropped."""
    rings = np.ascontiguousarray(words).view(EVENT_DTYPE).reshape(-1, 1 + capacity)
    claimed = (rings["t"][:, 0] & 0xFFFFFFFF).astype(np.int64)     # the u32 cursor
    kept = np.minimum(claimed, capacity)
    events = [rings[q, 1:1 + k] for q, k in enumerate(kept) if k]
    out = np.concatenate(events) if events else np.zeros(0, EVENT_DTYPE)
    return out, int((claimed - kept).sum())


class Timeline:
    """One call's events: ``events[kernel]`` (``EVENT_DTYPE``: ``%globaltimer`` ns, the
    event's index in ``trace.EVENTS``, rank, block, warp, payload) of every kernel the call
    ran, ``dropped[kernel]`` the events full rings did not keep; ``n_ranks`` and ``grid``
    shape ``stamps``."""

    def __init__(self, events: dict, dropped: dict, n_ranks: int, grid: int):
        self.events, self.dropped = events, dropped
        self.n_ranks, self.grid = n_ranks, grid

    @property
    def stamps(self) -> dict:
        """Per kernel, u64 ``[ranks, grid, events, (first, last)]``: the earliest and latest
        time a warp of each rank's block recorded each event (first ~0 and last 0 where
        none did)."""
        out = {}
        for kernel, ev in self.events.items():
            s = np.zeros((self.n_ranks, self.grid, len(trace.EVENTS), 2), np.uint64)
            s[..., 0] = UNSTAMPED
            idx = (ev["rank"].astype(np.int64), ev["block"].astype(np.int64),
                   ev["event"].astype(np.int64))
            np.minimum.at(s[..., 0], idx, ev["t"])
            np.maximum.at(s[..., 1], idx, ev["t"])
            out[kernel] = s
        return out

    def t0(self) -> int:
        """The call's earliest event time (0 when there is none)."""
        return min((int(ev["t"].min()) for ev in self.events.values() if ev.size), default=0)

    def rows(self) -> list[tuple[str, str, float, float, int]]:
        """``(kernel, event, first_us, last_us, blocks)`` for every event some block
        recorded, in order of first arrival: ``first`` the earliest warp of any rank's block
        there, ``last`` the latest, both in us after the call's earliest event; ``blocks``
        how many (rank, block) pairs recorded it."""
        t0 = self.t0()
        out = []
        for kernel, ev in self.events.items():
            for i in np.unique(ev["event"]):
                mine = ev[ev["event"] == i]
                blocks = len({(int(a), int(b)) for a, b in zip(mine["rank"], mine["block"])})
                out.append((kernel, trace.EVENTS[i], (int(mine["t"].min()) - t0) / 1e3,
                            (int(mine["t"].max()) - t0) / 1e3, blocks))
        return sorted(out, key=lambda row: (row[2], row[3]))


def read(world) -> Timeline:
    """The events of the last call, of the kernels it ran (the caller has synchronised the
    world)."""
    cap = world.cfg.tuning.trace_ring_capacity
    events: dict = {}
    dropped: dict = {}
    for rk in world.ranks:
        for kernel, buf in rk.trace_bufs.items():
            ev, lost = decode(buf.to_host(), cap)
            events.setdefault(kernel, []).append(ev)
            dropped[kernel] = dropped.get(kernel, 0) + lost
    merged = {k: np.concatenate(v) for k, v in events.items()}
    # the kernels the call ran (a two-kernel world does not launch the fused one)
    ran = {k: ev for k, ev in merged.items() if ev.size}
    return Timeline(ran, {k: dropped[k] for k in ran}, world.cfg.n_ranks, world.cfg.n_sms)


def median_rows(timelines: list[Timeline]) -> list[tuple[str, str, float, float, int]]:
    """Every call's ``rows()`` merged: per (kernel, event) the median first and last time
    over the calls that reached it, and the most blocks one call had there; in order of the
    median first time."""
    merged: dict[tuple[str, str], list] = {}
    for tl in timelines:
        for kernel, point, first, last, blocks in tl.rows():
            merged.setdefault((kernel, point), []).append((first, last, blocks))
    out = [(k, p, statistics.median(v[0] for v in vals),
            statistics.median(v[1] for v in vals), max(v[2] for v in vals))
           for (k, p), vals in merged.items()]
    return sorted(out, key=lambda row: (row[2], row[3]))


def format_rows(rows, title: str = "") -> str:
    """The timeline as a text table (us after the call's first event)."""
    lines = [title] if title else []
    lines.append(f"{'kernel':<20} {'event':<24} {'first us':>9} {'last us':>9} {'blocks':>7}")
    for kernel, point, first, last, blocks in rows:
        lines.append(f"{kernel:<20} {point:<24} {first:9.2f} {last:9.2f} {blocks:7d}")
    return "\n".join(lines)


__all__ = ["EVENT_DTYPE", "UNSTAMPED", "buffer_words", "allocate", "arm", "decode",
           "Timeline", "read", "median_rows", "format_rows"]
