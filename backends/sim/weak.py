"""The weak-memory mode of ``backends.sim`` (``Machine(memory="weak")``): global memory under an
operational model of the PTX memory consistency model, so a missing ``.release`` or
``.acquire``, a missing fence or a scope too narrow shows up as a stale read on the CPU.

The model (one ``WeakMemory`` per interpreter, its choices drawn from its own seeded random
stream, so a seed repeats its run):

- **Store buffers in levels.** A thread's weak, volatile and relaxed global stores go to its
  own store buffer; buffers drain one level up (thread -> its CTA -> its domain -> memory)
  one randomly chosen 8-byte word at a time (an aligned access of up to 8 bytes is
  single-copy atomic), a little each scheduler round, so stores become
  visible late and out of order. A *domain* is what a ``sys`` scope separates: the emulated
  rank or PE (the kernel's ``my_rank`` argument), whichever GPU it runs on. A thread reads
  the newest of its own buffer, its CTA's, its domain's, then memory.
- **Release** (``st.release``, an RMW with release semantics, ``fence`` with a release part)
  at scope ``cta`` moves the thread's buffer into its CTA's; at ``gpu`` also the CTA's buffer
  into the domain's (the words carry the release's id); at ``sys`` also the domain buffer's
  words of releases the thread has observed (its own, those its acquires and barriers
  brought it, all from before its launch) into memory. A released store itself lands at its
  scope's level.
- **Stale loads.** Memory keeps a short history per word. A weak, volatile, relaxed or
  ``.nc`` load may return an older value than the newest (the model of loads reordered
  earlier), but never one older than the thread's frontier: coherence (a CTA never reads a
  word older than one it has already read or written) and the last acquire.
- **Acquire** (``ld.acquire``, a ``spin_wait``, an RMW with acquire semantics) of a word
  moves the thread's frontier to the view of that word's releasers (their own frontiers,
  their domain's words landed when they released, the releases they had observed);
  nothing, when no release wrote it.
  At ``gpu`` or ``cta`` scope it takes only a view of its own domain (a narrower acquire
  does not synchronise with another domain's release; causality stays transitive through a
  release and acquire inside the domain) and moves the frontier to now for its own
  domain's words. An acquire fence moves the frontier to now for every word. A relaxed
  store after a release fence carries the thread's view as a release store would.
  ``ld.global.nc`` ignores the acquire frontier (it may return data older than any acquire, though never
  older than the CTA has already seen).
- **RMW atomicity**: an atomic first lands the thread's own pending stores of that word,
  then reads and writes memory in one step, whatever its scope.
- **``bar.sync`` and ``bar.warp.sync``** order at CTA scope: the participants' buffers move
  into the CTA's and each participant's frontier becomes the newest of theirs.
- **Kernel boundaries**: a finished launch's thread and CTA buffers move to its domain's;
  a launch starts after the words its dependencies of other domains left in domain buffers
  have landed, with the frontier of what those dependencies saw (and, in its own domain,
  of now); the host sees memory only after every launch has run and every buffer drained.
- NVSHMEM puts read their source through the issuing thread's view and land in memory at
  the thread's quiet or fence; ``nvshmemx_signal_op`` is an RMW at ``sys`` scope that
  carries the thread's view (the puts its quiet completed are visible to whoever acquires
  the signal).

What it does not model: shared memory (sequentially consistent: its races are the barriers'
business, and the barriers are not weakened); release cumulativity exactly (a ``gpu`` release
publishes every word in the CTA's buffer, also ones the thread never observed, and per word
only the newest value waits in a buffer) and release views (an acquirer sees every word of
the releaser's domain landed before the release), so it can miss a bug, never invent one
(as far as the checks show: every unmutated variant passes every seed tried); a load of
the thread's own domain reading a stale value of another thread's pending domain-level word;
caches, time, the ``cluster`` scope (treated as ``cta``), the ``.sc`` order (an ``.sc`` fence
is an ``acq_rel`` one), mixed-size atomics, proxies (``fence.proxy``, TMA).
"""

from __future__ import annotations

import random

from ir.enums import Scope, Sem

WORD = 8
_FULL = (1 << WORD) - 1
_HISTORY = 6            # values kept per memory word
_RELEASES = (Sem.RELEASE, Sem.ACQ_REL, Sem.SC)
_ACQUIRES = (Sem.ACQUIRE, Sem.ACQ_REL, Sem.SC)

CTA, GPU, SYS = 1, 2, 3


def level(scope) -> int:
    """The buffer level a release at ``scope`` reaches (1 CTA, 2 domain, 3 memory)."""
    if scope is None or scope is Scope.SYS:
        return SYS
    return GPU if scope is Scope.GPU else CTA


class _Buf:
    """One store buffer: ``word -> [bytearray(8), byte mask, the releases that moved its
    bytes here, origins (launch, block) of its writers and readers]``."""

    __slots__ = ("words", "up", "dom", "lvl")

    def __init__(self, up, dom, lvl):
        self.words: dict = {}
        self.up = up        # the next level's buffer; None: memory
        self.dom = dom
        self.lvl = lvl


class _Block:
    """A CTA of a launch: its store buffer and its coherence floor per word."""

    __slots__ = ("buf", "floor", "launch", "warp_reads")

    def __init__(self, buf, launch):
        self.buf = buf
        self.floor: dict = {}
        self.launch = launch
        self.warp_reads: dict = {}  # (warp, statement, k, word) -> the bytes read


class WeakMemory:
    """Global memory of a ``Sim`` under the weak model (module docstring). ``drain``: the
    chance per scheduler round that a non-empty buffer moves one word up; ``stale``: the
    chance a load steps one more value back into the history, when the frontier allows."""

    def __init__(self, mem, seed: int = 0, drain: float = 0.05, stale: float = 0.5):
        self.mem = mem
        self.rng = random.Random(f"weak-{seed}")
        self.drain_p = drain
        self.stale_p = stale
        self.clock = 1
        self.epoch = 1              # when the last run ended: nothing older is kept
        self.history: dict = {}     # word -> [(ts, prev bytes, prev ts, domain, seen since)]
        self.rel_view: dict = {}    # word -> {releasing domain -> its releasers' view}
        self.domains: dict = {}     # domain -> its _Buf
        self.dirty: dict = {}       # buffers with words (a dict: a seed repeats its order)

    # -- threads and blocks ----------------------------------------------------------------
    def domain_buf(self, dom) -> _Buf:
        b = self.domains.get(dom)
        if b is None:
            b = self.domains[dom] = _Buf(None, dom, GPU)
        return b

    def start_thread(self, th) -> None:
        """``th`` starts: it sees what its launch's dependencies saw and wrote (and, in its
        own domain, everything that has landed: its stream's earlier work)."""
        la = th.launch
        dom = int(th.params.get("my_rank", 0)) if "my_rank" in th.params else 0
        blocks = la.__dict__.setdefault("weak_blocks", {})
        blk = blocks.get(th.block)
        if blk is None:
            blk = blocks[th.block] = _Block(_Buf(self.domain_buf(dom), dom, CTA), la)
        th.wdom, th.wblk = dom, blk
        th.wbuf = _Buf(blk.buf, dom, 0)
        th.wseq = {}
        f_all = self.epoch
        for d in la.deps:
            view = d.__dict__.get("weak_view")
            if view is not None:
                f_all = max(f_all, view[0], view[1] if view[2] - {dom} else 0)
        th.f_all = f_all
        th.f_peer = {}      # domain -> frontier for its words (views of its releases)
        th.f_own = th.g_upto = self.clock
        th.g_rels = set()

    def barrier(self, threads) -> None:
        """``bar.sync`` / ``bar.warp.sync`` among ``threads`` (one CTA)."""
        f_own = max(t.f_own for t in threads)
        f_all = max(t.f_all for t in threads)
        g_upto = max(t.g_upto for t in threads)
        g_rels = set().union(*(t.g_rels for t in threads))
        f_peer: dict = {}
        for t in threads:
            _merge(f_peer, t.f_peer)
        for t in threads:
            self._move_all(t.wbuf)
            t.f_own, t.f_all, t.g_upto, t.g_rels = f_own, f_all, g_upto, set(g_rels)
            t.f_peer = dict(f_peer)

    def launch_done(self, la) -> None:
        """Every thread of ``la`` exited: its pending words move to the domain buffers; a
        launch that depends on it will see what its threads saw and, from another domain,
        what it wrote."""
        for blk in la.__dict__.get("weak_blocks", {}).values():
            self._move_all(blk.buf)
        la.weak_view = (max((t.f_all for t in la.threads), default=0), self.clock,
                        {t.wdom for t in la.threads})

    @staticmethod
    def _domains(la) -> set:
        rows = la.rank_params if la.rank_params is not None else [la.params]
        return {int(r.get("my_rank", 0)) for r in rows}

    def before_launch(self, la) -> None:
        """``la`` starts: the words that its dependencies of other domains left in domain
        buffers land (a stream's later launch sees its domain's buffer anyway)."""
        la.weak_doms = mine = self._domains(la)
        deps = {id(d) for d in la.deps if d.__dict__.get("weak_doms", mine) - mine}
        if deps:
            for buf in self.domains.values():
                for w in [w for w, e in buf.words.items()
                          if any(o[0] in deps for o in e[3])]:
                    self._move(buf, w)
        for d in la.deps:
            if "weak_view" in d.__dict__:
                f, _, doms = d.weak_view
                d.weak_view = (f, self.clock, doms)

    def retire_all(self) -> None:
        """Nothing runs: every buffer drains, the history is dropped."""
        while self.dirty:
            for buf in sorted(self.dirty, key=lambda b: b.lvl):
                self._move_all(buf)
        self.history.clear()
        self.rel_view.clear()
        self.clock += 1
        self.epoch = self.clock

    def round(self) -> None:
        """One scheduler round: each non-empty buffer moves one random word up, by chance."""
        rng, p = self.rng, self.drain_p
        for buf in list(self.dirty):
            if rng.random() < p and buf.words:
                w = rng.choice(list(buf.words))
                self._move(buf, w)

    # -- buffers -------------------------------------------------------------------------------
    def _put(self, buf: _Buf, w: int, data, mask: int, origins, tag: int = 0) -> None:
        """Bytes into ``buf``; ``tag``: the release that put them there (0: none)."""
        e = buf.words.get(w)
        if e is None:
            buf.words[w] = [bytearray(data), mask, {tag} if tag else set(), set(origins),
                            self.clock]
            self.dirty[buf] = None
            return
        if mask == _FULL:
            e[0][:] = data
        else:
            for i in range(WORD):
                if mask >> i & 1:
                    e[0][i] = data[i]
        e[1] |= mask
        if tag:
            e[2].add(tag)
        e[3] |= origins

    def _move(self, buf: _Buf, w: int, tag: int = 0) -> None:
        e = buf.words.pop(w)
        if not buf.words:
            self.dirty.pop(buf, None)
        if buf.up is not None:
            self._put(buf.up, w, e[0], e[1], e[3], tag)
            if e[2]:
                buf.up.words[w][2].update(e[2])
        else:
            self._land(w, e[0], e[1], buf.dom, e[3], e[4])

    def _move_all(self, buf: _Buf) -> None:
        for w in list(buf.words):
            self._move(buf, w)

    def _land(self, w: int, data, mask: int, dom, origins=(), seen=None) -> None:
        """Bytes of word ``w`` reach memory (the coherence point); ``seen``: since when the
        writer's domain has seen them (in its domain buffer; default now)."""
        old = self.mem.read(w, WORD)
        new = bytearray(old)
        for i in range(WORD):
            if mask >> i & 1:
                new[i] = data[i]
        hist = self.history.setdefault(w, [])
        prev_ts = hist[-1][0] if hist else 0
        self.clock += 1
        hist.append((self.clock, old, prev_ts, dom, self.clock if seen is None else seen))
        if len(hist) > _HISTORY:
            del hist[0]
        self.mem.write(w, bytes(new))
        for o in origins:
            blk = o[1] if isinstance(o, tuple) else None
            if blk is not None:
                blk.floor[w] = self.clock

    def release(self, th, scope) -> None:
        """A release at ``scope`` by ``th`` (module docstring). Words a ``gpu`` release moves
        into the domain buffer carry its id; a ``sys`` release lands the domain buffer's
        words whose release ``th`` has observed (its own, those its acquires and barriers
        brought it, and every one from before its launch or its last acquire fence)."""
        lvl = level(scope)
        self.clock += 1
        rid = self.clock
        self._move_all(th.wbuf)
        if lvl >= GPU:
            for w in list(th.wblk.buf.words):
                self._move(th.wblk.buf, w, rid)
            # the CTA's words that drained into the domain buffer before are released too
            me = (id(th.launch), th.wblk)
            for e in self.domain_buf(th.wdom).words.values():
                if me in e[3]:
                    e[2].add(rid)
            th.g_rels.add(rid)
        if lvl >= SYS:
            buf = self.domain_buf(th.wdom)
            upto, rels = th.g_upto, th.g_rels
            for w in [w for w, e in buf.words.items()
                      if any(t <= upto or t in rels for t in e[2])]:
                self._move(buf, w)

    def note_release(self, th, addr: int) -> None:
        """``th`` wrote ``addr`` with a release (or after a release fence): an acquirer of
        it inherits ``th``'s view: its frontiers, the releases it has observed, and its
        domain's words landed so far (kept per releasing domain: a word may hold the flags
        of several)."""
        w = addr - addr % WORD
        views = self.rel_view.setdefault(w, {})
        peers = dict(th.f_peer)
        peers[th.wdom] = max(peers.get(th.wdom, 0), self.clock)
        old = views.get(th.wdom)
        if old is None:
            views[th.wdom] = (th.f_all, th.g_upto, set(th.g_rels), peers)
        else:
            old[2].update(th.g_rels)
            _merge(old[3], peers)
            views[th.wdom] = (max(th.f_all, old[0]), max(th.g_upto, old[1]), old[2], old[3])

    def acquire(self, th, scope, addr: int | None = None) -> None:
        """An acquire by ``th`` at ``scope``; ``addr``: the word it read (None: a fence,
        which acquires everything landed so far)."""
        self.clock += 1
        th.f_own = self.clock
        if addr is None:
            th.f_all = th.g_upto = self.clock
            return
        wide = level(scope) >= SYS
        for dom, (f_all, g_upto, g_rels, peers) in self.rel_view.get(
                addr - addr % WORD, {}).items():
            same = dom == th.wdom
            if same or wide:
                th.f_all = max(th.f_all, f_all)
                _merge(th.f_peer, peers)
            if same:
                th.g_upto = max(th.g_upto, g_upto)
                th.g_rels |= g_rels

    # -- accesses -------------------------------------------------------------------------------
    def _origin(self, th):
        return {(id(th.launch), th.wblk)}

    def store(self, th, addr: int, data: bytes, lvl: int = 0) -> None:
        """``data`` stored at ``addr`` into the buffer of level ``lvl`` (0: the thread's)."""
        target = th.wbuf if lvl == 0 else th.wblk.buf if lvl == CTA else \
            self.domain_buf(th.wdom) if lvl == GPU else None
        origins = self._origin(th)
        tag = self.clock if lvl == GPU else 0     # the release just made
        for w, off, chunk in _words(addr, data):
            mask = ((1 << len(chunk)) - 1) << off
            full = bytearray(WORD)
            full[off:off + len(chunk)] = chunk
            if target is None:
                self._land(w, full, mask, th.wdom, origins)
            else:
                self._put(target, w, full, mask, origins, tag)

    def load(self, th, addr: int, n: int, nc: bool = False, site=None) -> bytes:
        """The bytes a load of ``n`` bytes at ``addr`` by ``th`` returns. ``site``: the
        statement: the lanes of a warp running it for the k-th time read the same value of
        a word (one instruction, one transaction), so a warp-uniform load stays uniform."""
        out = bytearray()
        key = None
        if site is not None:
            seq = th.wseq
            k = seq[site] = seq.get(site, 0) + 1
            key = (th.tid >> 5, site, k)
        for w, off, size in _spans(addr, n):
            own = th.wbuf.words.get(w)
            if key is None or (own is not None and own[1] == _FULL):
                out += self._load_word(th, w, nc)[off:off + size]
                continue
            cache = th.wblk.warp_reads
            value = cache.get((key, w))
            if value is None:
                if len(cache) > 8192:
                    cache.clear()
                value = cache[(key, w)] = bytes(self._load_word(th, w, nc))
            out += value[off:off + size]
        return bytes(out)

    def _load_word(self, th, w: int, nc: bool) -> bytearray:
        bufs = (th.wbuf, th.wblk.buf, self.domain_buf(th.wdom))
        entries = [e for e in (b.words.get(w) for b in bufs) if e is not None]
        if entries:
            # whoever reads a pending word must not read an older one once it lands
            me = (id(th.launch), th.wblk)
            for e in entries:
                e[3].add(me)
        if entries and entries[0][1] == _FULL:
            return entries[0][0]
        value = bytearray(self._memory_word(th, w, nc))
        for e in reversed(entries):
            for i in range(WORD):
                if e[1] >> i & 1:
                    value[i] = e[0][i]
        return value

    def _memory_word(self, th, w: int, nc: bool) -> bytes:
        cur = self.mem.read(w, WORD)
        hist = self.history.get(w)
        floor = th.wblk.floor
        if not hist:
            return cur
        least = floor.get(w, 0)
        chosen, start = cur, hist[-1][0]
        for ts, prev, prev_ts, dom, seen in reversed(hist):
            if nc:
                older = ts <= least
            elif dom == th.wdom:    # the domain saw it in its buffer before it landed
                older = ts <= least or seen <= th.f_own
            else:
                older = ts <= max(least, th.f_all, th.f_peer.get(dom, 0))
            if older or self.rng.random() >= self.stale_p:
                break
            chosen, start = prev, prev_ts
        if start > least:
            floor[w] = start
        return chosen

    def rmw(self, th, addr: int, n: int, fn) -> bytes:
        """Atomically: ``old`` = the newest bytes at ``addr``, memory = ``fn(old)``;
        returns ``old``. The thread's own pending stores of those words land first."""
        spans = list(_spans(addr, n))
        for w, _, _ in spans:
            for buf in (th.wbuf, th.wblk.buf, self.domain_buf(th.wdom)):
                if w in buf.words:
                    self._move_through(buf, w)
        old = self.mem.read(addr, n)
        new = fn(old)
        self.store(th, addr, new, SYS)
        return old

    def _move_through(self, buf: _Buf, w: int) -> None:
        while buf is not None:
            if w in buf.words:
                self._move(buf, w)
            buf = buf.up

    def land_put(self, th, addr: int, data: bytes) -> None:
        """An NVSHMEM put's bytes land in memory."""
        self.store(th, addr, data, SYS)


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


def _words(addr: int, data: bytes):
    """``(word address, offset in the word, bytes)`` pieces of ``data`` stored at ``addr``."""
    i, n = 0, len(data)
    while i < n:
        a = addr + i
        w, off = a - a % WORD, a % WORD
        take = min(WORD - off, n - i)
        yield w, off, data[i:i + take]
        i += take


def _spans(addr: int, n: int):
    i = 0
    while i < n:
        a = addr + i
        w, off = a - a % WORD, a % WORD
        take = min(WORD - off, n - i)
        yield w, off, take
        i += take


def is_release(sem) -> bool:
    return sem in _RELEASES


def is_acquire(sem) -> bool:
    return sem in _ACQUIRES
