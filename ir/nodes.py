"""Nodes of the kernel IR: expressions, statements, roles, kernels.

Expressions are pure trees (``Const``, ``Param``, ``Var``, ``SRegRead``, ``BinOp`` ...): each
evaluation reads its operands again, nothing is written. Everything that touches memory, the
warp or the barrier hardware is a statement, and a statement that yields a value assigns it to
a ``Var`` (a mutable local, promoted to a register by the lowering). Nodes are frozen ``attrs``
classes with structural equality, so two builds of one kernel compare equal.

Each statement's docstring names the PTX instruction it becomes.
"""

from __future__ import annotations

from typing import Union

import attrs

from . import types as T
from .enums import (AtomOp, BinOpKind, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, SReg,
                    UnOpKind, VoteMode)
from .types import DType, PtrType, Type, VecType


# ---------------------------------------------------------------------------------------------
# Expressions


class ExprOps:
    """Python operators for expressions, so builder code reads like the kernel:
    ``base + tid * 16``. Equality stays structural; use ``.eq()``/``.ne()`` for comparisons."""

    def _bin(self, op, other, swap=False):
        if isinstance(self.dtype, PtrType):
            if op is not BinOpKind.ADD or swap:
                raise TypeError(f"only pointer + offset is defined, not {op.value}")
            return PtrAdd(self, as_expr(other, T.u64))
        other = as_expr(other, self.dtype)
        return BinOp(op, other, self) if swap else BinOp(op, self, other)

    def __add__(self, o): return self._bin(BinOpKind.ADD, o)
    def __radd__(self, o): return self._bin(BinOpKind.ADD, o, True)
    def __sub__(self, o): return self._bin(BinOpKind.SUB, o)
    def __rsub__(self, o): return self._bin(BinOpKind.SUB, o, True)
    def __mul__(self, o): return self._bin(BinOpKind.MUL, o)
    def __rmul__(self, o): return self._bin(BinOpKind.MUL, o, True)
    def __floordiv__(self, o): return self._bin(BinOpKind.DIV, o)
    def __truediv__(self, o): return self._bin(BinOpKind.DIV, o)
    def __mod__(self, o): return self._bin(BinOpKind.REM, o)
    def __and__(self, o): return self._bin(BinOpKind.AND, o)
    def __rand__(self, o): return self._bin(BinOpKind.AND, o, True)
    def __or__(self, o): return self._bin(BinOpKind.OR, o)
    def __ror__(self, o): return self._bin(BinOpKind.OR, o, True)
    def __xor__(self, o): return self._bin(BinOpKind.XOR, o)
    def __lshift__(self, o): return self._bin(BinOpKind.SHL, o)
    def __rshift__(self, o): return self._bin(BinOpKind.SHR, o)
    def __neg__(self): return UnOp(UnOpKind.NEG, self)
    def __invert__(self): return UnOp(UnOpKind.NOT, self)
    def __lt__(self, o): return Cmp(CmpOp.LT, self, as_expr(o, self.dtype))
    def __le__(self, o): return Cmp(CmpOp.LE, self, as_expr(o, self.dtype))
    def __gt__(self, o): return Cmp(CmpOp.GT, self, as_expr(o, self.dtype))
    def __ge__(self, o): return Cmp(CmpOp.GE, self, as_expr(o, self.dtype))

    def eq(self, o): return Cmp(CmpOp.EQ, self, as_expr(o, self.dtype))
    def ne(self, o): return Cmp(CmpOp.NE, self, as_expr(o, self.dtype))
    def cast(self, dtype: DType): return self if self.dtype == dtype else Cast(dtype, self)
    def min(self, o): return self._bin(BinOpKind.MIN, o)
    def max(self, o): return self._bin(BinOpKind.MAX, o)


@attrs.frozen
class Const(ExprOps):
    """An immediate of type ``dtype`` (ints for integer types, floats for float types)."""

    value: int | float
    dtype: DType


@attrs.frozen
class Param(ExprOps):
    """A kernel parameter (``.param``). ``peer`` marks an address other GPUs (or emulated ranks)
    read or write: the verifier requires ``sys`` scope for ordered operations on it."""

    name: str
    dtype: Type
    peer: bool = False


@attrs.frozen
class Var(ExprOps):
    """A mutable local of a scalar, vector or pointer type; ``peer`` as for ``Param``."""

    name: str
    dtype: Type
    peer: bool = False


@attrs.frozen
class SRegRead(ExprOps):
    """Read of a special register: ``mov.u32 %r, %tid.x`` (u64 for globaltimer/clock64)."""

    sreg: SReg

    @property
    def dtype(self) -> DType:
        return T.u64 if self.sreg.bits == 64 else T.u32


@attrs.frozen
class BinOp(ExprOps):
    """``add/sub/mul/div/rem/and/or/xor/shl/shr/min/max`` on two operands of one type
    (pointer + integer is ``PtrAdd``)."""

    op: BinOpKind
    a: Expr
    b: Expr

    @property
    def dtype(self) -> Type:
        return self.a.dtype


@attrs.frozen
class UnOp(ExprOps):
    """``neg/not/popc/abs``."""

    op: UnOpKind
    a: Expr

    @property
    def dtype(self) -> Type:
        return T.u32 if self.op is UnOpKind.POPC else self.a.dtype


@attrs.frozen
class Cmp(ExprOps):
    """``setp.<op>.<type>``; yields ``pred``."""

    op: CmpOp
    a: Expr
    b: Expr

    dtype = T.pred


@attrs.frozen
class Select(ExprOps):
    """``selp``: ``a`` where ``cond`` else ``b``."""

    cond: Expr
    a: Expr
    b: Expr

    @property
    def dtype(self) -> Type:
        return self.a.dtype


@attrs.frozen
class Cast(ExprOps):
    """``cvt``: integer widening (sign by source type), narrowing, int<->float, float<->float,
    pointer<->u64 and pred->int."""

    dtype: Type
    a: Expr


@attrs.frozen
class Bitcast(ExprOps):
    """``mov.b<n>``: reinterpret the bits of ``a`` as ``dtype`` (same width)."""

    dtype: Type
    a: Expr


@attrs.frozen
class PtrAdd(ExprOps):
    """Address arithmetic: ``base`` plus ``offset`` bytes (``add.s64``); keeps the state space."""

    base: Expr
    offset: Expr

    @property
    def dtype(self) -> Type:
        return self.base.dtype


@attrs.frozen
class SharedAddr(ExprOps):
    """Address of a shared-memory buffer declared by the kernel (``mov.u64 %rd, buf``)."""

    name: str

    dtype = T.ptr_shared


@attrs.frozen
class Extract(ExprOps):
    """Lane ``index`` of a vector value (``mov.b32 {..}``)."""

    vec: Expr
    index: int

    @property
    def dtype(self) -> DType:
        return self.vec.dtype.elem


@attrs.frozen
class Pack(ExprOps):
    """A vector built from scalar lanes."""

    dtype: VecType
    lanes: tuple


@attrs.frozen
class CvtE4M3x2(ExprOps):
    """``cvt.rn.satfinite.e4m3x2.f32 d, a, b`` (sm_89+): two f32 to two e4m3 bytes in a u16,
    rounded to nearest even and saturated to +-448 (NaN stays NaN); ``a`` gives the upper
    byte, ``b`` the lower byte (in memory order: ``b`` first)."""

    a: Expr
    b: Expr

    dtype = T.u16


@attrs.frozen
class CvtE4M3ToF32(ExprOps):
    """``cvt.rn.f16x2.e4m3x2`` (sm_89+) of the u16 ``a``, then ``cvt.f32.f16`` of the lower
    half: the e4m3 byte in ``a``'s low byte as an f32, exactly (every e4m3 value is an f16);
    the upper byte is ignored, the NaN codes 0x7f/0xff give NaN."""

    a: Expr

    dtype = T.f32


@attrs.frozen
class Fma(ExprOps):
    """``fma.rn.f32 d, a, b, c`` (``.f64`` for f64 operands): ``a * b + c`` rounded once, to
    nearest even."""

    a: Expr
    b: Expr
    c: Expr

    @property
    def dtype(self) -> Type:
        return self.a.dtype


Expr = Union[Const, Param, Var, SRegRead, BinOp, UnOp, Cmp, Select, Cast, Bitcast, PtrAdd,
             SharedAddr, Extract, Pack, CvtE4M3x2, CvtE4M3ToF32, Fma]


def as_expr(value, dtype: Type | None = None):
    """Turn a Python int/float/bool into a ``Const`` of ``dtype`` (default u32); pass IR through."""
    if isinstance(value, ExprOps):
        return value
    if isinstance(value, bool):
        return Const(int(value), T.pred)
    if isinstance(value, (int, float)):
        if dtype is None or isinstance(dtype, (VecType,)):
            dtype = T.u32 if isinstance(value, int) else T.f32
        if isinstance(dtype, PtrType):
            dtype = T.s64
        return Const(value, dtype)
    raise TypeError(f"not an IR expression: {value!r}")


def const(value, dtype: DType = T.u32) -> Const:
    return Const(value, dtype)


# ---------------------------------------------------------------------------------------------
# Statements


@attrs.frozen
class Assign:
    """``dst = value`` (a register move; no memory access)."""

    dst: Var
    value: Expr


@attrs.frozen
class Load:
    """``ld{.sem.scope}.<space>{.nc}{.v2|.v4}.<type>``: ``dst = *addr``. ``sem`` is weak,
    volatile, relaxed or acquire; vectors (up to 16 bytes) only weak."""

    dst: Var
    addr: Expr
    sem: Sem = Sem.WEAK
    scope: Scope | None = None
    cache: CacheHint = CacheHint.NONE


@attrs.frozen
class Store:
    """``st{.sem.scope}.<space>{.v2|.v4}.<type> [addr], value``; ``sem`` weak, volatile,
    relaxed or release."""

    addr: Expr
    value: Expr
    sem: Sem = Sem.WEAK
    scope: Scope | None = None


@attrs.frozen
class AtomicRMW:
    """``atom.<sem>.<scope>.<space>.<op>.<type> dst, [addr], value``; with ``dst=None`` the
    result is unused and it becomes ``red.<sem>.<scope>.<space>.<op>.<type> [addr], value``."""

    dst: Var | None
    op: AtomOp
    addr: Expr
    value: Expr
    sem: Sem = Sem.RELAXED
    scope: Scope = Scope.GPU


@attrs.frozen
class AtomicCAS:
    """``atom.<sem>.<scope>.<space>.cas.b<n> dst, [addr], compare, value``."""

    dst: Var
    addr: Expr
    compare: Expr
    value: Expr
    sem: Sem = Sem.RELAXED
    scope: Scope = Scope.GPU


@attrs.frozen
class Fence:
    """``fence.<sem>.<scope>`` (sem acquire, release, acq_rel or sc)."""

    sem: Sem
    scope: Scope


@attrs.frozen
class NamedBarrier:
    """A hardware barrier a role owns: id 0..15 and its thread count (``None`` = every thread
    of the CTA, the form ``bar.sync id``). ``group``: a warp-group barrier, ``count`` threads
    out of the role's (whole warps, dividing them): each group of the role's warps syncs on
    an id of its own, so the role declares one such barrier per group."""

    name: str
    id: int
    count: int | None
    group: bool = False


@attrs.frozen
class BarSync:
    """``bar.sync id, count`` (``bar.sync id`` when the barrier counts the whole CTA)."""

    barrier: NamedBarrier


@attrs.frozen
class BarArrive:
    """``bar.arrive id, count``: signal arrival without waiting."""

    barrier: NamedBarrier


@attrs.frozen
class WarpSync:
    """``bar.warp.sync mask``."""

    mask: int = 0xFFFFFFFF


@attrs.frozen
class Shuffle:
    """``shfl.sync.<mode>.b32 dst, value, lane, clamp, mask`` (64-bit values: two shuffles)."""

    dst: Var
    mode: ShflMode
    value: Expr
    lane: Expr
    mask: int = 0xFFFFFFFF
    width: int = 32


@attrs.frozen
class Ballot:
    """``vote.sync.ballot.b32 dst, pred, mask``."""

    dst: Var
    pred: Expr
    mask: int = 0xFFFFFFFF


@attrs.frozen
class Vote:
    """``vote.sync.<any|all|uni>.pred dst, pred, mask``."""

    dst: Var
    mode: VoteMode
    pred: Expr
    mask: int = 0xFFFFFFFF


@attrs.frozen
class Redux:
    """``redux.sync.<op>.<u32|s32> dst, value, mask`` (sm_80+)."""

    dst: Var
    op: ReduxOp
    value: Expr
    mask: int = 0xFFFFFFFF


@attrs.frozen
class Nanosleep:
    """``nanosleep.u32 ns``."""

    ns: Expr


@attrs.frozen
class If:
    """Structured branch: ``@p bra`` around ``then`` / ``orelse``."""

    cond: Expr
    then: tuple
    orelse: tuple = ()


@attrs.frozen
class For:
    """Counted loop ``for var = start; var < stop; var += step`` (``step`` > 0)."""

    var: Var
    start: Expr
    stop: Expr
    step: Expr
    body: tuple


@attrs.frozen
class While:
    """``while cond: body``; ``cond`` is evaluated before every iteration."""

    cond: Expr
    body: tuple


@attrs.frozen
class Break:
    """Leave the innermost ``For``/``While`` (a branch to its exit block)."""


@attrs.frozen
class Return:
    """End the thread: ``ret`` from the kernel, which is PTX ``exit`` for an entry."""


@attrs.frozen
class Trap:
    """``trap``: abort the kernel with an error the host sees."""


@attrs.frozen
class Call:
    """Call of an external device function (NVSHMEM): ``call.uni (dst), name, (args)``."""

    dst: Var | None
    name: str
    args: tuple
    arg_types: tuple = ()


@attrs.frozen
class Comment:
    """A comment kept in the IR text (no code)."""

    text: str


@attrs.frozen
class DiagSite:
    """What a bounded wait waits on, for its timeout record: a buffer name and an element
    index; ``site_id`` is the site's number in its kernel (assigned by the builder)."""

    site_id: int
    buffer: str
    index: Expr


@attrs.frozen
class SpinWait:
    """Bounded spin-wait (docs/design.md, "The reliability contract").

    Repeats ``v = ld.<sem>.<scope> [addr]`` until ``((v >> shift) & mask) <cond> expected``,
    sleeping ``backoff_ns`` between polls. It gives up when ``%globaltimer`` has advanced more
    than ``timeout_ns`` (0 = never) since the first poll, or when another wait of the same
    launch group has already given up (the abort word of ``err_buf``). On its own expiry it
    appends a diagnostic record (kernel, role, rank, block, thread, site, index, expected,
    last value seen) to ``err_buf``, raises the abort word, and the thread exits (PTX ``exit``:
    barriers that count the whole CTA are released by exiting threads). ``dst`` receives the
    last value loaded.

    A wait on another rank may give up instead (rank masks, docs/design.md): ``give_up`` (the
    address of a u32 word, polled ``ld.relaxed.sys`` after each unmet poll) ends the wait as
    soon as that word is non-zero; ``shrink`` (a u32 value) non-zero makes an expiry end the
    wait too, with no record and no abort (the kernel records what it does about it).
    ``status`` (a u32 var, required with either) says how the wait ended: 0 the condition
    held, 1 ``give_up`` was set, 2 it expired under ``shrink``.
    """

    dst: Var | None
    addr: Expr
    dtype: DType
    cond: CmpOp
    expected: Expr
    site: DiagSite
    timeout_ns: Expr
    err_buf: Expr
    rank: Expr
    sem: Sem = Sem.ACQUIRE
    scope: Scope = Scope.GPU
    shift: int = 0
    mask: int | None = None
    backoff_ns: int = 0
    give_up: Expr | None = None
    shrink: Expr | None = None
    status: Var | None = None


#: ``SpinWait.status`` values
SPIN_MET, SPIN_GAVE_UP, SPIN_EXPIRED = 0, 1, 2


Stmt = Union[Assign, Load, Store, AtomicRMW, AtomicCAS, Fence, BarSync, BarArrive, WarpSync,
             Shuffle, Ballot, Vote, Redux, Nanosleep, If, For, While, Break, Return, Trap, Call,
             Comment, SpinWait]


# ---------------------------------------------------------------------------------------------
# Kernels


@attrs.frozen
class BlockRange:
    """Blocks ``[start, stop)`` of the grid a role runs on (``stop=None``: to the grid's end)."""

    start: Expr = Const(0, T.u32)
    stop: Expr | None = None


@attrs.frozen
class ThreadRange:
    """Threads ``[base, base + count)`` of the block a role runs on."""

    base: int
    count: int


@attrs.frozen
class Role:
    """A named thread class: the threads of ``threads`` in the blocks of ``blocks`` run
    ``body``. Roles run in kernel order: a thread in several roles runs them one after another.
    ``barriers`` are the named barriers the role owns."""

    name: str
    body: tuple
    blocks: BlockRange = BlockRange()
    threads: ThreadRange | None = None
    barriers: tuple = ()


@attrs.frozen
class SharedBuffer:
    """A static shared-memory array (``.shared .align a .b8 name[bytes]``)."""

    name: str
    nbytes: int
    align: int = 16


@attrs.frozen
class SiteInfo:
    """Host-side description of a bounded wait, to decode its timeout records."""

    site_id: int
    role: str
    buffer: str


@attrs.frozen
class RankBatch:
    """A rank-batched launch: the grids of ``ranks`` ranks, ``blocks`` blocks each, run as one
    grid of ``ranks * blocks`` blocks. The kernel then takes one by-value parameter,
    ``.param .align 8 .b8 rank_args[ranks * len(params) * 8]``: row ``q`` holds rank ``q``'s
    arguments, one 8-byte slot per parameter in declaration order (``RANK_ARG_BYTES``;
    integers and pointers zero-extended, ``f32`` as its bits in the low half). Block ``b``
    is block ``b % blocks`` of rank ``b / blocks``: ``%ctaid.x`` reads the former,
    ``%nctaid.x`` reads ``blocks``, and a parameter reads its slot of that rank's row
    (``ld.param`` at a register address). Nothing else changes: every rank's blocks start
    with one launch instead of one launch per rank."""

    ranks: int
    blocks: int

    def __attrs_post_init__(self):
        for what, v in (("ranks", self.ranks), ("blocks", self.blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"batch_ranks: {what} must be a positive int, got {v!r}")


RANK_ARG_BYTES = 8


@attrs.frozen
class Kernel:
    """An entry point (``.visible .entry name``) launched with ``block_threads`` threads per
    block (``.maxntid``); ``min_blocks_per_sm`` becomes ``.minnctapersm``.
    ``dynamic_shared`` declares the extern dynamic shared array ``dyn_smem``. ``rank_batch``
    (``RankBatch``): launched for several ranks at once, its parameters read from one
    by-value table."""

    name: str
    params: tuple
    block_threads: int
    roles: tuple
    shared: tuple = ()
    dynamic_shared: bool = False
    min_blocks_per_sm: int | None = None
    sites: tuple = ()
    rank_batch: RankBatch | None = None

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(name)


@attrs.frozen
class Module:
    """Kernels emitted together into one PTX module."""

    name: str
    kernels: tuple

    def kernel(self, name: str) -> Kernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)


def batch_ranks(m: Module, ranks: int, blocks: int) -> Module:
    """``m`` with every kernel rank-batched (``RankBatch(ranks, blocks)``): one launch of
    ``ranks * blocks`` blocks runs every rank's grid (``ValueError`` unless both are
    positive ints)."""
    batch = RankBatch(ranks, blocks)
    return Module(m.name, tuple(attrs.evolve(k, rank_batch=batch) for k in m.kernels))


# ---------------------------------------------------------------------------------------------
# Traversal helpers


CHILD_BODIES = {If: ("then", "orelse"), For: ("body",), While: ("body",)}


def walk(stmts):
    """Every statement in ``stmts``, depth first, nested bodies included."""
    for s in stmts:
        yield s
        for field in CHILD_BODIES.get(type(s), ()):
            yield from walk(getattr(s, field))


def walk_expr(e):
    """Every sub-expression of ``e`` (``e`` first)."""
    if e is None or not isinstance(e, ExprOps):
        return
    yield e
    for field in attrs.fields(type(e)):
        v = getattr(e, field.name)
        if isinstance(v, ExprOps):
            yield from walk_expr(v)
        elif isinstance(v, tuple):
            for x in v:
                yield from walk_expr(x)
