"""A builder whose code reads like the kernel it builds.

    kb = KernelBuilder("copy16", block_threads=256)
    dst, src = kb.param("dst", T.ptr_global), kb.param("src", T.ptr_global)
    n = kb.param("n_vec", T.u64)
    with kb.role("copy") as r:
        i = r.let("i", r.global_thread_id(T.u64))
        with r.while_(i < n):
            v = r.load(src + i * 16, T.vec(T.u32, 4), cache=CacheHint.NC)
            r.store(dst + i * 16, v)
            r.assign(i, i + r.grid_threads(T.u64))
    kernel = kb.build()

Statement methods append to the innermost open body; ``with r.if_(c):``, ``r.else_()``,
``r.for_range(...)`` and ``r.while_(...)`` open nested bodies.

A role is a context: ``kb.role(name, blocks=, threads=, barrier_id=, smem_base=)`` gives its
``RoleBuilder`` the block range, the thread range (``r.tid``, ``r.warp`` role-local,
``r.n_threads``, ``r.warp_base``), the id of the role's own block barrier (``r.barrier_id``;
None: the role spans the block and joins with ``bar.sync 0``) and the byte where its scratch
starts in dynamic shared memory (``r.smem_base``; None: static ``.shared`` buffers), so a
builder that shares its block with another role (a fused megakernel) takes them from ``r``
instead of from its arguments: ``r.scratch(name, nbytes)`` allocates scratch, and the
kernels' ``comm_sync(r)`` (``epgen.primitives``) joins on ``r.barrier_id``.
"""

from __future__ import annotations

import contextlib

from . import nodes as N
from . import types as T
from .enums import AtomOp, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, SReg, VoteMode
from .nodes import as_expr


ALIGN = 16          # dynamic shared scratch slices start on 16-byte boundaries
N_BARRIERS = 16     # hardware named barriers per block: ids 0..15


class _Body:
    def __init__(self):
        self.stmts: list = []


class RoleBuilder:
    """Builds one role's body. ``tid``/``warp``/``lane`` are role-local (``tid.x`` minus the
    role's thread base); ``block`` is ``ctaid.x``. ``barrier_id`` and ``smem_base`` are the
    role's context (module docstring; ``KernelBuilder.role``)."""

    def __init__(self, kb: "KernelBuilder", name: str, blocks: N.BlockRange,
                 threads: N.ThreadRange | None, barrier_id: int | None = None,
                 smem_base: int | None = None):
        self.kb = kb
        self.name = name
        self.blocks = blocks
        self.threads = threads
        #: the role's block barrier: None = ``bar.sync 0`` over the block, else this named
        #: barrier id over the role's threads
        self.barrier_id = barrier_id
        #: where the role's scratch starts in dynamic shared memory (None: static buffers)
        self.smem_base = smem_base
        self.barriers: list[N.NamedBarrier] = []
        self._stack: list[_Body] = [_Body()]
        self._last_if: tuple | None = None
        self._scratch_end = smem_base

    # -- identity of the running thread --------------------------------------------------------
    @property
    def n_threads(self) -> int:
        return self.threads.count if self.threads else self.kb.block_threads

    @property
    def thread_base(self) -> int:
        return self.threads.base if self.threads else 0

    @property
    def warp_base(self) -> int:
        """The block's warp index of the role's first warp (the reference's
        ``comm_warp_base``): ``thread_base // 32``."""
        return self.thread_base // 32

    def sreg(self, sreg: SReg) -> N.SRegRead:
        return N.SRegRead(sreg)

    @property
    def tid(self) -> N.Expr:
        t = N.SRegRead(SReg.TID_X)
        return t - self.thread_base if self.thread_base else t

    @property
    def warp(self) -> N.Expr:
        """Role-local logical warp index (``tid / 32``; not the volatile ``%warpid``)."""
        return self.tid // 32

    @property
    def lane(self) -> N.Expr:
        return N.SRegRead(SReg.LANEID)

    @property
    def block(self) -> N.Expr:
        return N.SRegRead(SReg.CTAID_X)

    @property
    def n_blocks(self) -> N.Expr:
        return N.SRegRead(SReg.NCTAID_X)

    def global_thread_id(self, dtype: T.DType = T.u32) -> N.Expr:
        return self.block.cast(dtype) * self.n_threads + self.tid.cast(dtype)

    def grid_threads(self, dtype: T.DType = T.u32) -> N.Expr:
        return self.n_blocks.cast(dtype) * self.n_threads

    # -- scratch -------------------------------------------------------------------------------
    def scratch(self, name: str, nbytes: int) -> N.Expr:
        """A shared scratch array of the role: a static ``.shared`` buffer ``name`` when the
        role has no ``smem_base``, else the next 16-byte-aligned slice of the kernel's dynamic
        shared memory (``dyn_smem``) at or after ``smem_base`` (``scratch_end`` grows)."""
        if self.smem_base is None:
            return self.kb.shared_buffer(name, nbytes)
        dyn = self.kb.dynamic_shared_memory()
        addr = dyn + self._scratch_end if self._scratch_end else dyn
        self._scratch_end += -(-nbytes // ALIGN) * ALIGN
        return addr

    @property
    def scratch_end(self) -> int:
        """Bytes of dynamic shared memory the role's scratch needs so far: 0 without
        ``smem_base``, else ``smem_base`` plus its slices (the launch gives at least the
        largest over the kernel's roles)."""
        return 0 if self._scratch_end is None else self._scratch_end

    # -- bodies --------------------------------------------------------------------------------
    def _emit(self, stmt):
        self._stack[-1].stmts.append(stmt)
        self._last_if = None
        return stmt

    @contextlib.contextmanager
    def _nested(self):
        body = _Body()
        self._stack.append(body)
        try:
            yield body
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def if_(self, cond):
        """``with r.if_(cond):`` a guarded body; ``with r.else_():`` right after adds the else."""
        with self._nested() as then:
            yield
        stmt = N.If(as_expr(cond), tuple(then.stmts))
        body = self._stack[-1].stmts
        body.append(stmt)
        self._last_if = (body, len(body) - 1)

    @contextlib.contextmanager
    def else_(self):
        if self._last_if is None:
            raise ValueError(f"role {self.name}: else_() must directly follow an if_() block")
        body, idx = self._last_if
        self._last_if = None
        with self._nested() as orelse:
            yield
        body[idx] = N.If(body[idx].cond, body[idx].then, tuple(orelse.stmts))

    @contextlib.contextmanager
    def for_range(self, name: str, start, stop, step=1, dtype: T.DType = T.u32):
        """``for name in range(start, stop, step)``; yields the loop variable."""
        var = self.kb.new_var(name, dtype)
        with self._nested() as body:
            yield var
        self._emit(N.For(var, as_expr(start, dtype).cast(dtype), as_expr(stop, dtype).cast(dtype),
                         as_expr(step, dtype).cast(dtype), tuple(body.stmts)))

    @contextlib.contextmanager
    def while_(self, cond):
        with self._nested() as body:
            yield
        self._emit(N.While(as_expr(cond), tuple(body.stmts)))

    def break_(self):
        self._emit(N.Break())

    def return_(self):
        self._emit(N.Return())

    # -- values --------------------------------------------------------------------------------
    def var(self, name: str, dtype: T.Type, init=None, peer: bool = False) -> N.Var:
        """A new mutable local, assigned ``init`` if given."""
        v = self.kb.new_var(name, dtype, peer)
        if init is not None:
            self.assign(v, init)
        return v

    def let(self, name: str, value, peer: bool = False) -> N.Var:
        """A new local holding ``value`` (its type is the value's)."""
        value = as_expr(value)
        return self.var(name, value.dtype, value, peer)

    def assign(self, var: N.Var, value):
        self._emit(N.Assign(var, as_expr(value, var.dtype)))

    # -- memory --------------------------------------------------------------------------------
    def load(self, addr, dtype: T.Type, sem: Sem = Sem.WEAK, scope: Scope | None = None,
             cache: CacheHint = CacheHint.NONE, name: str = "v", peer: bool = False) -> N.Var:
        dst = self.kb.new_var(name, dtype, peer)
        self._emit(N.Load(dst, addr, sem, scope, cache))
        return dst

    def store(self, addr, value, sem: Sem = Sem.WEAK, scope: Scope | None = None):
        self._emit(N.Store(addr, as_expr(value), sem, scope))

    def atomic(self, op: AtomOp, addr, value, sem: Sem = Sem.RELAXED, scope: Scope = Scope.GPU,
               dtype: T.DType = T.u32, name: str = "old") -> N.Var:
        """``atom``: returns the old value."""
        dst = self.kb.new_var(name, dtype)
        self._emit(N.AtomicRMW(dst, op, addr, as_expr(value, dtype).cast(dtype), sem, scope))
        return dst

    def red(self, op: AtomOp, addr, value, sem: Sem = Sem.RELAXED, scope: Scope = Scope.GPU,
            dtype: T.DType = T.u32):
        """``red``: an atomic whose old value is not needed."""
        self._emit(N.AtomicRMW(None, op, addr, as_expr(value, dtype).cast(dtype), sem, scope))

    def cas(self, addr, compare, value, sem: Sem = Sem.RELAXED, scope: Scope = Scope.GPU,
            dtype: T.DType = T.u32, name: str = "old") -> N.Var:
        dst = self.kb.new_var(name, dtype)
        self._emit(N.AtomicCAS(dst, addr, as_expr(compare, dtype).cast(dtype),
                               as_expr(value, dtype).cast(dtype), sem, scope))
        return dst

    def fence(self, sem: Sem, scope: Scope):
        self._emit(N.Fence(sem, scope))

    # -- barriers and warps --------------------------------------------------------------------
    def named_barrier(self, name: str, id: int, count: int | None = -1,
                      group: bool = False) -> N.NamedBarrier:
        """Declare a barrier this role owns; ``count`` defaults to the role's thread count
        (``None``: the whole CTA, ``bar.sync id``); ``group``: a warp-group barrier of
        ``count`` of the role's threads (``NamedBarrier.group``)."""
        b = N.NamedBarrier(name, id, self.n_threads if count == -1 else count, group)
        self.barriers.append(b)
        return b

    def barrier(self, name: str, id: int, count: int | None = -1,
                group: bool = False) -> N.NamedBarrier:
        """The role's barrier ``id``: the one already declared with that id (whatever its
        name), else ``named_barrier(name, id, count, group)``."""
        return next((b for b in self.barriers if b.id == id), None) or \
            self.named_barrier(name, id, count, group)

    def bar_sync(self, barrier: N.NamedBarrier):
        self._emit(N.BarSync(barrier))

    def bar_arrive(self, barrier: N.NamedBarrier):
        self._emit(N.BarArrive(barrier))

    def syncthreads(self):
        """``bar.sync 0``: the whole CTA (declares barrier 0 on first use)."""
        self.bar_sync(self.barrier("cta", 0, None))

    def warp_sync(self, mask: int = 0xFFFFFFFF):
        self._emit(N.WarpSync(mask))

    def shfl(self, mode: ShflMode, value, lane, mask: int = 0xFFFFFFFF, name: str = "sh") -> N.Var:
        value = as_expr(value)
        dst = self.kb.new_var(name, value.dtype)
        self._emit(N.Shuffle(dst, mode, value, as_expr(lane), mask))
        return dst

    def ballot(self, pred, mask: int = 0xFFFFFFFF, name: str = "ballot") -> N.Var:
        dst = self.kb.new_var(name, T.u32)
        self._emit(N.Ballot(dst, as_expr(pred), mask))
        return dst

    def vote(self, mode: VoteMode, pred, mask: int = 0xFFFFFFFF, name: str = "vote") -> N.Var:
        dst = self.kb.new_var(name, T.pred)
        self._emit(N.Vote(dst, mode, as_expr(pred), mask))
        return dst

    def redux(self, op: ReduxOp, value, mask: int = 0xFFFFFFFF, name: str = "red") -> N.Var:
        value = as_expr(value)
        dst = self.kb.new_var(name, value.dtype)
        self._emit(N.Redux(dst, op, value, mask))
        return dst

    def warp_sum(self, value, name: str = "wsum") -> N.Var:
        """Sum of a u32/s32 over the warp (``redux.sync.add``)."""
        return self.redux(ReduxOp.ADD, value, name=name)

    def nanosleep(self, ns):
        self._emit(N.Nanosleep(as_expr(ns)))

    # -- waits, calls, misc --------------------------------------------------------------------
    def spin_wait(self, addr, dtype: T.DType, until: CmpOp, expected, *, buffer: str, index,
                  sem: Sem = Sem.ACQUIRE, scope: Scope = Scope.GPU, shift: int = 0,
                  mask: int | None = None, backoff_ns: int = 0, name: str = "seen",
                  timeout_ns=None) -> N.Var:
        """Bounded wait until ``([addr] >> shift) & mask <until> expected``; ``buffer[index]``
        names the word in the timeout record. Needs ``KernelBuilder.diagnostics`` first.
        ``timeout_ns`` (a u64 expression): this wait's deadline instead of the kernel's."""
        return self._spin(addr, dtype, until, expected, buffer, index, sem, scope, shift, mask,
                          backoff_ns, name, timeout_ns)[0]

    def spin_wait_or_give_up(self, addr, dtype: T.DType, until: CmpOp, expected, *,
                             buffer: str, index, give_up, shrink, sem: Sem = Sem.ACQUIRE,
                             scope: Scope = Scope.GPU, backoff_ns: int = 0,
                             name: str = "seen") -> tuple[N.Var, N.Var]:
        """``spin_wait`` that may end without its condition (``N.SpinWait``'s ``give_up`` and
        ``shrink``): returns ``(seen, status)``, ``status`` a u32 var (``N.SPIN_MET``,
        ``SPIN_GAVE_UP``, ``SPIN_EXPIRED``)."""
        return self._spin(addr, dtype, until, expected, buffer, index, sem, scope, 0, None,
                          backoff_ns, name, None, give_up, shrink)

    def _spin(self, addr, dtype, until, expected, buffer, index, sem, scope, shift, mask,
              backoff_ns, name, timeout_ns, give_up=None, shrink=None):
        d = self.kb.diag
        if d is None:
            raise ValueError(f"role {self.name}: spin_wait needs kb.diagnostics(...) first")
        site = self.kb.new_site(self.name, buffer, as_expr(index, T.u64).cast(T.u64))
        dst = self.kb.new_var(name, dtype)
        status = None
        if give_up is not None or shrink is not None:
            status = self.kb.new_var(f"{name}_status", T.u32)
            give_up = None if give_up is None else as_expr(give_up)
            shrink = None if shrink is None else as_expr(shrink, T.u32).cast(T.u32)
        deadline = d["timeout_ns"] if timeout_ns is None else as_expr(timeout_ns, T.u64)
        self._emit(N.SpinWait(dst, addr, dtype, until, as_expr(expected, dtype).cast(dtype), site,
                              deadline, d["err_buf"], d["rank"], sem, scope, shift, mask,
                              backoff_ns, give_up, shrink, status))
        return dst, status

    def call(self, name: str, args, ret: T.DType | None = None, arg_types=()) -> N.Var | None:
        dst = self.kb.new_var("ret", ret) if ret else None
        args = tuple(as_expr(a) for a in args)
        self._emit(N.Call(dst, name, args, tuple(arg_types) or tuple(a.dtype for a in args)))
        return dst

    def trap(self):
        self._emit(N.Trap())

    def comment(self, text: str):
        self._emit(N.Comment(text))

    def build(self) -> N.Role:
        if len(self._stack) != 1:
            raise ValueError(f"role {self.name}: a nested body is still open")
        return N.Role(self.name, tuple(self._stack[0].stmts), self.blocks, self.threads,
                      tuple(self.barriers))


class KernelBuilder:
    """Builds a ``Kernel``: parameters, shared buffers, roles (in execution order)."""

    def __init__(self, name: str, block_threads: int, min_blocks_per_sm: int | None = None):
        self.name = name
        self.block_threads = block_threads
        self.min_blocks_per_sm = min_blocks_per_sm
        self.params: list[N.Param] = []
        self.shared: list[N.SharedBuffer] = []
        self.dynamic_shared = False
        self.roles: list[N.Role] = []
        self.sites: list[N.SiteInfo] = []
        self.diag: dict | None = None
        #: callables ``hook(rb, "begin" | "end")`` run as each role opens (before its body)
        #: and closes (after it, at the role's top level): instrumentation such as
        #: ``epgen.kernels.trace`` adds statements there
        self.role_hooks: list = []
        self._names: dict[str, int] = {}

    def param(self, name: str, dtype: T.Type, peer: bool = False) -> N.Param:
        if any(p.name == name for p in self.params):
            raise ValueError(f"kernel {self.name}: parameter {name!r} declared twice")
        p = N.Param(name, dtype, peer)
        self.params.append(p)
        return p

    def diagnostics(self, err_buf: N.Expr | None = None, timeout_ns: N.Expr | None = None,
                    rank=0):
        """Declare where bounded waits report: the error buffer and deadline parameters
        (created as ``err_buf`` and ``timeout_ns`` when not given) and this rank's number."""
        err_buf = err_buf if err_buf is not None else self.param("err_buf", T.ptr_global)
        timeout_ns = timeout_ns if timeout_ns is not None else self.param("timeout_ns", T.u64)
        self.diag = {"err_buf": err_buf, "timeout_ns": timeout_ns,
                     "rank": as_expr(rank, T.u32).cast(T.u32)}
        return self.diag

    def shared_buffer(self, name: str, nbytes: int, align: int = 16) -> N.SharedAddr:
        self.shared.append(N.SharedBuffer(name, nbytes, align))
        return N.SharedAddr(name)

    def dynamic_shared_memory(self) -> N.SharedAddr:
        self.dynamic_shared = True
        return N.SharedAddr("dyn_smem")

    def new_var(self, name: str, dtype: T.Type, peer: bool = False) -> N.Var:
        n = self._names.get(name, 0)
        self._names[name] = n + 1
        return N.Var(name if n == 0 else f"{name}_{n}", dtype, peer)

    def new_site(self, role: str, buffer: str, index: N.Expr) -> N.DiagSite:
        site = N.DiagSite(len(self.sites), buffer, index)
        self.sites.append(N.SiteInfo(site.site_id, role, buffer))
        return site

    @contextlib.contextmanager
    def role(self, name: str, blocks: tuple | N.BlockRange | None = None,
             threads: tuple | N.ThreadRange | None = None, *, barrier_id: int | None = None,
             smem_base: int | None = None):
        """``with kb.role("monitor", blocks=(0, n_signal), threads=(0, 1024)) as r:``.
        ``blocks`` ends may be ints or u32 expressions; ``None`` as the end means the grid's end.
        ``threads`` starts on a warp. The role's context (module docstring): ``barrier_id``
        (None, or a named barrier id in 1..15 over the role's threads) and ``smem_base`` (None,
        or a byte offset >= 0, a multiple of 16, into dynamic shared memory). A bad one is a
        ``ValueError`` naming it."""
        if isinstance(blocks, tuple):
            start, stop = blocks
            blocks = N.BlockRange(as_expr(start, T.u32), None if stop is None else as_expr(stop, T.u32))
        if isinstance(threads, tuple):
            threads = N.ThreadRange(*threads)
        _check_role_context(name, threads, barrier_id, smem_base)
        rb = RoleBuilder(self, name, blocks or N.BlockRange(), threads, barrier_id, smem_base)
        for hook in self.role_hooks:
            hook(rb, "begin")
        yield rb
        for hook in self.role_hooks:
            hook(rb, "end")
        self.roles.append(rb.build())

    def build(self) -> N.Kernel:
        return N.Kernel(self.name, tuple(self.params), self.block_threads, tuple(self.roles),
                        tuple(self.shared), self.dynamic_shared, self.min_blocks_per_sm,
                        tuple(self.sites))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_role_context(name: str, threads, barrier_id, smem_base) -> None:
    """``ValueError`` naming the argument of ``KernelBuilder.role`` that breaks its rule."""
    if threads is not None and (not _is_int(threads.base) or threads.base % 32):
        raise ValueError(f"role {name}: threads must start on a warp (a multiple of 32), got "
                         f"base {threads.base!r}")
    if barrier_id is not None and (not _is_int(barrier_id)
                                   or not 1 <= barrier_id < N_BARRIERS):
        raise ValueError(f"role {name}: barrier_id must be None (bar.sync 0 over the block) or "
                         f"a named barrier id in 1..{N_BARRIERS - 1}, got {barrier_id!r}")
    if smem_base is not None and (not _is_int(smem_base) or smem_base < 0
                                  or smem_base % ALIGN):
        raise ValueError(f"role {name}: smem_base must be None (static shared buffers) or a "
                         f"byte offset >= 0 and a multiple of {ALIGN}, got {smem_base!r}")
