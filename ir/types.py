"""Value types of the kernel IR, spelled as PTX spells them.

A scalar ``DType`` is one of PTX's fundamental types (``u32``, ``s64``, ``f32``, ``bf16``,
``pred`` ...). ``VecType`` is a short vector of one scalar type (at most 16 bytes, the widest
single memory access). ``PtrType`` is a 64-bit address in one state space.
"""

from __future__ import annotations

import attrs

from .enums import Space


@attrs.frozen
class DType:
    """A PTX fundamental type: ``kind`` is ``u`` (unsigned), ``s`` (signed), ``f`` (float),
    ``b`` (untyped bits) or ``pred``; ``bits`` its width."""

    kind: str
    bits: int

    @property
    def name(self) -> str:
        return "pred" if self.kind == "pred" else f"{self.kind}{self.bits}"

    @property
    def nbytes(self) -> int:
        return max(1, self.bits // 8)

    @property
    def is_int(self) -> bool:
        return self.kind in ("u", "s", "b")

    @property
    def is_signed(self) -> bool:
        return self.kind == "s"

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    def __str__(self) -> str:
        return self.name


@attrs.frozen
class VecType:
    """``n`` lanes of ``elem``; lowers to an LLVM vector and to PTX ``.v2``/``.v4`` accesses."""

    elem: DType
    n: int

    @property
    def name(self) -> str:
        return f"v{self.n}.{self.elem.name}"

    @property
    def nbytes(self) -> int:
        return self.elem.nbytes * self.n

    @property
    def bits(self) -> int:
        return self.elem.bits * self.n

    kind = "vec"
    is_int = False
    is_float = False
    is_signed = False

    def __str__(self) -> str:
        return self.name


@attrs.frozen
class PtrType:
    """A 64-bit address in state space ``space`` (``ptr.global``, ``ptr.shared``, ``ptr.generic``)."""

    space: Space

    @property
    def name(self) -> str:
        return f"ptr.{self.space.value}"

    nbytes = 8
    bits = 64
    kind = "ptr"
    is_int = False
    is_float = False
    is_signed = False

    def __str__(self) -> str:
        return self.name


Type = DType | VecType | PtrType

pred = DType("pred", 1)
u8, u16, u32, u64 = (DType("u", b) for b in (8, 16, 32, 64))
s8, s16, s32, s64 = (DType("s", b) for b in (8, 16, 32, 64))
b8, b16, b32, b64 = (DType("b", b) for b in (8, 16, 32, 64))
f16, f32, f64 = DType("f", 16), DType("f", 32), DType("f", 64)
bf16 = DType("bf", 16)

ptr_global = PtrType(Space.GLOBAL)
ptr_shared = PtrType(Space.SHARED)
ptr_generic = PtrType(Space.GENERIC)

SCALARS = {t.name: t for t in (pred, u8, u16, u32, u64, s8, s16, s32, s64, b8, b16, b32, b64, f16, f32, f64)}
SCALARS["bf16"] = bf16


def vec(elem: DType, n: int) -> VecType:
    return VecType(elem, n)


def parse_type(text: str) -> Type:
    """Inverse of ``str(type)``: ``u32``, ``v4.u32``, ``ptr.global``."""
    if text in SCALARS:
        return SCALARS[text]
    if text.startswith("ptr."):
        return PtrType(Space(text[4:]))
    if text.startswith("v") and "." in text:
        n, elem = text[1:].split(".", 1)
        return VecType(SCALARS[elem], int(n))
    raise ValueError(f"unknown IR type {text!r}")
