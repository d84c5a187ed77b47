"""Bandwidth of the IR ``copy16`` demo kernel against a device-to-device copy through CuPy,
measured in the same run (median of CUDA-event timings after warm-up).

    PYTHONPATH=. python3 benchmarks/copy_bandwidth.py [--mib 1024] [--iters 50]

Bandwidth counts bytes read plus bytes written (2 x size), the usual copy convention.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def time_ms(stream, fn, iters: int, warmup: int = 20):
    return time_interleaved(stream, [fn], iters, warmup)[0]


def time_interleaved(stream, fns, iters: int, warmup: int = 20):
    """Median ms of each of ``fns``, timed round-robin (A, B, A, B ...) with CUDA events, so
    clock and thermal drift during the run affect every candidate alike."""
    from backends import cuda
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, out in zip(fns, times):
            with cuda.Timer(stream) as t:
                fn()
            out.append(t.ms)
    return [statistics.median(t) for t in times]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="buffer size in MiB")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--blocks-per-sm", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sweep", action="store_true",
                    help="also time copy16 over block sizes, loads in flight and blocks per SM")
    args = ap.parse_args(argv)

    import cupy
    from backends import cuda
    from epgen.runtime.demo_runs import DemoRunner

    n = args.mib << 20
    runner = DemoRunner()
    stream = cuda.create_stream()
    src = cuda.to_device(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8))
    dst = cuda.zeros(n, np.uint8)
    blocks = args.blocks_per_sm * cuda.sm_count()
    cp_stream = cupy.cuda.ExternalStream(int(stream.handle))
    a = cupy.asarray(src)
    b = cupy.empty_like(a)

    def cupy_copy():
        with cp_stream:
            b[...] = a
    ms_cp, ms_ir = time_interleaved(
        stream, [cupy_copy, lambda: runner.copy16(dst, src, n, stream, blocks)], args.iters)
    assert (dst.to_host() == src.to_host()).all(), "copy16 result differs"
    gbs = lambda ms: 2 * n / ms / 1e6  # noqa: E731
    sweep = []
    if args.sweep:
        import ir
        from epgen.demos import build_copy16
        from epgen.runtime.program import Program
        combos = [(t, lif, bps, ir.CacheHint.NC) for t in (512, 1024) for lif in (4, 8)
                  for bps in (1, 2, 4) if t * bps <= 2048]
        progs = {}
        for threads, lif, bps, cache in combos:
            key = (threads, lif, cache)
            if key not in progs:
                progs[key] = Program(ir.Module("copy16", (build_copy16(threads, lif, cache),)))
            prog, blk = progs[key], bps * cuda.sm_count()
            args_ = {"dst": dst, "src": src, "n_vec": n // 16}
            ms_c, ms = time_interleaved(
                stream, [cupy_copy, lambda: prog.launch("copy16", blk, args_, stream)],
                args.iters)
            sweep.append({"threads": threads, "loads_in_flight": lif, "cache": cache.value,
                          "blocks_per_sm": bps, "ms": ms, "cupy_ms": ms_c,
                          "fraction": ms_c / ms})
            print(f"sweep threads={threads:4d} lif={lif} blocks/SM={bps} {cache.value:12s}: "
                  f"{ms:.4f} ms {gbs(ms):7.1f} GB/s {ms_c / ms:.3f} of cupy (interleaved)")
    res = {"bytes": n, "copy16_ms": ms_ir, "cupy_ms": ms_cp, "copy16_GBps": gbs(ms_ir),
           "cupy_GBps": gbs(ms_cp), "fraction": ms_cp / ms_ir, "sweep": sweep}
    print(f"{'kernel':<10} {'median ms':>10} {'GB/s':>9}")
    print(f"{'copy16':<10} {ms_ir:>10.4f} {gbs(ms_ir):>9.1f}")
    print(f"{'cupy d2d':<10} {ms_cp:>10.4f} {gbs(ms_cp):>9.1f}")
    print(f"copy16 / cupy bandwidth = {res['fraction']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
