"""The bare copy rate of each way to reach a peer (``epgen bench --world shmem --copy-rate``):
the bytes a shape's dispatch sends from its busiest PE, copied to the other PEs by the
kernels of ``epgen.kernels.peer_copy`` (warp stores through ``nvshmem_ptr``, NVSHMEM warp
puts, NVSHMEM warp puts with a signal each), on the world's grid, every PE at once.

What it separates: a dispatch by puts does more than copy (reservations, counts, the
monitor's signals, the receive); this times the copy alone, so the put path's figure can be
read against what NVSHMEM's copy of the same bytes costs on the same GPU.

- **Messages.** ``n_msgs`` messages of the configuration's ``msg_bytes`` per PE, message
  ``i`` to PE ``peer_copy.message_peer(rank, i, n_pes)``; the source bytes are the words of
  ``source_words`` (a function of the PE and the word's index), so every PE knows what each
  slot of its destination must hold.
- **Timing**, per mode, on this PE's stream: the destination (and the signal word) zeroed,
  then ``warmup + iters`` calls, each after a host barrier of every PE: an event, the
  launch, an event, a synchronise. A figure is the median over calls of the slowest PE's
  time of each call, as ``bench.shmem`` combines its PEs.
- **Check**, per mode, after its calls: up to ``CHECK_SLOTS`` slots of this PE's
  destination, spread evenly, against their source's words; for ``put_signals`` the signal
  word against the messages every call delivered (``n_msgs`` a call: every slot has one
  source). Every PE hears every verdict.
"""

from __future__ import annotations

import statistics

import numpy as np

from backends import cuda

from ..kernels import peer_copy
from ..kernels.peer_copy import MODES

#: destination slots each PE checks per mode
CHECK_SLOTS = 64

_MUL_PE = 0x9E3779B1
_MUL_WORD = 0x85EBCA6B


def source_words(pe: int, first: int, count: int) -> np.ndarray:
    """Words ``[first, first + count)`` of PE ``pe``'s source (uint32): ``(pe + 1) *
    0x9E3779B1 + word * 0x85EBCA6B`` modulo 2**32."""
    idx = np.arange(first, first + count, dtype=np.uint64)
    words = ((pe + 1) * _MUL_PE + idx * np.uint64(_MUL_WORD)) & np.uint64(0xFFFFFFFF)
    return words.astype(np.uint32)


def check_slots(n_msgs: int, count: int = CHECK_SLOTS) -> list[int]:
    """The destination slots a PE checks: ``count`` (at most ``n_msgs``) spread evenly,
    the first and the last included."""
    if n_msgs <= count:
        return list(range(n_msgs))
    return sorted({round(k * (n_msgs - 1) / (count - 1)) for k in range(count)})


def slot_problems(dst: np.ndarray, me: int, n_pes: int, msg_bytes: int, slots) -> list[str]:
    """What is wrong with this PE's destination bytes ``dst`` at ``slots``: each slot ``i``
    must hold message ``i`` of ``peer_copy.message_source(me, i, n_pes)``."""
    words = msg_bytes // 4
    view = dst.view(np.uint32)
    bad = []
    for i in slots:
        src = peer_copy.message_source(me, i, n_pes)
        if not np.array_equal(view[i * words:(i + 1) * words],
                              source_words(src, i * words, words)):
            bad.append(i)
    if not bad:
        return []
    return [f"{len(bad)} of {len(slots)} checked slots differ from their source's message "
            f"(first: slot {bad[0]}, from PE {peer_copy.message_source(me, bad[0], n_pes)})"]


class PeerCopy:
    """This PE's copy kernels and buffers on a ``ShmemWorld`` (module docstring): ``n_msgs``
    messages of the world's ``msg_bytes``, in symmetric memory (``src``, ``dst``, the
    signal word ``sig``), the peers' addresses of ``dst`` (``nvshmem_ptr``: every PE must be
    reachable by it, else ``PeerAccessError``). Every PE builds it with the same
    ``n_msgs`` (symmetric allocations happen in the same order everywhere)."""

    def __init__(self, world, n_msgs: int):
        if n_msgs < 1:
            raise ValueError(f"PeerCopy: n_msgs={n_msgs} must be >= 1")
        cfg = world.cfg
        if cfg.n_ranks < 2:
            raise ValueError("PeerCopy: needs at least 2 PEs (n_ranks)")
        self.world, self.n_msgs = world, n_msgs
        self.msg_bytes = cfg.layout.msg_bytes
        self.grid = cfg.n_sms
        rk = world.ranks[0]
        self.programs = world.load(peer_copy.build_peer_copy_module(self.msg_bytes,
                                                                    cfg.num_threads))
        self.program = self.programs.of(rk)
        nbytes = n_msgs * self.msg_bytes

        def symmetric(n, dt):
            return world.cuda.zeros(n, dt, device=rk.device, stream=rk.stream,
                                    memory_resource=world.pool)
        self.src = symmetric(nbytes, np.uint8)
        self.dst = symmetric(nbytes, np.uint8)
        self.sig = symmetric(1, np.uint64)
        world.register_symmetric("peer_copy_dst", [self.dst])
        world.register_symmetric("peer_copy_sig", [self.sig])
        self.src.copy_from_host(source_words(world.rank, 0, nbytes // 4).view(np.uint8),
                                stream=rk.stream)
        world.synchronize()
        world.barrier("peer-copy-ready")         # every PE's buffers exist before tables
        self.peers = world.pointer_table(0, range(cfg.n_ranks), [self.dst])

    @property
    def bytes_per_call(self) -> int:
        """Bytes this PE sends per call."""
        return self.n_msgs * self.msg_bytes

    def args(self) -> dict:
        world = self.world
        return {"src": self.src.ptr, "dst_own": self.dst.ptr, "dst_peers": self.peers.ptr,
                "sig_own": self.sig.ptr, "n_msgs": self.n_msgs, "my_rank": world.rank,
                "n_pes": world.cfg.n_ranks}

    def measure(self, mode: str, iters: int, warmup: int) -> dict:
        """This PE's ``{"times_ms", "problems"}`` of ``mode`` (module docstring)."""
        world, rk = self.world, self.world.ranks[0]
        self.dst.zero(stream=rk.stream)
        self.sig.zero(stream=rk.stream)
        world.synchronize()
        name, args = peer_copy.kernel_name(mode), self.args()
        times = []
        for i in range(warmup + iters):
            world.barrier("peer-copy")
            start = cuda.record(rk.stream)
            self.program.launch(name, self.grid, args, rk.stream)
            end = cuda.record(rk.stream)
            world.synchronize()
            if i >= warmup:
                times.append(cuda.elapsed_ms(start, end))
        world.barrier("peer-copy-done")          # every PE's messages have landed here
        dst = self.dst.to_host(stream=rk.stream)
        problems = slot_problems(dst, world.rank, world.cfg.n_ranks, self.msg_bytes,
                                 check_slots(self.n_msgs))
        if mode == "put_signals":
            got = int(self.sig.to_host(stream=rk.stream)[0])
            want = (warmup + iters) * self.n_msgs
            if got != want:
                problems.append(f"signal word {got}, expected {want} ({warmup + iters} calls "
                                f"of {self.n_msgs} messages)")
        return {"times_ms": times, "problems": problems}


def measure(world, n_msgs: int, iters: int, warmup: int, exchange) -> dict:
    """Every mode on ``world`` (module docstring): the combined figure of every PE per mode
    (``combine_modes``). ``exchange(value)`` returns every PE's value (a gather)."""
    copy = PeerCopy(world, n_msgs)
    per_pe = {}
    for mode in MODES:
        mine = copy.measure(mode, iters, warmup)
        per_pe[mode] = exchange(mine)
        if any(pe["problems"] for pe in per_pe[mode]):
            break
    return combine_modes(per_pe, copy.msg_bytes, n_msgs, copy.grid, world.cfg.num_threads)


def combine_modes(per_pe: dict, msg_bytes: int, n_msgs: int, grid: int,
                  threads: int) -> dict:
    """Per mode of ``per_pe`` (each PE's ``{"times_ms", "problems"}``): the slowest PE's
    time per call, its median (us), GB/s sent per PE, and against ``stores``
    (``of_stores``: the stores' median / this mode's; 1.0 is as fast). A PE's problems
    make the mode ``"check": "FAILED: ..."`` with no figure."""
    out = {"n_msgs": n_msgs, "msg_bytes": msg_bytes, "grid": grid, "threads": threads,
           "bytes_per_pe": n_msgs * msg_bytes, "modes": {}}
    for mode, pes in per_pe.items():
        failed = [f"PE {r}: {'; '.join(pe['problems'])}" for r, pe in enumerate(pes)
                  if pe["problems"]]
        if failed:
            out["modes"][mode] = {"check": "FAILED: " + " | ".join(failed)}
            continue
        slowest = [max(call) for call in zip(*(pe["times_ms"] for pe in pes))]
        us = statistics.median(slowest) * 1e3
        out["modes"][mode] = {"check": "ok", "median_us": us,
                              "gbps_per_pe": n_msgs * msg_bytes / (us * 1e-6) / 1e9,
                              "pe_median_us": [statistics.median(pe["times_ms"]) * 1e3
                                               for pe in pes]}
    stores = out["modes"].get("stores", {}).get("median_us")
    for mode, fig in out["modes"].items():
        if stores and "median_us" in fig:
            fig["of_stores"] = stores / fig["median_us"]
    return out


def failures(entry: dict) -> list[str]:
    """The failed checks of a combined entry, one line per mode."""
    return [f"copy rate {mode}: {fig['check']}" for mode, fig in entry["modes"].items()
            if fig["check"] != "ok"]


def report_line(T: int, entry: dict) -> str:
    """One line: the copy's shape, then each mode's median, GB/s per PE and ratio."""
    parts = []
    for mode, fig in entry["modes"].items():
        if "median_us" not in fig:
            parts.append(f"{mode} {fig['check']}")
            continue
        parts.append(f"{mode} {fig['median_us']:.1f} us ({fig['gbps_per_pe']:.1f} GB/s per "
                     f"PE, {fig.get('of_stores', float('nan')):.3f}x of stores)")
    return (f"T={T} copy rate ({entry['n_msgs']} messages of {entry['msg_bytes']} B per PE, "
            f"{entry['grid']} blocks of {entry['threads']} threads): " + "; ".join(parts))


__all__ = ["CHECK_SLOTS", "MODES", "PeerCopy", "source_words", "check_slots",
           "slot_problems", "measure", "combine_modes", "failures", "report_line"]
