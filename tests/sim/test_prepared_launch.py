"""Prepared launches (``Program.prepare``; ``backends.cuda.prepared``): the packed parameter
buffer's layout, a prepared ``copy16`` on the CPU simulator copying what a plain launch
copies, ``set`` changing only later launches, and unknown parameters refused. On the GPU
(the same checks and the host time of a prepared launch):
tests/gpu/test_prepared_launch_gpu.py."""

from __future__ import annotations

import numpy as np

import ir
from backends.cuda.prepared import param_dtype, param_layout
from epgen.demos import build_copy16
from epgen.runtime.program import Program

from prepared_checks import copy_checks


def test_layout_aligns_each_parameter_to_its_size():
    types = ["ptr.global", "u32", "u32", "ptr.global", "f32", "u8", "u64", "u16"]
    offsets, size = param_layout(types)
    assert offsets == [0, 8, 12, 16, 24, 28, 32, 40] and size == 42
    assert [param_dtype(t).name for t in ("s32", "pred", "bf16", "f64")] == \
        ["int32", "bool", "uint16", "float64"]


def test_prepared_copy_on_the_simulator(seed):
    from backends.sim import Machine
    m = Machine()
    program = Program(ir.Module("copy", (build_copy16(64, 2),)), backend=m)
    copy_checks(m, program, np.random.default_rng(seed))
