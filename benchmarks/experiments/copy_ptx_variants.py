"""Experiment: which PTX-level cache qualifiers move copy16's bandwidth? Takes the generated
PTX of copy16 and rewrites its load/store qualifiers textually (no IR change), then times each
variant against a CuPy device-to-device copy in the same run.

    PYTHONPATH=. python3 benchmarks/experiments/copy_ptx_variants.py
"""

from __future__ import annotations

import statistics

import numpy as np

VARIANTS = {
    "as generated": [],
    "st.cs": [("st.global.v4", "st.global.cs.v4")],
    "ld.L1::no_allocate": [("ld.global.nc.v4", "ld.global.nc.L1::no_allocate.v4")],
    "ld.lu + st.cs": [("ld.global.nc.v4", "ld.global.lu.v4"), ("st.global.v4", "st.global.cs.v4")],
    "ld.L1::no_allocate + st.cs": [("ld.global.nc.v4", "ld.global.nc.L1::no_allocate.v4"),
                                   ("st.global.v4", "st.global.cs.v4")],
    "st.L1::no_allocate": [("st.global.v4", "st.global.L1::no_allocate.v4")],
}


def main():
    import cupy
    import ir
    from backends import cuda, nvptx
    from epgen.demos import build_copy16

    n = 1 << 30
    stream = cuda.create_stream()
    src = cuda.to_device(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8))
    dst = cuda.zeros(n, np.uint8)
    a = cupy.asarray(src)
    b = cupy.empty_like(a)
    cps = cupy.cuda.ExternalStream(int(stream.handle))

    def timed(fn, iters=30):
        for _ in range(5):
            fn()
        out = []
        for _ in range(iters):
            with cuda.Timer(stream) as t:
                fn()
            out.append(t.ms)
        return statistics.median(out)

    def cupy_copy():
        with cps:
            b[...] = a
    ms_cp = timed(cupy_copy)
    print(f"cupy d2d: {ms_cp:.4f} ms {2 * n / ms_cp / 1e6:.1f} GB/s")
    for threads, lif, bps in ((512, 4, 2), (1024, 4, 2), (512, 8, 2)):
        base = nvptx.emit_ptx(ir.Module("copy16", (build_copy16(threads, lif),)))
        for name, subs in VARIANTS.items():
            ptx = base
            for old, new in subs:
                assert old in ptx, (name, old)
                ptx = ptx.replace(old, new)
            k = cuda.LoadedModule(ptx).kernel("copy16", param_types=["ptr.global", "ptr.global", "u64"])
            grid = bps * cuda.sm_count()
            ms = timed(lambda: k.launch(grid, threads, [dst, src, np.uint64(n // 16)], stream))
            ok = bool((dst.to_host()[:: 1 << 20] == src.to_host()[:: 1 << 20]).all())
            print(f"{threads:4d} thr lif {lif} {bps}/SM {name:28s}: {ms:.4f} ms "
                  f"{2 * n / ms / 1e6:7.1f} GB/s {ms_cp / ms:.3f} of cupy {'ok' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()
