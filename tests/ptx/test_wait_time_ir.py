"""``Tuning.wait_times`` (epgen.kernels.wait_time) in the IR, CHECK-style: in dispatch_wait
(and the fused ``ep_dispatch``) and in every combine_wait (BF16, FP8, the fused ``ep_combine``)
(the capacity-strided final layout, as the DeepEP API builds it, and the staged one) each
waiting thread reads ``%globaltimer`` before its bounded wait for another rank's word,
again after it, and stores the difference into ``wait_time[thread]``, in that order; without
the knob no kernel takes ``wait_time`` or reads the timer outside its waits."""

from __future__ import annotations

import re

import pytest

import ir
from epgen.kernels import build_combine_fp8_module, build_combine_module, build_module
from epgen.presets import load_preset

#: kernel -> the buffer name of the wait it times
TIMED = {"ep_dispatch_wait": "recv_count", "staged/ep_dispatch_wait": "recv_count",
         "staged/ep_dispatch": "recv_count",
         "ep_combine_wait": "combine_arrival", "ep_combine_wait_fp8": "combine_arrival",
         "ep_combine": "combine_arrival", "ep_combine_fp8": "combine_arrival"}


def _cfg(on: bool):
    cfg = load_preset("small")
    return cfg.replace(ep_final_layout=True, tuning=cfg.tuning.replace(wait_times=on))


def _kernels(cfg):
    from epgen.kernels import build_combine_fused
    from epgen.kernels.combine_fp8 import Fp8Wire
    mods = [build_module(cfg), build_combine_module(cfg), build_combine_fp8_module(cfg),
            ir.Module("fused", (build_combine_fused(cfg), build_combine_fused(cfg, Fp8Wire(cfg))))]
    out = {k.name: ir.printer.print_kernel(k) for m in mods for k in m.kernels}
    staged = build_module(cfg.replace(ep_final_layout=False))    # with the fused ep_dispatch
    out.update({f"staged/{k.name}": ir.printer.print_kernel(k) for k in staged.kernels})
    return out


def _line(lines, pattern, start, what):
    for i in range(start, len(lines)):
        if re.search(pattern, lines[i]):
            return i
    pytest.fail(f"{what}: no line matching {pattern!r} after line {start}")


@pytest.mark.parametrize("name", sorted(TIMED))
def test_each_timed_wait_is_bracketed_by_the_timer_and_stored(name):
    text = _kernels(_cfg(True))[name]
    lines = text.splitlines()
    assert re.search(r"param \$wait_time:ptr\.global", text), name
    t0 = _line(lines, r"%(\w+)_t0:u64 = @globaltimer", 0, name)
    clock = re.search(r"%(\w+)_t0:u64", lines[t0]).group(1)
    wait = _line(lines, rf"spin_wait\..* buffer={TIMED[name]} ", t0 + 1, name)
    t1 = _line(lines, rf"%{clock}_t1:u64 = @globaltimer", wait + 1, name)
    spent = _line(lines, rf"%{clock}_ns = sub\(%{clock}_t1, %{clock}_t0\)", t1 + 1, name)
    _line(lines, rf"st\.global \[ptradd\(\$wait_time, mul\(cvt\.u64\(@tid\.x\), 8:u64\)\)\], "
                 rf"%{clock}_ns", spent + 1, name)
    # nothing else runs between the timer reads but the wait (and its result's moves)
    between = [ln for ln in lines[t0 + 1:t1] if "spin_wait" in ln]
    assert len(between) == 1, between


def test_without_the_knob_no_kernel_takes_or_reads_it():
    for name, text in _kernels(_cfg(False)).items():
        assert "wait_time" not in text, name
        assert "@globaltimer" not in text, name
