"""How fast can one H200 read a token once and write it to K rows? The send half of the
dispatch round trip without its protocol (no slot atomics, no monitors, no counters): the
ceiling the warp send path (``send_warp.warp_broadcast_tokens``) can reach.

    PYTHONPATH=. python3 benchmarks/experiments/broadcast_bw.py [--tokens 32768] [--json F]

The kernel is the warp send path's data movement exactly: warp ``w`` takes tokens ``w, w +
n_warps, ...``; lanes ``k < K`` load row ``rows[t, k]`` and the addresses reach every lane by
``shfl``; then ``BF16Format.emit_broadcast_token`` (4 loads in flight, ``K`` stores each).
``--format NVFP4`` (or ``BlockwiseFP8``, ``MXFP8``) times a quantising format's broadcast
instead (its ``emit_broadcast_token``: quantise once, store payload and scales ``K`` times)
with 1 or 2 items loaded per trip, at 512 and 1024 threads per block. ``--unroll-sweep`` times the loads in flight per lane (the kernel asks for the residency
its grid needs, ``.minnctapersm``, as the world does). Bytes: each token read once, each of its ``K`` rows written once. Every case is timed
interleaved with a CuPy device-to-device copy of 1 GiB (median of CUDA-event timings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H = 7168
ROW = 2 * H


def build_broadcast(threads: int, k: int, unroll: int = 4, fmt_name: str = "BF16"):
    """The kernel ``bcast``: BF16 rows copied, or a quantising format's payload and scales
    (``fmt_name``; rows ``fmt.token_size`` bytes apart, ``unroll`` items in flight)."""
    import ir
    from ir import CacheHint, ShflMode
    from ir import types as T
    from epgen.formats import make_format

    fmt = make_format(fmt_name, H, k)
    out_row = out_row_bytes(fmt_name)
    kb = ir.KernelBuilder("bcast", threads)
    src = kb.param("src", T.ptr_global)
    rows = kb.param("rows", T.ptr_global)
    dst = kb.param("dst", T.ptr_global)
    n_tokens = kb.param("n_tokens", T.u32)
    with kb.role("all") as r:
        warps = threads // 32
        first = r.let("first", r.block * warps + r.warp)
        with r.for_range("t", first, n_tokens, r.n_blocks * warps) as t:
            addr = r.var("addr", T.u64, ir.Const(0, T.u64))
            with r.if_(r.lane < k):
                row = r.load(rows + (t * k + r.lane).cast(T.u64) * 4, T.u32,
                             cache=CacheHint.NC, name="row")
                r.assign(addr, ir.Cast(T.u64, dst + row.cast(T.u64) * out_row))
            dsts = [r.shfl(ShflMode.IDX, addr, j, name=f"d{j}") for j in range(k)]
            fmt.emit_broadcast_token(r, src + t.cast(T.u64) * ROW, dsts, unroll=unroll)
    return kb.build()


def out_row_bytes(fmt_name: str) -> int:
    """Bytes of one written row: the bf16 token, or a format's payload plus scales."""
    from epgen.formats import make_format
    return ROW if fmt_name == "BF16" else make_format(fmt_name, H, 8).token_size


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768, help="tokens (8 ranks x 4096)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--unroll-sweep", action="store_true",
                    help="K=8 only: loads in flight per lane 2, 4, 7, 8")
    ap.add_argument("--format", action="append", default=[],
                    help="a quantising format (BlockwiseFP8, NVFP4, MXFP8; repeatable): K=8, "
                         "1 or 2 items per trip; the token quantised once and "
                         "stored K times (emit_broadcast_token)")
    args = ap.parse_args(argv)

    import attrs
    import cupy

    import ir
    from backends import cuda
    from benchmarks.copy_bandwidth import time_interleaved
    from epgen.runtime.program import Program

    rng = np.random.default_rng(0)
    t = args.tokens
    stream = cuda.create_stream()
    cp_stream = cupy.cuda.ExternalStream(int(stream.handle))
    a = cupy.zeros(1 << 30, dtype=cupy.uint8)
    b = cupy.empty_like(a)

    def cupy_copy():
        with cp_stream:
            b[...] = a

    src = cuda.to_device(rng.integers(0, 1 << 16, t * H, dtype=np.uint16))
    dst = cuda.zeros(t * 8 * ROW, np.uint8)
    sms = cuda.sm_count()
    results = []
    progs = {}
    layouts = {
        "permuted": lambda k: rng.permutation(t * k).astype(np.uint32),
        "sequential": lambda k: np.arange(t * k, dtype=np.uint32),
    }
    cases = [(k, lay, threads, blocks, 4)
             for k in (8, 1) for lay in layouts
             for threads, blocks in ((512, 136), (512, 2 * sms), (1024, sms), (256, 4 * sms))]
    if args.unroll_sweep:
        cases = [(8, "permuted", threads, blocks, u) for u in (2, 4, 7, 8)
                 for threads, blocks in ((512, 2 * sms), (1024, sms))]
    cases = [c + ("BF16",) for c in cases]
    if args.format:
        cases = [(8, "permuted", threads, blocks, u, f) for f in args.format
                 for threads, blocks in ((512, 2 * sms), (1024, sms)) for u in (1, 2)]
    for k, lay, threads, blocks, unroll, fmt_name in cases:
        key = (threads, k, unroll, fmt_name)
        if key not in progs:
            kern = attrs.evolve(build_broadcast(threads, k, unroll, fmt_name),
                                min_blocks_per_sm=-(-blocks // sms))
            progs[key] = Program(ir.Module("bcast", (kern,)))
        rows = cuda.to_device(layouts[lay](k))
        prog = progs[key]
        kargs = {"src": src, "rows": rows, "dst": dst, "n_tokens": t}
        if any(prm.name == "input_scale" for prm in prog.module.kernels[0].params):
            kargs["input_scale"] = np.float32(1.0)
        ms_c, ms = time_interleaved(
            stream, [cupy_copy, lambda: prog.launch("bcast", blocks, kargs, stream)],
            args.iters, warmup=5)
        nbytes = t * (ROW + k * out_row_bytes(fmt_name))
        copy_gbs = 2 * (1 << 30) / ms_c / 1e6
        res = {"format": fmt_name, "k": k, "rows": lay, "threads": threads, "blocks": blocks,
               "unroll": unroll, "ms": ms,
               "gbps": nbytes / ms / 1e6, "copy_gbps": copy_gbs,
               "fraction_of_copy": nbytes / ms / 1e6 / copy_gbs}
        results.append(res)
        print(f"{fmt_name} K={k} rows={lay:10s} {threads:4d} threads x {blocks:3d} blocks, "
              f"{unroll} in flight: {ms:8.3f} ms "
              f"{res['gbps']:7.1f} GB/s = {res['fraction_of_copy']:.3f} of copy "
              f"({copy_gbs:.0f} GB/s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
