"""Helpers of the combine tests (simulator and GPU): expert outputs, weights and the
corrupted-``src_info`` check."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing
from epgen.errors import EPInputError
from epgen.reference_combine import source_of_rows
from epgen.runtime import combine as combine_mod


def expert_outputs(rng, cfg, results):
    """Per destination, one random BF16 row per received row (bit 14 cleared: finite, below
    2 in magnitude, every sign and mantissa; the products and sums round at every step)."""
    H = cfg.token_fmt.hid_dim
    ys = []
    for res in results:
        n = len(res.src_info)
        rnd = rng.integers(0, 1 << 16, size=(n, H), dtype=np.uint16) & np.uint16(0xBFFF)
        ys.append(rnd)
    return ys


def weights(rng, cfg, ids):
    """Per source, random router weights ``[T, K]``, NaN in every masked slot (id ``-1``):
    combine must skip such a slot, not multiply it by zero."""
    ws = [rng.standard_normal((len(i), cfg.token_fmt.top_k)).astype(np.float32) for i in ids]
    for w, i in zip(ws, ids):
        w[np.asarray(i) == -1] = np.nan
    return ws


def bounds_edges(cfg, t: int, k: int) -> list[tuple[int, int]]:
    """The four out-of-range values of a row's ``(t, k)`` around its real ``(t, k)``:
    ``t = -1``, ``t = max_tokens_per_rank``, ``k = -1``, ``k = top_k``."""
    return [(-1, k), (cfg.max_tokens_per_rank, k), (t, -1), (t, cfg.token_fmt.top_k)]


def corrupted_row_check(world, rng, d: int = 1, edges: bool = False):
    """Corrupt rows of destination ``d``'s ``src_info`` between dispatch and combine: one
    row's token set to ``max_tokens_per_rank``, or with ``edges`` four rows, each with one
    of ``bounds_edges`` (``t = -1``, ``t = max_tokens_per_rank``, ``k = -1``, ``k = K``).
    The error names every one of them (each was recorded), no other slot and no guard byte
    of any rank's combine receive buffer (pre-filled with 0xA5) is written, every valid row
    lands, and the next call is exact. Returns the error's text and the corrupted rows."""
    cfg = world.cfg
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = world.dispatch(toks, ids)
    ys = expert_outputs(rng, cfg, results)
    world.combine(ys, None)              # builds the buffers
    res = results[d]
    n_bad = 4 if edges else 1
    sent = np.nonzero(source_of_rows(res) >= 0)[0]       # rows combine_async reads
    rows = [int(r) for r in rng.choice(sent, size=n_bad, replace=False)]
    bad = res.src_info.copy()
    for i, row in enumerate(rows):
        t, k = (int(v) for v in res.src_info[row])
        bad[row] = bounds_edges(cfg, t, k)[i] if edges else (cfg.max_tokens_per_rank, 0)
    comb = world._combiner
    pattern = np.full(comb.bufs[0].recv_bytes + combine_mod.GUARD_BYTES, 0xA5, np.uint8)
    for b in comb.bufs:
        b.recv.copy_from_host(pattern)
    with pytest.raises(EPInputError) as refused:
        world.combine(ys, None,
                      _src_info=[bad if q == d else None for q in range(len(results))])
    for row in rows:
        named = f"rank {d} src_info[{row}] = ({bad[row][0]}, {bad[row][1]})"
        assert named in str(refused.value), f"not reported: {named}: {refused.value}"
    K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    for s, b in enumerate(comb.bufs):
        mem = b.recv.to_host()
        assert np.all(mem[comb.bufs[0].recv_bytes:] == 0xA5), f"rank {s}: guard bytes written"
        slots = mem[:b.recv_bytes].view(np.uint16).reshape(cfg.max_tokens_per_rank, K, H)
        written = np.zeros((cfg.max_tokens_per_rank, K), bool)
        expect = np.zeros((cfg.max_tokens_per_rank, K, H), np.uint16)
        for dd, (rr, y) in enumerate(zip(results, ys)):
            srcs = source_of_rows(rr)
            for i in range(len(rr.src_info)):
                if srcs[i] == s and not (dd == d and i in rows):
                    t, k = rr.src_info[i]
                    written[t, k] = True
                    expect[t, k] = y[i]
        assert np.array_equal(slots[written], expect[written]), f"rank {s}: rows wrong"
        assert np.all(slots[~written].view(np.uint8) == 0xA5), \
            f"rank {s}: a slot no valid row targets was written"
    # the world is usable again: the next call is exact
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = world.dispatch(toks, ids)
    ys = expert_outputs(rng, cfg, results)
    w = weights(rng, cfg, ids)
    for g, r in zip(world.combine(ys, w), reference.combine(cfg, results, ys, w)):
        assert np.array_equal(g, r)
    return str(refused.value), rows


def residuals(rng, cfg, ids):
    """Per source, a random residual ``[T, H]`` BF16 (bit 14 cleared, as ``expert_outputs``)."""
    return [rng.integers(0, 1 << 16, size=(len(i), cfg.token_fmt.hid_dim), dtype=np.uint16)
            & np.uint16(0xBFFF) for i in ids]


def combine_matches(world, rng, seed, call, results, ids):
    """After a dispatch (``results`` of the ids ``ids``): one combine with weights on even
    calls and None on odd ones, a residual every fourth call, against ``reference.combine``
    bit for bit (the error names the seed, the call and the source)."""
    cfg = world.cfg
    ys = expert_outputs(rng, cfg, results)
    w = weights(rng, cfg, ids) if call % 2 == 0 else None
    res = residuals(rng, cfg, ids) if call % 4 == 0 else None
    got = world.combine(ys, w, residual=res)
    want = reference.combine(cfg, results, ys, w, residual=res, n_tokens=[len(i) for i in ids])
    for s, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"seed {seed} call {call} rank {s}: {np.count_nonzero(g != r)} elements differ"


def check_round_trips(world, rng, seed, inputs, what: str = ""):
    """For each ``(tokens, topk_ids)`` of ``inputs``: dispatch, then combine with weights
    and a residual, with weights alone, and unreduced, each against ``reference.combine``
    bit for bit (the error names the seed, the call and the source)."""
    cfg = world.cfg
    for call, (toks, ids) in enumerate(inputs):
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        n_tok = [len(i) for i in ids]
        forms = [("weighted+residual", w, residuals(rng, cfg, ids)), ("weighted", w, None),
                 ("unreduced", None, None)]
        for form, wt, res in forms:
            got = world.combine(ys, wt, residual=res)
            want = reference.combine(cfg, results, ys, wt, residual=res, n_tokens=n_tok)
            assert len(got) == len(want)
            for s, (g, r) in enumerate(zip(got, want)):
                assert g.shape == r.shape and np.array_equal(g, r), \
                    (f"seed {seed} {what} call {call} {form} source {s}: "
                     f"{np.count_nonzero(g != r)} elements differ")


def round_trip_inputs(rng, cfg, n_calls, devices=None):
    """``n_calls`` dispatch inputs, token counts random in ``[0, max_tokens_per_rank]`` but the
    first call full; under ``skip_a2a``, one per device with global ids over every device's
    experts. Every odd call has masked slots (id ``-1``) at random positions."""
    n = cfg.n_ranks if devices is None else devices
    E = cfg.n_experts if devices is None else cfg.layout.n_local_experts * devices
    out = []
    for call in range(n_calls):
        counts = [cfg.max_tokens_per_rank if call == 0 else
                  int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(n)]
        toks = [routing.random_tokens(rng, c, cfg.token_fmt.hid_dim) for c in counts]
        ids = [routing.random_topk(rng, c, E, cfg.token_fmt.top_k) for c in counts]
        if call % 2:
            ids = [routing.mask_slots(rng, a, 0.25) for a in ids]
        out.append((toks, ids))
    return out


def row_keyed_expert_outputs(results):
    """Each received row's expert output, a function of what the row is (its token's payload,
    its top-k slot, its group), not of where it lies, so that two dispatches whose rows
    inside a block come in different orders combine to the same result."""
    outs = []
    for res in results:
        n = len(res.src_info)
        y = np.asarray(res.out_tokens)[:n].view(np.uint16).copy()
        k = np.asarray(res.src_info)[:, 1].astype(np.uint16)
        group = np.repeat(np.arange(len(res.row_offsets) - 1, dtype=np.uint16),
                          np.diff(np.asarray(res.row_offsets, np.int64)))[:n]
        y ^= ((k * 5 + group * 3 + 1) & 0x3F)[:, None]     # low mantissa bits: still finite
        outs.append(y)
    return outs


def assert_combine_ignores_flag(cfg, flag: str, make_world, calls, ws) -> None:
    """Dispatch then combine ``calls`` (``(tokens, ids)`` per call, weights ``ws``) on a world
    of ``cfg`` with ``flag`` off and on (``make_world(cfg)``), each call checked against the
    reference, expert outputs ``row_keyed_expert_outputs``: the combines of the two builds
    are equal bit for bit."""
    got = {}
    for on in (False, True):
        c = cfg.replace(**{flag: on})
        world = make_world(c)
        got[on] = outs = []
        for (toks, ids), w in zip(calls, ws):
            results = world.dispatch(toks, ids)
            for want, res in zip(reference.dispatch(c, toks, ids), results):
                reference.assert_match(c, want, res)
            ys = row_keyed_expert_outputs(results)
            out = world.combine(ys, w)
            for o, e in zip(out, reference.combine(c, results, ys, w)):
                assert np.array_equal(o, e), "combine differs from the reference"
            outs.append(out)
    for c, (a, b) in enumerate(zip(got[False], got[True])):
        for s, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), f"call {c} rank {s}: the combine with {flag} differs"


def check_torch_combine_option(world, seed: int, option: str, n_calls: int = 3) -> None:
    """``EPBuffer`` over ``world`` (on a CUDA device): ``n_calls`` dispatches with weights,
    each followed by a combine with ``option=True`` (``fp8``, ``partial_reduce``) and one
    without, each equal bit for bit to ``reference.combine`` with the same option."""
    import torch

    import epgen.torch as ept
    cfg, ep = world.cfg, ept.EPBuffer(world)
    rng = np.random.default_rng(seed)
    H, K, M = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k, cfg.layout.max_out_rows

    def dev(bits):
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(
            torch.bfloat16).cuda()
    for call, (toks, ids) in enumerate(round_trip_inputs(rng, cfg, n_calls)):
        w = [rng.random((len(a), K), dtype=np.float32) for a in ids]
        outs = ep.dispatch([dev(t) for t in toks],
                           [torch.from_numpy(i.astype(np.int64)).cuda() for i in ids],
                           [torch.from_numpy(a).cuda() for a in w])
        results = [o.to_reference(cfg) for o in outs]
        ys = [rng.integers(0, 1 << 16, size=(M, H), dtype=np.uint16) & np.uint16(0xBFFF)
              for _ in outs]
        for on in (True, False):
            got = ep.combine([dev(y) for y in ys], outs, **{option: on})
            ep.check("combine")
            want = reference.combine(cfg, results, ys, w, **{option: on})
            for r, (g, e) in enumerate(zip(got, want)):
                g = g.view(torch.int16).cpu().numpy().view(np.uint16)
                assert np.array_equal(g, e), f"seed {seed} call {call} {option}={on} rank {r}"
