"""NVPTX backend: kernel IR -> llvmlite IR -> PTX (LLVM's NVPTX target), PTX checks, ptxas."""

from .check import CheckReport, OrderedOp, PtxCheckError, check_ptx, ordered_ops
from .emit import emit_llvm_ir, emit_ptx
from .errors import LoweringError
from .nvshmem import NvshmemLinkError, emit_linked_ptx, find_bitcode, uses_nvshmem
from .ptxas import KernelResources, PtxasError, PtxasReport, assemble, find_ptxas
from .target import ARCHES, Target

__all__ = ["ARCHES", "CheckReport", "KernelResources", "LoweringError", "NvshmemLinkError",
           "OrderedOp",
           "PtxCheckError", "PtxasError", "PtxasReport", "Target", "assemble", "check_ptx",
           "emit_linked_ptx", "emit_llvm_ir", "emit_ptx", "find_bitcode", "find_ptxas",
           "ordered_ops", "uses_nvshmem"]
