"""Prepared launches (``Program.prepare``) on the GPU: a prepared ``copy16`` copies what a
plain launch copies (``prepared_checks.copy_checks``), and the host time of one prepared
launch is measured against a plain one. The parameter buffer's layout and the simulator's
run: tests/sim/test_prepared_launch.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ir
from epgen.demos import build_copy16
from epgen.runtime.program import Program

from prepared_checks import copy_checks


@pytest.mark.gpu
def test_prepared_copy_on_the_gpu_and_its_host_time(seed):
    from backends import cuda
    program = Program(ir.Module("copy", (build_copy16(128, 2),)))
    copy_checks(cuda, program, np.random.default_rng(seed))
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
