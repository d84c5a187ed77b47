"""The NVPTX target: architecture, PTX ISA version, LLVM target machine, capabilities.

Only the architectures and PTX versions listed here are accepted: LLVM silently ignores a
feature it does not know (``+ptx91`` only prints a warning on stderr), so an unchecked
spelling would change the emitted ``.version`` without any error.
"""

from __future__ import annotations

import functools

import llvmlite.binding as llvm

TRIPLE = "nvptx64-nvidia-cuda"
ARCHES = ("sm_80", "sm_90", "sm_100")
PTX_VERSIONS = (86, 87, 88, 90)
DEFAULT_PTX = 86

LLVM_MAJOR = llvm.llvm_version_info[0]

# LLVM < 23 lowers every `atomicrmw` to a relaxed, gpu-scope `atom` whatever its ordering and
# syncscope (llvm PR #176015 fixed it). See atomics.py.
NATIVE_SCOPED_ATOMICRMW = LLVM_MAJOR >= 23


@functools.cache
def _initialize_llvm() -> None:
    # llvm.initialize() raises since llvmlite 0.45.
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()


class Target:
    """An NVPTX target: ``Target("sm_90")`` gives PTX ``.target sm_90`` / ``.version 8.6``."""

    def __init__(self, arch: str = "sm_90", ptx: int = DEFAULT_PTX):
        if arch not in ARCHES:
            raise ValueError(f"arch={arch!r} is not supported; expected one of {', '.join(ARCHES)}")
        if ptx not in PTX_VERSIONS:
            raise ValueError(f"ptx={ptx!r} is not supported; expected one of {PTX_VERSIONS}")
        self.arch = arch
        self.ptx = ptx
        self.sm = int(arch[3:])
        _initialize_llvm()
        self.machine = llvm.Target.from_triple(TRIPLE).create_target_machine(
            cpu=arch, features=self.features, opt=2)

    @property
    def features(self) -> str:
        return f"+ptx{self.ptx}"

    @property
    def data_layout(self) -> str:
        return str(self.machine.target_data)

    @property
    def has_cluster_scope(self) -> bool:
        """``.cluster`` scope exists from sm_90."""
        return self.sm >= 90

    @property
    def has_fp8_cvt(self) -> bool:
        """``cvt...e4m3x2``/``e5m2x2`` exist from sm_89."""
        return self.sm >= 89

    def __repr__(self) -> str:
        return f"Target({self.arch!r}, ptx={self.ptx})"
