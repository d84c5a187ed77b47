"""The NVSHMEM device functions of ``ir.nvshmem`` on the simulator: every PE in one process.

The symmetric heap is modelled by a table, ``SymmetricHeap``: the caller (a world) registers,
per PE, the base and size of each symmetric buffer under one name (``register(pe, name,
base, nbytes)``). A symmetric address is an address inside some PE's registered buffer; the
same buffer of PE ``b`` at the same offset is its image on ``b`` (``translate``). The kernels
pass this PE's own address of a symmetric object, as NVSHMEM requires; the PE that issued a
call is the one whose buffer holds the address (the simulator does not tell a launch's PE
apart otherwise, so ``nvshmem_my_pe`` is not modelled).

Transfers (``Transfers``; ``Sim`` runs the calls, one ``ir.Call`` statement each) follow what
NVSHMEM defines (docs/shmem.md, "What NVSHMEM promises"), no more:

- **Scopes.** A thread's own calls are its thread scope's; a warp-collective call
  (``nvshmemx_*_warp``: every live lane of the warp calls it, with the same arguments, or it
  is a ``SimError``) is one operation of the warp's scope, issued once the lanes have met
  (a warp barrier, as NVSHMEM synchronises the warp around it).
- **Issue.** ``nvshmem_putmem_nbi`` / ``nvshmemx_putmem_nbi_warp`` read the source bytes at
  the call and queue a put; ``nvshmemx_signal_op`` queues a signal (SET or ADD of a u64
  word); ``nvshmemx_putmem_signal_nbi_warp`` queues a put and a signal that is ordered after
  it. Nothing lands at the call.
- **Delivery.** At the end of every scheduler round each queued transfer whose
  predecessors have landed lands with probability ``1 / Sim.shmem_delay`` (every round
  with a delay of 0 or 1), drawn from the interpreter's seeded stream: a transfer may land
  any number of rounds late, and transfers land in any order except: a put-with-signal's
  signal after its data, and an operation to PE ``p`` after every operation to ``p`` that
  its issuer's ``nvshmem_fence`` preceded (a fence by a thread orders its own and its
  warp's earlier operations before its own and its warp's later ones, per PE). A plain
  ``nvshmemx_signal_op`` is ordered after nothing (no fence, no put it belongs to).
- **Landing.** A put's bytes reach the target PE's image of ``dest``; a signal updates
  the target's u64 word atomically (``SIGNAL_SET`` / ``SIGNAL_ADD``).
- ``nvshmem_fence()``: records the ordering above, completes nothing.
- ``nvshmem_quiet()``: the thread waits (yielding rounds, every other thread running on)
  until every transfer of its thread scope and of its warp's scope has landed. A quiet by
  one lane after a warp-collective call completes the warp's operations (NVSHMEM's warp
  calls end with the warp's barrier, and its implementation says a thread-scoped quiet of
  one thread completes the operations of the threads synchronised with it).
- ``nvshmem_signal_wait_until(sig_addr, cmp, value)``: reads the u64 word (an acquire's
  read under the weak mode) and returns it when it compares true; the kernels call it only
  after their own bounded poll saw the condition, so a word that does not is a
  ``SimError`` (the call would block, with no deadline). The consistency step it runs on a
  network transport has nothing to model here: a landed transfer is visible at once.
- **Exit.** NVSHMEM ties completion to ``nvshmem_quiet`` (and to barriers, which quiet)
  and promises nothing at a kernel's end (on InfiniBand a posted request may wait for a
  later doorbell), so a thread that exits with an operation of its scope issued after its
  last quiet, or the last lane of a warp that exits with such an operation of its warp's,
  is a ``SimError`` (an operation nobody completed), whether or not it happened to land.

Under the weak-memory mode (``weak.py``) each scope lands its transfers as an agent of its
own (``WeakMemory.agent``): a put's bytes land in memory stamped by the agent, a signal is
an RMW at ``sys`` scope that carries the causal past its issuer had at the call plus every
transfer the agent has landed before it (so an acquirer of a put-with-signal's signal sees
the data; of a plain signal, only what happened to land before it on the same scope); a
quiet joins the landed transfers of its scopes into the thread's causal past.

What the model does not show: a put's source is read at the call, so a source rewritten
before the put completes goes unseen (the kernels never rewrite a source within a kernel,
and every scope completes its transfers before it exits); gets, fetching atomics and
collectives are not modelled (the kernels do not call them).

Any other extern function is a ``SimError`` naming it.
"""

from __future__ import annotations

from ir.nvshmem import SIGNAL_ADD, SIGNAL_SET

from .memory import SimError

MASK64 = (1 << 64) - 1


class SymmetricHeap:
    """Per PE, the registered symmetric buffers: ``name -> (base, nbytes)``."""

    def __init__(self):
        self.buffers: dict[int, dict[str, tuple[int, int]]] = {}

    def register(self, pe: int, name: str, base: int, nbytes: int) -> None:
        """Buffer ``name`` of PE ``pe`` is ``nbytes`` bytes at ``base``."""
        pe = int(pe)
        if pe < 0:
            raise SimError(f"shmem: PE must be >= 0, got {pe}")
        self.buffers.setdefault(pe, {})[str(name)] = (int(base), int(nbytes))

    @property
    def n_pes(self) -> int:
        return len(self.buffers)

    def locate(self, addr: int, nbytes: int = 1) -> tuple[int, str, int]:
        """``(pe, name, offset)`` of the registered buffer holding ``[addr, addr + nbytes)``;
        ``SimError`` when no buffer does (not a symmetric address)."""
        for pe, bufs in self.buffers.items():
            for name, (base, size) in bufs.items():
                if base <= addr and addr + nbytes <= base + size:
                    return pe, name, addr - base
        raise SimError(f"shmem: address {addr:#x} (+{nbytes} bytes) is in no registered "
                       f"symmetric buffer (registered: {self._names()})")

    def translate(self, addr: int, pe: int, nbytes: int = 1) -> int:
        """``pe``'s address of the symmetric address ``addr`` (the same buffer, the same
        offset)."""
        if not self.buffers:
            raise SimError("shmem: an NVSHMEM call, but no symmetric buffer is registered "
                           "(the world registers them: backends.sim.Machine.symmetric_heap)")
        _, name, off = self.locate(addr, nbytes)
        target = self.buffers.get(int(pe))
        if target is None or name not in target:
            raise SimError(f"shmem: PE {pe} has no symmetric buffer {name!r} (PEs: "
                           f"{sorted(self.buffers)})")
        return target[name][0] + off

    def _names(self) -> str:
        names = sorted({n for bufs in self.buffers.values() for n in bufs})
        return ", ".join(names) or "none"


class Transfer:
    """One queued put (``data`` to ``target``) or signal (``op`` of ``value`` on the u64 word
    at ``target``) to PE ``pe``: ``after`` the transfers that must land first; ``view`` the
    issuer's causal past at the call (weak mode; None otherwise)."""

    __slots__ = ("kind", "target", "pe", "data", "value", "op", "after", "view", "scope",
                 "landed")

    def __init__(self, kind, target, pe, scope, after, view, data=None, value=0, op=0):
        self.kind, self.target, self.pe, self.scope = kind, target, pe, scope
        self.after, self.view = after, view
        self.data, self.value, self.op = data, value, op
        self.landed = False

    def ready(self) -> bool:
        return all(t.landed for t in self.after)


class Scope:
    """The operations one thread, or one warp's collective calls, issued: ``pending`` (issue
    order, not landed), ``unquieted`` (issued since the last quiet that covered this scope),
    ``floor`` (per PE, the operations an earlier fence of this thread ordered before the
    ones issued after it), ``agent`` (weak mode: who lands them)."""

    def __init__(self, name: str):
        self.name = name
        self.pending: list[Transfer] = []
        self.unquieted = 0
        self.floor: dict = {}
        self.agent = None


class Transfers:
    """The NVSHMEM transfers in flight and their delivery (module docstring). ``land(t)``
    (the interpreter's) writes a transfer's effect into memory."""

    def __init__(self, rng, delay: int, land):
        self.rng = rng
        self.delay = delay
        self.land = land
        self.scopes: list[Scope] = []      # scopes with pending transfers (issue order)

    @property
    def active(self) -> bool:
        return bool(self.scopes)

    def _after(self, scopes, pe) -> list:
        out = []
        for sc in scopes:
            out += [t for t in sc.floor.get(pe, ()) if not t.landed]
        return out

    def issue(self, scope: Scope, fence_scopes, kind, target, pe, view, after=(), **what):
        """Queue a transfer of ``kind`` (``"put"``: ``data=``; ``"signal"``: ``value=``,
        ``op=``) on ``scope``, ordered after ``after`` and after what the fences of
        ``fence_scopes`` (the issuing threads' scopes) put before it for ``pe``."""
        t = Transfer(kind, target, pe, scope, list(after) + self._after(fence_scopes, pe),
                     view, **what)
        if not scope.pending:
            self.scopes.append(scope)
        scope.pending.append(t)
        scope.unquieted += 1
        return t

    @staticmethod
    def fence(floor_scope: Scope, scopes) -> None:
        """``nvshmem_fence`` of the thread whose scope is ``floor_scope``: every pending
        transfer of ``scopes`` (its own and its warp's) goes before the thread's (and its
        warp's) later transfers to the same PE."""
        floor: dict = {}
        for sc in scopes:
            for t in sc.pending:
                floor.setdefault(t.pe, []).append(t)
        floor_scope.floor = floor

    def deliver_round(self) -> None:
        """One scheduler round: each transfer whose predecessors landed lands, by chance."""
        p = 1.0 if self.delay <= 1 else 1.0 / self.delay
        rng = self.rng
        for sc in list(self.scopes):
            for t in list(sc.pending):
                if t.ready() and (p >= 1.0 or rng.random() < p):
                    self._land(t)
        self.scopes = [sc for sc in self.scopes if sc.pending]

    def _land(self, t: Transfer) -> None:
        self.land(t)
        t.landed = True
        t.scope.pending.remove(t)


def check_completed(scope: Scope | None, who: str) -> None:
    """``SimError`` when ``scope`` (``who`` exits) issued operations after its last quiet."""
    if scope is not None and scope.unquieted:
        raise SimError(f"{who} exits with {scope.unquieted} NVSHMEM operation(s) never "
                       f"completed (no nvshmem_quiet after them; {len(scope.pending)} not "
                       f"landed yet)")


#: ``nvshmemx_cmp_type_t`` (``ir.nvshmem.CMP_*``) as Python comparisons
_COMPARE = {0: lambda a, b: a == b, 1: lambda a, b: a != b, 2: lambda a, b: a > b,
            3: lambda a, b: a <= b, 4: lambda a, b: a < b, 5: lambda a, b: a >= b}


def compare(word: int, cmp: int, value: int) -> bool:
    """Whether the u64 ``word`` compares true with ``value`` by NVSHMEM's ``cmp``."""
    if cmp not in _COMPARE:
        raise SimError(f"nvshmem_signal_wait_until: unknown cmp {cmp}")
    return _COMPARE[cmp](word & MASK64, value & MASK64)


def signal_result(old: int, value: int, op: int) -> int:
    """The u64 word after a signal: ``SIGNAL_SET`` of ``value`` or ``SIGNAL_ADD`` of it."""
    if op == SIGNAL_SET:
        return value & MASK64
    if op == SIGNAL_ADD:
        return (old + value) & MASK64
    raise SimError(f"nvshmemx_signal_op: unknown sig_op {op}")


__all__ = ["SymmetricHeap", "Transfer", "Scope", "Transfers", "check_completed",
           "compare", "signal_result"]
