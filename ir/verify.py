"""Static checks of the kernel IR (docs/ir.md).

``verify(kernel_or_module)`` raises ``VerifyError`` listing every ``Issue`` found; ``check``,
``check_kernel`` and ``check_role`` return the issues instead. Each issue names the kernel, the
role (``None`` for kernel-level rules), the offending node and the rule it breaks.

Rules:

- barriers: id in 0..15; a counted barrier counts a multiple of 32 threads, exactly its role's
  (a ``group`` barrier: a proper divisor of its role's, one group of its warps);
  ``count=None`` (``bar.sync id``: the whole CTA) only in a role covering the whole block; roles
  that can run at once in one block (blocks may overlap, threads disjoint) use distinct ids;
  ``bar.sync``/``bar.arrive`` only on a barrier the role declares;
- memory ordering: which semantics each access may have (``ACCESS_SEMS``), a scope exactly when
  the semantics need one, vector accesses only weak, at most 16 bytes, ``.nc`` only on weak
  global loads; release/acquire on a peer-visible address needs ``sys`` scope;
- types: assignments, operands of one type, predicates where a condition is expected, loads and
  stores through pointers, loop bounds of the loop variable's type, atomic types PTX has
  (``ATOMIC_TYPES``), spin-wait operands, declared shared buffers, ``break`` inside a loop;
- kernel: block size a multiple of 32 in 32..1024, role thread ranges inside the block, unique
  parameter names (and unique kernel names in a module), spin-wait sites listed in ``sites``.
"""

from __future__ import annotations

import math

import attrs

from . import nodes as N
from . import types as T
from .enums import AtomOp, CacheHint, Scope, Sem, Space
from .printer import print_node
from .types import PtrType, VecType

# the semantics each kind of access may have
ACCESS_SEMS = {
    "load": (Sem.WEAK, Sem.VOLATILE, Sem.RELAXED, Sem.ACQUIRE),
    "store": (Sem.WEAK, Sem.VOLATILE, Sem.RELAXED, Sem.RELEASE),
    "atomic": (Sem.RELAXED, Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL),
    "spin_wait": (Sem.RELAXED, Sem.ACQUIRE),
    "fence": (Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL, Sem.SC),
}
ACCESS_NOUNS = {"load": "a load", "store": "a store", "atomic": "an atomic",
                "spin_wait": "a spin wait", "fence": "a fence"}

INT32_64 = frozenset({T.u32, T.u64, T.s32, T.s64, T.b32, T.b64})
ATOMIC_TYPES = {
    AtomOp.ADD: frozenset({T.u32, T.u64, T.s32, T.f32, T.f64}),
    AtomOp.MIN: frozenset({T.u32, T.s32, T.u64, T.s64}),
    AtomOp.MAX: frozenset({T.u32, T.s32, T.u64, T.s64}),
    AtomOp.EXCH: INT32_64, AtomOp.AND: INT32_64, AtomOp.OR: INT32_64, AtomOp.XOR: INT32_64,
    AtomOp.INC: frozenset({T.u32}), AtomOp.DEC: frozenset({T.u32}),
}
CAS_TYPES = INT32_64
SPIN_TYPES = frozenset({T.u32, T.u64, T.s32, T.s64})
MAX_ACCESS_BYTES = 16
N_BARRIERS = 16


def _names(types) -> str:
    return "/".join(sorted(t.name for t in types))


@attrs.frozen
class Issue:
    """One broken rule: in kernel ``kernel`` (a name), role ``role`` (a name, or ``None`` for
    a kernel-level rule), at ``node``."""

    kernel: str
    role: str | None
    node: object
    message: str

    def __str__(self) -> str:
        where = f"kernel {self.kernel}" + (f", role {self.role}" if self.role else "")
        return f"{where}: `{print_node(self.node)}`: {self.message}"


class VerifyError(ValueError):
    """The IR breaks one or more rules; ``issues`` lists them all, ``str()`` one per line."""

    def __init__(self, issues: list[Issue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


def _type(e):
    """The type of expression ``e``, or None when it is ill-formed (reported elsewhere)."""
    try:
        return e.dtype
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Peer visibility


def _peer_root(e, peer_vars):
    """The peer ``Param``/``Var`` the address ``e`` is built from, or None. Follows what an
    address can be derived from: pointer arithmetic, casts, selects and integer arithmetic."""
    match e:
        case N.Param() | N.Var():
            return e if e.peer or e in peer_vars else None
        case N.PtrAdd():
            return _peer_root(e.base, peer_vars)
        case N.Cast() | N.Bitcast():
            return _peer_root(e.a, peer_vars)
        case N.Select() | N.BinOp():
            return _peer_root(e.a, peer_vars) or _peer_root(e.b, peer_vars)
    return None


def peer_vars(kernel: N.Kernel) -> frozenset:
    """Variables assigned a peer-visible address somewhere in ``kernel`` (besides those marked
    ``peer``): a forgotten ``peer=True`` must not hide a release on peer memory."""
    assigns = [s for r in kernel.roles for s in N.walk(r.body) if isinstance(s, N.Assign)]
    found: set = set()
    changed = True
    while changed:
        changed = False
        for s in assigns:
            if s.dst not in found and _peer_root(s.value, found) is not None:
                found.add(s.dst)
                changed = True
    return frozenset(found)


# ---------------------------------------------------------------------------------------------
# Roles


def _threads(kernel: N.Kernel, role: N.Role) -> tuple[int, int]:
    """The role's thread range ``[lo, hi)`` inside the block."""
    t = role.threads
    return (0, kernel.block_threads) if t is None else (t.base, t.base + t.count)


def _const_blocks(b: N.BlockRange):
    if not isinstance(b.start, N.Const):
        return None
    if b.stop is None:
        return b.start.value, math.inf
    return (b.start.value, b.stop.value) if isinstance(b.stop, N.Const) else None


def blocks_disjoint(a: N.BlockRange, b: N.BlockRange) -> bool:
    """True only when no block can be in both ranges: both constant and disjoint, or one
    ends (structurally) where the other starts."""
    if (a.stop is not None and a.stop == b.start) or (b.stop is not None and b.stop == a.start):
        return True
    ca, cb = _const_blocks(a), _const_blocks(b)
    if ca is None or cb is None:
        return False
    (a0, a1), (b0, b1) = ca, cb
    return a0 >= a1 or b0 >= b1 or a1 <= b0 or b1 <= a0


def roles_concurrent(kernel: N.Kernel, a: N.Role, b: N.Role) -> bool:
    """Whether ``a`` and ``b`` can run at the same time in one block: their blocks may overlap
    and their threads are disjoint (roles sharing threads run one after the other)."""
    (a0, a1), (b0, b1) = _threads(kernel, a), _threads(kernel, b)
    return not blocks_disjoint(a.blocks, b.blocks) and (a1 <= b0 or b1 <= a0)


class _RoleChecker:
    """Checks one role's barriers and body."""

    def __init__(self, kernel: N.Kernel, role: N.Role, peers: frozenset):
        self.k, self.role, self.peers = kernel, role, peers
        self.issues: list[Issue] = []
        self.shared = {b.name for b in kernel.shared}
        if kernel.dynamic_shared:
            self.shared.add("dyn_smem")
        self.n_threads = role.threads.count if role.threads else kernel.block_threads

    def add(self, node, message: str):
        self.issues.append(Issue(self.k.name, self.role.name, node, message))

    def run(self) -> list[Issue]:
        for b in self.role.barriers:
            self.barrier_decl(b)
        for e in (self.role.blocks.start, self.role.blocks.stop):
            if e is not None:
                self.exprs(e)
        self.body(self.role.body, loops=0)
        return self.issues

    def barrier_decl(self, b: N.NamedBarrier):
        if not 0 <= b.id < N_BARRIERS:
            self.add(b, f"barrier id {b.id} is outside 0..{N_BARRIERS - 1}")
        lo, hi = _threads(self.k, self.role)
        if b.count is None:
            if b.group:
                self.add(b, "a group barrier needs a thread count (count=all is the CTA)")
            if (lo, hi) != (0, self.k.block_threads):
                self.add(b, f"count=all (bar.sync {b.id}: the whole CTA) needs a role covering "
                            f"the whole block [0, {self.k.block_threads}), not threads "
                            f"[{lo}, {hi})")
            return
        if b.count % 32:
            self.add(b, f"barrier count {b.count} is not a multiple of 32")
        if b.group:
            if b.count >= self.n_threads or self.n_threads % b.count:
                self.add(b, f"group barrier count {b.count} must be a proper divisor of the "
                            f"role's thread count {self.n_threads} (one group of its warps)")
        elif b.count != self.n_threads:
            self.add(b, f"barrier count {b.count} differs from the role's thread count "
                        f"{self.n_threads}")

    # -- expressions ---------------------------------------------------------------------------
    def exprs(self, root):
        for e in N.walk_expr(root):
            self.expr(e)

    def expr(self, e):
        match e:
            case N.BinOp() | N.Cmp():
                self.same_type(e, (e.a, e.b), f"operands of {e.op.value}")
            case N.Select():
                self.pred(e, e.cond, "selp condition")
                self.same_type(e, (e.a, e.b), "selp operands")
            case N.PtrAdd():
                if not isinstance(_type(e.base), PtrType):
                    self.add(e, f"ptradd base has type {_type(e.base)}, not a pointer")
                t = _type(e.offset)
                if t is not None and not (isinstance(t, T.DType) and t.is_int):
                    self.add(e, f"ptradd offset has type {t}, not an integer")
            case N.SharedAddr():
                if e.name not in self.shared:
                    self.add(e, f"shared buffer {e.name!r} is not declared by the kernel")
            case N.Extract():
                t = _type(e.vec)
                if not isinstance(t, VecType):
                    self.add(e, f"extract from type {t}, not a vector")
                elif not 0 <= e.index < t.n:
                    self.add(e, f"lane {e.index} is outside {t} (0..{t.n - 1})")
            case N.Pack():
                t = e.dtype
                if not isinstance(t, VecType) or len(e.lanes) != t.n:
                    self.add(e, f"pack of {len(e.lanes)} lanes into {t}")
                else:
                    self.same_type(e, e.lanes, "pack lanes", want=t.elem)
            case N.CvtE4M3x2():
                self.same_type(e, (e.a, e.b), "cvt.rn.satfinite.e4m3x2.f32 operands",
                               want=T.f32)
            case N.CvtE4M3ToF32():
                self.same_type(e, (e.a,), "cvt.rn.f16x2.e4m3x2 operand", want=T.u16)
            case N.Fma():
                t = _type(e.a)
                if t is not None and t not in (T.f32, T.f64):
                    self.add(e, f"fma operands have type {t}, not f32 or f64")
                self.same_type(e, (e.a, e.b, e.c), "fma operands")
            case N.Bitcast():
                t = _type(e.a)
                if t is not None and t.bits != e.dtype.bits:
                    self.add(e, f"bitcast from {t} ({t.bits} bits) to {e.dtype} "
                                f"({e.dtype.bits} bits)")

    def same_type(self, node, operands, what: str, want=None):
        types = [_type(x) for x in operands]
        if None in types:
            return
        ref = want if want is not None else types[0]
        if any(t != ref for t in types):
            need = f" ({want})" if want is not None else ""
            got = ", ".join(str(t) for t in types)
            self.add(node, f"{what} must have one type{need}, found {got}")

    def pred(self, node, cond, what: str):
        t = _type(cond)
        if t is not None and t != T.pred:
            self.add(node, f"{what} has type {t}, not pred")

    def expect_type(self, node, expr, want, what: str):
        t = _type(expr)
        if t is not None and t != want:
            self.add(node, f"{what} has type {t}, expected {want}")

    # -- statements ----------------------------------------------------------------------------
    def body(self, stmts, loops: int):
        for s in stmts:
            for e in _stmt_exprs(s):
                self.exprs(e)
            handler = getattr(self, "s_" + type(s).__name__, None)
            if handler is not None:
                handler(s, loops)

    def s_Assign(self, s: N.Assign, loops):
        self.expect_type(s, s.value, s.dst.dtype, f"value assigned to %{s.dst.name}:{s.dst.dtype}")

    def pointer(self, s, addr, what: str):
        t = _type(addr)
        if t is not None and not isinstance(t, PtrType):
            self.add(s, f"{what} address has type {t}, not a pointer")

    def ordering(self, s, kind: str, sem: Sem, scope: Scope | None, addr=None):
        """Semantics allowed for this access, scope presence, and sys scope on peer memory."""
        allowed = ACCESS_SEMS[kind]
        if sem not in allowed:
            self.add(s, f"{sem.value} is not allowed on {ACCESS_NOUNS[kind]} "
                        f"(allowed: {', '.join(x.value for x in allowed)})")
        if sem.needs_scope and scope is None:
            self.add(s, f"{sem.value} needs a scope (cta, cluster, gpu or sys)")
        elif not sem.needs_scope and scope is not None:
            self.add(s, f"{sem.value} takes no scope, found {scope.value}")
        if addr is not None and sem.is_ordered and scope is not None and scope is not Scope.SYS:
            root = _peer_root(addr, self.peers)
            if root is not None:
                sigil = "$" if isinstance(root, N.Param) else "%"
                self.add(s, f"{sem.value} at {scope.value} scope on a peer-visible address "
                            f"(from {sigil}{root.name}): peer memory needs sys scope")

    def access(self, s, kind: str, t):
        """Width, vector and pred rules of one ld/st of type ``t``."""
        if t is None:
            return
        if t == T.pred:
            self.add(s, f"a {kind} cannot move a pred")
        if t.nbytes > MAX_ACCESS_BYTES:
            self.add(s, f"{kind} of {t} is {t.nbytes} bytes, wider than {MAX_ACCESS_BYTES}")
        if isinstance(t, VecType) and s.sem is not Sem.WEAK:
            self.add(s, f"vector {kind} of {t} must be weak, not {s.sem.value}")

    def s_Load(self, s: N.Load, loops):
        self.pointer(s, s.addr, "load")
        self.ordering(s, "load", s.sem, s.scope, s.addr)
        self.access(s, "load", s.dst.dtype)
        if s.cache is not CacheHint.NONE:
            t = _type(s.addr)
            if s.sem is not Sem.WEAK or (isinstance(t, PtrType) and t.space is not Space.GLOBAL):
                self.add(s, "ld.global.nc needs a weak load through a global pointer")

    def s_Store(self, s: N.Store, loops):
        self.pointer(s, s.addr, "store")
        self.ordering(s, "store", s.sem, s.scope, s.addr)
        self.access(s, "store", _type(s.value))

    def s_AtomicRMW(self, s: N.AtomicRMW, loops):
        self.pointer(s, s.addr, "atomic")
        self.ordering(s, "atomic", s.sem, s.scope, s.addr)
        t = _type(s.value)
        if t is not None and t not in ATOMIC_TYPES[s.op]:
            self.add(s, f"atom.{s.op.value} has no {t} form "
                        f"(PTX has {_names(ATOMIC_TYPES[s.op])})")
        if s.dst is not None and t is not None:
            self.expect_type(s, s.dst, t, f"destination %{s.dst.name}")

    def s_AtomicCAS(self, s: N.AtomicCAS, loops):
        self.pointer(s, s.addr, "atomic")
        self.ordering(s, "atomic", s.sem, s.scope, s.addr)
        self.same_type(s, (s.dst, s.compare, s.value), "cas destination, compare and value")
        t = _type(s.value)
        if t is not None and t not in CAS_TYPES:
            self.add(s, f"atom.cas has no {t} form (PTX has {_names(CAS_TYPES)})")

    def s_Fence(self, s: N.Fence, loops):
        self.ordering(s, "fence", s.sem, s.scope)

    def s_BarSync(self, s, loops):
        if s.barrier not in self.role.barriers:
            self.add(s, f"barrier {s.barrier.name!r} (id {s.barrier.id}) is not declared by "
                        f"role {self.role.name}")

    s_BarArrive = s_BarSync

    def s_Ballot(self, s: N.Ballot, loops):
        self.pred(s, s.pred, "ballot predicate")

    def s_Vote(self, s: N.Vote, loops):
        self.pred(s, s.pred, "vote predicate")

    def s_If(self, s: N.If, loops):
        self.pred(s, s.cond, "if condition")
        self.body(s.then, loops)
        self.body(s.orelse, loops)

    def s_While(self, s: N.While, loops):
        self.pred(s, s.cond, "while condition")
        self.body(s.body, loops + 1)

    def s_For(self, s: N.For, loops):
        for what, e in (("start", s.start), ("stop", s.stop), ("step", s.step)):
            self.expect_type(s, e, s.var.dtype, f"for {what}")
        self.body(s.body, loops + 1)

    def s_Break(self, s, loops):
        if loops == 0:
            self.add(s, "break outside a loop")

    def s_SpinWait(self, s: N.SpinWait, loops):
        self.pointer(s, s.addr, "spin_wait")
        self.ordering(s, "spin_wait", s.sem, s.scope, s.addr)
        if s.dtype not in SPIN_TYPES:
            self.add(s, f"spin_wait polls {s.dtype}; it needs {_names(SPIN_TYPES)}")
        self.expect_type(s, s.expected, s.dtype, "spin_wait expected value")
        if s.dst is not None:
            self.expect_type(s, s.dst, s.dtype, f"destination %{s.dst.name}")
        self.expect_type(s, s.timeout_ns, T.u64, "spin_wait timeout_ns")
        self.expect_type(s, s.rank, T.u32, "spin_wait rank")
        self.expect_type(s, s.site.index, T.u64, "spin_wait site index")
        self.expect_type(s, s.err_buf, T.ptr_global, "spin_wait err_buf")
        if s.give_up is not None:
            self.pointer(s, s.give_up, "spin_wait give_up")
        if s.shrink is not None:
            self.expect_type(s, s.shrink, T.u32, "spin_wait shrink")
        if s.status is not None:
            self.expect_type(s, s.status, T.u32, f"spin_wait status %{s.status.name}")
        elif s.give_up is not None or s.shrink is not None:
            self.add(s, "spin_wait with give_up or shrink needs a status variable (how the "
                        "wait ended)")
        info = N.SiteInfo(s.site.site_id, self.role.name, s.site.buffer)
        if info not in self.k.sites:
            self.add(s, f"site {s.site.site_id} (role {self.role.name}, buffer "
                        f"{s.site.buffer}) is not listed in the kernel's sites")


def _stmt_exprs(s):
    """The expressions a statement evaluates itself (not those of nested bodies)."""
    for f in attrs.fields(type(s)):
        v = getattr(s, f.name)
        if isinstance(v, N.ExprOps):
            yield v
        elif isinstance(v, N.DiagSite):
            yield v.index
        elif isinstance(v, tuple):
            yield from (x for x in v if isinstance(x, N.ExprOps))


def check_role(kernel: N.Kernel, role: N.Role, peers: frozenset | None = None) -> list[Issue]:
    """The issues of one role (its barriers and body); ``peers`` as from ``peer_vars``."""
    return _RoleChecker(kernel, role, peer_vars(kernel) if peers is None else peers).run()


# ---------------------------------------------------------------------------------------------
# Kernels and modules


def check_kernel(k: N.Kernel) -> list[Issue]:
    """Every issue of kernel ``k``: kernel-level rules, then each role."""
    issues: list[Issue] = []

    def add(role, node, message):
        issues.append(Issue(k.name, role, node, message))

    if not (32 <= k.block_threads <= 1024 and k.block_threads % 32 == 0):
        add(None, k, f"block_threads={k.block_threads} must be a multiple of 32 in 32..1024")
    seen = set()
    for p in k.params:
        if p.name in seen:
            add(None, p, f"parameter name {p.name!r} is declared twice")
        seen.add(p.name)
    for r in k.roles:
        if r.threads is not None:
            lo, hi = _threads(k, r)
            if lo < 0 or hi <= lo or hi > k.block_threads:
                add(r.name, r, f"thread range [{lo}, {hi}) is not a non-empty range inside the "
                               f"block's {k.block_threads} threads")
    issues += _barrier_conflicts(k)
    peers = peer_vars(k)
    for r in k.roles:
        issues += check_role(k, r, peers)
    return issues


def _barrier_conflicts(k: N.Kernel) -> list[Issue]:
    """Roles that can run at once in one block must not share a barrier id."""
    issues = []
    for j, b in enumerate(k.roles):
        for a in k.roles[:j]:
            if not roles_concurrent(k, a, b):
                continue
            ids_a = {x.id: x for x in a.barriers}
            reported = set()
            for y in b.barriers:
                x = ids_a.get(y.id)
                if x is None or y.id in reported:
                    continue
                reported.add(y.id)
                lo, hi = _threads(k, a)
                issues.append(Issue(k.name, b.name, y, (
                    f"barrier id {y.id} is also used by role {a.name} (barrier {x.name!r}), "
                    f"which can run in the same block at the same time on threads [{lo}, {hi})")))
    return issues


def check(obj: N.Kernel | N.Module) -> list[Issue]:
    """Every issue of a kernel or of each kernel of a module."""
    if isinstance(obj, N.Kernel):
        return check_kernel(obj)
    if not isinstance(obj, N.Module):
        raise TypeError(f"verify expects a Kernel or a Module, not {type(obj).__name__}")
    issues, seen = [], set()
    for k in obj.kernels:
        if k.name in seen:
            issues.append(Issue(k.name, None, k, f"kernel name {k.name!r} appears twice in "
                                                  f"module {obj.name}"))
        seen.add(k.name)
        issues += check_kernel(k)
    return issues


def verify(obj: N.Kernel | N.Module) -> None:
    """Raise ``VerifyError`` with every issue of ``obj`` (a Kernel or Module); return None if
    there is none."""
    issues = check(obj)
    if issues:
        raise VerifyError(issues)
