"""The monitor blocks' count of the top-k ids (``dispatch_async.count_block_experts``) in the
IR simulator, against numpy: the vector path (``MONITOR_COUNT_VECTORS`` loads of four ids in
flight, the ids before the first 16-byte boundary and after the last whole vector one by
one) at every 4-byte misalignment, and the scalar path."""

from __future__ import annotations

import numpy as np
import pytest

import ir
from ir import types as T
from epgen.kernels import dispatch_async
from ir_sim import Sim

THREADS = 64          # two warps: each block counts two experts


def count_kernel() -> ir.Kernel:
    """Block ``b`` counts experts ``2b`` and ``2b + 1`` of ``n_ids`` ids at ``topk_ids`` and
    stores the two counts at ``out[2b:2b+2]``."""
    kb = ir.KernelBuilder("count_ids", THREADS)
    ids, n_ids, out = (kb.param("topk_ids", T.ptr_global), kb.param("n_ids", T.u32),
                       kb.param("out", T.ptr_global))
    warps = THREADS // 32
    hist = kb.shared_buffer("hist", 4 * warps)
    with kb.role("count", blocks=(0, None)) as r:
        first_g = r.let("first_g", r.block * warps)
        dispatch_async.count_block_experts(r, ids, n_ids, first_g, hist)
        with r.if_(r.tid < warps):
            r.store(out + ((first_g + r.tid) * 4).cast(T.u64),
                    r.load(hist + (r.tid * 4).cast(T.u64), T.u32, name="h"))
    return kb.build()


@pytest.mark.parametrize("vectors", [8, 2, 0], ids=["vectors8", "vectors2", "scalar"])
@pytest.mark.parametrize("misalign", [0, 4, 8], ids=["aligned", "off4", "off8"])
@pytest.mark.parametrize("n_ids", [1, 7, 1024, 2051, 2304 + 3])
def test_counts_match_numpy(vectors, misalign, n_ids, seed, monkeypatch):
    monkeypatch.setattr(dispatch_async, "MONITOR_COUNT_VECTORS", vectors)
    rng = np.random.default_rng(seed)
    n_experts = 6
    ids = rng.integers(0, n_experts + 2, n_ids, dtype=np.uint32)   # some ids nobody owns
    kernel = count_kernel()
    text = ir.print_module(ir.Module("m", (kernel,)))
    assert ("%ids_head" in text) is bool(vectors)
    sim = Sim(seed=seed)
    base = sim.mem.alloc(4 * n_ids + 16)
    sim.mem.put(base + misalign, ids)
    out = sim.mem.alloc(4 * n_experts)
    sim.launch(kernel, n_experts // 2, {"topk_ids": base + misalign, "n_ids": n_ids, "out": out})
    sim.run()
    got = sim.mem.get(out, (n_experts,), np.uint32)
    want = np.bincount(ids, minlength=n_experts + 2)[:n_experts]
    assert got.tolist() == want.tolist()
