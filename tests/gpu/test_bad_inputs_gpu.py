"""Bad inputs to ``epgen.torch.EPBuffer.combine`` on the GPU: the delivered row count stays
on the device (the torch API reads no device data), so expert outputs must have one row per
row of ``out.tokens`` (``max_out_rows``); outputs of only the delivered rows (what a host
read of ``row_offsets[-1]`` gives) are refused by name, and so are a ``DispatchOutput``
no dispatch filled and one of an earlier dispatch; nothing is enqueued for a refused call,
and the next combine matches ``reference.combine``."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.errors import EPInputError

from world_checks import make_cfg

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device", allow_module_level=True)
ept = pytest.importorskip("epgen.torch")


def _tensor(bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(
        torch.bfloat16).cuda()


def _buffer():
    return ept.EPBuffer(epgen.EmulatedWorld(make_cfg(4, 16, 256, 4, 32, 256, 6)))


def _dispatch(rng, ep, n_tok):
    cfg = ep.cfg
    toks, ids = routing.routing(rng, cfg, n_tok)
    w = [rng.random((len(a), cfg.token_fmt.top_k), dtype=np.float32) for a in ids]
    outs = ep.dispatch([_tensor(t) for t in toks],
                       [torch.from_numpy(a.astype(np.int64)).cuda() for a in ids],
                       [torch.from_numpy(a).cuda() for a in w])
    ep.check()
    return outs, w


def _rows(rng, cfg, n_outs):
    shape = (cfg.layout.max_out_rows, cfg.token_fmt.hid_dim)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF)
            for _ in range(n_outs)]


def _assert_combine_matches(ep, outs, w, ys, seed, what):
    cfg = ep.cfg
    results = [o.to_reference(cfg) for o in outs]
    got = ep.combine([_tensor(y) for y in ys], outs)
    ep.check("combine")
    want = reference.combine(cfg, results, ys, w)
    for r, (g, e) in enumerate(zip(got, want)):
        g = g.view(torch.int16).cpu().numpy().view(np.uint16)
        assert np.array_equal(g, e), f"seed {seed} {what}: rank {r} combine differs"


def test_expert_outputs_of_the_delivered_rows_only_are_refused(seed):
    ep = _buffer()
    cfg = ep.cfg
    M, H = cfg.layout.max_out_rows, cfg.token_fmt.hid_dim
    rng = np.random.default_rng(seed)
    outs, w = _dispatch(rng, ep, cfg.max_tokens_per_rank)
    ys = _rows(rng, cfg, len(outs))
    n = [int(o.row_offsets[-1].item()) for o in outs]
    assert n[0] < M, f"seed {seed}: rank 0 received max_out_rows rows"
    with pytest.raises(EPInputError, match=(
            rf"expert_out\[0\]: shape \({n[0]}, {H}\), must be \[max_out_rows={M}, "
            rf"hid_dim={H}\] \(one row per row of out.tokens")):
        ep.combine([_tensor(y[:k]) for y, k in zip(ys, n)], outs)
    _assert_combine_matches(ep, outs, w, ys, seed, "after the refusal")


def test_a_dispatch_output_no_dispatch_filled_or_an_earlier_one_is_refused(seed):
    ep = _buffer()
    cfg = ep.cfg
    rng = np.random.default_rng(seed)
    ys = _rows(rng, cfg, cfg.n_ranks)
    with pytest.raises(RuntimeError, match=r"out\[0\]: no dispatch has filled it: call "
                                           r"dispatch first"):
        ep.combine([_tensor(y) for y in ys], ep.outputs)
    old = [o.clone() for o in _dispatch(rng, ep, 8)[0]]
    outs, w = _dispatch(rng, ep, 5)
    with pytest.raises(EPInputError, match=r"out\[0\]: from an earlier dispatch \(8 tokens; "
                                           r"rank 0's last dispatch had 5\)"):
        ep.combine([_tensor(y) for y in ys], old)
    _assert_combine_matches(ep, outs, w, ys, seed, "after the refusals")
