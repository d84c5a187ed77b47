"""Prepared launches (``Program.prepare``; ``backends.cuda.prepared``): the packed parameter
buffer's layout, a prepared ``copy16`` on the CPU simulator (and on the GPU) copying what a
plain launch copies, ``set`` changing only later launches, and unknown parameters refused.
On the GPU the host time of one prepared launch is measured against a plain one."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ir
from backends.cuda.prepared import param_dtype, param_layout
from epgen.demos import build_copy16
from epgen.runtime.program import Program


def test_layout_aligns_each_parameter_to_its_size():
    types = ["ptr.global", "u32", "u32", "ptr.global", "f32", "u8", "u64", "u16"]
    offsets, size = param_layout(types)
    assert offsets == [0, 8, 12, 16, 24, 28, 32, 40] and size == 42
    assert [param_dtype(t).name for t in ("s32", "pred", "bf16", "f64")] == \
        ["int32", "bool", "uint16", "float64"]


def _copy_checks(cuda, program, rng):
    n = 4096
    src = rng.integers(0, 2**32, size=n, dtype=np.uint32)
    a, b, c = (cuda.to_device(src) for _ in range(3))
    dst1, dst2 = cuda.zeros(n, np.uint32), cuda.zeros(n, np.uint32)
    stream = cuda.create_stream()
    prep = program.prepare("copy16", 2, {"dst": dst1, "src": a, "n_vec": n // 4 // 2})
    prep.launch(stream)              # the first half
    prep.set("dst", dst2)
    prep.set("n_vec", n // 4)
    prep.launch(stream)              # all of it, into dst2
    stream.sync()
    got1, got2 = dst1.to_host(), dst2.to_host()
    assert np.array_equal(got1[:n // 2], src[:n // 2]) and not got1[n // 2:].any()
    assert np.array_equal(got2, src)
    with pytest.raises(KeyError, match="no parameter 'dest'"):
        prep.set("dest", dst1)
    with pytest.raises(TypeError, match="missing arguments"):
        program.prepare("copy16", 2, {"dst": dst1, "src": b})
    del c


def test_prepared_copy_on_the_simulator(seed):
    from backends.sim import Machine
    m = Machine()
    program = Program(ir.Module("copy", (build_copy16(64, 2),)), backend=m)
    _copy_checks(m, program, np.random.default_rng(seed))


@pytest.mark.gpu
def test_prepared_copy_on_the_gpu_and_its_host_time(seed):
    from backends import cuda
    program = Program(ir.Module("copy", (build_copy16(128, 2),)))
    _copy_checks(cuda, program, np.random.default_rng(seed))
    dst, src = cuda.zeros(1024, np.uint32), cuda.zeros(1024, np.uint32)
    stream = cuda.create_stream()
    args = {"dst": dst, "src": src, "n_vec": 256}
    prep = program.prepare("copy16", 1, args)

    def host_us(fn, n=2000):
        for _ in range(100):
            fn()
        stream.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = (time.perf_counter() - t0) / n * 1e6
        stream.sync()
        return t
    plain = host_us(lambda: program.launch("copy16", 1, args, stream))
    fast = host_us(lambda: prep.launch(stream))
    print(f"host time per launch: plain {plain:.1f} us, prepared {fast:.1f} us")
    assert fast < plain, f"prepared {fast:.1f} us is not below plain {plain:.1f} us"
