"""Expansion of a bounded ``SpinWait`` into plain IR statements (docs/design.md, "The reliability contract").

The wait becomes a loop of IR nodes whose lowerings (and PTX) are each pinned on their own:

    t0 = %globaltimer
    loop:
        seen = ld.<sem>.<scope> [addr]                       # the poll
        if ((seen >> shift) & mask) <cond> expected: break  # unsigned compare
        if timeout_ns != 0 and %globaltimer - t0 > timeout_ns:
            slot = atom.relaxed.gpu.global.add.u32 [err_buf + COUNT_WORD], 1
            if slot < MAX_RECORDS: st [record words]          # layout from ir.diag
            st.relaxed.sys [err_buf + ABORT_WORD], 1
            exit
        if ld.relaxed.sys [err_buf + ABORT_WORD] != 0: exit  # another wait gave up
        nanosleep backoff_ns
    dst = seen

A ``timeout_ns`` that is the constant 0 drops the deadline test entirely.

A wait that may give up (``give_up``, ``shrink``; rank masks) sets ``status = 0`` before the
loop, and after an unmet poll:

        if ld.relaxed.sys [give_up] != 0: status = 1; break     # the rank is masked
        ... on expiry, first: if shrink != 0: status = 2; break  # no record, no abort
"""

from __future__ import annotations

from ir import diag
from ir import nodes as N
from ir import types as T
from ir.enums import AtomOp, BinOpKind, CmpOp, Scope, Sem, SReg

from .errors import LoweringError


def _word(base: N.Expr, index) -> N.Expr:
    """Address of u32 word ``index`` (an int or a u64 expression) of ``base``."""
    offset = N.Const(4 * index, T.u64) if isinstance(index, int) else index * 4
    return N.PtrAdd(base, offset)


def _wide(value: N.Expr) -> tuple[N.Expr, N.Expr]:
    """Low and high u32 words of a u64 expression."""
    return N.Cast(T.u32, value), N.Cast(T.u32, N.BinOp(BinOpKind.SHR, value, N.Const(32, T.u64)))


def _record(kernel_name: str, s: N.SpinWait, seen: N.Expr, elapsed: N.Expr, slot: N.Var) -> tuple:
    """Stores of one timeout record into slot ``slot`` (word offsets from ``ir.diag.FIELDS``)."""
    unsigned = T.DType("u", s.dtype.bits)
    tid = N.SRegRead(SReg.TID_X)
    values = {
        "magic": N.Const(diag.RECORD_MAGIC, T.u32),
        "kernel_tag": N.Const(diag.kernel_tag(kernel_name), T.u32),
        "site_id": N.Const(s.site.site_id, T.u32),
        "rank": s.rank.cast(T.u32),
        "block": N.SRegRead(SReg.CTAID_X),
        "thread": tid,
        "warp": N.BinOp(BinOpKind.DIV, tid, N.Const(32, T.u32)),
        "smid": N.SRegRead(SReg.SMID),
        "index": s.site.index.cast(T.u64),
        "expected": N.Bitcast(unsigned, s.expected).cast(T.u64),
        "last_seen": N.Bitcast(unsigned, seen).cast(T.u64),
        "elapsed_ns": elapsed,
    }
    first = N.Const(diag.HEADER_WORDS, T.u64) + slot.cast(T.u64) * diag.RECORD_WORDS
    stmts = []
    for field, offset in diag.FIELDS.items():
        words = _wide(values[field]) if field in diag.WIDE_FIELDS else (values[field],)
        stmts += [N.Store(_word(s.err_buf, first + (offset + i)), w) for i, w in enumerate(words)]
    return tuple(stmts)


def expand(kernel_name: str, s: N.SpinWait) -> tuple:
    """The IR statements that implement ``s`` in kernel ``kernel_name``."""
    if not s.dtype.is_int:
        raise LoweringError(f"spin-wait site {s.site.site_id}: polls an integer word, "
                            f"not {s.dtype}")
    tag = f"spin{s.site.site_id}"
    unsigned = T.DType("u", s.dtype.bits)
    seen = s.dst or N.Var(f"{tag}.seen", s.dtype)
    field = N.Bitcast(unsigned, seen)
    if s.shift:
        field = N.BinOp(BinOpKind.SHR, field, N.Const(s.shift, unsigned))
    if s.mask is not None:
        field = N.BinOp(BinOpKind.AND, field, N.Const(s.mask, unsigned))
    abort_word = _word(s.err_buf, diag.ABORT_WORD)
    abort = N.Var(f"{tag}.abort", T.u32)

    body = [N.Load(seen, s.addr, s.sem, s.scope),
            N.If(N.Cmp(s.cond, field, N.Bitcast(unsigned, s.expected)), (N.Break(),))]
    prologue = []
    if s.status is not None:
        prologue.append(N.Assign(s.status, N.Const(N.SPIN_MET, T.u32)))
    if s.give_up is not None:
        gave_up = N.Var(f"{tag}.give_up", T.u32)
        body += [N.Load(gave_up, s.give_up, Sem.RELAXED, Scope.SYS),
                 N.If(N.Cmp(CmpOp.NE, gave_up, N.Const(0, T.u32)),
                      (N.Assign(s.status, N.Const(N.SPIN_GAVE_UP, T.u32)), N.Break()))]
    bounded = not (isinstance(s.timeout_ns, N.Const) and s.timeout_ns.value == 0)
    if bounded:
        t0 = N.Var(f"{tag}.t0", T.u64)
        elapsed = N.Var(f"{tag}.elapsed", T.u64)
        slot = N.Var(f"{tag}.slot", T.u32)
        timeout = s.timeout_ns.cast(T.u64)
        prologue.append(N.Assign(t0, N.SRegRead(SReg.GLOBALTIMER)))
        shrink = ()
        if s.shrink is not None:
            shrink = (N.If(N.Cmp(CmpOp.NE, s.shrink, N.Const(0, T.u32)),
                           (N.Assign(s.status, N.Const(N.SPIN_EXPIRED, T.u32)), N.Break())),)
        expire = shrink + (
            N.AtomicRMW(slot, AtomOp.ADD, _word(s.err_buf, diag.COUNT_WORD), N.Const(1, T.u32),
                        Sem.RELAXED, Scope.GPU),
            N.If(N.Cmp(CmpOp.LT, slot, N.Const(diag.MAX_RECORDS, T.u32)),
                 _record(kernel_name, s, seen, elapsed, slot)),
            N.Store(abort_word, N.Const(1, T.u32), Sem.RELAXED, Scope.SYS),
            N.Return(),
        )
        body += [
            N.Assign(elapsed, N.BinOp(BinOpKind.SUB, N.SRegRead(SReg.GLOBALTIMER), t0)),
            N.If(N.BinOp(BinOpKind.AND, N.Cmp(CmpOp.NE, timeout, N.Const(0, T.u64)),
                         N.Cmp(CmpOp.GT, elapsed, timeout)), expire),
        ]
    body += [N.Load(abort, abort_word, Sem.RELAXED, Scope.SYS),
             N.If(N.Cmp(CmpOp.NE, abort, N.Const(0, T.u32)), (N.Return(),))]
    if s.backoff_ns:
        body.append(N.Nanosleep(N.Const(s.backoff_ns, T.u32)))
    return (*prologue, N.While(N.Const(1, T.pred), tuple(body)))
