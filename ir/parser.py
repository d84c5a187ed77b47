"""Reads the text form of ``ir.printer`` back into IR nodes: ``parse(print(k)) == k``.

The text is line oriented (one statement per line, ``{`` ends a line that opens a body, ``}``
closes it), so the parser reads lines and parses each with a small recursive-descent parser
over its tokens. The grammar is described in ``ir.printer``. Errors are ``ParseError``\\ s that
name the line. Blank lines are skipped; ``//`` lines outside role bodies are ignored (inside
a role they are ``Comment`` statements).
"""

from __future__ import annotations

import json
import re

from . import nodes as N
from . import types as T
from .enums import (AtomOp, BinOpKind, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, Space,
                    SReg, UnOpKind, VoteMode)
from .printer import CVT_E4M3_TO_F32, CVT_E4M3X2


class ParseError(ValueError):
    """Malformed IR text; ``lineno`` is 1-based."""

    def __init__(self, lineno: int, message: str, line: str = ""):
        self.lineno = lineno
        self.message = message
        super().__init__(f"line {lineno}: {message}" + (f"\n    {line.strip()}" if line else ""))


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<num>-?(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|inf\b|nan\b))
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+(?:::[A-Za-z0-9_]+)?)*)
  | (?P<punct>[()\[\]{},=:%$@&])
""", re.VERBOSE)

_SEMS = {s.value: s for s in Sem}
_SCOPES = {s.value: s for s in Scope}
_SPACES = {s.value for s in Space}
_ATOM_OPS = {o.value: o for o in AtomOp}
_BINOPS = {o.value: o for o in BinOpKind}
_UNOPS = {o.value: o for o in UnOpKind}
_CMPS = {o.value: o for o in CmpOp}
_SREGS = {r.value: r for r in SReg}
# right-hand sides that are statements, not expressions (``%x = ld ...`` vs ``%x = add(...)``)
_VALUE_STMTS = {"ld", "atom", "shfl", "vote", "redux", "call", "spin_wait"}


class _Line:
    """The tokens of one line and a cursor over them."""

    def __init__(self, lineno: int, text: str):
        self.lineno, self.text = lineno, text
        self.toks: list[tuple[str, str]] = []
        self.i = 0
        if text.lstrip().startswith("//"):
            return  # a comment: its text is taken verbatim, not tokenized
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                self.fail(f"unexpected character {text[pos]!r}")
            if m.lastgroup != "ws":
                self.toks.append((m.lastgroup, m.group()))
            pos = m.end()

    def fail(self, message: str):
        raise ParseError(self.lineno, message, self.text)

    def peek(self, k: int = 0) -> tuple[str, str]:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("eol", "end of line")

    def at(self, value: str) -> bool:
        kind, v = self.peek()
        return v == value and kind in ("punct", "id")

    def next(self) -> tuple[str, str]:
        tok = self.peek()
        if tok[0] == "eol":
            self.fail("unexpected end of line")
        self.i += 1
        return tok

    def accept(self, value: str) -> bool:
        if self.at(value):
            self.i += 1
            return True
        return False

    def expect(self, value: str):
        if not self.accept(value):
            self.fail(f"expected {value!r}, found {self.peek()[1]!r}")

    def expect_kind(self, kind: str, what: str) -> str:
        k, v = self.peek()
        if k != kind:
            self.fail(f"expected {what}, found {v!r}")
        self.i += 1
        return v

    def done(self) -> bool:
        return self.i >= len(self.toks)

    def end(self):
        if not self.done():
            self.fail(f"unexpected {self.peek()[1]!r}")

    # -- small values --------------------------------------------------------------------------
    def name(self) -> str:
        kind, v = self.peek()
        if kind == "str":
            self.i += 1
            return json.loads(v)
        if kind == "id" and "." not in v:
            self.i += 1
            return v
        self.fail(f"expected a name, found {v!r}")

    def int(self) -> int:
        v = self.expect_kind("num", "an integer")
        try:
            return int(v, 0) if "x" in v.lower() else int(v)
        except ValueError:
            self.fail(f"expected an integer, found {v!r}")

    def mask(self) -> int | None:
        return None if self.accept("none") else self.int()

    def count(self) -> int | None:
        return None if self.accept("all") else self.int()

    def bool(self) -> bool:
        v = self.expect_kind("id", "true or false")
        if v not in ("true", "false"):
            self.fail(f"expected true or false, found {v!r}")
        return v == "true"

    def type(self, text: str | None = None) -> T.Type:
        text = text if text is not None else self.expect_kind("id", "a type")
        try:
            return T.parse_type(text)
        except (ValueError, KeyError):
            self.fail(f"unknown type {text!r}")

    def types(self) -> tuple:
        self.expect("(")
        out = []
        while not self.accept(")"):
            if out:
                self.expect(",")
            out.append(self.type())
        return tuple(out)

    def keyed(self, parsers: dict, required=()) -> dict:
        """``key=value`` pairs up to the end of the line (or a final ``{``), in any order."""
        out = {}
        while not self.done() and not self.at("{"):
            key = self.expect_kind("id", "key=value")
            if key not in parsers:
                self.fail(f"unknown key {key!r} (expected one of {', '.join(parsers)})")
            if key in out:
                self.fail(f"{key} given twice")
            self.expect("=")
            out[key] = parsers[key]()
        missing = [k for k in required if k not in out]
        if missing:
            self.fail(f"missing {', '.join(missing)}")
        return out


def _split_op(op: str) -> tuple[str, list[str]]:
    head, *rest = op.split(".")
    return head, rest


class _Parser:
    def __init__(self, text: str):
        self.lines = [(n, t) for n, t in enumerate(text.splitlines(), 1) if t.strip()]
        self.pos = 0
        self.params: dict[str, N.Param] = {}
        self.vars: dict[str, N.Var] = {}
        self.line: _Line | None = None

    # -- lines ---------------------------------------------------------------------------------
    def raw(self) -> tuple[int, str] | None:
        return self.lines[self.pos] if self.pos < len(self.lines) else None

    def next_line(self, closing: str) -> _Line:
        """The next line, tokenized; ``closing`` names what is still open (for the error)."""
        if self.pos >= len(self.lines):
            last = self.lines[-1][0] if self.lines else 0
            raise ParseError(last, f"unexpected end of text: {closing} is not closed")
        n, t = self.lines[self.pos]
        self.pos += 1
        self.line = _Line(n, t)
        return self.line

    def skip_comments(self):
        while (r := self.raw()) is not None and r[1].lstrip().startswith("//"):
            self.pos += 1

    @staticmethod
    def kind_of(line: _Line) -> str:
        """``close`` for ``}``, ``else`` for ``} else {``, else ``stmt``."""
        v = [t[1] for t in line.toks]
        if v == ["}"]:
            return "close"
        if v == ["}", "else", "{"]:
            return "else"
        return "stmt"

    # -- modules and kernels -------------------------------------------------------------------
    def module(self) -> N.Module:
        self.skip_comments()
        ln = self.next_line("the text")
        ln.expect("module")
        mname = ln.name()
        ln.expect("{")
        ln.end()
        kernels = []
        while True:
            self.skip_comments()
            ln = self.next_line(f"module {mname}")
            if self.kind_of(ln) == "close":
                break
            kernels.append(self.kernel(ln))
        self.finish()
        return N.Module(mname, tuple(kernels))

    def kernel(self, ln: _Line) -> N.Kernel:
        ln.expect("kernel")
        kname = ln.name()
        hdr = ln.keyed({"block_threads": ln.int, "min_blocks_per_sm": ln.int,
                        "dynamic_shared": ln.bool, "batch_ranks": ln.int,
                        "batch_blocks": ln.int}, required=("block_threads",))
        if ("batch_ranks" in hdr) != ("batch_blocks" in hdr):
            ln.fail("batch_ranks and batch_blocks come together")
        ln.expect("{")
        ln.end()
        self.params, self.vars = {}, {}
        params, shared, sites, roles = [], [], [], []
        while True:
            self.skip_comments()
            ln = self.next_line(f"kernel {kname}")
            if self.kind_of(ln) == "close":
                break
            kw = ln.expect_kind("id", "param, shared, site or role")
            if kw == "param":
                ln.expect("$")
                p = N.Param(*self.typed_name(ln))
                self.params.setdefault(p.name, p)
                params.append(p)
            elif kw == "shared":
                bname = ln.name()
                ln.expect("[")
                nbytes = ln.int()
                ln.expect("]")
                kv = ln.keyed({"align": ln.int}, required=("align",))
                shared.append(N.SharedBuffer(bname, nbytes, kv["align"]))
            elif kw == "site":
                sid = ln.int()
                kv = ln.keyed({"role": ln.name, "buffer": ln.name}, required=("role", "buffer"))
                sites.append(N.SiteInfo(sid, kv["role"], kv["buffer"]))
            elif kw == "role":
                roles.append(self.role(ln))
                continue
            else:
                ln.fail(f"expected param, shared, site or role, found {kw!r}")
            ln.end()
        return N.Kernel(kname, tuple(params), hdr["block_threads"], tuple(roles), tuple(shared),
                        hdr.get("dynamic_shared", False), hdr.get("min_blocks_per_sm"),
                        tuple(sites),
                        N.RankBatch(hdr["batch_ranks"], hdr["batch_blocks"])
                        if "batch_ranks" in hdr else None)

    def role(self, ln: _Line) -> N.Role:
        rname = ln.name()
        ln.expect("blocks")
        ln.expect("=")
        ln.expect("[")
        start = self.expr()
        ln.expect(",")
        stop = None if ln.accept("end") else self.expr()
        ln.expect(")")
        ln.expect("threads")
        ln.expect("=")
        threads = None
        if not ln.accept("all"):
            ln.expect("[")
            base = ln.int()
            ln.expect(",")
            end = ln.int()
            ln.expect(")")
            threads = N.ThreadRange(base, end - base)
        ln.expect("{")
        ln.end()
        barriers, body = [], []
        while True:
            ln = self.next_line(f"role {rname}")
            kind = self.kind_of(ln)
            if kind == "close":
                break
            if kind == "else":
                ln.fail("'} else {' without an if")
            if ln.at("barrier"):
                ln.next()
                barriers.append(self.barrier(ln))
                ln.end()
            else:
                body.append(self.stmt(ln))
        return N.Role(rname, tuple(body), N.BlockRange(start, stop), threads, tuple(barriers))

    def finish(self):
        self.skip_comments()
        if (r := self.raw()) is not None:
            raise ParseError(r[0], "unexpected text after the end", r[1])

    # -- bodies and statements -----------------------------------------------------------------
    def body(self, what: str) -> tuple[tuple, str]:
        """Statements up to the ``}`` (or ``} else {``) closing ``what``."""
        stmts = []
        while True:
            ln = self.next_line(what)
            kind = self.kind_of(ln)
            if kind != "stmt":
                return tuple(stmts), kind
            if ln.at("barrier"):
                ln.fail("barrier declarations belong at the top of a role body")
            stmts.append(self.stmt(ln))

    def stmt(self, ln: _Line):
        stripped = ln.text.strip()
        if stripped.startswith("//"):
            text = stripped[2:]
            return N.Comment(text[1:] if text.startswith(" ") else text)
        dst = None
        if ln.at("%"):
            dst = self.var()
            ln.expect("=")
            kind, v = ln.peek()
            if kind != "id" or _split_op(v)[0] not in _VALUE_STMTS:
                s = N.Assign(dst, self.expr())
                ln.end()
                return s
        op = ln.expect_kind("id", "a statement")
        head, q = _split_op(op)
        handler = getattr(self, "s_" + head, None)
        if handler is None:
            ln.fail(f"unknown statement {op!r}")
        s = handler(dst, q, op)
        ln.end()
        return s

    def no_dst(self, dst, op):
        if dst is not None:
            self.line.fail(f"{op} does not produce a value")

    def need_dst(self, dst, op):
        if dst is None:
            self.line.fail(f"{op} needs a destination variable")

    def mem_quals(self, q: list[str], op: str, extra: dict) -> dict:
        """Classify the dot-qualifiers of a memory op: sem, scope, space, and ``extra``
        (qualifier -> (slot, value))."""
        out = {}
        for word in q:
            if word in _SEMS:
                slot, val = "sem", _SEMS[word]
            elif word in _SCOPES:
                slot, val = "scope", _SCOPES[word]
            elif word in _SPACES:
                slot, val = "space", word
            elif word in extra:
                slot, val = extra[word]
            else:
                self.line.fail(f"unknown qualifier .{word} in {op}")
            if slot in out:
                self.line.fail(f"two {slot} qualifiers in {op}")
            out[slot] = val
        return out

    def address(self, quals: dict, op: str):
        """``[addr]``, checked against the space the op names (when it names one)."""
        ln = self.line
        ln.expect("[")
        addr = self.expr()
        ln.expect("]")
        space = quals.get("space")
        if space is not None:
            try:
                t = addr.dtype
            except Exception:
                t = None
            if isinstance(t, T.PtrType) and t.space.value != space:
                ln.fail(f"{op} names .{space} but the address is {t}")
        return addr

    def s_ld(self, dst, q, op):
        self.need_dst(dst, op)
        qs = self.mem_quals(q, op, {"nc": ("cache", CacheHint.NC), "L2::256B": ("l2", True)})
        if qs.pop("l2", False):
            if qs.get("cache") is not CacheHint.NC:
                self.line.fail(f".L2::256B needs .nc in {op}")
            qs["cache"] = CacheHint.NC_L2_256
        addr = self.address(qs, op)
        return N.Load(dst, addr, qs.get("sem", Sem.WEAK), qs.get("scope"),
                      qs.get("cache", CacheHint.NONE))

    def s_st(self, dst, q, op):
        self.no_dst(dst, op)
        qs = self.mem_quals(q, op, {})
        addr = self.address(qs, op)
        self.line.expect(",")
        return N.Store(addr, self.expr(), qs.get("sem", Sem.WEAK), qs.get("scope"))

    def atomic(self, dst, q, op):
        extra = {k: ("op", v) for k, v in _ATOM_OPS.items()} | {"cas": ("op", "cas")}
        qs = self.mem_quals(q, op, extra)
        if "op" not in qs:
            self.line.fail(f"{op} names no operation")
        addr = self.address(qs, op)
        self.line.expect(",")
        sem, scope = qs.get("sem", Sem.RELAXED), qs.get("scope")
        if qs["op"] == "cas":
            self.need_dst(dst, op)
            compare = self.expr()
            self.line.expect(",")
            return N.AtomicCAS(dst, addr, compare, self.expr(), sem, scope)
        return N.AtomicRMW(dst, qs["op"], addr, self.expr(), sem, scope)

    def s_atom(self, dst, q, op):
        self.need_dst(dst, op)
        return self.atomic(dst, q, op)

    def s_red(self, dst, q, op):
        self.no_dst(dst, op)
        if "cas" in q:
            self.line.fail("cas needs a destination (atom ... cas)")
        return self.atomic(dst, q, op)

    def s_fence(self, dst, q, op):
        self.no_dst(dst, op)
        qs = self.mem_quals(q, op, {})
        if "sem" not in qs or "space" in qs:
            self.line.fail(f"expected fence.<sem>[.<scope>], found {op}")
        return N.Fence(qs["sem"], qs.get("scope"))

    def s_bar(self, dst, q, op):
        self.no_dst(dst, op)
        if q == ["sync"]:
            return N.BarSync(self.barrier(self.line))
        if q == ["arrive"]:
            return N.BarArrive(self.barrier(self.line))
        if q == ["warp", "sync"]:
            return N.WarpSync(self.line.int())
        self.line.fail(f"unknown barrier op {op!r}")

    def barrier(self, ln: _Line) -> N.NamedBarrier:
        bname = ln.name()
        kv = ln.keyed({"id": ln.int, "count": ln.count, "group": ln.bool},
                      required=("id", "count"))
        return N.NamedBarrier(bname, kv["id"], kv["count"], kv.get("group", False))

    def mode(self, q, op, enum, prefix=("sync",)):
        if len(q) != len(prefix) + 1 or tuple(q[:-1]) != prefix:
            self.line.fail(f"malformed {op}")
        try:
            return enum(q[-1])
        except ValueError:
            self.line.fail(f"unknown mode .{q[-1]} in {op}")

    def s_shfl(self, dst, q, op):
        self.need_dst(dst, op)
        mode = self.mode(q, op, ShflMode)
        value = self.expr()
        self.line.expect(",")
        lane = self.expr()
        kv = self.line.keyed({"mask": self.line.int, "width": self.line.int},
                             required=("mask", "width"))
        return N.Shuffle(dst, mode, value, lane, kv["mask"], kv["width"])

    def s_vote(self, dst, q, op):
        self.need_dst(dst, op)
        ballot = q == ["sync", "ballot"]
        mode = None if ballot else self.mode(q, op, VoteMode)
        pred = self.expr()
        mask = self.line.keyed({"mask": self.line.int}, required=("mask",))["mask"]
        return N.Ballot(dst, pred, mask) if ballot else N.Vote(dst, mode, pred, mask)

    def s_redux(self, dst, q, op):
        self.need_dst(dst, op)
        rop = self.mode(q, op, ReduxOp)
        value = self.expr()
        mask = self.line.keyed({"mask": self.line.int}, required=("mask",))["mask"]
        return N.Redux(dst, rop, value, mask)

    def s_nanosleep(self, dst, q, op):
        self.plain(dst, q, op)
        return N.Nanosleep(self.expr())

    def plain(self, dst, q, op):
        self.no_dst(dst, op)
        if q:
            self.line.fail(f"unknown statement {op!r}")

    def s_if(self, dst, q, op):
        self.plain(dst, q, op)
        ln = self.line
        cond = self.expr()
        ln.expect("{")
        ln.end()
        then, kind = self.body("if")
        orelse = ()
        if kind == "else":
            orelse, kind = self.body("else")
            if kind != "close":
                self.line.fail("second '} else {' for one if")
        self.line = ln
        return N.If(cond, then, orelse)

    def s_for(self, dst, q, op):
        self.plain(dst, q, op)
        ln = self.line
        if not ln.at("%"):
            ln.fail("expected the loop variable")
        var = self.var()
        ln.expect("in")
        ln.expect("[")
        start = self.expr()
        ln.expect(",")
        stop = self.expr()
        ln.expect(")")
        ln.expect("step")
        ln.expect("=")
        step = self.expr()
        ln.expect("{")
        ln.end()
        body = self.loop_body("for")
        self.line = ln
        return N.For(var, start, stop, step, body)

    def s_while(self, dst, q, op):
        self.plain(dst, q, op)
        ln = self.line
        cond = self.expr()
        ln.expect("{")
        ln.end()
        body = self.loop_body("while")
        self.line = ln
        return N.While(cond, body)

    def loop_body(self, what):
        body, kind = self.body(what)
        if kind == "else":
            self.line.fail(f"'}} else {{' closing a {what} loop")
        return body

    def s_break(self, dst, q, op):
        self.plain(dst, q, op)
        return N.Break()

    def s_ret(self, dst, q, op):
        self.plain(dst, q, op)
        return N.Return()

    def s_trap(self, dst, q, op):
        self.plain(dst, q, op)
        return N.Trap()

    def s_comment(self, dst, q, op):
        self.plain(dst, q, op)
        return N.Comment(json.loads(self.line.expect_kind("str", "a quoted comment")))

    def s_call(self, dst, q, op):
        if q:
            self.line.fail(f"unknown statement {op!r}")
        ln = self.line
        fname = ln.name()
        args = tuple(self.args())
        kv = ln.keyed({"arg_types": ln.types}, required=("arg_types",))
        return N.Call(dst, fname, args, kv["arg_types"])

    def s_spin_wait(self, dst, q, op):
        ln = self.line
        if not q or q[-1] not in T.SCALARS:
            ln.fail(f"{op} must end with the polled type (spin_wait...u32)")
        dtype = T.SCALARS[q[-1]]
        qs = self.mem_quals(q[:-1], op, {})
        addr = self.address(qs, op)
        cmp = ln.expect_kind("id", "a comparison")
        if cmp not in _CMPS:
            ln.fail(f"unknown comparison {cmp!r}")
        expected = self.expr()
        e = self.expr
        kv = ln.keyed({"site": ln.int, "buffer": ln.name, "index": e, "timeout_ns": e,
                       "err_buf": e, "rank": e, "shift": ln.int, "mask": ln.mask,
                       "backoff_ns": ln.int, "give_up": e, "shrink": e, "status": e},
                      required=("site", "buffer", "index", "timeout_ns", "err_buf", "rank"))
        status = kv.get("status")
        if status is not None and not isinstance(status, N.Var):
            ln.fail("status must be a variable (%name:u32)")
        site = N.DiagSite(kv["site"], kv["buffer"], kv["index"])
        return N.SpinWait(dst, addr, dtype, _CMPS[cmp], expected, site, kv["timeout_ns"],
                          kv["err_buf"], kv["rank"], qs.get("sem", Sem.ACQUIRE),
                          qs.get("scope"), kv.get("shift", 0), kv.get("mask"),
                          kv.get("backoff_ns", 0), kv.get("give_up"), kv.get("shrink"),
                          status)

    # -- expressions ---------------------------------------------------------------------------
    def typed_name(self, ln: _Line) -> tuple:
        """``name:type [peer]`` after a sigil."""
        nm = ln.name()
        ln.expect(":")
        t = ln.type()
        return nm, t, ln.accept("peer")

    def var(self) -> N.Var:
        ln = self.line
        ln.expect("%")
        if ln.peek(1)[1] == ":":
            v = N.Var(*self.typed_name(ln))
            self.vars[v.name] = v
            return v
        nm = ln.name()
        if nm not in self.vars:
            ln.fail(f"variable %{nm} has no type yet (its first use must read %{nm}:<type>)")
        return self.vars[nm]

    def param(self) -> N.Param:
        ln = self.line
        ln.expect("$")
        if ln.peek(1)[1] == ":":
            return N.Param(*self.typed_name(ln))
        nm = ln.name()
        if nm not in self.params:
            ln.fail(f"parameter ${nm} is not declared")
        return self.params[nm]

    def args(self, n: int | None = None) -> list:
        ln = self.line
        ln.expect("(")
        out = []
        while not ln.accept(")"):
            if out:
                ln.expect(",")
            out.append(self.expr())
        if n is not None and len(out) != n:
            ln.fail(f"expected {n} operands, found {len(out)}")
        return out

    def expr(self):
        ln = self.line
        kind, v = ln.peek()
        if kind == "num":
            ln.next()
            ln.expect(":")
            return N.Const(_number(v), ln.type())
        if v == "%":
            return self.var()
        if v == "$":
            return self.param()
        if v == "@":
            ln.next()
            r = ln.expect_kind("id", "a special register")
            if r not in _SREGS:
                ln.fail(f"unknown special register @{r}")
            return N.SRegRead(_SREGS[r])
        if v == "&":
            ln.next()
            return N.SharedAddr(ln.name())
        if kind != "id":
            ln.fail(f"expected an expression, found {v!r}")
        ln.next()
        head, rest = v.split(".", 1) if "." in v else (v, None)
        if rest is None:
            if v in _BINOPS:
                return N.BinOp(_BINOPS[v], *self.args(2))
            if v in _CMPS:
                return N.Cmp(_CMPS[v], *self.args(2))
            if v in _UNOPS:
                return N.UnOp(_UNOPS[v], *self.args(1))
            if v == "selp":
                return N.Select(*self.args(3))
            if v == "fma":
                return N.Fma(*self.args(3))
            if v == "ptradd":
                return N.PtrAdd(*self.args(2))
            if v == "extract":
                ln.expect("(")
                vec = self.expr()
                ln.expect(",")
                index = ln.int()
                ln.expect(")")
                return N.Extract(vec, index)
        elif v == CVT_E4M3X2:
            return N.CvtE4M3x2(*self.args(2))
        elif v == CVT_E4M3_TO_F32:
            return N.CvtE4M3ToF32(*self.args(1))
        elif head == "cvt":
            return N.Cast(ln.type(rest), *self.args(1))
        elif head == "bitcast":
            return N.Bitcast(ln.type(rest), *self.args(1))
        elif head == "pack":
            return N.Pack(ln.type(rest), tuple(self.args()))
        ln.fail(f"unknown operator {v!r}")


def _number(text: str) -> int | float:
    t = text.lower()
    if "x" in t:
        return int(t, 16)
    if re.fullmatch(r"-?\d+", t):
        return int(t)
    return float(t)


# ---------------------------------------------------------------------------------------------
# Public API


def parse_kernel(text: str) -> N.Kernel:
    """The kernel printed by ``ir.printer.print_kernel``."""
    p = _Parser(text)
    p.skip_comments()
    k = p.kernel(p.next_line("the text"))
    p.finish()
    return k


def parse_module(text: str) -> N.Module:
    """The module printed by ``ir.printer.print_module``."""
    return _Parser(text).module()
