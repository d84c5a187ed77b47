"""The interpreter of ``backends.sim``: a small CPU interpreter of the kernel IR (``ir``).

It runs every thread of every launched grid as a Python generator over one flat byte memory,
with the IR's semantics (integer widths and signedness as in the lowering, 16-byte vector
accesses, atomics, ``shfl/ballot/vote/redux.sync`` over the warp's live lanes, ``bar.sync``
over the block's live threads, bounded ``SpinWait`` polls). Threads are interleaved at every
synchronisation point (warp collective, barrier, spin poll) and, with probability ``preempt``,
before any global memory access, in a seeded random order, so reservation orders, arrival
orders and the windows between a write and the read that should follow it vary from run to
run.

What it does not model by default: the weak memory model (every access is sequentially
consistent; ``Sim(memory="weak")`` compiles global accesses, fences and spin polls against
``weak.WeakMemory`` instead, weak.py), caches and the ``nc`` hint, time (``%globaltimer``
advances by one per read). A wait that polls more than ``max_spins`` times raises ``SimHang``.
With ``timeouts=True`` a bounded wait instead expires as it does on the GPU (a diagnostic
record in ``err_buf``, the abort word raised, the thread exits; every other wait then gives
up) once its simulated time runs past its ``timeout_ns``: each poll counts ``SIM_POLL_NS`` of
simulated time (``polls_to_expiry``); a wait that would expire only after more than
``max_spins`` polls (or never: ``timeout_ns`` 0) is a ``SimHang`` after ``max_spins`` polls.
Launches may depend on other launches (stream order): a launch's threads start once every
launch it depends on has finished.

Cost: every thread is a Python generator stepped one statement group at a time, so a launch
costs a few microseconds per executed IR statement per thread, on one core: a grid of a few
thousand threads moving a few hundred kilobytes runs in seconds, and the cost grows linearly
with the threads and the bytes moved. A full-size grid (a million threads) is not what it is
for; ``epgen`` refuses configurations past a size limit before running them.
"""

from __future__ import annotations

import math
import operator
import random
import struct

from ir import diag, nvshmem
from ir import nodes as N
from ir import types as T
from ir.enums import (AtomOp, BinOpKind, CacheHint, CmpOp, ReduxOp, ShflMode, Space, SReg,
                      UnOpKind, VoteMode)
from ir.types import PtrType, VecType

from . import shmem as nvshmem_model
from .memory import Memory, SimError
from .numerics import canonical_f32, e4m3_code, e4m3_value, fma
from .weak import WeakMemory, is_acquire, is_release, level as release_level

MASK64 = (1 << 64) - 1


class SimHang(RuntimeError):
    """A bounded wait polled too long: the protocol deadlocked (or a word is never written)."""


class _Break(Exception):
    pass


class _Exit(Exception):
    pass


def _mask(v: int, bits: int) -> int:
    return v & ((1 << bits) - 1)


def _signed(v: int, bits: int) -> int:
    v = _mask(v, bits)
    return v - (1 << bits) if v >> (bits - 1) else v


def _scalar_bytes(v, dtype: T.DType) -> bytes:
    if dtype.kind == "f":
        return struct.pack({16: "<e", 32: "<f", 64: "<d"}[dtype.bits], v)
    if dtype.kind == "pred":
        return bytes([1 if v else 0])
    return _mask(int(v), dtype.bits).to_bytes(dtype.nbytes, "little")


def _scalar_value(data: bytes, dtype: T.DType):
    if dtype.kind == "f":
        return struct.unpack({16: "<e", 32: "<f", 64: "<d"}[dtype.bits], data)[0]
    if dtype.kind == "pred":
        return bool(data[0])
    return int.from_bytes(data, "little")


def _round_float(v, dtype: T.DType) -> float:
    """``v`` rounded to ``dtype`` (f32: to nearest even, as the hardware's ``.rn`` results;
    f64 as is)."""
    import numpy as np
    v = float(v)
    if dtype.bits != 32:
        return v
    with np.errstate(over="ignore"):          # beyond the f32 range: infinity, as .rn does
        return float(np.float32(v))


def _float_binop(op, a: float, b: float, dtype: T.DType) -> float:
    """PTX float arithmetic: ``add/sub/mul/div.rn`` (computed in double, then rounded once:
    exact for these four in f32), ``min/max`` returning the non-NaN operand; an f32 NaN
    result is the canonical NaN (``numerics.canonical_f32``)."""
    r = _float_binop_value(op, a, b, dtype)
    return canonical_f32(r) if dtype.bits == 32 else r


def _float_binop_value(op, a: float, b: float, dtype: T.DType) -> float:
    """``_float_binop`` before the f32 NaN canonicalisation."""
    if op is BinOpKind.MIN or op is BinOpKind.MAX:
        if math.isnan(a):
            return b
        if math.isnan(b):
            return a
        return min(a, b) if op is BinOpKind.MIN else max(a, b)
    if op is BinOpKind.ADD:
        r = a + b
    elif op is BinOpKind.SUB:
        r = a - b
    elif op is BinOpKind.MUL:
        r = a * b
    elif op is BinOpKind.DIV:
        if b == 0:
            r = math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) \
                * math.copysign(1.0, b)
        else:
            r = a / b
    else:
        raise SimError(f"binop {op} on {dtype}")
    return _round_float(r, dtype)


def _access_bytes(dtype) -> int:
    """Bytes one access of ``dtype`` moves (a vector's elements, a pointer's 8)."""
    if isinstance(dtype, VecType):
        return dtype.elem.nbytes * dtype.n
    if isinstance(dtype, PtrType):
        return 8
    return dtype.nbytes


def _store_kind(s) -> str:
    """The traffic counter's kind of store ``s`` (traffic.py): ``release`` or ``store``."""
    return "release" if is_release(s.sem) else "store"


def _space(addr):
    """The state space of an address expression (None when it has no pointer type)."""
    t = getattr(addr, "dtype", None)
    return t.space if isinstance(t, PtrType) else None


def _bits(t) -> int:
    return 64 if isinstance(t, PtrType) else t.bits


_FLOAT_BITS = {16: "<e", 32: "<f", 64: "<d"}


def unpack_rank_table(kernel: N.Kernel, table) -> list[dict]:
    """Every rank's arguments from the by-value table of a rank-batched launch
    (``ir.RankBatch``): row ``q`` holds rank ``q``'s arguments, one 8-byte little-endian slot
    per parameter in declaration order, integers and pointers zero-extended, floats as their
    bits in the low bytes (the layout the lowering reads). ``table``: the words (any
    sequence of ints, e.g. a u64 numpy array) or the bytes."""
    batch, params = kernel.rank_batch, kernel.params
    if isinstance(table, (bytes, bytearray)):
        words = [int.from_bytes(table[i:i + 8], "little") for i in range(0, len(table), 8)]
    else:
        words = [int(w) for w in getattr(table, "ravel", lambda: table)()]
    if len(words) != batch.ranks * len(params):
        raise TypeError(f"kernel {kernel.name}: rank table of {len(words)} words, needs "
                        f"{batch.ranks} x {len(params)}")
    rows = []
    for q in range(batch.ranks):
        args = {}
        for i, p in enumerate(params):
            w = words[q * len(params) + i]
            if isinstance(p.dtype, T.DType) and p.dtype.kind == "f":
                raw = (w & ((1 << p.dtype.bits) - 1)).to_bytes(p.dtype.nbytes, "little")
                args[p.name] = struct.unpack(_FLOAT_BITS[p.dtype.bits], raw)[0]
            else:
                args[p.name] = w
        rows.append(args)
    return rows


class _Thread:
    def __init__(self, launch, block: int, tid: int):
        self.launch = launch
        self.block = block
        self.tid = tid
        # a rank-batched launch (ir.RankBatch): the rank's block index and arguments
        self.vblock = block % launch.vgrid
        self.params = launch.rank_params[block // launch.vgrid] \
            if launch.rank_params is not None else launch.params
        self.vars: dict = {}
        self.gen = None
        self.waiting = None     # None (runnable), "bar" or "warp"
        self.reply = None
        self.spins = 0
        self.done = False
        self.shmem_scope = None         # shmem.Scope of its NVSHMEM calls, on first one
        self.wfenced = 0                # weak.py: the level of the widest release fence run


class _Launch:
    def __init__(self, sim, kernel: N.Kernel, grid: int, params: dict, deps, shmem: int = 0,
                 stream=None):
        self.sim, self.kernel, self.grid, self.params = sim, kernel, grid, params
        self.shmem = shmem              # dynamic shared memory bytes per block (dyn_smem)
        self.stream = stream            # the stream it was queued on (holds: Sim.hold)
        self.deps = list(deps)
        self.threads: list[_Thread] = []
        self.started = False
        self.shared: dict = {}
        self.block_live: dict = {}      # block -> threads not exited
        self.warp_live: dict = {}       # (block, warp) -> lanes not exited
        self.bar_wait: dict = {}        # (block, barrier id) -> threads waiting
        self.bar_count: dict = {}       # (block, barrier id) -> its thread count (None: all)
        self.warp_wait: dict = {}       # (block, warp) -> lanes at a warp collective
        self.warp_scopes: dict = {}     # (block, warp) -> shmem.Scope of its warp calls
        batch = kernel.rank_batch
        self.vgrid = grid if batch is None else batch.blocks   # %nctaid.x
        self.rank_params = None         # per rank: its arguments (from the by-value table)
        if batch is not None and grid != batch.ranks * batch.blocks:
            raise TypeError(f"kernel {kernel.name}: rank-batched for {batch.ranks} x "
                            f"{batch.blocks} blocks, launched with {grid}")
        names = [p.name for p in kernel.params] if batch is None else ["rank_args"]
        missing = [n for n in names if n not in params]
        extra = sorted(set(params) - set(names))
        if missing or extra:
            raise TypeError(f"kernel {kernel.name}: missing arguments {missing}, unknown {extra}")
        if batch is not None:
            self.rank_params = unpack_rank_table(kernel, params["rank_args"])

    @property
    def finished(self) -> bool:
        return self.started and all(t.done for t in self.threads)


MEMORY_MODELS = ("sc", "weak")
"""``Sim(memory=...)``: sequentially consistent (the default), or the weak model of weak.py."""

SIM_POLL_NS = 10_000_000
"""Simulated time of one poll of a bounded wait (10 ms), in nanoseconds. The simulator has no
clock; this charge turns a ``timeout_ns`` into a number of polls (``polls_to_expiry``): the
default 2 s deadline expires on poll 201, affordable to simulate and far past the polls a
healthy wait of the simulated configurations takes (under 100), and 1000 times that deadline
(200,001 polls) is far past the default ``max_spins`` (20000): a wrong deadline shows."""


def polls_to_expiry(timeout_ns: int, poll_ns: int = SIM_POLL_NS) -> int | None:
    """The poll on which a bounded wait of ``timeout_ns`` expires in the simulator (with
    ``timeouts=True``): the first whose simulated elapsed time ``polls * poll_ns`` exceeds
    ``timeout_ns``, as the GPU's ``%globaltimer - t0 > timeout_ns``, i.e.
    ``timeout_ns // poll_ns + 1``. None for ``timeout_ns`` 0 (unbounded)."""
    return None if timeout_ns == 0 else timeout_ns // poll_ns + 1


class Sim:
    """The interpreter. ``launch(kernel, grid, params, after=())`` queues a grid; ``run()``
    runs every queued grid to completion."""

    def __init__(self, seed: int = 0, max_spins: int = 20000, preempt: float = 0.2,
                 timeouts: bool = False, shmem_delay: int = 256, memory: str = "sc"):
        if memory not in MEMORY_MODELS:
            raise ValueError(f"Sim: memory must be one of {', '.join(MEMORY_MODELS)}, got "
                             f"{memory!r}")
        self.mem = Memory()
        #: the weak-memory model (weak.py), or None: every access sequentially consistent
        self.weak = WeakMemory(self.mem, seed) if memory == "weak" else None
        self.rng = random.Random(seed)
        self.max_spins = max_spins
        self.preempt = preempt
        self.timeouts = timeouts
        self.launches: list[_Launch] = []
        self.clock = 0
        self._codes: dict = {}      # id(statement tuple) -> compiled ops
        self._exprs: dict = {}      # id(expression) -> fn(th)
        self._slots: dict = {}      # Var -> index into a thread's vars
        self._keep: list = []       # the compiled nodes (their ids stay unique)
        self.shmem = None           # shmem.SymmetricHeap, once a world registers buffers
        #: traffic.TrafficCounter while the machine counts written bytes, else None
        self.traffic = None
        self.shmem_delay = shmem_delay
        #: the NVSHMEM transfers in flight (shmem.py), delivered at the end of each round
        self.transfers = nvshmem_model.Transfers(self.rng, shmem_delay, self._land_transfer)
        #: held streams (``hold``): stream -> rounds left to run (None: none)
        self.holds: dict = {}

    # -- launches -------------------------------------------------------------------------
    def launch(self, kernel: N.Kernel, grid: int, params: dict, after=(),
               shmem: int = 0, stream=None) -> _Launch:
        """Queue a grid of ``kernel`` after the launches ``after``; each block gets ``shmem``
        bytes of dynamic shared memory (the kernel's ``dyn_smem``); ``stream``: the stream it
        belongs to (what ``hold`` names)."""
        la = _Launch(self, kernel, grid, dict(params), after, shmem, stream)
        self.launches.append(la)
        return la

    # -- holds: a rank that is late, or stops -----------------------------------------------
    def hold(self, stream, after_rounds: int | None = None) -> None:
        """Hold the launches of ``stream``: none of them starts or runs a step, from now
        (``after_rounds`` None) or once they have run ``after_rounds`` more scheduler rounds
        (a launch that stops half-way). ``run`` then returns with them still queued, with
        every launch that depends on them; ``release`` lets them go on."""
        if after_rounds is not None and (isinstance(after_rounds, bool) or
                                         not isinstance(after_rounds, int) or after_rounds < 0):
            raise ValueError(f"hold: after_rounds must be None or an integer >= 0, got "
                             f"{after_rounds!r}")
        self.holds[stream] = after_rounds

    def release(self, stream) -> None:
        """End ``stream``'s hold (a no-op for a stream not held); the next ``run`` runs its
        launches."""
        self.holds.pop(stream, None)

    def _frozen(self, la: _Launch) -> bool:
        """Whether ``la``'s threads may not run now (its stream is held, no rounds left)."""
        if la.stream is None or la.stream not in self.holds:
            return False
        left = self.holds[la.stream]
        return left is None or left <= 0

    def _held_back(self, la: _Launch) -> bool:
        """Whether unfinished ``la`` is frozen or waits on a launch that is held back."""
        if self._frozen(la):
            return True
        return any(not d.finished and self._held_back(d) for d in la.deps)

    def pending(self) -> list:
        """The launches queued and not finished (after ``run``: the held ones)."""
        return [la for la in self.launches if not la.finished]

    def _start(self, la: _Launch):
        la.started = True
        if self.weak is not None:
            self.weak.before_launch(la)
        for b in range(la.grid):
            shared = {}
            for buf in la.kernel.shared:
                shared[buf.name] = self.mem.alloc(buf.nbytes, max(buf.align, 16))
            if la.kernel.dynamic_shared:
                shared["dyn_smem"] = self.mem.alloc(la.shmem, 16)
            la.shared[b] = shared
            la.block_live[b] = la.kernel.block_threads
            for w in range((la.kernel.block_threads + 31) // 32):
                la.warp_live[(b, w)] = min(32, la.kernel.block_threads - 32 * w)
            for t in range(la.kernel.block_threads):
                th = _Thread(la, b, t)
                th.gen = self._thread_body(th)
                la.threads.append(th)
                if self.weak is not None:
                    self.weak.start_thread(th)
        la.live = len(la.threads)

    def run(self) -> None:
        """Run every queued grid to completion, except the held ones (``hold``) and those
        that depend on them, which stay queued."""
        while True:
            for la in self.launches:
                if not la.started and not self._frozen(la) and \
                        all(d.finished for d in la.deps):
                    self._start(la)
            live = [t for la in self.launches if la.started and not self._frozen(la)
                    for t in la.threads if not t.done]
            if not live:
                pending = self.pending()
                if any(not self._held_back(la) for la in pending):
                    raise SimError("a launch waits on one that never finishes")
                self.launches = pending
                if self.weak is not None and not pending:
                    self.weak.retire_all()
                return
            for key in {t.launch.stream for t in live} & set(self.holds):
                if self.holds[key] is not None:
                    self.holds[key] -= 1        # a round of a launch that stops half-way
            runnable = [t for t in live if t.waiting is None]
            if not runnable:
                where = sorted({f"{t.launch.kernel.name} block {t.block}: {t.waiting}"
                                for t in live})
                raise SimError("every live thread is blocked at a barrier or warp collective: "
                               + "; ".join(where[:5]))
            self.rng.shuffle(runnable)
            for th in runnable:
                if th.waiting is None and not th.done:
                    self._step(th)
            if self.transfers.active:
                self.transfers.deliver_round()
            if self.weak is not None:
                self.weak.round()

    def _step(self, th: _Thread) -> None:
        reply, th.reply = th.reply, None
        try:
            req = th.gen.send(reply)
        except StopIteration:
            th.done = True
            self._recheck(th)
            th.launch.live -= 1
            if self.weak is not None and not th.launch.live:
                self.weak.launch_done(th.launch)
            return
        kind = req[0]
        if kind == "yield":
            return
        if kind == "spin":
            th.spins += 1
            if th.spins > self.max_spins:
                _, site, idx, seen, expiry = req
                raise SimHang(f"kernel {th.launch.kernel.name} block {th.block} thread "
                              f"{th.tid}: waited on {site.buffer}[{idx}], last saw {seen:#x}, "
                              f"{self.max_spins} polls" + self._deadline_note(expiry))
            return
        th.spins = 0
        la, blk = th.launch, th.block
        if kind == "bar":
            th.waiting = "bar"
            key = (blk, req[1])
            la.bar_wait.setdefault(key, []).append(th)
            self._try_barrier(la, key, req[2])
        elif kind == "warp":
            th.waiting = "warp"
            th.reply = req[1:]
            key = (blk, th.tid // 32)
            la.warp_wait.setdefault(key, []).append(th)
            self._try_warp(la, key)

    def _recheck(self, th: _Thread) -> None:
        """A thread exited: barriers of its block and collectives of its warp need one
        participant fewer."""
        la, blk = th.launch, th.block
        la.block_live[blk] -= 1
        la.warp_live[(blk, th.tid // 32)] -= 1
        if not la.warp_live[(blk, th.tid // 32)]:
            nvshmem_model.check_completed(
                la.warp_scopes.get((blk, th.tid // 32)),
                f"kernel {la.kernel.name} block {blk} warp {th.tid // 32} (its warp calls)")
        for key in [k for k in la.bar_wait if k[0] == blk]:
            self._try_barrier(la, key, la.bar_count.get(key))
        self._try_warp(la, (blk, th.tid // 32))

    def _try_barrier(self, la, key, count) -> None:
        waiting = la.bar_wait.get(key)
        if not waiting:
            return
        la.bar_count[key] = count
        need = count if count is not None else la.block_live[key[0]]
        if len(waiting) >= need:
            for t in waiting[:need]:
                t.waiting = None
                t.reply = None
            if self.weak is not None:
                self.weak.barrier(waiting[:need])
            del waiting[:need]

    def _try_warp(self, la, key) -> None:
        waiting = la.warp_wait.get(key)
        if not waiting or len(waiting) < la.warp_live[key]:
            return
        la.warp_wait[key] = []
        ops = {id(t.reply[0]) for t in waiting}
        if len(ops) != 1:
            names = sorted({type(t.reply[0]).__name__ for t in waiting})
            raise SimError(f"kernel {la.kernel.name} block {key[0]} warp {key[1]}: lanes at "
                           f"different warp collectives ({', '.join(names)})")
        node = waiting[0].reply[0]
        if self.weak is not None and isinstance(node, (N.WarpSync, N.Call)):
            self.weak.barrier(waiting)
        if isinstance(node, N.Call):
            self._warp_call(node, key, sorted(waiting, key=lambda t: t.tid))
        vals = {t.tid % 32: t.reply[1] for t in waiting}
        for t in waiting:
            t.reply = self._collective(node, vals, t.tid % 32, t.reply[2])
            t.waiting = None

    def _collective(self, node, vals: dict, lane: int, arg):
        if isinstance(node, (N.WarpSync, N.Call)):
            return None
        if isinstance(node, N.Ballot):
            return sum(1 << ln for ln, v in vals.items() if v)
        if isinstance(node, N.Vote):
            ps = list(vals.values())
            if node.mode is VoteMode.ANY:
                return any(ps)
            if node.mode is VoteMode.ALL:
                return all(ps)
            return all(ps) or not any(ps)
        if isinstance(node, N.Redux):
            bits = node.value.dtype.bits
            xs = list(vals.values())
            signed = node.value.dtype.is_signed
            if node.op is ReduxOp.ADD:
                return _mask(sum(xs), bits)
            if node.op in (ReduxOp.MIN, ReduxOp.MAX):
                key = (lambda x: _signed(x, bits)) if signed else None
                return (min if node.op is ReduxOp.MIN else max)(xs, key=key)
            acc = xs[0]
            for x in xs[1:]:
                acc = {ReduxOp.AND: acc & x, ReduxOp.OR: acc | x, ReduxOp.XOR: acc ^ x}[node.op]
            return acc
        if isinstance(node, N.Shuffle):
            src_lane = arg
            if node.mode is ShflMode.IDX:
                src = src_lane & 31
            elif node.mode is ShflMode.UP:
                src = lane - src_lane if lane - src_lane >= 0 else lane
            elif node.mode is ShflMode.DOWN:
                src = lane + src_lane if lane + src_lane < 32 else lane
            else:
                src = lane ^ src_lane
            if src not in vals:
                raise SimError(f"shfl from exited lane {src}")
            return vals[src]
        raise SimError(f"not a warp collective: {node}")

    # -- threads -------------------------------------------------------------------------------
    def _thread_body(self, th: _Thread):
        try:
            for role in th.launch.kernel.roles:
                if not self._in_role(th, role):
                    continue
                yield from self._run(th, self._code(role.body))
        except _Exit:
            pass
        except KeyError as exc:
            raise SimError(f"kernel {th.launch.kernel.name}: a variable is read before it is "
                           f"assigned ({exc})") from None
        nvshmem_model.check_completed(th.shmem_scope, f"kernel {th.launch.kernel.name} "
                                      f"block {th.block} thread {th.tid}")

    def _in_role(self, th, role) -> bool:
        b = role.blocks
        if th.vblock < self._fn(b.start)(th):
            return False
        if b.stop is not None and th.vblock >= self._fn(b.stop)(th):
            return False
        if role.threads is not None:
            return role.threads.base <= th.tid < role.threads.base + role.threads.count
        return True

    # Statements compile to a tuple of ops: (SIMPLE, fn) runs fn(th); (MEM, fn) may first
    # yield to the scheduler (preemption); (GEN, fn) delegates to the generator fn(th).
    _SIMPLE, _MEM, _GEN = 0, 1, 2

    def _code(self, stmts) -> tuple:
        key = id(stmts)
        code = self._codes.get(key)
        if code is None:
            code = tuple(self._compile_stmt(s) for s in stmts)
            self._codes[key] = code
            self._keep.append(stmts)
        return code

    def _run(self, th, code):
        rng, preempt = self.rng, self.preempt
        for kind, fn in code:
            if kind == 0:
                fn(th)
            elif kind == 1:
                if preempt and rng.random() < preempt:
                    yield ("yield",)
                fn(th)
            else:
                yield from fn(th)

    def _slot(self, var: N.Var) -> int:
        slot = self._slots.get(var)
        if slot is None:
            slot = self._slots[var] = len(self._slots)
        return slot

    def _compile_stmt(self, s):
        f = self._fn
        S, M, G = self._SIMPLE, self._MEM, self._GEN
        if self.weak is not None:
            op = self._compile_weak(s)
            if op is not None:
                return op
        if isinstance(s, N.Assign):
            slot, v = self._slot(s.dst), f(s.value)

            def assign(th):
                th.vars[slot] = v(th)
            return S, assign
        if isinstance(s, N.Load):
            slot, addr, dt = self._slot(s.dst), f(s.addr), s.dst.dtype

            def load(th):
                th.vars[slot] = self._load(addr(th), dt)
            return M, load
        if isinstance(s, N.Store):
            addr, val, dt = f(s.addr), f(s.value), s.value.dtype
            kind, n = _store_kind(s), _access_bytes(dt)

            def store(th):
                a = addr(th)
                self._store(a, val(th), dt)
                if self.traffic is not None:
                    self.traffic.note(th.launch.stream, a, n, kind)
            return M, store
        if isinstance(s, N.AtomicRMW):
            addr, val, dt, op = f(s.addr), f(s.value), s.value.dtype, s.op
            slot = None if s.dst is None else self._slot(s.dst)

            def rmw(th):
                a = addr(th)
                old = self._load(a, dt)
                self._store(a, self._rmw(op, old, val(th), dt), dt)
                if slot is not None:
                    th.vars[slot] = old
                if self.traffic is not None:
                    self.traffic.note(th.launch.stream, a, dt.nbytes, "atomic")
            return M, rmw
        if isinstance(s, N.AtomicCAS):
            addr, cmp, val, dt = f(s.addr), f(s.compare), f(s.value), s.value.dtype
            slot = self._slot(s.dst)

            def cas(th):
                a = addr(th)
                old = self._load(a, dt)
                if old == cmp(th):
                    self._store(a, val(th), dt)
                th.vars[slot] = old
                if self.traffic is not None:
                    self.traffic.note(th.launch.stream, a, dt.nbytes, "atomic")
            return M, cas
        if isinstance(s, (N.Fence, N.Comment, N.Nanosleep)):
            return S, lambda th: None
        if isinstance(s, N.BarSync):
            bar = s.barrier

            def bar_sync(th):
                yield ("bar", bar.id, bar.count)
            return G, bar_sync
        if isinstance(s, (N.WarpSync, N.Shuffle, N.Ballot, N.Vote, N.Redux)):
            return G, self._compile_collective(s)
        if isinstance(s, N.If):
            cond = f(s.cond)
            then = self._code(s.then)
            orelse = self._code(s.orelse) if s.orelse else None

            def if_(th):
                if cond(th):
                    yield from self._run(th, then)
                elif orelse is not None:
                    yield from self._run(th, orelse)
            return G, if_
        if isinstance(s, N.For):
            slot, start, stop, step = self._slot(s.var), f(s.start), f(s.stop), f(s.step)
            body, bits = self._code(s.body), s.var.dtype.bits
            signed = s.var.dtype.kind == "s"
            m = (1 << bits) - 1

            def for_(th):
                v = th.vars
                v[slot] = start(th)
                try:
                    while (_signed(v[slot], bits) < _signed(stop(th), bits)) if signed \
                            else v[slot] < stop(th):
                        yield from self._run(th, body)
                        v[slot] = (v[slot] + step(th)) & m
                except _Break:
                    pass
            return G, for_
        if isinstance(s, N.While):
            cond, body = f(s.cond), self._code(s.body)

            def while_(th):
                try:
                    while cond(th):
                        yield from self._run(th, body)
                except _Break:
                    pass
            return G, while_
        if isinstance(s, N.Break):
            def break_(th):
                raise _Break()
            return S, break_
        if isinstance(s, N.Return):
            def exit_(th):
                raise _Exit()
            return S, exit_
        if isinstance(s, N.Trap):
            def trap(th):
                raise SimError(f"trap in kernel {th.launch.kernel.name}")
            return S, trap
        if isinstance(s, N.SpinWait):
            return G, self._compile_spin(s)
        if isinstance(s, N.Call):
            if s.name == "nvshmem_quiet":
                return G, self._quiet
            if nvshmem.is_nvshmem(s.name) and nvshmem.FUNCTIONS[s.name].group == "warp":
                return G, self._compile_warp_call(s)
            return M, self._compile_call(s)
        raise SimError(f"the simulator does not run {type(s).__name__}")

    # -- the weak-memory model (weak.py): global accesses, fences, spin polls ----------------
    def _compile_weak(self, s):
        """The weak model's form of a global access, fence or spin wait (None: not one)."""
        f, wm = self._fn, self.weak
        M, G = self._MEM, self._GEN
        if isinstance(s, N.Fence):
            rel, acq, scope = is_release(s.sem), is_acquire(s.sem), s.scope

            def fence(th):
                if rel:
                    wm.release(th, scope)
                    th.wfenced = max(th.wfenced, release_level(scope))
                if acq:
                    wm.acquire(th, scope)
            return self._SIMPLE, fence
        if not isinstance(s, (N.Load, N.Store, N.AtomicRMW, N.AtomicCAS, N.SpinWait)):
            return None
        if _space(s.addr) is Space.SHARED:
            return None
        addr, scope = f(s.addr), s.scope
        if isinstance(s, N.Load):
            slot, dt = self._slot(s.dst), s.dst.dtype
            nc, acq = s.cache is not CacheHint.NONE, is_acquire(s.sem)
            site = id(s)

            def load(th):
                a = addr(th)
                th.vars[slot] = self._wload(th, a, dt, nc, site)
                if acq:
                    wm.acquire(th, scope, a)
            return M, load
        if isinstance(s, N.Store):
            val, dt = f(s.value), s.value.dtype
            lvl = release_level(scope) if is_release(s.sem) else 0
            kind, n = _store_kind(s), _access_bytes(dt)

            def store(th):
                a = addr(th)
                if lvl:
                    wm.release(th, scope)
                wm.store(th, a, self._bytes(val(th), dt), lvl)
                if lvl or th.wfenced:
                    wm.note_release(th, a, lvl or th.wfenced)
                if self.traffic is not None:
                    self.traffic.note(th.launch.stream, a, n, kind)
            return M, store
        if isinstance(s, N.SpinWait):
            return G, self._compile_spin(s, weak=True)
        rel, acq, dt = is_release(s.sem), is_acquire(s.sem), s.value.dtype
        rlvl = release_level(scope)
        slot = None if s.dst is None else self._slot(s.dst)
        val = f(s.value)
        if isinstance(s, N.AtomicRMW):
            op = s.op

            def new(th, old):
                return self._rmw(op, old, val(th), dt)
        else:
            cmp = f(s.compare)

            def new(th, old):
                return val(th) if old == cmp(th) else old

        def atomic(th):
            a = addr(th)
            if rel:
                wm.release(th, scope)
            raw = wm.rmw(th, a, dt.nbytes, lambda b: self._bytes(
                new(th, _scalar_value(b, dt)), dt))
            if rel or th.wfenced:
                wm.note_release(th, a, rlvl if rel else th.wfenced)
            if slot is not None:
                th.vars[slot] = _scalar_value(raw, dt)
            if acq:
                wm.acquire(th, scope, a)
            if self.traffic is not None:
                self.traffic.note(th.launch.stream, a, dt.nbytes, "atomic")
        return M, atomic

    def _bytes(self, value, dtype) -> bytes:
        if isinstance(dtype, VecType):
            return b"".join(_scalar_bytes(v, dtype.elem) for v in value)
        if isinstance(dtype, PtrType):
            return _mask(value, 64).to_bytes(8, "little")
        return _scalar_bytes(value, dtype)

    def _wload(self, th, addr, dtype, nc=False, site=None):
        """A global load under the weak model (``site``: the statement, weak.py)."""
        if isinstance(dtype, VecType):
            n = dtype.elem.nbytes
            data = self.weak.load(th, addr, n * dtype.n, nc, site)
            return tuple(_scalar_value(data[i * n:(i + 1) * n], dtype.elem)
                         for i in range(dtype.n))
        if isinstance(dtype, PtrType):
            return int.from_bytes(self.weak.load(th, addr, 8, nc, site), "little")
        return _scalar_value(self.weak.load(th, addr, dtype.nbytes, nc, site), dtype)

    def _compile_call(self, s: N.Call):
        """A thread's ``ir.nvshmem`` device function (``shmem.py`` says what each one does);
        any other extern function is a ``SimError``."""
        args = [self._fn(a) for a in s.args]
        name = s.name
        if name == "nvshmem_putmem_nbi":
            dest, src, nbytes, pe = args

            def put(th):
                scope = self._thread_scope(th)
                self._issue_put(th, scope, [scope], dest(th), src(th), nbytes(th), pe(th))
            return put
        if name == "nvshmemx_signal_op":
            addr, value, op, pe = args

            def signal(th):
                scope = self._thread_scope(th)
                self._issue_signal(th, scope, [scope], addr(th), value(th), op(th), pe(th))
            return signal
        if name == "nvshmem_signal_wait_until":
            (addr, cmp, value), dst = args, s.dst

            def wait_until(th):
                a, c, v = addr(th), cmp(th), value(th)
                word = self._load(a, T.u64) if self.weak is None else \
                    self._wload(th, a, T.u64)
                if not nvshmem_model.compare(word, c, v):
                    raise SimError(f"nvshmem_signal_wait_until({a:#x}, cmp {c}, {v}) in kernel "
                                   f"{th.launch.kernel.name} would block: the word is {word} "
                                   f"(the kernels call it only after their own bounded poll "
                                   f"saw the condition)")
                if dst is not None:
                    th.vars[self._slot(dst)] = word
            return wait_until
        if name == "nvshmem_fence":
            def fence(th):
                self.transfers.fence(self._thread_scope(th),
                                     [self._thread_scope(th), self._warp_scope(th)])
            return fence
        known = "" if not nvshmem.is_nvshmem(name) else " (an NVSHMEM function the " \
            "simulator does not model)"
        modelled = sorted(n for n in nvshmem.FUNCTIONS if n != "nvshmem_my_pe")
        raise SimError(f"the simulator cannot call extern function {name!r}{known}; it "
                       f"models {', '.join(modelled)}")

    def _compile_warp_call(self, s: N.Call):
        """A warp-collective ``ir.nvshmem`` function: every live lane arrives with its
        argument values; ``_warp_call`` issues the warp's one operation."""
        args = [self._fn(a) for a in s.args]

        def warp_call(th):
            yield ("warp", s, tuple(a(th) for a in args), None)
        return warp_call

    def _warp_call(self, node: N.Call, key, lanes) -> None:
        """The lanes of warp ``key`` met at warp-collective call ``node``: the same
        arguments on every lane, then one put (and its signal) of the warp's scope, ordered
        after what every lane's fences put before it; the source read through lane 0's
        view (the lanes have just met at the warp barrier)."""
        vals = {t.tid % 32: t.reply[1] for t in lanes}
        if len(set(vals.values())) != 1:
            raise SimError(f"kernel {lanes[0].launch.kernel.name} block {key[0]} warp {key[1]}:"
                           f" the lanes call {node.name} with different arguments")
        th = lanes[0]
        scope = self._warp_scope(th)
        fences = [scope] + [self._thread_scope(t) for t in lanes if t.shmem_scope is not None]
        args = vals[th.tid % 32]
        if node.name == "nvshmemx_putmem_nbi_warp":
            dest, src, nbytes, pe = args
            self._issue_put(th, scope, fences, dest, src, nbytes, pe)
        elif node.name == "nvshmemx_putmem_signal_nbi_warp":
            dest, src, nbytes, sig, value, op, pe = args
            put = self._issue_put(th, scope, fences, dest, src, nbytes, pe)
            self._issue_signal(th, scope, fences, sig, value, op, pe, after=[put])
        else:
            raise SimError(f"the simulator does not model warp call {node.name!r}")

    def _thread_scope(self, th):
        if th.shmem_scope is None:
            th.shmem_scope = nvshmem_model.Scope(f"thread {th.tid}")
        return th.shmem_scope

    def _warp_scope(self, th):
        key = (th.block, th.tid // 32)
        scope = th.launch.warp_scopes.get(key)
        if scope is None:
            scope = th.launch.warp_scopes[key] = nvshmem_model.Scope(f"warp {key[1]}")
        return scope

    def _view(self, th, scope):
        """Weak mode: the issuer's causal past now (``scope``'s agent, who lands its
        transfers, made on first use); None otherwise."""
        if self.weak is None:
            return None
        if scope.agent is None:
            scope.agent = self.weak.agent(th)
        return self.weak.view(th)

    def _issue_put(self, th, scope, fences, dest, src, nbytes, pe):
        n = int(nbytes)
        target = self._heap().translate(dest, pe, n)
        data = self.mem.read(src, n) if self.weak is None else self.weak.load(th, src, n)
        if self.traffic is not None:
            self.traffic.note(th.launch.stream, target, n, "put")
        return self.transfers.issue(scope, fences, "put", target, int(pe),
                                    self._view(th, scope), data=bytes(data))

    def _issue_signal(self, th, scope, fences, addr, value, op, pe, after=()):
        if op not in (nvshmem.SIGNAL_SET, nvshmem.SIGNAL_ADD):
            raise SimError(f"nvshmemx_signal_op: unknown sig_op {op}")
        target = self._heap().translate(addr, pe, 8)
        if self.traffic is not None:
            self.traffic.note(th.launch.stream, target, 8, "put_signal" if after else "signal")
        return self.transfers.issue(scope, fences, "signal", target, int(pe),
                                    self._view(th, scope), after, value=value & MASK64,
                                    op=op)

    def _land_transfer(self, t) -> None:
        """A transfer reaches its target (shmem.py, "Landing")."""
        if self.weak is not None:
            if t.kind == "put":
                self.weak.land_put(t.scope.agent, t.view, t.target, t.data)
            else:
                self.weak.land_signal(t.scope.agent, t.view, t.target, lambda b: (
                    nvshmem_model.signal_result(int.from_bytes(b, "little"), t.value, t.op)
                ).to_bytes(8, "little"))
            return
        if t.kind == "put":
            self.mem.write(t.target, t.data)
        else:
            old = self._load(t.target, T.u64)
            self._store(t.target, nvshmem_model.signal_result(old, t.value, t.op), T.u64)

    def _heap(self):
        if self.shmem is None:
            raise SimError("shmem: an NVSHMEM call, but no symmetric heap exists (the world "
                           "registers its symmetric buffers: Machine.symmetric_heap())")
        return self.shmem

    def _quiet(self, th):
        """``nvshmem_quiet``: the thread yields rounds until every transfer of its own scope
        and its warp's has landed; under the weak model what landed joins its causal past."""
        scopes = [sc for sc in (th.shmem_scope, th.launch.warp_scopes.get(
            (th.block, th.tid // 32))) if sc is not None]
        while any(sc.pending for sc in scopes):
            yield ("yield",)
        for sc in scopes:
            sc.unquieted = 0
        if self.weak is not None:
            self.weak.completed(th, [sc.agent for sc in scopes if sc.agent is not None])

    def _compile_collective(self, s):
        f = self._fn
        slot = None if isinstance(s, N.WarpSync) else self._slot(s.dst)
        if isinstance(s, N.Shuffle):
            val, arg = f(s.value), f(s.lane)
        elif isinstance(s, (N.Ballot, N.Vote)):
            val, arg = f(s.pred), (lambda th: None)
        elif isinstance(s, N.Redux):
            val, arg = f(s.value), (lambda th: None)
        else:
            val = arg = (lambda th: None)

        def collective(th):
            result = yield ("warp", s, val(th), arg(th))
            if slot is not None:
                th.vars[slot] = result
        return collective

    def _compile_spin(self, s: N.SpinWait, weak: bool = False):
        f = self._fn
        wm = self.weak if weak else None
        acq, scope, site = is_acquire(s.sem), s.scope, id(s)
        bits, shift, mask, op = s.dtype.bits, s.shift, s.mask, s.cond
        addr, expected, index = f(s.addr), f(s.expected), f(s.site.index)
        udt, dt = T.DType("u", bits), s.dtype
        slot = None if s.dst is None else self._slot(s.dst)

        err_buf, timeout = f(s.err_buf), f(s.timeout_ns)
        give_up = None if s.give_up is None else f(s.give_up)
        shrink = None if s.shrink is None else f(s.shrink)
        status = None if s.status is None else self._slot(s.status)

        def spin(th):
            want = _mask(expected(th), bits)
            polls = 0
            expiry = polls_to_expiry(timeout(th)) if self.timeouts else None
            # past max_spins the hang detector (_step) ends the wait first
            expires_on = expiry if expiry is not None and expiry <= self.max_spins else None
            ended = N.SPIN_MET
            while True:
                seen = self._load(addr(th), dt) if wm is None else \
                    self._wload(th, addr(th), dt, site=site)
                field = seen >> shift
                if mask is not None:
                    field &= mask
                if self._cmp(op, field, want, udt):
                    break
                if give_up is not None and (self._load if wm is None else
                                            lambda a, t: self._wload(th, a, t))(
                        give_up(th), T.u32):
                    ended = N.SPIN_GAVE_UP          # the rank waited on is masked
                    break
                if self.timeouts:
                    polls += 1
                    if polls == expires_on:
                        if shrink is not None and shrink(th):
                            ended = N.SPIN_EXPIRED  # no record, no abort: the kernel's call
                            break
                        self._expire(th, s, seen, want, polls * SIM_POLL_NS)
                        raise _Exit()
                    if (self._load if wm is None else
                            lambda a, t: self._wload(th, a, t))(
                            err_buf(th) + 4 * diag.ABORT_WORD, T.u32):
                        raise _Exit()   # another wait of the launch group gave up
                yield ("spin", s.site, index(th), seen, expiry)
            if wm is not None and acq:
                wm.acquire(th, scope, addr(th))
            if slot is not None:
                th.vars[slot] = seen
            if status is not None:
                th.vars[status] = ended
        return spin

    def _deadline_note(self, expiry: int | None) -> str:
        """Why a wait that polled ``max_spins`` times did not expire (``SimHang``'s message)."""
        if not self.timeouts:
            return " (timeouts off: waits never expire)"
        if expiry is None:
            return " (timeout_ns 0: an unbounded wait)"
        return (f" (its timeout_ns expires only on poll {expiry}, at {SIM_POLL_NS} ns a poll: "
                f"past max_spins)")

    def _expire(self, th, s: N.SpinWait, seen: int, want: int, elapsed_ns: int) -> None:
        """What an expired bounded wait does (backends/nvptx/spin_wait.py): claim a record
        slot, write the record (``ir.diag`` layout; ``elapsed_ns`` the simulated time of its
        polls), raise the abort word; the caller exits."""
        base = self._fn(s.err_buf)(th)
        word = lambda i: base + 4 * i  # noqa: E731
        slot = self._load(word(diag.COUNT_WORD), T.u32)
        self._store(word(diag.COUNT_WORD), slot + 1, T.u32)
        if slot < diag.MAX_RECORDS:
            values = {"magic": diag.RECORD_MAGIC,
                      "kernel_tag": diag.kernel_tag(th.launch.kernel.name),
                      "site_id": s.site.site_id, "rank": self._fn(s.rank)(th),
                      "block": th.vblock, "thread": th.tid, "warp": th.tid // 32,
                      "smid": th.block % 132, "index": self._fn(s.site.index)(th),
                      "expected": want, "last_seen": seen, "elapsed_ns": elapsed_ns}
            first = diag.HEADER_WORDS + slot * diag.RECORD_WORDS
            for field, offset in diag.FIELDS.items():
                v = values[field]
                if field in diag.WIDE_FIELDS:
                    self._store(word(first + offset), v & 0xFFFFFFFF, T.u32)
                    self._store(word(first + offset + 1), (v >> 32) & 0xFFFFFFFF, T.u32)
                else:
                    self._store(word(first + offset), v & 0xFFFFFFFF, T.u32)
        self._store(word(diag.ABORT_WORD), 1, T.u32)

    # -- expressions: compiled once per node into fn(th) -> value --------------------------------
    def _fn(self, e):
        fn = self._exprs.get(id(e))
        if fn is None:
            fn = self._compile_expr(e)
            self._exprs[id(e)] = fn
            self._keep.append(e)
        return fn

    def _compile_expr(self, e):
        f = self._fn
        if isinstance(e, N.Const):
            t = e.dtype
            v = bool(e.value) if t.kind == "pred" else _round_float(e.value, t) \
                if t.kind == "f" else _mask(int(e.value), t.bits)
            return lambda th: v
        if isinstance(e, N.Var):
            slot = self._slot(e)
            return lambda th: th.vars[slot]
        if isinstance(e, N.Param):
            name = e.name
            is_float = isinstance(e.dtype, T.DType) and e.dtype.kind == "f"
            m = (1 << _bits(e.dtype)) - 1
            return (lambda th: th.params[name]) if is_float \
                else (lambda th: int(th.params[name]) & m)
        if isinstance(e, N.SRegRead):
            r = e.sreg
            if r is SReg.TID_X:
                return lambda th: th.tid
            if r is SReg.CTAID_X:
                return lambda th: th.vblock
            if r is SReg.LANEID:
                return lambda th: th.tid & 31
            if r is SReg.NCTAID_X:
                return lambda th: th.launch.vgrid
            return lambda th: self._sreg(th, r)
        if isinstance(e, N.BinOp):
            fa, fb, op, dt = f(e.a), f(e.b), e.op, e.a.dtype
            if isinstance(dt, T.DType) and dt.kind == "u":
                m = (1 << dt.bits) - 1
                if op is BinOpKind.ADD:
                    return lambda th: (fa(th) + fb(th)) & m
                if op is BinOpKind.SUB:
                    return lambda th: (fa(th) - fb(th)) & m
                if op is BinOpKind.MUL:
                    return lambda th: (fa(th) * fb(th)) & m
                if op is BinOpKind.AND:
                    return lambda th: fa(th) & fb(th)
                if op is BinOpKind.OR:
                    return lambda th: fa(th) | fb(th)
            return lambda th: self._binop(op, fa(th), fb(th), dt)
        if isinstance(e, N.Cmp):
            fa, fb, op, dt = f(e.a), f(e.b), e.op, e.a.dtype
            if not (isinstance(dt, T.DType) and dt.kind == "s"):
                pyop = {CmpOp.EQ: operator.eq, CmpOp.NE: operator.ne, CmpOp.LT: operator.lt,
                        CmpOp.LE: operator.le, CmpOp.GT: operator.gt, CmpOp.GE: operator.ge}[op]
                return lambda th: pyop(fa(th), fb(th))
            return lambda th: self._cmp(op, fa(th), fb(th), dt)
        if isinstance(e, N.PtrAdd):
            fb, fo = f(e.base), f(e.offset)
            if e.offset.dtype.is_signed:
                bits = e.offset.dtype.bits
                return lambda th: (fb(th) + _signed(fo(th), bits)) & MASK64
            return lambda th: (fb(th) + fo(th)) & MASK64
        if isinstance(e, N.Cast):
            fa, src, dst = f(e.a), e.a.dtype, e.dtype
            return lambda th: self._cast(fa(th), src, dst)
        if isinstance(e, N.Bitcast):
            fa, src, dst = f(e.a), e.a.dtype, e.dtype
            return lambda th: self._bitcast(fa(th), src, dst)
        if isinstance(e, N.UnOp):
            fa, op, dt = f(e.a), e.op, e.a.dtype
            return lambda th: self._unop(op, fa(th), dt)
        if isinstance(e, N.Select):
            fc, fa, fb = f(e.cond), f(e.a), f(e.b)
            return lambda th: fa(th) if fc(th) else fb(th)
        if isinstance(e, N.SharedAddr):
            name = e.name
            return lambda th: th.launch.shared[th.block][name]
        if isinstance(e, N.Extract):
            fv, i = f(e.vec), e.index
            return lambda th: fv(th)[i]
        if isinstance(e, N.Pack):
            lanes = [f(x) for x in e.lanes]
            return lambda th: tuple(g(th) for g in lanes)
        if isinstance(e, N.CvtE4M3x2):
            fa, fb = f(e.a), f(e.b)
            return lambda th: (e4m3_code(fa(th)) << 8) | e4m3_code(fb(th))
        if isinstance(e, N.CvtE4M3ToF32):
            fa = f(e.a)
            return lambda th: e4m3_value(fa(th) & 0xFF)
        if isinstance(e, N.Fma):
            fa, fb, fc, dt = f(e.a), f(e.b), f(e.c), e.dtype
            return lambda th: fma(fa(th), fb(th), fc(th), dt)
        raise SimError(f"the simulator does not evaluate {type(e).__name__}")

    # -- memory and arithmetic -----------------------------------------------------------------
    def _load(self, addr, dtype):
        if isinstance(dtype, VecType):
            n = dtype.elem.nbytes
            data = self.mem.read(addr, n * dtype.n)
            return tuple(_scalar_value(data[i * n:(i + 1) * n], dtype.elem)
                         for i in range(dtype.n))
        if isinstance(dtype, PtrType):
            return int.from_bytes(self.mem.read(addr, 8), "little")
        return _scalar_value(self.mem.read(addr, dtype.nbytes), dtype)

    def _store(self, addr, value, dtype):
        if isinstance(dtype, VecType):
            self.mem.write(addr, b"".join(_scalar_bytes(v, dtype.elem) for v in value))
        elif isinstance(dtype, PtrType):
            self.mem.write(addr, _mask(value, 64).to_bytes(8, "little"))
        else:
            self.mem.write(addr, _scalar_bytes(value, dtype))

    def _rmw(self, op, old, v, dt):
        bits = dt.bits
        if dt.kind == "f":
            if op is AtomOp.ADD:
                return old + v
            raise SimError(f"atomic {op.value} on {dt}")
        signed = dt.is_signed
        key = (lambda x: _signed(x, bits)) if signed else (lambda x: x)
        if op is AtomOp.ADD:
            return _mask(old + v, bits)
        if op is AtomOp.MIN:
            return old if key(old) <= key(v) else v
        if op is AtomOp.MAX:
            return old if key(old) >= key(v) else v
        if op is AtomOp.EXCH:
            return v
        if op is AtomOp.AND:
            return old & v
        if op is AtomOp.OR:
            return old | v
        if op is AtomOp.XOR:
            return old ^ v
        if op is AtomOp.INC:
            return 0 if old >= v else old + 1
        if op is AtomOp.DEC:
            return v if old == 0 or old > v else old - 1
        raise SimError(f"atomic {op}")

    @staticmethod
    def _cmp(op, a, b, dtype) -> bool:
        if isinstance(dtype, T.DType) and dtype.kind == "s":
            a, b = _signed(a, dtype.bits), _signed(b, dtype.bits)
        return {CmpOp.EQ: a == b, CmpOp.NE: a != b, CmpOp.LT: a < b, CmpOp.LE: a <= b,
                CmpOp.GT: a > b, CmpOp.GE: a >= b}[op]

    def _sreg(self, th, r: SReg) -> int:
        if r is SReg.TID_X:
            return th.tid
        if r is SReg.CTAID_X:
            return th.vblock
        if r is SReg.NTID_X:
            return th.launch.kernel.block_threads
        if r is SReg.NCTAID_X:
            return th.launch.vgrid
        if r is SReg.LANEID:
            return th.tid % 32
        if r is SReg.WARPID:
            return th.tid // 32
        if r is SReg.SMID:
            return th.block % 132
        if r is SReg.NSMID:
            return 132
        if r in (SReg.GLOBALTIMER, SReg.CLOCK64):
            self.clock += 1
            return self.clock
        if r in (SReg.TID_Y, SReg.TID_Z, SReg.CTAID_Y):
            return 0
        if r is SReg.DYNAMIC_SMEM_SIZE:
            return 0
        raise SimError(f"sreg {r}")

    def _binop(self, op, a, b, dtype):
        if isinstance(dtype, T.DType) and dtype.kind == "pred":
            return {BinOpKind.AND: a and b, BinOpKind.OR: a or b,
                    BinOpKind.XOR: a != b}[op]
        if isinstance(dtype, T.DType) and dtype.kind == "f":
            return _float_binop(op, a, b, dtype)
        bits = _bits(dtype)
        signed = isinstance(dtype, T.DType) and dtype.kind == "s"
        sa, sb = (_signed(a, bits), _signed(b, bits)) if signed else (a, b)
        if op is BinOpKind.ADD:
            return _mask(a + b, bits)
        if op is BinOpKind.SUB:
            return _mask(a - b, bits)
        if op is BinOpKind.MUL:
            return _mask(a * b, bits)
        if op in (BinOpKind.DIV, BinOpKind.REM):
            if b == 0:
                raise SimError("integer division by zero")
            q = abs(sa) // abs(sb) * (1 if (sa >= 0) == (sb >= 0) else -1)
            return _mask(q if op is BinOpKind.DIV else sa - q * sb, bits)
        if op is BinOpKind.AND:
            return a & b
        if op is BinOpKind.OR:
            return a | b
        if op is BinOpKind.XOR:
            return a ^ b
        if op is BinOpKind.SHL:
            return _mask(a << b, bits) if b < bits else 0
        if op is BinOpKind.SHR:
            if b >= bits:
                return _mask(-1, bits) if signed and sa < 0 else 0
            return _mask(sa >> b, bits)
        if op is BinOpKind.MIN:
            return a if sa <= sb else b
        if op is BinOpKind.MAX:
            return a if sa >= sb else b
        raise SimError(f"binop {op}")

    def _unop(self, op, a, dtype):
        if isinstance(dtype, T.DType) and dtype.kind == "pred" and op is UnOpKind.NOT:
            return not a
        if isinstance(dtype, T.DType) and dtype.kind == "f":
            if op is UnOpKind.ABS:
                return math.fabs(a)
            if op is UnOpKind.NEG:
                return -a
            raise SimError(f"unop {op} on {dtype}")
        bits = _bits(dtype)
        if op is UnOpKind.NEG:
            return _mask(-a, bits)
        if op is UnOpKind.NOT:
            return _mask(~a, bits)
        if op is UnOpKind.POPC:
            return bin(a).count("1")
        if op is UnOpKind.ABS:
            return _mask(abs(_signed(a, bits)), bits)
        raise SimError(f"unop {op}")

    def _cast(self, v, src, dst):
        if src == dst:
            return v
        if isinstance(dst, PtrType):
            return _mask(int(v), 64)
        if isinstance(src, PtrType):
            return _mask(v, dst.bits)
        if src.kind == "pred":
            return int(bool(v)) if dst.kind != "f" else float(bool(v))
        if dst.kind == "f":
            return _round_float(_signed(v, src.bits) if src.kind == "s" else v, dst) \
                if src.kind != "f" else _round_float(v, dst)
        if src.kind == "f":     # cvt.rzi: toward zero, saturating, NaN -> 0
            if math.isnan(v):
                return 0
            lo, hi = (-(1 << (dst.bits - 1)), (1 << (dst.bits - 1)) - 1) \
                if dst.kind == "s" else (0, (1 << dst.bits) - 1)
            return _mask(int(min(max(math.trunc(v) if math.isfinite(v) else v, lo), hi)),
                         dst.bits)
        if src.kind == "s" and src.bits < dst.bits:
            return _mask(_signed(v, src.bits), dst.bits)
        return _mask(v, dst.bits)

    def _bitcast(self, v, src, dst):
        if isinstance(src, T.DType) and src.kind == "f":
            v = int.from_bytes(_scalar_bytes(v, src), "little")
        if isinstance(dst, T.DType) and dst.kind == "f":
            return _scalar_value(_mask(v, dst.bits).to_bytes(dst.nbytes, "little"), dst)
        return v
