"""Deterministic text form of the kernel IR, in PTX vocabulary (``ir.parser`` reads it back).

One statement per line; bodies in braces, indented two spaces::

    module dispatch {
      kernel copy16 block_threads=256 min_blocks_per_sm=1 dynamic_shared=true {
        param $dst:ptr.global
        param $recv:ptr.global peer
        shared tile[4096] align=16
        site 0 role=copy buffer=recv_count
        role copy blocks=[0:u32, end) threads=[0, 256) {
          barrier send id=3 count=256
          %i:u64 = add(mul(cvt.u64(@ctaid.x), 256:u64), cvt.u64(@tid.x))
          while lt(%i, $n) {
            %v:v4.u32 = ld.global.nc [ptradd($src, mul(%i, 16:u64))]
            st.release.sys.global [$dst], %v
          }
        }
      }
    }

Expressions:

- constants ``5:u32``, ``-1:s64``, ``1.5:f32``, ``-inf:f64``; special registers ``@tid.x``;
  shared buffers ``&tile``;
- parameters ``$name`` (the declared one; ``$name:type [peer]`` when the node differs from the
  declaration); variables ``%name:type [peer]`` at their first appearance in a kernel (and whenever
  the same name appears with another type), ``%name`` after that;
- operators as calls: ``add(a, b)`` (every ``BinOpKind``), ``neg(a)`` (``UnOpKind``), ``lt(a, b)``
  (``CmpOp``), ``selp(c, a, b)``, ``cvt.u64(a)``, ``bitcast.f32(a)``, ``ptradd(p, off)``,
  ``extract(v, 2)``, ``pack.v2.u32(a, b)``, ``cvt.rn.satfinite.e4m3x2.f32(a, b)``.

Statements (``[...]`` marks an optional part; ``dst`` is a variable):

- ``dst = expr``; ``dst = ld[.sem][.scope][.space][.nc] [addr]``;
  ``st[.sem][.scope][.space] [addr], value`` (weak loads/stores print no ``.sem``);
- ``dst = atom.sem[.scope][.space].op [addr], value`` (``red...`` without ``dst``),
  ``dst = atom.sem[.scope][.space].cas [addr], compare, value``; ``fence.sem[.scope]``;
- ``bar.sync|bar.arrive NAME id=N count=N|all [group=true]``; ``bar.warp.sync 0xffffffff``;
- ``dst = shfl.sync.MODE value, lane mask=0x.. width=N``, ``dst = vote.sync.ballot p mask=..``,
  ``dst = vote.sync.any|all|uni p mask=..``, ``dst = redux.sync.OP value mask=..``;
- ``nanosleep ns``; ``if c {`` / ``} else {`` / ``}``; ``for %i:u32 in [start, stop) step=s {``;
  ``while c {``; ``break``; ``ret``; ``trap``;
- ``[dst =] call NAME(args) arg_types=(u64, u32)``; ``// text`` (``comment "json"`` when the text
  has a line break or trailing space);
- ``[dst =] spin_wait.sem[.scope][.space].TYPE [addr] CMP expected site=N buffer=NAME index=e
  timeout_ns=e err_buf=e rank=e shift=N mask=0x..|none backoff_ns=N``.

Kernel items: ``param $name:type [peer]``, ``shared NAME[bytes] align=N``,
``site N role=NAME buffer=NAME``, ``role NAME blocks=[start, stop|end) threads=all|[base, end) {``
whose body starts with ``barrier NAME id=N count=N|all`` lines. Names that are not plain
identifiers are printed as JSON strings. Masks are hexadecimal.
"""

from __future__ import annotations

import json
import math
import numbers
import re

from . import nodes as N
from .enums import CacheHint, Sem, Space
from .types import PtrType

CVT_E4M3X2 = "cvt.rn.satfinite.e4m3x2.f32"
CVT_E4M3_TO_F32 = "cvt.f32.e4m3"
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER_WORDS = ("inf", "nan")  # read as numbers, so names spelled so are quoted
INDENT = "  "
SHORT_WIDTH = 200


def name(text: str) -> str:
    """A name as printed: bare when it is an identifier, else a JSON string."""
    plain = IDENT.fullmatch(text) and text not in NUMBER_WORDS
    return text if plain else json.dumps(text)


def number(v) -> str:
    """An int or float literal that ``ir.parser`` reads back to the same value."""
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def hexmask(m) -> str:
    return "none" if m is None else f"{int(m):#x}"


def count(c) -> str:
    return "all" if c is None else str(c)


def space_of(addr) -> str | None:
    """The state-space qualifier an access through ``addr`` prints (None: generic or unknown)."""
    try:
        t = addr.dtype
    except Exception:  # an ill-typed address still prints; the verifier reports it
        return None
    if isinstance(t, PtrType) and t.space is not Space.GENERIC:
        return t.space.value
    return None


def quals(*parts) -> str:
    return "".join("." + p for p in parts if p)


def _val(e) -> str | None:
    return None if e is None else e.value


class Printer:
    """Prints expressions and statements of one kernel. It remembers which variables already
    showed their type, so text is produced (and must be parsed) strictly left to right."""

    def __init__(self, kernel: N.Kernel | None = None):
        self.params: dict[str, N.Param] | None = None
        if kernel is not None:
            self.params = {}
            for p in kernel.params:
                self.params.setdefault(p.name, p)
        self.vars: dict[str, N.Var] = {}

    # -- expressions ---------------------------------------------------------------------------
    def typed(self, sigil: str, node) -> str:
        peer = " peer" if node.peer else ""
        return f"{sigil}{name(node.name)}:{node.dtype}{peer}"

    def var(self, v: N.Var) -> str:
        if self.vars.get(v.name) == v:
            return "%" + name(v.name)
        self.vars[v.name] = v
        return self.typed("%", v)

    def param(self, p: N.Param) -> str:
        if self.params is None or self.params.get(p.name) == p:
            return "$" + name(p.name)
        return self.typed("$", p)

    def call(self, op: str, *args) -> str:
        return f"{op}({', '.join(args)})"

    def expr(self, e) -> str:
        match e:
            case N.Const():
                return f"{number(e.value)}:{e.dtype}"
            case N.Param():
                return self.param(e)
            case N.Var():
                return self.var(e)
            case N.SRegRead():
                return "@" + e.sreg.value
            case N.BinOp() | N.Cmp():
                return self.call(e.op.value, self.expr(e.a), self.expr(e.b))
            case N.UnOp():
                return self.call(e.op.value, self.expr(e.a))
            case N.Select():
                return self.call("selp", self.expr(e.cond), self.expr(e.a), self.expr(e.b))
            case N.Cast():
                return self.call(f"cvt.{e.dtype}", self.expr(e.a))
            case N.Bitcast():
                return self.call(f"bitcast.{e.dtype}", self.expr(e.a))
            case N.PtrAdd():
                return self.call("ptradd", self.expr(e.base), self.expr(e.offset))
            case N.SharedAddr():
                return "&" + name(e.name)
            case N.Extract():
                return self.call("extract", self.expr(e.vec), str(e.index))
            case N.Pack():
                return self.call(f"pack.{e.dtype}", *(self.expr(x) for x in e.lanes))
            case N.CvtE4M3x2():
                return self.call(CVT_E4M3X2, self.expr(e.a), self.expr(e.b))
            case N.CvtE4M3ToF32():
                return self.call(CVT_E4M3_TO_F32, self.expr(e.a))
            case N.Fma():
                return self.call("fma", self.expr(e.a), self.expr(e.b), self.expr(e.c))
        raise TypeError(f"not an IR expression: {e!r}")

    # -- statements ----------------------------------------------------------------------------
    def dst(self, v) -> str:
        return "" if v is None else self.var(v) + " = "

    def line(self, s) -> str:
        """The one-line form of ``s``; for ``If``/``For``/``While`` the header, without ``{``."""
        x = self.expr
        match s:
            case N.Assign():
                return f"{self.var(s.dst)} = {x(s.value)}"
            case N.Load():
                nc = None if s.cache is CacheHint.NONE else s.cache.value
                sem = None if s.sem is Sem.WEAK else s.sem.value
                op = "ld" + quals(sem, _val(s.scope), space_of(s.addr), nc)
                return f"{self.var(s.dst)} = {op} [{x(s.addr)}]"
            case N.Store():
                sem = None if s.sem is Sem.WEAK else s.sem.value
                op = "st" + quals(sem, _val(s.scope), space_of(s.addr))
                return f"{op} [{x(s.addr)}], {x(s.value)}"
            case N.AtomicRMW():
                head = self.dst(s.dst)
                op = ("red" if s.dst is None else "atom") + quals(
                    s.sem.value, _val(s.scope), space_of(s.addr), s.op.value)
                return f"{head}{op} [{x(s.addr)}], {x(s.value)}"
            case N.AtomicCAS():
                head = self.dst(s.dst)
                op = "atom" + quals(s.sem.value, _val(s.scope), space_of(s.addr), "cas")
                return f"{head}{op} [{x(s.addr)}], {x(s.compare)}, {x(s.value)}"
            case N.Fence():
                return "fence" + quals(s.sem.value, _val(s.scope))
            case N.BarSync():
                return "bar.sync " + self.barrier_ref(s.barrier)
            case N.BarArrive():
                return "bar.arrive " + self.barrier_ref(s.barrier)
            case N.WarpSync():
                return f"bar.warp.sync {hexmask(s.mask)}"
            case N.Shuffle():
                head = self.dst(s.dst)
                return (f"{head}shfl.sync.{s.mode.value} {x(s.value)}, {x(s.lane)} "
                        f"mask={hexmask(s.mask)} width={s.width}")
            case N.Ballot():
                return f"{self.dst(s.dst)}vote.sync.ballot {x(s.pred)} mask={hexmask(s.mask)}"
            case N.Vote():
                head = self.dst(s.dst)
                return f"{head}vote.sync.{s.mode.value} {x(s.pred)} mask={hexmask(s.mask)}"
            case N.Redux():
                head = self.dst(s.dst)
                return f"{head}redux.sync.{s.op.value} {x(s.value)} mask={hexmask(s.mask)}"
            case N.Nanosleep():
                return f"nanosleep {x(s.ns)}"
            case N.If():
                return f"if {x(s.cond)}"
            case N.For():
                v = self.var(s.var)
                return f"for {v} in [{x(s.start)}, {x(s.stop)}) step={x(s.step)}"
            case N.While():
                return f"while {x(s.cond)}"
            case N.Break():
                return "break"
            case N.Return():
                return "ret"
            case N.Trap():
                return "trap"
            case N.Call():
                head = self.dst(s.dst)
                args = ", ".join(x(a) for a in s.args)
                types = ", ".join(str(t) for t in s.arg_types)
                return f"{head}call {name(s.name)}({args}) arg_types=({types})"
            case N.Comment():
                t = s.text
                if "\n" in t or "\r" in t or t != t.rstrip():
                    return f"comment {json.dumps(t)}"
                return f"// {t}" if t else "//"
            case N.SpinWait():
                return self.spin_wait(s)
        raise TypeError(f"not an IR statement: {s!r}")

    def spin_wait(self, s: N.SpinWait) -> str:
        x = self.expr
        head = self.dst(s.dst)
        op = "spin_wait" + quals(s.sem.value, _val(s.scope), space_of(s.addr), str(s.dtype))
        text = f"{head}{op} [{x(s.addr)}] {s.cond.value} {x(s.expected)}"
        site = s.site
        text += f" site={site.site_id} buffer={name(site.buffer)} index={x(site.index)}"
        text += f" timeout_ns={x(s.timeout_ns)} err_buf={x(s.err_buf)} rank={x(s.rank)}"
        text += f" shift={s.shift} mask={hexmask(s.mask)} backoff_ns={s.backoff_ns}"
        for key in ("give_up", "shrink", "status"):     # printed only when set
            v = getattr(s, key)
            if v is not None:
                text += f" {key}={x(v)}"
        return text

    def barrier_ref(self, b: N.NamedBarrier) -> str:
        return f"{name(b.name)} id={b.id} count={count(b.count)}" + group_key(b)

    def stmt(self, s, depth: int = 0) -> list[str]:
        """The lines of ``s`` (nested bodies included) indented ``depth`` levels."""
        pad = INDENT * depth
        head = pad + self.line(s)
        if isinstance(s, N.If):
            lines = [head + " {", *self.body(s.then, depth + 1)]
            if s.orelse:
                lines += [pad + "} else {", *self.body(s.orelse, depth + 1)]
            return lines + [pad + "}"]
        if isinstance(s, (N.For, N.While)):
            return [head + " {", *self.body(s.body, depth + 1), pad + "}"]
        return [head]

    def body(self, stmts, depth: int) -> list[str]:
        return [line for s in stmts for line in self.stmt(s, depth)]

    # -- kernels -------------------------------------------------------------------------------
    def role_header(self, r: N.Role) -> str:
        stop = "end" if r.blocks.stop is None else self.expr(r.blocks.stop)
        blocks = f"[{self.expr(r.blocks.start)}, {stop})"
        t = r.threads
        threads = "all" if t is None else f"[{t.base}, {t.base + t.count})"
        return f"role {name(r.name)} blocks={blocks} threads={threads}"

    def role(self, r: N.Role, depth: int) -> list[str]:
        pad = INDENT * depth
        lines = [pad + self.role_header(r) + " {"]
        lines += [pad + INDENT + barrier_decl(b) for b in r.barriers]
        lines += self.body(r.body, depth + 1)
        return lines + [pad + "}"]

    def kernel(self, k: N.Kernel, depth: int = 0) -> list[str]:
        pad, inner = INDENT * depth, INDENT * (depth + 1)
        lines = [pad + kernel_header(k) + " {"]
        lines += [inner + param_decl(p) for p in k.params]
        lines += [inner + shared_decl(b) for b in k.shared]
        lines += [inner + site_decl(s) for s in k.sites]
        for r in k.roles:
            lines += self.role(r, depth + 1)
        return lines + [pad + "}"]


def kernel_header(k: N.Kernel) -> str:
    text = f"kernel {name(k.name)} block_threads={k.block_threads}"
    if k.min_blocks_per_sm is not None:
        text += f" min_blocks_per_sm={k.min_blocks_per_sm}"
    if k.dynamic_shared:
        text += " dynamic_shared=true"
    if k.rank_batch is not None:
        text += f" batch_ranks={k.rank_batch.ranks} batch_blocks={k.rank_batch.blocks}"
    return text


def param_decl(p: N.Param) -> str:
    return "param " + Printer().typed("$", p)


def shared_decl(b: N.SharedBuffer) -> str:
    return f"shared {name(b.name)}[{b.nbytes}] align={b.align}"


def site_decl(s: N.SiteInfo) -> str:
    return f"site {s.site_id} role={name(s.role)} buffer={name(s.buffer)}"


def barrier_decl(b: N.NamedBarrier) -> str:
    return f"barrier {name(b.name)} id={b.id} count={count(b.count)}" + group_key(b)


def group_key(b: N.NamedBarrier) -> str:
    """`` group=true`` for a warp-group barrier, else nothing."""
    return " group=true" if b.group else ""


# ---------------------------------------------------------------------------------------------
# Public API


def print_kernel(k: N.Kernel) -> str:
    """The text of kernel ``k`` (ends with a newline)."""
    return "\n".join(Printer(k).kernel(k)) + "\n"


def print_module(m: N.Module) -> str:
    """The text of module ``m``: its kernels in order, separated by blank lines."""
    lines = [f"module {name(m.name)} {{"]
    for i, k in enumerate(m.kernels):
        if i:
            lines.append("")
        lines += Printer(k).kernel(k, depth=1)
    return "\n".join(lines + ["}"]) + "\n"


def print_stmt(s, kernel: N.Kernel | None = None, depth: int = 0) -> str:
    """The text of one statement, nested bodies included (no trailing newline). Variables show
    their type at their first appearance in it; with ``kernel``, parameters that differ from its
    declarations show theirs."""
    return "\n".join(Printer(kernel).stmt(s, depth))


def print_expr(e, kernel: N.Kernel | None = None) -> str:
    """The text of one expression."""
    return Printer(kernel).expr(e)


def print_node(node, kernel: N.Kernel | None = None) -> str:
    """A short one-line rendering of any IR node, for messages: statements print their first
    line (``if c { ... }`` for compound ones), roles and kernels their header, declarations their
    line. Long renderings are cut at ``SHORT_WIDTH`` characters."""
    p = Printer(kernel)
    match node:
        case N.If() | N.For() | N.While():
            text = p.line(node) + " { ... }"
        case N.Kernel():
            text = kernel_header(node)
        case N.Module():
            text = f"module {name(node.name)}"
        case N.Role():
            text = p.role_header(node)
        case N.Param():
            text = param_decl(node)
        case N.NamedBarrier():
            text = barrier_decl(node)
        case N.SharedBuffer():
            text = shared_decl(node)
        case N.SiteInfo():
            text = site_decl(node)
        case N.DiagSite():
            text = f"site={node.site_id} buffer={name(node.buffer)} index={p.expr(node.index)}"
        case N.ExprOps():
            text = p.expr(node)
        case _:
            text = p.line(node)
    return text if len(text) <= SHORT_WIDTH else text[:SHORT_WIDTH - 3] + "..."
