"""Enumerations of the kernel IR. Each value is its PTX spelling, so the printer, the
verifier and the lowering share one vocabulary (``Scope.SYS.value == "sys"``)."""

from __future__ import annotations

import enum


class Scope(enum.Enum):
    """Memory-model scope of an ordered operation: PTX ``.cta .cluster .gpu .sys``."""

    CTA = "cta"
    CLUSTER = "cluster"
    GPU = "gpu"
    SYS = "sys"

    @property
    def rank(self) -> int:
        """Width of the scope: a wider scope includes every narrower one."""
        return list(Scope).index(self)


class Sem(enum.Enum):
    """Memory ordering: PTX ``.relaxed .acquire .release .acq_rel .sc`` plus the plain
    (``weak``) and ``volatile`` forms of ``ld``/``st``."""

    WEAK = "weak"
    VOLATILE = "volatile"
    RELAXED = "relaxed"
    ACQUIRE = "acquire"
    RELEASE = "release"
    ACQ_REL = "acq_rel"
    SC = "sc"

    @property
    def is_ordered(self) -> bool:
        """True for the semantics that order other memory operations."""
        return self in (Sem.ACQUIRE, Sem.RELEASE, Sem.ACQ_REL, Sem.SC)

    @property
    def needs_scope(self) -> bool:
        return self not in (Sem.WEAK, Sem.VOLATILE)


class Space(enum.Enum):
    """PTX state space of an address: ``.global .shared .param`` or generic (no qualifier)."""

    GLOBAL = "global"
    SHARED = "shared"
    GENERIC = "generic"
    PARAM = "param"


class AtomOp(enum.Enum):
    """Read-modify-write operations of ``atom``/``red``."""

    ADD = "add"
    MIN = "min"
    MAX = "max"
    EXCH = "exch"
    AND = "and"
    OR = "or"
    XOR = "xor"
    INC = "inc"
    DEC = "dec"


class BinOpKind(enum.Enum):
    """Two-operand arithmetic; signedness comes from the operand type."""

    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    REM = "rem"
    AND = "and"
    OR = "or"
    XOR = "xor"
    SHL = "shl"
    SHR = "shr"
    MIN = "min"
    MAX = "max"


class UnOpKind(enum.Enum):
    """One-operand arithmetic: negation, bitwise not, population count, absolute value."""

    NEG = "neg"
    NOT = "not"
    POPC = "popc"
    ABS = "abs"


class CmpOp(enum.Enum):
    """Comparisons (``setp.<op>``); signed or unsigned by operand type."""

    EQ = "eq"
    NE = "ne"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"


class SReg(enum.Enum):
    """PTX special registers (``%tid.x`` ...). 64-bit: ``globaltimer`` and ``clock64``."""

    TID_X = "tid.x"
    TID_Y = "tid.y"
    TID_Z = "tid.z"
    NTID_X = "ntid.x"
    CTAID_X = "ctaid.x"
    CTAID_Y = "ctaid.y"
    NCTAID_X = "nctaid.x"
    LANEID = "laneid"
    WARPID = "warpid"
    SMID = "smid"
    NSMID = "nsmid"
    GLOBALTIMER = "globaltimer"
    CLOCK64 = "clock64"
    DYNAMIC_SMEM_SIZE = "dynamic_smem_size"

    @property
    def bits(self) -> int:
        return 64 if self in (SReg.GLOBALTIMER, SReg.CLOCK64) else 32

    @property
    def is_volatile(self) -> bool:
        """Registers whose value changes while a thread runs (never hoisted or merged)."""
        return self in (SReg.GLOBALTIMER, SReg.CLOCK64, SReg.SMID, SReg.WARPID)


class ShflMode(enum.Enum):
    """``shfl.sync`` modes."""

    IDX = "idx"
    UP = "up"
    DOWN = "down"
    BFLY = "bfly"


class VoteMode(enum.Enum):
    """``vote.sync`` modes returning a predicate (``ballot`` is its own node)."""

    ANY = "any"
    ALL = "all"
    UNI = "uni"


class ReduxOp(enum.Enum):
    """``redux.sync`` operations (sm_80+)."""

    ADD = "add"
    MIN = "min"
    MAX = "max"
    AND = "and"
    OR = "or"
    XOR = "xor"


class CacheHint(enum.Enum):
    """Load hints: ``nc`` = read-only / invariant data (``ld.global.nc``); ``nc.L2::256B``
    also asks L2 to prefetch the surrounding 256 bytes (streaming reads)."""

    NONE = "none"
    NC = "nc"
    NC_L2_256 = "nc.L2::256B"
