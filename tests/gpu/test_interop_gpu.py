"""Device inputs of the numpy world API on the GPU (``EmulatedWorld``, 2 ranks): torch CUDA
BF16 tensors that are strided views (``x[:, :H]`` of a wider tensor) dispatch as their values;
a transposed view is refused by name and writes nothing; top-k ids as a CUDA tensor and BF16
bits as a CuPy array are accepted; a tensor produced on another torch stream is read after
its producer."""

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

_world = {}


def _get():
    if "w" not in _world:
        _world["w"] = epgen.EmulatedWorld(make_cfg(2, 8, 256, 4, 32, 256, 6))
    return _world["w"]


def _bits_to_torch(t, pad=0):
    """BF16 bits ``[T, H]`` as a CUDA bf16 tensor, inside a wider one when ``pad``."""
    base = torch.from_numpy(np.ascontiguousarray(t).view(np.int16)).view(torch.bfloat16).cuda()
    if not pad:
        return base
    wide = torch.zeros((t.shape[0], t.shape[1] + pad), dtype=torch.bfloat16, device="cuda")
    wide[:, pad // 2:pad // 2 + t.shape[1]] = base
    return wide[:, pad // 2:pad // 2 + t.shape[1]]


def test_strided_cuda_views_and_cuda_ids(seed):
    world = _get()
    cfg = world.cfg
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    x = [_bits_to_torch(t, pad=40) for t in toks]
    assert not x[0].is_contiguous()
    got = world.dispatch(x, [torch.from_numpy(i.astype(np.int32)).cuda() for i in ids])
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)


def test_transposed_view_is_refused_and_nothing_is_written(seed):
    world = _get()
    cfg = world.cfg
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    world.dispatch(toks, ids)
    before = [rk.tokens.to_host().copy() for rk in world.ranks]
    t1 = _bits_to_torch(np.ascontiguousarray(toks[1].T)).t()      # [T, H], transposed view
    assert t1.shape == (cfg.max_tokens_per_rank, cfg.token_fmt.hid_dim)
    new = [_bits_to_torch(toks[0][::-1].copy()), t1]
    with pytest.raises(EPInputError, match=r"tokens\[1\].*contiguous"):
        world.dispatch(new, ids)
    for rk, b in zip(world.ranks, before):
        assert np.array_equal(rk.tokens.to_host(), b), f"seed {seed}: rank {rk.rank} written"


def test_producer_on_another_stream_is_waited_for(seed):
    world = _get()
    cfg = world.cfg
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    side = torch.cuda.Stream()
    src = [_bits_to_torch(t) for t in toks]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)              # the copy below lands late
        x = [s.clone() for s in src]
    with torch.cuda.stream(side):
        got = world.dispatch(x, ids)
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)


def test_cupy_bf16_bits(seed):
    cp = pytest.importorskip("cupy")
    world = _get()
    cfg = world.cfg
    rng = np.random.default_rng(seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    got = world.dispatch([cp.asarray(t) for t in toks], [cp.asarray(i) for i in ids])
    reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), got)
