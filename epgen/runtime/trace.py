"""The host side of the kernels' trace points (``epgen.kernels.trace``): each rank's trace
buffers, armed before a call and read after it into a ``Timeline``.

A world whose kernels declare ``trace_buf`` (built with ``cfg.tuning.trace``) allocates each
rank's buffer of each such kernel when it is made (``allocate``) and passes it; ``arm(world)`` resets every buffer (first slots
~0, last slots 0) and ``read(world)`` decodes them once the world has synchronised."""

from __future__ import annotations

import statistics

import numpy as np

from ..kernels import trace

UNSTAMPED = np.uint64(np.iinfo(np.uint64).max)


def armed(n_ranks: int, grid: int) -> np.ndarray:
    """One kernel's buffer before a call: ``[ranks, grid, points, (first, last)]`` u64, first
    slots ~0 (``red.min`` lowers them) and last slots 0 (``red.max`` raises them)."""
    a = np.zeros((n_ranks, grid, len(trace.POINTS), 2), np.uint64)
    a[..., 0] = UNSTAMPED
    return a


def allocate(world) -> None:
    """Every rank's armed trace buffer of each kernel of ``world.program`` that declares
    ``trace_buf``: a world's constructor calls it, as no allocation may happen while a
    round trip is being captured as a graph."""
    host = armed(world.cfg.n_ranks, world.cfg.n_sms).reshape(-1)
    for kernel in world.program.module.kernels:
        if any(p.name == trace.PARAM for p in kernel.params):
            for rk in world.ranks:
                rk.trace_bufs[kernel.name] = world.cuda.to_device(host, device=rk.device,
                                                                  stream=rk.stream)


def arm(world) -> None:
    """Reset every trace buffer of ``world`` (after its launches have finished)."""
    host = armed(world.cfg.n_ranks, world.cfg.n_sms).reshape(-1)
    for rk in world.ranks:
        for buf in rk.trace_bufs.values():
            buf.copy_from_host(host)


class Timeline:
    """One call's stamps: ``stamps[kernel]`` u64 ``[ranks, grid, points, (first, last)]``
    in ``%globaltimer`` ns, each rank's rows from its own buffer."""

    def __init__(self, stamps: dict):
        self.stamps = stamps

    def rows(self) -> list[tuple[str, str, float, float, int]]:
        """``(kernel, point, first_us, last_us, blocks)`` for every point some block reached,
        in order of first arrival: ``first`` the earliest warp of any rank's block there,
        ``last`` the latest, both in us after the call's earliest stamp; ``blocks`` how many
        (rank, block) pairs reached it."""
        firsts = [s[..., 0][s[..., 0] != UNSTAMPED] for s in self.stamps.values()]
        t0 = min((int(f.min()) for f in firsts if f.size), default=0)
        out = []
        for kernel, s in self.stamps.items():
            for i, point in enumerate(trace.POINTS):
                first = s[:, :, i, 0]
                hit = first != UNSTAMPED
                if not hit.any():
                    continue
                last = s[:, :, i, 1][hit]
                out.append((kernel, point, (int(first[hit].min()) - t0) / 1e3,
                            (int(last.max()) - t0) / 1e3, int(hit.sum())))
        return sorted(out, key=lambda row: (row[2], row[3]))


def read(world) -> Timeline:
    """The stamps of the last call, of the kernels it ran (the caller has synchronised the
    world)."""
    n, grid = world.cfg.n_ranks, world.cfg.n_sms
    stamps = {}
    for rk in world.ranks:
        for kernel, buf in rk.trace_bufs.items():
            own = buf.to_host().reshape(n, grid, len(trace.POINTS), 2)[rk.rank]
            stamps.setdefault(kernel, armed(n, grid))[rk.rank] = own
    # the kernels the call ran (a two-kernel world does not launch the fused one)
    return Timeline({k: s for k, s in stamps.items() if (s[..., 0] != UNSTAMPED).any()})


def median_rows(timelines: list[Timeline]) -> list[tuple[str, str, float, float, int]]:
    """Every call's ``rows()`` merged: per (kernel, point) the median first and last time
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
    """The timeline as a text table (us after the call's first stamp)."""
    lines = [title] if title else []
    lines.append(f"{'kernel':<20} {'point':<18} {'first us':>9} {'last us':>9} {'blocks':>7}")
    for kernel, point, first, last, blocks in rows:
        lines.append(f"{kernel:<20} {point:<18} {first:9.2f} {last:9.2f} {blocks:7d}")
    return "\n".join(lines)


__all__ = ["armed", "allocate", "arm", "Timeline", "read", "median_rows", "format_rows"]
