"""The default deadline of the bounded waits on the GPU is the documented 2 s: a rank whose
peer never runs gives up after 2 s (each record's ``elapsed_ns`` just past 2e9, the call
returning within seconds), through the numpy API and through ``epgen.torch.EPBuffer``
(which the CPU simulator cannot run; tests/sim/test_sim_deadline.py pins the value every world
passes on the simulator). A default of 0 (unbounded) or 1000 times too large hangs: the
per-test limit below turns that into a failure with this test's name."""

from __future__ import annotations

import time

import numpy as np
import pytest

import epgen
from epgen import routing

from world_checks import make_cfg, run_only

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

#: the documented default deadline (``EPConfig.timeout_ns``, docs/design.md)
DEFAULT_TIMEOUT_NS = 2_000_000_000
#: how far past the deadline a wait may notice it (its polls, the %globaltimer resolution)
SLACK_NS = 500_000_000


def _cfg():
    return make_cfg(2, 4, 256, 2, 8, 256, 4)


def _assert_expired_at_the_default(records, elapsed_s: float) -> None:
    assert records, "no wait recorded an expiry"
    for rec in records:
        assert DEFAULT_TIMEOUT_NS < rec.elapsed_ns < DEFAULT_TIMEOUT_NS + SLACK_NS, str(rec)
    assert DEFAULT_TIMEOUT_NS / 1e9 <= elapsed_s < 20, f"the call took {elapsed_s:.1f} s"


def test_numpy_world_waits_expire_after_the_default_deadline(seed):
    world = epgen.EmulatedWorld(_cfg())
    rng = np.random.default_rng(seed)
    world.load_inputs(*routing.routing(rng, world.cfg, world.cfg.max_tokens_per_rank))
    t0 = time.monotonic()
    err = run_only(world, {0})
    _assert_expired_at_the_default(err.records, time.monotonic() - t0)


def test_epbuffer_waits_expire_after_the_default_deadline(seed):
    """Only rank 0's handle is called: its receive waits for rank 1's sends, never made."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from epgen.torch import EPBuffer

    world = epgen.EmulatedWorld(_cfg())
    ep0 = EPBuffer(world, rank=0)
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, world.cfg, world.cfg.max_tokens_per_rank)
    x = torch.from_numpy(np.ascontiguousarray(toks[0]).view(np.int16)).view(
        torch.bfloat16).cuda()
    i = torch.from_numpy(ids[0].astype(np.int64)).cuda()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    ep0.dispatch(x, i)
    with pytest.raises(epgen.EPTimeoutError) as info:
        ep0.check()
    _assert_expired_at_the_default(info.value.records, time.monotonic() - t0)
