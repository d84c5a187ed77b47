"""epgen's kernel IR: types, enums, nodes, builder, verifier and printer.

Pure data: this package imports neither llvmlite nor cuda.
"""

from . import diag, types
from .builder import KernelBuilder, RoleBuilder
from .enums import (AtomOp, BinOpKind, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, Space,
                    SReg, UnOpKind, VoteMode)
from .nodes import *  # noqa: F401,F403  (the node classes are the IR's vocabulary)
from .nodes import Kernel, Module, as_expr, const, walk, walk_expr
