"""The weak-memory model of ``backends.sim.weak`` on hand-made threads: scopes across domains
(emulated GPUs) and releases that publish exactly their causal past.

Each test drives ``WeakMemory`` the way the interpreter does (``store``, ``release``,
``note_release``, ``acquire``, ``load``) on fake threads, for several seeds of the model's
random choices; every failure names its seed."""

from __future__ import annotations

import pytest

from backends.sim.memory import Memory
from backends.sim.weak import CTA, GPU, SYS, WeakMemory
from ir.enums import Scope

SEEDS = range(16)
SCOPE = {CTA: Scope.CTA, GPU: Scope.GPU, SYS: Scope.SYS}
ONE, ZERO = (1).to_bytes(4, "little"), bytes(4)


class _Launch:
    def __init__(self):
        self.deps, self.threads, self.params, self.rank_params = [], [], {}, None


class _Thread:
    def __init__(self, launch, rank: int, block: int, tid: int):
        self.launch, self.block, self.tid = launch, block, tid
        self.params = {"my_rank": rank}


class _World:
    """A model with two words (``data``, ``flag``) and threads started in it."""

    def __init__(self, seed: int):
        self.mem = Memory()
        self.wm = WeakMemory(self.mem, seed, drain=1.0)
        self.data, self.flag, self.other = (self.mem.alloc(8, 8) for _ in range(3))
        self.launches: dict = {}

    def thread(self, rank: int, block: int = 0, tid: int = 0):
        la = self.launches.setdefault(rank, _Launch())
        th = _Thread(la, rank, block, tid)
        la.threads.append(th)
        self.wm.start_thread(th)
        return th

    def release_store(self, th, addr: int, lvl: int) -> None:
        """``st.release.<lvl> [addr], 1`` as the interpreter runs it."""
        self.wm.release(th, SCOPE[lvl])
        self.wm.store(th, addr, ONE, lvl)
        self.wm.note_release(th, addr, lvl)

    def wait(self, th, addr: int) -> None:
        """Drain buffers until ``th`` reads 1 at ``addr`` (the poll of a ``spin_wait``)."""
        for _ in range(100):
            if self.wm.load(th, addr, 4) == ONE:
                return
            self.wm.round()
        raise AssertionError(f"{addr:#x} never became visible")


def _stale_reads(rel: int, acq: int, same_rank: bool, sites: dict | None = None) -> list:
    """Seeds whose reader read ``data`` stale after acquiring the writer's flag: the writer
    lands ``data`` = 1 in memory, then stores ``flag`` with a release at ``rel``; the reader
    (another rank, or another CTA of the writer's) acquires it at ``acq`` and reads ``data``."""
    stale = []
    for seed in SEEDS:
        w = _World(seed)
        writer = w.thread(0)
        reader = w.thread(0 if same_rank else 1, block=1)
        w.wm.store(writer, w.data, ONE)
        w.wm.release(writer, Scope.SYS)       # data is in memory, its old value in the history
        w.release_store(writer, w.flag, rel)
        w.wait(reader, w.flag)
        w.wm.acquire(reader, SCOPE[acq], w.flag)
        if w.wm.load(reader, w.data, 4, site="data") != ONE:
            stale.append(seed)
        if sites is not None:
            sites[seed] = dict(w.wm.stale_reads)
    return stale


@pytest.mark.parametrize("rel,acq", [(GPU, SYS), (SYS, GPU), (GPU, GPU)])
def test_a_gpu_scope_release_or_acquire_does_not_synchronise_across_gpus(rel, acq):
    stale = _stale_reads(rel, acq, same_rank=False)
    print(f"release {rel}, acquire {acq}, seeds {list(SEEDS)}: stale in {stale}")
    assert stale, f"release at {SCOPE[rel]} and acquire at {SCOPE[acq]} on two GPUs " \
        f"synchronised in every seed of {list(SEEDS)}"


@pytest.mark.parametrize("rel,acq,same_rank", [(SYS, SYS, False), (GPU, GPU, True),
                                               (SYS, GPU, True)])
def test_a_release_acquire_pair_of_including_scopes_synchronises(rel, acq, same_rank):
    stale = _stale_reads(rel, acq, same_rank)
    assert not stale, f"release at {SCOPE[rel]}, acquire at {SCOPE[acq]} " \
        f"({'one GPU' if same_rank else 'two GPUs'}): stale data read in seeds {stale}"


def _published(synced: bool) -> list:
    """Per seed, what a reader on another GPU reads at ``data`` after acquiring a ``sys``
    release by thread T: thread U of T's CTA stored ``data`` = 1 and released it at CTA scope
    (into the CTA's buffer), and T acquired that release first when ``synced``."""
    got = []
    for seed in SEEDS:
        w = _World(seed)
        u, t = w.thread(0, tid=0), w.thread(0, tid=32)
        reader = w.thread(1)
        w.wm.store(u, w.data, ONE)
        w.release_store(u, w.other, CTA)
        if synced:
            w.wm.acquire(t, Scope.CTA, w.other)
        w.release_store(t, w.flag, SYS)
        w.wm.acquire(reader, Scope.SYS, w.flag)
        got.append((seed, w.wm.load(reader, w.data, 4) == ONE, w.mem.read(w.data, 4) == ONE))
    return got


def test_a_release_publishes_only_its_causal_past():
    # T never synchronised with U: U's store is not T's to publish, it stays in the CTA buffer
    wrong = [s for s, seen, landed in _published(synced=False) if seen or landed]
    assert not wrong, f"a release published another thread's unobserved store in seeds {wrong}"


def test_a_release_publishes_what_it_acquired():
    wrong = [s for s, seen, landed in _published(synced=True) if not (seen and landed)]
    assert not wrong, f"a release did not publish the store it had acquired in seeds {wrong}"


@pytest.mark.parametrize("rel,acq,same_rank", [(GPU, SYS, False), (SYS, SYS, False)])
def test_a_stale_read_is_counted_at_its_load_site(rel, acq, same_rank):
    """``WeakMemory.stale_reads`` counts, by load site, the loads that returned an older
    value than memory's newest: exactly the seeds that read ``data`` stale."""
    sites: dict = {}
    stale = _stale_reads(rel, acq, same_rank, sites)
    counted = [seed for seed, got in sites.items() if got.get("data")]
    assert counted == stale, f"release {SCOPE[rel]}, acquire {SCOPE[acq]}: stale in seeds " \
        f"{stale}, counted in {counted}"
    assert bool(stale) == (rel != acq), f"seeds {list(SEEDS)}: {stale}"
