#!/usr/bin/env python3
"""The ``epgen run`` calls that ``benchmarks/gpu_session.sh sanitizer`` runs under each
compute-sanitizer tool: one line per run, ``NAME ARGS...``.

Every named single-GPU variant of ``epgen variants`` (``epgen.ep_goldens``): the ``small``
preset in each token format, each flag variant (``FLAG_VARIANTS``), the fused single launch,
the fused shared expert, the batched launch and a CUDA-graph replay; each with
``--combine`` where the combine kernels build for it (``epgen.variants.combine_error``).
The SHMEM variants are left out (one process per PE, under ``epgen launch``). Every run is
one call (``--calls 1``) of the small preset, with bounded waits of 60 s instead of 2 s (a
sanitizer slows kernels down by tens of times; a wait that expires is still a failure).

``--slow``: the subset for the slower tools (racecheck, initcheck, synccheck): BF16 with
combine, NVFP4 with combine, the final layout with prod reserve, and the fused launch, which
between them run every kernel role and both quantising paths (payload and scales).
"""

from __future__ import annotations

import argparse
import sys

COMMON = ("--preset", "small", "--calls", "1", "--seed", "1", "--set", "timeout_ns=60000000000")

#: the runs of the slower tools (module docstring)
SLOW = ("small", "nvfp4", "final_layout_prod_reserve", "fused")


def _text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def runs() -> list[tuple[str, list[str]]]:
    """``(name, epgen run arguments)`` of every run (module docstring)."""
    from epgen import presets, variants
    from epgen.ep_goldens import FLAG_VARIANTS, GOLDEN_FORMATS

    def sets(changes: dict) -> list[str]:
        return [a for k, v in changes.items() for a in ("--set", f"{k}={_text(v)}")]

    plan: list[tuple[str, dict, list[str]]] = [("small", {}, [])]
    plan += [(suffix, {"format": fmt}, []) for _preset, suffix, fmt in GOLDEN_FORMATS]
    plan += [(name, dict(changes), []) for name, (preset, changes) in FLAG_VARIANTS.items()
             if preset == "small"]
    plan += [("fused", {}, ["--fused"]), ("fused_se", {"fused_shared_expert": True}, []),
             ("batched", {}, ["--batched"]), ("graph", {}, ["--graph"])]
    out = []
    for name, changes, extra in plan:
        cfg = presets.config_from_dict(presets.with_overrides(presets.preset_data("small"),
                                                              changes))
        combine = ["--combine"] if variants.combine_error(cfg) is None else []
        out.append((name, [*COMMON, *sets(changes), *extra, *combine]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", action="store_true", help="only the slower tools' subset")
    args = ap.parse_args(argv)
    for name, run_args in runs():
        if not args.slow or name in SLOW:
            print(name, *run_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
