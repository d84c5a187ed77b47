"""epgen's kernel IR: types, enums, nodes, builder, verifier, printer and parser.

Pure data: this package imports neither llvmlite nor cuda.
"""

from . import diag, types
from .builder import KernelBuilder, RoleBuilder
from .enums import (AtomOp, BinOpKind, CacheHint, CmpOp, ReduxOp, Scope, Sem, ShflMode, Space,
                    SReg, UnOpKind, VoteMode)
from .nodes import *  # noqa: F401,F403  (the node classes are the IR's vocabulary)
from .nodes import Kernel, Module, RankBatch, as_expr, batch_ranks, const, walk, walk_expr
from .parser import ParseError, parse_kernel, parse_module
from .printer import print_expr, print_kernel, print_module, print_node, print_stmt
from .verify import Issue, VerifyError, check, verify
