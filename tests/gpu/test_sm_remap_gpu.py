"""GPU test of the SM-remapping test kernel ``ep_dispatch_sm_remap`` (every SM argument of
the reference methods remapped, ``sm_map.ReversedSubsetSMs``) against the numpy reference,
bit-exact, on the edge cases and back-to-back calls, with and without the shared expert."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.runtime.sm_remap_run import SMRemapRunner

pytestmark = pytest.mark.gpu

# (R, E, H, K, max_tpr, num_threads, n_sms per rank); all ranks' grids must fit on the GPU
CONFIGS = [(2, 32, 2048, 4, 64, 256, 17), (4, 64, 2048, 8, 128, 512, 17)]


def make_cfg(R, E, H, K, T, threads, sms, **flags):
    return epgen.EPConfig(num_threads=threads, n_sms=sms, n_experts=E, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=epgen.BF16Format(hid_dim=H, top_k=K), **flags)


@pytest.mark.parametrize("se", [False, True], ids=["routed", "shared_expert"])
@pytest.mark.parametrize("shape", CONFIGS, ids=["R2-E32", "R4-E64"])
def test_remapped_sms_match_the_reference(shape, se, seed):
    cfg = make_cfg(*shape, fused_shared_expert=se)
    runner = SMRemapRunner(epgen.EmulatedWorld(cfg, fused=True))
    rng = np.random.default_rng(seed)
    for case in ("random", "one_hot_expert", "zero_tokens", "rank_without_tokens", "random"):
        toks, ids = routing.edge_case(rng, cfg, case)
        got = runner.dispatch(toks, ids)
        try:
            reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, {case}: {exc}") from None
