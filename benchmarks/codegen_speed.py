"""Code-generation speed (targets: under 1 s, goldens under 60 s; docs/PERF.md): generating and assembling the default preset, and
regenerating every golden variant. Runs on the CPU (no GPU needed).

    PYTHONPATH=. python3 benchmarks/codegen_speed.py
"""

from __future__ import annotations

import statistics
import time


def main():
    import epgen
    from backends.nvptx import assemble, emit_ptx
    from epgen import goldens
    from epgen.presets import load_preset

    cfg = load_preset("default")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assemble(emit_ptx(epgen.build_module(cfg)))
        times.append(time.perf_counter() - t0)
    print(f"default preset, IR build + PTX + ptxas: median {statistics.median(times):.3f} s "
          f"(5 runs, min {min(times):.3f} s)")

    goldens.load_all()
    t0 = time.perf_counter()
    for name in goldens.names():
        out = goldens.golden_outputs(name)
        assemble(out["ptx"])
    dt = time.perf_counter() - t0
    print(f"all {len(goldens.names())} golden variants, IR text + PTX + ptxas: {dt:.2f} s")


if __name__ == "__main__":
    main()
