"""Dynamic shared memory on ``backends.sim``: each block of a launch gets its own ``shmem``
bytes (the kernel's ``dyn_smem``), directly and through a captured graph; a bad byte count is
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import ir
from backends import sim
from ir import types as T

BLOCKS, THREADS, BASE = 3, 64, 32


def _module() -> ir.Module:
    """Each thread stores ``block * 1000 + tid`` at its word of a role scratch slice from
    byte ``BASE`` of ``dyn_smem``; after the barrier it writes its neighbour's word
    (``tid ^ 1``) to ``out[block * THREADS + tid]``."""
    kb = ir.KernelBuilder("neighbours", THREADS)
    out = kb.param("out", T.ptr_global)
    with kb.role("r", smem_base=BASE) as r:
        words = r.scratch("words", 4 * THREADS)
        r.store(words + (r.tid * 4).cast(T.u64), r.block * 1000 + r.tid)
        r.syncthreads()
        v = r.load(words + ((r.tid ^ 1) * 4).cast(T.u64), T.u32)
        r.store(out + ((r.block * THREADS + r.tid) * 4).cast(T.u64), v)
        assert r.scratch_end == BASE + 4 * THREADS
    return ir.Module("neighbours", (kb.build(),))


def _want():
    b, t = np.divmod(np.arange(BLOCKS * THREADS), THREADS)
    return (b * 1000 + (t ^ 1)).astype(np.uint32)


def test_each_block_has_its_own_dynamic_shared_memory(seed):
    m = sim.Machine(seed)
    out = m.to_device(np.zeros(BLOCKS * THREADS, np.uint32))
    kernel = m.load_module(_module()).kernel("neighbours")
    kernel.launch(BLOCKS, THREADS, [out], m.create_stream(), shmem=BASE + 4 * THREADS)
    assert (out.to_host() == _want()).all()


def test_a_graph_replays_the_dynamic_shared_memory(seed):
    m = sim.Machine(seed)
    out = m.to_device(np.zeros(BLOCKS * THREADS, np.uint32))
    kernel = m.load_module(_module()).kernel("neighbours")
    st = m.create_stream()
    with m.graph.capture(st) as cap:
        kernel.launch(BLOCKS, THREADS, [out], st, shmem=BASE + 4 * THREADS)
    m.graph.GraphExec(cap.graph).launch(st)
    assert (out.to_host() == _want()).all()


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_a_bad_byte_count_is_refused(bad):
    m = sim.Machine(0)
    kernel = m.load_module(_module()).kernel("neighbours")
    with pytest.raises(ValueError, match="shmem must be a byte count >= 0"):
        kernel.launch(BLOCKS, THREADS, [m.to_device(np.zeros(1, np.uint32))], shmem=bad)
