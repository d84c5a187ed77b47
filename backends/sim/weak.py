"""The weak-memory mode of ``backends.sim`` (``Machine(memory="weak")``): global memory under an
operational model of the PTX memory consistency model, so a missing ``.release`` or
``.acquire``, a missing fence or a scope too narrow shows up as a stale read on the CPU.

The model (one ``WeakMemory`` per interpreter, its choices drawn from its own seeded random
stream, so a seed repeats its run):

- **Domains.** A *domain* is one emulated GPU: the rank or PE a thread runs for (the kernel's
  ``my_rank`` argument), whichever simulated GPU runs it. ``sys`` is the scope that spans
  domains; ``gpu`` spans the CTAs of one domain; ``cta`` one CTA.
- **Store buffers in levels.** A thread's weak, volatile and relaxed global stores go to its
  own store buffer; buffers drain one level up (thread -> its CTA -> its domain -> memory)
  one randomly chosen 8-byte word at a time (an aligned access of up to 8 bytes is
  single-copy atomic), a little each scheduler round, so stores become visible late and out
  of order, but every store becomes visible everywhere eventually (also a ``gpu``-scope one
  read from another domain). A thread reads the newest of its own buffer, its CTA's, its
  domain's, then memory.
- **Causal pasts.** Every store is stamped (the writing thread, a global count); each buffered
  word and each value in memory's history keeps the stamps of its writers. A thread's
  *causal past* is a vector clock (thread -> the last stamp of it that happens-before): its
  own stores, what its acquires synchronised with, what ``bar.sync`` brought it, and the
  kernel boundary (the causal pasts of the launches it depends on; every word that had
  landed, or was visible in its own domain, when it started).
- **Release** (``st.release``, an RMW with release semantics, ``fence`` with a release part)
  at scope ``cta`` moves the thread's buffer into its CTA's; at ``gpu`` also the words of its
  CTA's buffer that are in its causal past into its domain's; at ``sys`` also those of its
  domain's buffer into memory (cumulativity: exactly what happens-before the release, not
  what other threads left there). A released store itself lands at its scope's level.
- **Release views.** A store with release semantics (or after a release fence) records on its
  word the releaser's causal past and scope. An acquire (``ld.acquire``, a ``spin_wait``, an
  RMW with acquire semantics) of that word at scope *s* synchronises with it, taking that
  causal past into its own, only when each scope includes the other thread: both ``sys``
  across domains, both at least ``gpu`` across the CTAs of a domain. A ``gpu`` release is
  thus invisible to another domain's ``sys`` acquire and a ``gpu`` acquire to another
  domain's ``sys`` release.
- **Stale loads.** Memory keeps a short history per word. A weak, volatile, relaxed or
  ``.nc`` load may return an older value than the newest (the model of loads reordered
  earlier), but never one older than a write in the thread's causal past (nor, by
  coherence, one older than its CTA has already read or written).
  ``ld.global.nc`` ignores the causal past (it may return data older than any acquire,
  though never older than the CTA has already seen). A load that returned an older value
  is counted by its statement (``stale_reads``; polls of a ``spin_wait`` too), which the
  ordering checker uses to tell guarded loads from racy ones.
- **Fences.** An acquire fence makes every word landed so far part of the causal past (time
  based: the model does not track which release a relaxed load read). A relaxed store
  after a release fence carries the thread's causal past as a release store of the fence's
  scope would.
- **RMW atomicity**: an atomic first lands the thread's own pending stores of that word,
  then reads and writes memory in one step, whatever its scope.
- **``bar.sync`` and ``bar.warp.sync``** order at CTA scope: the participants' buffers move
  into the CTA's and each participant's causal past becomes the union of theirs.
- **Kernel boundaries**: a finished launch's thread and CTA buffers move to its domain's;
  a launch starts after the words its dependencies of other domains left in domain buffers
  have landed, with their causal pasts (and, in its own domain, everything visible now);
  the host sees memory only after every launch has run and every buffer drained.
- NVSHMEM transfers (shmem.py) read a put's source through the issuing thread's view at
  the call and land later through an agent of the issuing scope (``agent``): a put's bytes
  land in memory stamped by the agent; a signal is an RMW at ``sys`` scope whose release
  carries the issuer's causal past at the call and every transfer the agent landed before
  it; a quiet joins what its scopes' agents landed into the thread's causal past.

What it does not model, so it can miss a bug but, as far as the checks show, not invent one
(every unmutated variant passes every seed tried): shared memory (sequentially consistent:
its races are the barriers' business, and the barriers are not weakened); a load reading a
store that comes later (load buffering: loads take values of stores already made, so an
ordering that only keeps a read before a later write is out of its reach); observation by a
plain read (a write a thread only read, without an acquire, does not join its causal past);
per word only the newest value waits in a buffer, and a buffered word any of whose writers
the releaser knows moves up whole; release sequences exactly (an acquire synchronises with
every earlier release of the word by a thread its scope includes); the scopes of atomicity
(a ``gpu`` RMW is atomic with another domain's); a load of the thread's own domain reading a
stale value of another thread's pending domain-level word; caches, time, the ``cluster``
scope (treated as ``cta``), the ``.sc`` order (an ``.sc`` fence is an ``acq_rel`` one),
mixed-size atomics, proxies (``fence.proxy``, TMA).
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
_EMPTY: dict = {}


def level(scope) -> int:
    """The buffer level a release at ``scope`` reaches (1 CTA, 2 domain, 3 memory)."""
    if scope is None or scope is Scope.SYS:
        return SYS
    return GPU if scope is Scope.GPU else CTA


class _Buf:
    """One store buffer: ``word -> [bytearray(8), byte mask, writers {thread: its first
    stamp here}, origins (launch, block) of its writers and readers, since when it is here]``."""

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
    chance a load steps one more value back into the history, when the causal past allows."""

    def __init__(self, mem, seed: int = 0, drain: float = 0.05, stale: float = 0.5):
        self.mem = mem
        self.rng = random.Random(f"weak-{seed}")
        self.drain_p = drain
        self.stale_p = stale
        self.clock = 1
        self.epoch = 1              # when the last run ended: nothing older is kept
        self.stamp = 0              # the last store's stamp
        self.threads = 0            # threads started (their ids in the vector clocks)
        self.history: dict = {}     # word -> [(ts, prev bytes, prev ts, domain, seen since,
        #                                      writers)]
        self.rel_view: dict = {}    # word -> {(domain, CTA, level) -> [vc, kb, f_all]}
        self.domains: dict = {}     # domain -> its _Buf
        self.dirty: dict = {}       # buffers with words (a dict: a seed repeats its order)
        #: load site (the statement) -> how many of its loads returned an older value than
        #: memory's newest (a spin_wait's polls too, under the spin_wait)
        self.stale_reads: dict = {}
        self._stepped_back = False

    # -- threads and blocks ----------------------------------------------------------------
    def domain_buf(self, dom) -> _Buf:
        b = self.domains.get(dom)
        if b is None:
            b = self.domains[dom] = _Buf(None, dom, GPU)
        return b

    def start_thread(self, th) -> None:
        """``th`` starts: its causal past is its launch's dependencies' (and, in its own
        domain, everything visible now: its stream's earlier work)."""
        la = th.launch
        dom = int(th.params.get("my_rank", 0)) if "my_rank" in th.params else 0
        blocks = la.__dict__.setdefault("weak_blocks", {})
        blk = blocks.get(th.block)
        if blk is None:
            blk = blocks[th.block] = _Block(_Buf(self.domain_buf(dom), dom, CTA), la)
        th.wdom, th.wblk = dom, blk
        th.wbuf = _Buf(blk.buf, dom, 0)
        th.wseq = {}
        self.threads += 1
        th.wid, th.wlast = self.threads, 0
        th.f_all, th.vc, th.kb = self._start_view(la, dom)

    def _start_view(self, la, dom) -> tuple:
        """``(f_all, vector clock, per-domain start times)`` a thread of ``la`` in ``dom``
        starts with (one per launch and domain, shared by its threads)."""
        cache = la.__dict__.setdefault("weak_start", {})
        got = cache.get(dom)
        if got is None:
            f_all, vc, kb = self.epoch, _EMPTY, _EMPTY
            for d in la.deps:
                view = d.__dict__.get("weak_view")
                if view is None or view[3] < self.epoch:
                    continue
                f_all = max(f_all, view[0], view[1] if view[2] - {dom} else 0)
                vc, kb = _join(vc, view[4]), _join(kb, view[5])
            got = cache[dom] = (f_all, vc, _join(kb, {dom: self.clock}))
            self.clock += 1     # what is put from now on is not known by that
        return got

    def barrier(self, threads) -> None:
        """``bar.sync`` / ``bar.warp.sync`` among ``threads`` (one CTA)."""
        f_all = max(t.f_all for t in threads)
        vc, kb = _join_all(t.vc for t in threads), _join_all(t.kb for t in threads)
        vc = dict(vc)
        for t in threads:
            if t.wlast:
                vc[t.wid] = t.wlast
        for t in threads:
            self._move_all(t.wbuf)
            t.f_all, t.vc, t.kb = f_all, vc, kb

    def launch_done(self, la) -> None:
        """Every thread of ``la`` exited: its pending words move to the domain buffers; a
        launch that depends on it will know what its threads knew and, from another domain,
        see what it wrote."""
        for blk in la.__dict__.get("weak_blocks", {}).values():
            self._move_all(blk.buf)
        vc = dict(_join_all(t.vc for t in la.threads))
        for t in la.threads:
            if t.wlast:
                vc[t.wid] = t.wlast
        la.weak_view = (max((t.f_all for t in la.threads), default=0), self.clock,
                        {t.wdom for t in la.threads}, self.clock, vc,
                        _join_all(t.kb for t in la.threads))

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
                v = d.weak_view
                d.weak_view = (v[0], self.clock) + v[2:]

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
    def _put(self, buf: _Buf, w: int, data, mask: int, origins, writers) -> None:
        """Bytes into ``buf``; ``writers``: their stamps (thread -> its first stamp)."""
        e = buf.words.get(w)
        if e is None:
            buf.words[w] = [bytearray(data), mask, dict(writers), set(origins), self.clock]
            self.dirty[buf] = None
            return
        if mask == _FULL:
            e[0][:] = data
        else:
            for i in range(WORD):
                if mask >> i & 1:
                    e[0][i] = data[i]
        e[1] |= mask
        for t, s in writers.items():
            if t not in e[2]:
                e[2][t] = s
        e[3] |= origins

    def _move(self, buf: _Buf, w: int) -> None:
        e = buf.words.pop(w)
        if not buf.words:
            self.dirty.pop(buf, None)
        if buf.up is not None:
            self._put(buf.up, w, e[0], e[1], e[3], e[2])
        else:
            self._land(w, e[0], e[1], buf.dom, e[3], e[4], e[2])

    def _move_all(self, buf: _Buf) -> None:
        for w in list(buf.words):
            self._move(buf, w)

    def _land(self, w: int, data, mask: int, dom, origins=(), seen=None, writers=_EMPTY):
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
        hist.append((self.clock, old, prev_ts, dom, self.clock if seen is None else seen,
                     writers))
        if len(hist) > _HISTORY:
            del hist[0]
        self.mem.write(w, bytes(new))
        for o in origins:
            blk = o[1] if isinstance(o, tuple) else None
            if blk is not None:
                blk.floor[w] = self.clock

    @staticmethod
    def _knows(th, writers) -> bool:
        """Whether a write of ``writers`` is in ``th``'s causal past (by its stamp)."""
        vc = th.vc
        for t, s in writers.items():
            if t == th.wid or s <= vc.get(t, 0):
                return True
        return False

    def _past(self, th, e, dom) -> bool:
        """Whether buffered word ``e`` (in a buffer of domain ``dom``) happens-before ``th``'s
        next release: a writer's stamp, or visible in ``dom`` before ``th`` knew it all."""
        return self._knows(th, e[2]) or e[4] <= th.kb.get(dom, 0)

    def release(self, th, scope) -> None:
        """A release at ``scope`` by ``th`` (module docstring): what happens-before it moves
        up to the scope's level; the rest stays where it is."""
        lvl = level(scope)
        self.clock += 1
        self._move_all(th.wbuf)
        if lvl >= GPU:
            buf = th.wblk.buf
            for w in [w for w, e in buf.words.items() if self._past(th, e, th.wdom)]:
                self._move(buf, w)
        if lvl >= SYS:
            buf = self.domain_buf(th.wdom)
            for w in [w for w, e in buf.words.items() if self._past(th, e, th.wdom)]:
                self._move(buf, w)

    def note_release(self, th, addr: int, lvl: int = SYS) -> None:
        """``th`` wrote ``addr`` with a release at level ``lvl`` (or after a release fence):
        an acquirer of it whose scope includes ``th`` and is included by ``lvl`` inherits
        ``th``'s causal past (kept per releasing domain, CTA and level: a word may hold the
        flags of several)."""
        w = addr - addr % WORD
        views = self.rel_view.setdefault(w, {})
        vc = dict(th.vc)
        if th.wlast:
            vc[th.wid] = th.wlast
        key = (th.wdom, (id(th.launch), th.block), lvl)
        old = views.get(key)
        if old is None:
            views[key] = [vc, th.kb, th.f_all]
        else:
            old[0], old[1] = _join(old[0], vc), _join(old[1], th.kb)
            old[2] = max(old[2], th.f_all)

    def acquire(self, th, scope, addr: int | None = None) -> None:
        """An acquire by ``th`` at ``scope``; ``addr``: the word it read (None: a fence,
        which acquires everything landed so far)."""
        self.clock += 1
        if addr is None:
            th.f_all = self.clock
            th.kb = _join(th.kb, {th.wdom: self.clock})
            self.clock += 1
            return
        lvl, me = level(scope), (id(th.launch), th.block)
        for (dom, blk, rlvl), (vc, kb, f_all) in self.rel_view.get(
                addr - addr % WORD, _EMPTY).items():
            if dom != th.wdom:
                if rlvl < SYS or lvl < SYS:
                    continue
            elif blk != me and (rlvl < GPU or lvl < GPU):
                continue
            th.f_all = max(th.f_all, f_all)
            th.vc, th.kb = _join(th.vc, vc), _join(th.kb, kb)

    # -- accesses -------------------------------------------------------------------------------
    def _origin(self, th):
        return {(id(th.launch), th.wblk)}

    def store(self, th, addr: int, data: bytes, lvl: int = 0) -> None:
        """``data`` stored at ``addr`` into the buffer of level ``lvl`` (0: the thread's)."""
        target = th.wbuf if lvl == 0 else th.wblk.buf if lvl == CTA else \
            self.domain_buf(th.wdom) if lvl == GPU else None
        origins = self._origin(th)
        self.stamp += 1
        th.wlast = self.stamp
        writers = {th.wid: self.stamp}
        for w, off, chunk in _words(addr, data):
            mask = ((1 << len(chunk)) - 1) << off
            full = bytearray(WORD)
            full[off:off + len(chunk)] = chunk
            if target is None:
                self._land(w, full, mask, th.wdom, origins, None, writers)
            else:
                self._put(target, w, full, mask, origins, writers)

    def load(self, th, addr: int, n: int, nc: bool = False, site=None) -> bytes:
        """The bytes a load of ``n`` bytes at ``addr`` by ``th`` returns. ``site``: the
        statement: the lanes of a warp running it for the k-th time read the same value of
        a word (one instruction, one transaction), so a warp-uniform load stays uniform."""
        out = bytearray()
        key = None
        self._stepped_back = False
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
        if self._stepped_back and site is not None:
            self.stale_reads[site] = self.stale_reads.get(site, 0) + 1
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
        for ts, prev, prev_ts, dom, seen, writers in reversed(hist):
            if nc:
                older = ts <= least
            else:   # in the causal past: by time (boundaries, fences) or by a writer's stamp
                older = ts <= least or ts <= th.f_all or seen <= th.kb.get(dom, 0) or \
                    self._knows(th, writers)
            if older or self.rng.random() >= self.stale_p:
                break
            chosen, start = prev, prev_ts
        if start > least:
            floor[w] = start
        if chosen is not cur:
            self._stepped_back = True
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

    # -- NVSHMEM transfers (shmem.py) ---------------------------------------------------------
    def agent(self, th) -> "_Agent":
        """A new agent that lands the NVSHMEM transfers of one scope of ``th``'s CTA: a writer
        of its own (its own stamps), in ``th``'s domain."""
        self.threads += 1
        return _Agent(self.threads, th)

    @staticmethod
    def view(th) -> tuple:
        """``th``'s causal past now, own stores included: ``(vector clock, kb, f_all)``."""
        vc = dict(th.vc)
        if th.wlast:
            vc[th.wid] = th.wlast
        return vc, th.kb, th.f_all

    @staticmethod
    def _as_issued(agent, view) -> None:
        """The agent acts with the causal past its transfer's issuer had at the call."""
        agent.vc, agent.kb, agent.f_all = view

    def land_put(self, agent, view, addr: int, data: bytes) -> None:
        """An NVSHMEM put's bytes land in memory, stamped by ``agent``."""
        self._as_issued(agent, view)
        self.store(agent, addr, data, SYS)

    def land_signal(self, agent, view, addr: int, fn) -> None:
        """An NVSHMEM signal lands: an RMW of the u64 word at ``addr`` (``fn`` of the old
        bytes) at ``sys`` scope that releases the issuer's causal past at the call and every
        transfer ``agent`` landed before it."""
        self._as_issued(agent, view)
        self.rmw(agent, addr, 8, fn)
        self.note_release(agent, addr)

    @staticmethod
    def completed(th, agents) -> None:
        """``nvshmem_quiet`` returned: what ``agents`` landed is in ``th``'s causal past."""
        for a in agents:
            if a.wlast:
                th.vc = _join(th.vc, {a.wid: a.wlast})


class _Agent:
    """Who lands one scope's NVSHMEM transfers: the fields ``store``, ``rmw`` and
    ``note_release`` read of a thread (its own writer id and stamps, an empty store buffer,
    the issuing CTA and domain)."""

    def __init__(self, wid: int, th):
        self.wid, self.wlast = wid, 0
        self.wdom, self.wblk = th.wdom, th.wblk
        self.wbuf = _Buf(th.wblk.buf, th.wdom, 0)
        self.launch, self.block = th.launch, th.block
        self.vc, self.kb, self.f_all = _EMPTY, _EMPTY, 0


def _join(a: dict, b: dict) -> dict:
    """The pointwise maximum of two vector clocks (``a`` itself when ``b`` adds nothing;
    neither is changed: threads share them)."""
    if a is b or not b:
        return a
    if not a:
        return b
    out = None
    for k, v in b.items():
        if v > a.get(k, 0):
            if out is None:
                out = dict(a)
            out[k] = v
    return a if out is None else out


def _join_all(clocks) -> dict:
    out: dict = _EMPTY
    seen = set()
    for c in clocks:
        if id(c) not in seen:
            seen.add(id(c))
            out = _join(out, c)
    return out


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
