"""The checks of a prepared launch (``Program.prepare``), shared by the simulator's and the
GPU's tests."""

from __future__ import annotations

import numpy as np
import pytest


def copy_checks(cuda, program, rng):
    """A prepared ``copy16`` of ``program`` on ``cuda`` (``backends.cuda`` or a simulator
    ``Machine``) copies what a plain launch copies, ``set`` changes only the later launches,
    and an unknown or missing parameter is refused."""
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
