"""Timelines (``epgen.runtime.trace``) as a Chrome trace-event file, which ui.perfetto.dev and
chrome://tracing open: ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}``.

One process per rank (``pid = rank + 1``, named ``rank R``) and in it one thread, i.e. one
track, per (kernel, role, block) that recorded events (named ``<kernel> <role> block B``;
role names are unique across the kernels one call runs). On each track, per call:

- a complete event (``"ph": "X"``) named after the role, from the first warp's
  ``<role>.begin`` to the last warp's ``<role>.end`` (only when both were kept);
- an instant event (``"ph": "i"``, ``"s": "t"``) per hand-off event (``copy.tile``,
  ``copy.l1_release``, ...), named after it, with the warp, the payload and its decoded
  fields in ``args``.

Timestamps are microseconds (``ts``, floats) after the earliest event of the first call, from
``%globaltimer`` nanoseconds; on the simulator the clock is its counter of ``%globaltimer``
reads, shown as nanoseconds. Events are sorted by time, so each track's are in order.
``validate`` checks a document against these rules (the tests run it on every export).
"""

from __future__ import annotations

import json
import math

from ..kernels import trace

PHASES = ("X", "i", "M")
METADATA = ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
#: hand-off events whose payload is ``a << 32 | b``: the names of ``a`` and ``b``
PAYLOAD_FIELDS = {"copy.tile": ("expert", "tile"), "copy.l1_release": ("expert", "token_block"),
                  "ffn.l1_seen": (None, "expert"), "send.arrival_raised": (None, "source")}
TID_STRIDE = 1 << 20


def _payload_args(name: str, payload: int) -> dict:
    args = {"payload": payload if payload < 2**53 else hex(payload)}
    hi, lo = PAYLOAD_FIELDS.get(name, (None, None))
    if hi is not None:
        args[hi] = payload >> 32
    if lo is not None:
        args[lo] = payload & 0xFFFFFFFF
    return args


def chrome_trace(timelines, *, clock: str = "globaltimer") -> dict:
    """The trace-event document of ``timelines`` (one ``Timeline`` per call, in call order);
    ``clock`` names the time source in ``otherData``."""
    timelines = list(timelines)
    t0 = min((tl.t0() for tl in timelines if tl.events), default=0)
    tracks: dict[tuple, int] = {}      # (rank, kernel, role, block) -> tid
    kernels: list[str] = []
    timed: list[dict] = []
    dropped = 0

    def us(t) -> float:
        return (int(t) - t0) / 1e3

    for call, tl in enumerate(timelines):
        dropped += sum(tl.dropped.values())
        for kernel, ev in tl.events.items():
            if kernel not in kernels:
                kernels.append(kernel)
            spans: dict[tuple, dict] = {}
            for e in ev:
                name = trace.EVENTS[int(e["event"])]
                role, point = name.split(".", 1)
                rank, block = int(e["rank"]), int(e["block"])
                key = (rank, kernel, role, block)
                tid = tracks.setdefault(key, (rank + 1) * TID_STRIDE + len(tracks))
                if point in ("begin", "end"):
                    span = spans.setdefault(key, {"tid": tid, "warps": set()})
                    span.setdefault(point, []).append(int(e["t"]))
                    span["warps"].add(int(e["warp"]))
                    continue
                timed.append({"name": name, "ph": "i", "s": "t", "ts": us(e["t"]),
                              "pid": rank + 1, "tid": tid, "cat": kernel,
                              "args": {"kernel": kernel, "call": call, "warp": int(e["warp"]),
                                       **_payload_args(name, int(e["payload"]))}})
            for (rank, _, role, block), span in spans.items():
                if "begin" in span and "end" in span:
                    start, end = min(span["begin"]), max(span["end"])
                    timed.append({"name": role, "ph": "X", "ts": us(start),
                                  "dur": max(end - start, 0) / 1e3, "pid": rank + 1,
                                  "tid": span["tid"], "cat": kernel,
                                  "args": {"kernel": kernel, "call": call, "block": block,
                                           "warps": len(span["warps"])}})
    # by time; at one time a track's span opens before its instants
    timed.sort(key=lambda d: (d["ts"], d["ph"] != "X"))
    meta = []
    for rank in sorted({key[0] for key in tracks}):
        meta.append({"name": "process_name", "ph": "M", "pid": rank + 1, "tid": 0,
                     "args": {"name": f"rank {rank}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank + 1, "tid": 0,
                     "args": {"sort_index": rank}})
    order = sorted(tracks, key=lambda k: (k[0], kernels.index(k[1]),
                                          trace.ROLES.index(k[2]), k[3]))
    for i, (rank, kernel, role, block) in enumerate(order):
        tid = tracks[(rank, kernel, role, block)]
        meta.append({"name": "thread_name", "ph": "M", "pid": rank + 1, "tid": tid,
                     "args": {"name": f"{kernel} {role} block {block}"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank + 1, "tid": tid,
                     "args": {"sort_index": i}})
    return {"traceEvents": meta + timed, "displayTimeUnit": "ns",
            "otherData": {"clock": clock, "calls": len(timelines),
                          "dropped_events": dropped}}


def write(path, timelines, *, clock: str = "globaltimer") -> dict:
    """Write ``chrome_trace(timelines)`` to ``path`` (after ``validate`` passes); returns it."""
    doc = chrome_trace(timelines, clock=clock)
    problems = validate(doc)
    if problems:
        raise ValueError("trace export: " + "; ".join(problems[:5]))
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return doc


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate(doc) -> list[str]:
    """The ways ``doc`` breaks the rules of this module's format (empty: none): the keys and
    types of every event, its ``ph``, metadata naming every process and track, one track
    name per (pid, tid) and one tid per track name, timestamps >= 0 and in order per track."""
    problems: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["the document is not an object with a traceEvents list"]
    if doc.get("displayTimeUnit", "ns") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {doc['displayTimeUnit']!r} is not ms or ns")
    processes, threads, names = set(), {}, {}
    last_ts: dict[tuple, float] = {}
    used = set()
    for n, e in enumerate(doc["traceEvents"]):
        where = f"event {n}"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"{where}: ph {ph!r} is not one of {PHASES}")
            continue
        if not isinstance(e.get("name"), str) or not e["name"]:
            problems.append(f"{where}: no name")
        if not all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool)
                   for k in ("pid", "tid")):
            problems.append(f"{where}: pid and tid must be integers")
            continue
        track = (e["pid"], e["tid"])
        args = e.get("args")
        if ph == "M":
            if e.get("name") not in METADATA or not isinstance(args, dict):
                problems.append(f"{where}: metadata {e.get('name')!r} unknown or without args")
            elif e["name"].endswith("_name"):
                if not isinstance(args.get("name"), str):
                    problems.append(f"{where}: {e['name']} without args.name")
                elif e["name"] == "process_name":
                    processes.add(e["pid"])
                else:
                    if threads.setdefault(track, args["name"]) != args["name"]:
                        problems.append(f"{where}: track {track} named twice")
                    if names.setdefault((e["pid"], args["name"]), track) != track:
                        problems.append(f"{where}: two tracks named {args['name']!r}")
            elif not isinstance(args.get("sort_index"), int):
                problems.append(f"{where}: {e['name']} without an integer sort_index")
            continue
        ts = e.get("ts")
        if not _number(ts) or ts < 0:
            problems.append(f"{where}: ts {ts!r} is not a number >= 0")
            continue
        if ph == "X" and (not _number(e.get("dur")) or e["dur"] < 0):
            problems.append(f"{where}: complete event without a dur >= 0")
        if ph == "i" and e.get("s") not in ("t", "p", "g"):
            problems.append(f"{where}: instant event scope {e.get('s')!r} is not t, p or g")
        if args is not None and not isinstance(args, dict):
            problems.append(f"{where}: args is not an object")
        if ts < last_ts.get(track, 0.0):
            problems.append(f"{where}: ts {ts} before the track's previous {last_ts[track]}")
        last_ts[track] = max(ts, last_ts.get(track, 0.0))
        used.add(track)
    for pid, tid in sorted(used):
        if pid not in processes:
            problems.append(f"pid {pid} has no process_name")
        if (pid, tid) not in threads:
            problems.append(f"track ({pid}, {tid}) has no thread_name")
    return problems


__all__ = ["chrome_trace", "write", "validate", "PHASES", "PAYLOAD_FIELDS"]
