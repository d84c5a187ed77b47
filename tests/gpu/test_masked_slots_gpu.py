"""Masked top-k slots (an id of ``-1``) on the GPU through the torch API: ``ep_check_ids``
passes them (``check()`` raises nothing), dispatch equals ``reference.dispatch`` and combine
equals ``reference.combine`` bit for bit with NaN weights in every masked slot (each call
has masked slots at random positions and a token all ``-1``; the second a rank whose every
slot is ``-1``), split and fused kernels, int64 ids as torch gives them. The numpy worlds'
round trips with masked routings run in the GPU tests that draw from ``routing.EDGE_CASES``
and ``combine_checks.round_trip_inputs``."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing

from test_torch_api_gpu import bf16_tensor, check_combine_on_device
from world_checks import make_cfg

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device", allow_module_level=True)
ept = pytest.importorskip("epgen.torch")

# R, E, H, K, T, threads, sms
SHAPES = {"split": (4, 16, 256, 4, 32, 256, 6), "fused": (2, 8, 256, 4, 32, 256, 6)}


@pytest.mark.parametrize("name", list(SHAPES))
def test_masked_slots_through_the_torch_api(name, seed):
    fused = name == "fused"
    world = epgen.EmulatedWorld(make_cfg(*SHAPES[name]), fused=fused)
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    for call in range(3):
        toks, ids = routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank)
        if call:
            ids[int(rng.integers(cfg.n_ranks))][:] = -1
        w = [rng.random((len(a), K), dtype=np.float32) for a in ids]
        for a, b in zip(w, ids):
            a[b == -1] = np.nan
        w = None if call == 2 else w                    # call 2: the unreduced rows
        outs = ep.dispatch([bf16_tensor(t) for t in toks],
                           [torch.from_numpy(a.astype(np.int64)).cuda() for a in ids],
                           None if w is None else [torch.from_numpy(a).cuda() for a in w])
        ep.check()
        results = [o.to_reference(cfg) for o in outs]
        try:
            reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), results)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} {name} call {call}: {exc}") from None
        ys = [rng.integers(0, 1 << 16, size=(cfg.layout.max_out_rows, H), dtype=np.uint16)
              & np.uint16(0xBFFF) for _ in outs]
        res = [rng.integers(0, 1 << 16, size=(len(a), H), dtype=np.uint16)
               & np.uint16(0xBFFF) for a in ids] if call == 1 else None
        check_combine_on_device(ep, cfg, outs, results, ys, w, res, ids,
                                f"seed {seed} {name} call {call}")
