"""``epgen bench --op combine --combine-fp8`` measured for real on the simulator with only the
event timing replaced: the BF16 and the FP8 combine both timed on one world, every FP8 sample
ran the FP8 kernels, both checked against the reference before and after the timing, and an
FP8 combine that did not run fails its check."""

from __future__ import annotations

import epgen
import pytest

from epgen.bench import combine, inputs
from epgen.formats import make_format
from epgen.runtime.world import EmulatedWorld


def _cfg():
    return epgen.EPConfig(num_threads=64, n_sms=4, n_experts=4, n_ranks=2,
                          max_tokens_per_rank=4, p2p_world_size=2, use_shmem=False,
                          token_fmt=make_format("BF16", 128, 2))


def _measure(cfg, seed, timer):
    T = cfg.max_tokens_per_rank
    sets = inputs.make_input_sets(cfg, T, 2, seed=seed)
    w = combine.weights(cfg, T, seed)
    worlds = []

    def factory():
        worlds.append(EmulatedWorld(cfg, backend="sim", sim_seed=seed))
        return worlds[0]
    res = combine.measure_world(cfg, sets, w, 3, 1, None, op="combine", world_factory=factory,
                                timer=timer, progress=lambda m: None, combine_fp8=True)
    return res, worlds[0]


def test_both_combines_timed_and_checked(seed):
    calls = []

    def fake_timer(ts, streams, gate, body):
        body()
        calls.append(1)
        return 0.25, False
    res, world = _measure(_cfg(), seed, fake_timer)
    assert res["check"] == res["post_check"] == res["post_check_fp8"] == "ok", f"seed {seed}"
    assert res["combine"]["n"] == res["combine_fp8"]["n"] == 3
    assert len(calls) == 2 * (3 + 1)                 # warm-up + iterations, each combine
    fp8 = world.combiner().fp8_side.program.loaded.launched
    assert sum(1 for k, *_ in fp8 if k == "ep_combine_async_fp8") >= 2 * 4


def test_an_fp8_combine_that_did_not_run_fails_the_check(seed):
    timed = []

    def fp8_skipped(ts, streams, gate, body):
        if len(timed) < 4:            # the BF16 samples run; the FP8 ones enqueue nothing
            body()
        timed.append(1)
        return 0.25, False
    with pytest.raises(AssertionError, match="fp8.*combine differs from the reference"):
        _measure(_cfg(), seed, fp8_skipped)
