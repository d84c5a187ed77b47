"""Evaluate straight-line IR (``Assign`` statements over pure expressions) on numpy arrays, one
array element per GPU thread, with PTX's semantics:

- integer arithmetic wraps at the type's width; ``shl``/``shr`` need a shift below the width;
- f32 ``add/sub/mul/div`` are IEEE, round to nearest even (``add.rn``/``mul.rn``/``div.rn``);
  ``min``/``max`` return the non-NaN operand (``min.f32``/``max.f32`` = ``np.fmin``/``fmax``);
  ``abs.f32`` clears the sign bit;
- float comparisons are ordered (``setp.ne.f32`` is false for NaN, unlike numpy's ``!=``);
- ``CvtE4M3x2`` is modelled (it is hardware: ``cvt.rn.satfinite.e4m3x2.f32``) as ml_dtypes'
  round-to-nearest-even e4m3 of the value clamped to +-448, NaN kept as NaN (0x7f);
  ``CvtE4M3ToF32`` as ml_dtypes' e4m3 value of the low byte;
- ``Fma`` (f32) rounds ``a * b + c`` once (``fma_f32``: the product is exact in f64, the sum
  is corrected by its rounding error where f64's rounding would decide an f32 tie), the
  interpreter's own model (``backends.sim.numerics``).

Used by the format tests to run the very IR a kernel contains (the encoders of
``epgen.formats.quant_ir`` and the per-item quantisers) against ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from backends.sim.numerics import fma_f32
from ir import nodes as N
from ir import types as T
from ir.enums import BinOpKind, CmpOp, UnOpKind

NP_TYPES = {T.pred: np.bool_, T.u8: np.uint8, T.u16: np.uint16, T.u32: np.uint32,
            T.u64: np.uint64, T.s8: np.int8, T.s16: np.int16, T.s32: np.int32, T.s64: np.int64,
            T.b8: np.uint8, T.b16: np.uint16, T.b32: np.uint32, T.b64: np.uint64,
            T.f32: np.float32, T.f64: np.float64}


def e4m3x2_model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What ``cvt.rn.satfinite.e4m3x2.f32 d, a, b`` is documented to do: ``a`` to the upper
    byte, ``b`` to the lower, each rounded to nearest even and saturated to +-448."""
    def one(x):
        x = np.asarray(x, dtype=np.float32)
        sat = np.where(np.isnan(x), x, np.clip(x, -448, 448)).astype(np.float32)
        codes = sat.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7F), codes)
    return (one(a) << 8) | one(b)


class Evaluator:
    def __init__(self, env: dict):
        self.env = dict(env)          # variable/parameter name -> numpy array or scalar

    def run(self, stmts) -> dict:
        for s in stmts:
            if not isinstance(s, N.Assign):
                raise TypeError(f"only straight-line Assigns are evaluated, not {s!r}")
            value = self.expr(s.value)
            self.env[s.dst.name] = np.asarray(value).astype(NP_TYPES[s.dst.dtype], copy=False)
        return self.env

    def expr(self, e):
        with np.errstate(all="ignore"):
            return self._expr(e)

    def _expr(self, e):
        match e:
            case N.Const():
                return NP_TYPES[e.dtype](e.value)
            case N.Var() | N.Param():
                return self.env[e.name]
            case N.BinOp():
                return self.binop(e)
            case N.UnOp():
                a = self.expr(e.a)
                if e.op is UnOpKind.ABS:
                    return np.abs(a)
                if e.op is UnOpKind.NEG:
                    return -a
                if e.op is UnOpKind.NOT:
                    return ~a
            case N.Cmp():
                return self.cmp(e)
            case N.Select():
                return np.where(self.expr(e.cond), self.expr(e.a), self.expr(e.b)) \
                    .astype(NP_TYPES[e.dtype], copy=False)
            case N.Cast():
                return np.asarray(self.expr(e.a)).astype(NP_TYPES[e.dtype], copy=False)
            case N.Bitcast():
                return np.asarray(self.expr(e.a)).view(NP_TYPES[e.dtype])
            case N.Extract():
                return self.expr(e.vec)[..., e.index]
            case N.CvtE4M3x2():
                return e4m3x2_model(self.expr(e.a), self.expr(e.b))
            case N.CvtE4M3ToF32():
                low = (np.asarray(self.expr(e.a)) & 0xFF).astype(np.uint8)
                return low.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            case N.Fma():
                if e.dtype != T.f32:
                    raise TypeError(f"fma on {e.dtype} is not evaluated (f32 only)")
                return fma_f32(self.expr(e.a), self.expr(e.b), self.expr(e.c))
        raise TypeError(f"cannot evaluate {e!r}")

    def binop(self, e: N.BinOp):
        a, b = self.expr(e.a), self.expr(e.b)
        t = NP_TYPES[e.dtype]
        is_float = e.dtype.is_float
        op = e.op
        if op is BinOpKind.ADD:
            return (a + b).astype(t, copy=False)
        if op is BinOpKind.SUB:
            return (a - b).astype(t, copy=False)
        if op is BinOpKind.MUL:
            return (a * b).astype(t, copy=False)
        if op is BinOpKind.DIV:
            return (a / b).astype(t, copy=False) if is_float else (a // b).astype(t, copy=False)
        if op is BinOpKind.MIN:
            return (np.fmin if is_float else np.minimum)(a, b).astype(t, copy=False)
        if op is BinOpKind.MAX:
            return (np.fmax if is_float else np.maximum)(a, b).astype(t, copy=False)
        if op in (BinOpKind.SHL, BinOpKind.SHR):
            if np.any(np.asarray(b) >= e.dtype.bits):
                raise ValueError("shift by the type width or more")
            return ((a << b) if op is BinOpKind.SHL else (a >> b)).astype(t, copy=False)
        if op is BinOpKind.AND:
            return (a & b).astype(t, copy=False)
        if op is BinOpKind.OR:
            return (a | b).astype(t, copy=False)
        if op is BinOpKind.XOR:
            return (a ^ b).astype(t, copy=False)
        if op is BinOpKind.REM:
            return (a % b).astype(t, copy=False)
        raise TypeError(f"cannot evaluate {op}")

    def cmp(self, e: N.Cmp):
        a, b = self.expr(e.a), self.expr(e.b)
        if e.op is CmpOp.NE and e.a.dtype.is_float:
            return (a < b) | (a > b)            # ordered: NaN compares false
        return {CmpOp.EQ: np.equal, CmpOp.NE: np.not_equal, CmpOp.LT: np.less,
                CmpOp.LE: np.less_equal, CmpOp.GT: np.greater,
                CmpOp.GE: np.greater_equal}[e.op](a, b)


class Compiled:
    """IR built once by ``build(r, *input_vars)`` in a fresh role; call it with numpy arrays
    for the inputs (by name) to evaluate its statements. ``result`` is what ``build``
    returned (e.g. the ``Var`` holding the answer); ``stmts`` the IR evaluated."""

    def __init__(self, build, inputs: dict, kernel_params: dict | None = None):
        import ir
        kb = ir.KernelBuilder("eval", 32)
        self.params = dict(kernel_params or {})
        for name, dtype in self.params.items():
            kb.param(name, dtype)
        self.inputs = dict(inputs)
        with kb.role("r") as r:
            vars_ = []
            for name, dtype in self.inputs.items():
                vars_.append(kb.new_var(name, dtype))   # reserves the name
            self.result = build(r, *vars_)
            self.stmts = list(r._stack[0].stmts)

    def __call__(self, **values) -> dict:
        env = {}
        for name, dtype in {**self.inputs, **self.params}.items():
            env[name] = np.asarray(values[name]).astype(NP_TYPES[dtype], copy=False)
        return Evaluator(env).run(self.stmts)

    def value(self, env: dict, e=None):
        """The value of ``e`` (default: ``result``) in ``env``."""
        return Evaluator(env).expr(self.result if e is None else e)


def run_role(build, inputs: dict, kernel_params: dict | None = None):
    """``Compiled(build, {name: dtype})`` evaluated once on ``inputs`` (name -> (dtype,
    array)); returns (environment, result)."""
    c = Compiled(build, {k: d for k, (d, _a) in inputs.items()}, kernel_params)
    return c(**{k: a for k, (_d, a) in inputs.items()}), c.result


def value(env: dict, e):
    """The value of expression ``e`` (typically a returned ``Var``) in ``env``."""
    return Evaluator(env).expr(e)
