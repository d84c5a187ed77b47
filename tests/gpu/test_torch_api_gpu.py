"""``epgen.torch.EPBuffer`` on the GPU (``EmulatedWorld``): dispatch on torch CUDA tensors
matches ``epgen.reference.dispatch`` (one handle for every rank, one handle per rank, the
fused kernel, a strided and a transposed input, int64 ids from ``torch.topk``, other
libraries' arrays produced on another stream); the call enqueues without synchronising (the
caller's stream is still busy when it returns); dispatch, and dispatch + combine, captured
in ``torch.cuda.graph`` replay fresh inputs correctly (1000 replays, ``ep_prod_reserve``'s
device generation included); the host time of a call is measured."""

from __future__ import annotations

import time

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

_worlds = {}


def _world(name="small", **kw):
    key = (name, tuple(sorted(kw.items())))
    if key not in _worlds:
        shape = {"small": (4, 16, 256, 4, 32, 256, 6), "fused": (2, 8, 256, 4, 32, 256, 6),
                 "final_prod": (4, 16, 256, 4, 32, 256, 6)}
        flags = {"ep_final_layout": True, "ep_prod_reserve": True} \
            if name == "final_prod" else {}
        _worlds[key] = epgen.EmulatedWorld(make_cfg(*shape[name], **flags), **kw)
    return _worlds[key]


def bf16_tensor(bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(
        torch.bfloat16).cuda()


def check_combine_on_device(ep, cfg, outs, results, ys, w, res, ids, label: str):
    """``ep.combine`` of the expert rows ``ys`` (BF16 bits) and the residual ``res`` (or
    None) after the dispatch ``outs`` equals ``reference.combine`` of the dispatch's
    ``results`` bit for bit on every rank; a mismatch names ``label``, the rank and the count."""
    got = ep.combine([bf16_tensor(y) for y in ys], outs,
                     residual=None if res is None else [bf16_tensor(r) for r in res])
    ep.check("combine")
    host = [g.view(torch.int16).cpu().numpy().view(np.uint16) for g in got]
    want = reference.combine(cfg, results, ys, w, residual=res, n_tokens=[len(a) for a in ids])
    for r, (g, e) in enumerate(zip(host, want)):
        assert g.shape == e.shape and np.array_equal(g, e), \
            f"{label} rank {r}: {np.count_nonzero(g != e)} elements differ"


def _inputs(rng, cfg, n_tok=None):
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank if n_tok is None else n_tok)
    return toks, ids, [bf16_tensor(t) for t in toks], \
        [torch.from_numpy(i.astype(np.int64)).cuda() for i in ids]


def _assert(cfg, outs, toks, ids, seed, what=""):
    want = reference.dispatch(cfg, toks, ids)
    got = [o.to_reference(cfg) for o in outs]
    try:
        reference.assert_match(cfg, want, got)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed} {what}: {exc}") from None


def test_one_handle_for_every_rank(seed):
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    assert not ep.on_caller_stream          # the ranks run at once on their own streams
    rng = np.random.default_rng(seed)
    for call in range(4):
        n = None if call < 2 else int(rng.integers(0, cfg.max_tokens_per_rank + 1))
        toks, ids, x, i = _inputs(rng, cfg, n)
        outs = ep.dispatch(x, i)
        ep.check()
        _assert(cfg, outs, toks, ids, seed, f"call {call}")


def test_one_handle_per_rank(seed):
    world = _world()
    cfg = world.cfg
    eps = [ept.EPBuffer(world, rank=r) for r in range(cfg.n_ranks)]
    assert eps[0].on_caller_stream
    callers = [torch.cuda.Stream() for _ in eps]    # one stream per rank, as processes have
    rng = np.random.default_rng(seed)
    for call in range(3):
        toks, ids, x, i = _inputs(rng, cfg)
        outs = []
        for r, (ep, s) in enumerate(zip(eps, callers)):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs.append(ep.dispatch(x[r], i[r]))
        torch.cuda.synchronize()
        eps[0].check()
        _assert(cfg, outs, toks, ids, seed, f"call {call}")


def test_fused_kernel_forks_the_rank_streams(seed):
    world = _world("fused", fused=True)
    cfg, ep = world.cfg, ept.EPBuffer(world)
    assert not ep.on_caller_stream
    rng = np.random.default_rng(seed)
    for call in range(3):
        toks, ids, x, i = _inputs(rng, cfg)
        outs = ep.dispatch(x, i)
        ep.check()
        _assert(cfg, outs, toks, ids, seed, f"call {call}")


def test_strided_and_transposed_inputs(seed):
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    toks, ids, x, i = _inputs(rng, cfg)
    H = cfg.token_fmt.hid_dim
    wide = [torch.cat([t[:, :H], t], dim=1)[:, :H] for t in x]
    tr = [t.t().contiguous().t() for t in x]
    assert not wide[0].is_contiguous() and not tr[0].is_contiguous()
    mixed = [wide[0], tr[1]] + x[2:]
    outs = ep.dispatch(mixed, i)
    ep.check()
    _assert(cfg, outs, toks, ids, seed)


def test_dispatch_does_not_synchronise(seed):
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    toks, ids, x, i = _inputs(rng, cfg)
    ep.dispatch(x, i)           # prepared launches built
    ep.check()
    torch.cuda._sleep(200_000_000)       # ~0.1 s of GPU time on the current stream
    t0 = time.perf_counter()
    outs = ep.dispatch(x, i)
    host = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    ep.check()
    assert busy, "the caller's stream was idle when dispatch returned: it synchronised"
    assert host < 0.05, f"dispatch took {host * 1e3:.1f} ms of host time behind a busy stream"
    _assert(cfg, outs, toks, ids, seed)


@pytest.mark.parametrize("name", ["small", "final_prod"])
def test_captured_dispatch_replays_fresh_inputs(name, seed):
    """1000 replays, each with one of 8 input sets copied into the captured tensors, every
    100th and the last checked against the reference (final_prod: the generation advances
    on the device, so the replays need no host update)."""
    world = _world(name)
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    sets = [_inputs(rng, cfg) for _ in range(8)]
    static_x = [t.clone() for t in sets[0][2]]
    static_i = [t.to(torch.int32).clone() for t in sets[0][3]]
    ep.dispatch(static_x, static_i)       # warm-up outside the capture
    ep.check()
    before = world.prod_generations() if cfg.ep_prod_reserve else None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = ep.dispatch(static_x, static_i)
    for replay in range(1000):
        toks, ids, x, i = sets[replay % len(sets)]
        for s_, t in zip(static_x, x):
            s_.copy_(t)
        for s_, t in zip(static_i, i):
            s_.copy_(t)
        g.replay()
        if replay % 100 == 99 or replay == 0:
            ep.check()
            _assert(cfg, outs, toks, ids, seed, f"{name} replay {replay}")
    if cfg.ep_prod_reserve:
        assert world.prod_generations() == [b + 1000 for b in before]


class _Foreign:
    """Another library's array over a torch tensor's memory: ``__cuda_array_interface__``
    (v3, naming ``stream``) or DLPack (delegated to the tensor)."""

    def __init__(self, t, kind, stream=None):
        self.t = t
        if kind == "cai":
            dt = {torch.bfloat16: "<u2", torch.int32: "<i4", torch.float32: "<f4"}[t.dtype]
            self.__cuda_array_interface__ = {
                "shape": tuple(t.shape), "typestr": dt, "data": (t.data_ptr(), False),
                "version": 3, "strides": None,
                "stream": None if stream is None else int(stream.cuda_stream)}
        else:
            self.__dlpack__ = t.__dlpack__
            self.__dlpack_device__ = t.__dlpack_device__


@pytest.mark.parametrize("kind", ["cai", "dlpack"])
def test_other_libraries_inputs_after_their_producer(kind, seed):
    """Tokens, ids and weights (and combine's expert outputs) as another library's arrays,
    written by a producer on another stream behind ~50 ms of GPU sleep: dispatch and
    combine wait for it (the CUDA-array-interface stream, or DLPack's stream hand-shake)
    and match the reference."""
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    toks, ids, x, i = _inputs(rng, cfg)
    K = cfg.token_fmt.top_k
    w = [rng.random((len(a), K), dtype=np.float32) for a in ids]
    producer = torch.cuda.Stream()
    # the buffers exist before the producer writes them; only the producer's order guards them
    bx = [torch.zeros_like(t) for t in x]
    bi = [torch.zeros(t.shape, dtype=torch.int32, device="cuda") for t in i]
    bw = [torch.zeros((len(a), K), dtype=torch.float32, device="cuda") for a in ids]
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)
        for b, t in zip(bx, x):
            b.copy_(t)
        for b, t in zip(bi, i):
            b.copy_(t)
        for b, a in zip(bw, w):
            b.copy_(torch.from_numpy(a).cuda())
    if kind == "dlpack":        # DLPack orders the producer through torch's current stream
        torch.cuda.current_stream().wait_stream(producer)
    wrap = lambda ts: [_Foreign(t, kind, producer) for t in ts]  # noqa: E731
    outs = ep.dispatch(wrap(bx), wrap(bi), wrap(bw))
    ep.check()
    _assert(cfg, outs, toks, ids, seed, kind)
    results = [o.to_reference(cfg) for o in outs]
    ys = _expert_rows(rng, cfg, outs)
    by = [torch.zeros((len(y), cfg.token_fmt.hid_dim), dtype=torch.bfloat16, device="cuda")
          for y in ys]
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)
        for b, y in zip(by, ys):
            b.copy_(bf16_tensor(y))
    if kind == "dlpack":
        torch.cuda.current_stream().wait_stream(producer)
    got = ep.combine(wrap(by), outs)
    ep.check("combine")
    want = reference.combine(cfg, results, ys, w, n_tokens=[len(a) for a in ids])
    for r, (g, e) in enumerate(zip(got, want)):
        g = g.view(torch.int16).cpu().numpy().view(np.uint16)
        assert np.array_equal(g, e), f"seed {seed} {kind} rank {r}: combine differs"


def test_combine_refuses_a_strided_foreign_array_by_name():
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(0)
    toks, ids, x, i = _inputs(rng, cfg)
    outs = ep.dispatch(x, i, [torch.ones(len(a), cfg.token_fmt.top_k, device="cuda")
                              for a in ids])
    H, M = cfg.token_fmt.hid_dim, cfg.layout.max_out_rows
    wide = torch.zeros((M, 2 * H), dtype=torch.bfloat16, device="cuda")
    strided = _Foreign(wide, "cai")
    strided.__cuda_array_interface__.update(shape=(M, H), strides=(4 * H, 2))
    with pytest.raises(EPInputError, match=r"expert_out\[1\]: must be C-contiguous"):
        ep.combine([outs[0].tokens, strided] + [o.tokens for o in outs[2:]], outs)
    ep.check()


@pytest.mark.parametrize("name", ["small", "final_prod"])
def test_dispatch_and_combine_in_one_torch_graph(name, seed):
    """Dispatch, the identity expert (the delivered rows fed back) and combine in one
    ``torch.cuda.graph``; replays with fresh inputs match the reference combine."""
    world = _world(name)
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    K = cfg.token_fmt.top_k
    sets = [_inputs(rng, cfg) for _ in range(3)]
    weights = [[rng.random((len(a), K), dtype=np.float32) for a in s[1]] for s in sets]
    static_x = [t.clone() for t in sets[0][2]]
    static_i = [t.clone() for t in sets[0][3]]
    static_w = [torch.from_numpy(a).cuda() for a in weights[0]]

    def layer():
        outs = ep.dispatch(static_x, static_i, static_w)
        return outs, ep.combine([o.tokens for o in outs], outs)
    layer()
    ep.check("combine")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs, ys = layer()
    for replay in range(6):
        j = replay % len(sets)
        toks, ids, x, i = sets[j]
        for dst, src in zip(static_x + static_i + static_w,
                            x + i + [torch.from_numpy(a).cuda() for a in weights[j]]):
            dst.copy_(src)
        g.replay()
        ep.check("combine")
        _assert(cfg, outs, toks, ids, seed, f"{name} replay {replay}")
        results = [o.to_reference(cfg) for o in outs]
        want = reference.combine(cfg, results, [r.out_tokens for r in results], weights[j],
                                 n_tokens=[len(a) for a in ids])
        for r, (got, e) in enumerate(zip(ys, want)):
            got = got.view(torch.int16).cpu().numpy().view(np.uint16)
            assert np.array_equal(got, e), f"seed {seed} {name} replay {replay} rank {r}"


@pytest.mark.parametrize("kind", ["past_the_experts", "negative", "repeated", "huge_int64"])
def test_bad_ids_are_reported_by_the_device_and_dropped(kind, seed):
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    toks, ids, x, i = _inputs(rng, cfg)
    t, k = int(rng.integers(0, cfg.max_tokens_per_rank)), int(rng.integers(1, cfg.token_fmt.top_k))
    bad = i[2].clone()
    bad[t, k] = {"past_the_experts": cfg.n_experts, "negative": -3, "huge_int64": 1 << 40,
                 "repeated": int(i[2][t, 0])}[kind]
    ep.dispatch(x, i[:2] + [bad] + i[3:])
    with pytest.raises(EPInputError, match=rf"rank 2 token {t} slot {k}: id"):
        ep.check()
    outs = ep.dispatch(x, i)       # the next call is clean
    ep.check()
    _assert(cfg, outs, toks, ids, seed, "after the bad call")


def test_host_time_per_call(seed):
    world = _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    toks, ids, x, i = _inputs(rng, cfg)
    i32 = [t.to(torch.int32) for t in i]
    for _ in range(20):
        ep.dispatch(x, i32)
    ep.check()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        ep.dispatch(x, i32)
    per_rank = (time.perf_counter() - t0) / n / cfg.n_ranks * 1e6
    ep.check()
    print(f"epgen.torch dispatch: {per_rank:.1f} us of host time per call per rank")
    assert per_rank < 200, f"{per_rank:.1f} us per call per rank"


def _expert_rows(rng, cfg, outs):
    """Random BF16 expert outputs (finite values) for every rank: one per row of its
    ``out.tokens`` (``max_out_rows``, what the torch combine takes), the delivered rows and
    those past them."""
    shape = (cfg.layout.max_out_rows, cfg.token_fmt.hid_dim)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF)
            for _ in outs]


@pytest.mark.parametrize("fused", [False, True])
def test_dispatch_then_combine_on_device(fused, seed):
    world = _world("fused", fused=True) if fused else _world()
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    for call in range(3):
        toks, ids, x, i = _inputs(rng, cfg)
        w = [rng.random((len(a), cfg.token_fmt.top_k), dtype=np.float32) for a in ids] \
            if call < 2 else None                       # call 2: the unreduced rows
        outs = ep.dispatch(x, i, None if w is None else [torch.from_numpy(a).cuda() for a in w])
        results = [o.to_reference(cfg) for o in outs]      # before combine reads them
        ys = _expert_rows(rng, cfg, outs)
        res = [rng.integers(0, 1 << 16, size=(len(a), cfg.token_fmt.hid_dim), dtype=np.uint16)
               & np.uint16(0xBFFF) for a in ids] if call == 1 else None
        check_combine_on_device(ep, cfg, outs, results, ys, w, res, ids,
                                f"seed {seed} call {call}")


def test_p2p_world_rank_on_its_gpu(seed):
    """``EPBuffer`` of a ``P2PWorld`` (here its one rank on the one GPU: the rank's own
    stream and memory pool): dispatch and combine match the reference."""
    world = epgen.P2PWorld(make_cfg(1, 4, 256, 4, 32, 256, 6))
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    toks, ids, x, i = _inputs(rng, cfg)
    w = [rng.random((len(a), cfg.token_fmt.top_k), dtype=np.float32) for a in ids]
    out = ep.dispatch(x[0], i[0], torch.from_numpy(w[0]).cuda())
    ep.check()
    _assert(cfg, [out], toks, ids, seed, "P2PWorld")
    results = [out.to_reference(cfg)]
    ys = _expert_rows(rng, cfg, [out])
    y = ep.combine(bf16_tensor(ys[0]), out)
    ep.check("combine")
    want = reference.combine(cfg, results, ys, w, n_tokens=[len(ids[0])])[0]
    assert np.array_equal(y.view(torch.int16).cpu().numpy().view(np.uint16), want), \
        f"seed {seed}: combine differs"
