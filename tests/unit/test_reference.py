"""The numpy reference model of dispatch: properties on random routings, edge cases, the
shared expert, skip_a2a, padding, canonical comparison and input validation."""

from collections import Counter

import attrs
import ml_dtypes
import numpy as np
import pytest

from epgen import BF16Format, EPConfig, reference
from epgen.reference import EPInputError, RankResult, se_slice, validate_inputs


def make_cfg(E=16, R=4, max_tpr=8, H=16, K=3, fmt=None, **flags):
    num_threads = max(128, 32 * -(-E // 32))
    n_sms = -(-E // (num_threads // 32)) + E // R + 2   # signal SMs + one wait SM per expert
    return EPConfig(num_threads=num_threads, n_sms=n_sms, n_experts=E, n_ranks=R,
                    max_tokens_per_rank=max_tpr, p2p_world_size=R,
                    token_fmt=fmt or BF16Format(hid_dim=H, top_k=K), use_shmem=False, **flags)


def random_ids(rng, T, E, K, allowed=None):
    """[T, K] int32 ids, unique per token, drawn from ``allowed`` (default all experts)."""
    allowed = np.arange(E) if allowed is None else np.asarray(allowed)
    pick = np.argsort(rng.random((T, len(allowed))), axis=1)[:, :K]
    return allowed[pick].astype(np.int32)


def random_tokens(rng, T, H):
    return rng.integers(0, 1 << 16, (T, H), dtype=np.uint16)


def random_inputs(rng, cfg, n_tokens):
    H, K, E = cfg.token_fmt.hid_dim, cfg.token_fmt.top_k, cfg.n_experts
    return ([random_tokens(rng, T, H) for T in n_tokens],
            [random_ids(rng, T, E, K) for T in n_tokens])


def check_properties(cfg, tokens, ids, results, seed):
    """Properties every correct dispatch has (everything but the exact row order)."""
    where = f"seed={seed}"
    L, R = cfg.layout.n_local_experts, cfg.n_ranks
    se = int(cfg.fused_shared_expert)
    assert len(results) == R, where
    seen = Counter()
    for d, res in enumerate(results):
        assert res.rank == d, where
        ro = res.row_offsets.astype(np.int64)
        assert res.row_offsets.dtype == np.uint32 and ro.shape == (L + se + 1,), where
        assert ro[0] == 0 and (np.diff(ro) >= 0).all(), f"{where}: row_offsets {ro}"
        assert res.counts.shape == (L, R) and res.counts.dtype == np.int32, where
        assert (res.expert_ids == np.arange(L + se)).all(), where
        assert (np.diff(ro) == res.group_counts).all(), f"{where}: row_offsets vs counts"
        assert res.out_tokens.shape == (ro[-1], cfg.token_fmt.hid_dim), where
        assert res.src_info.shape == (ro[-1], 2) and res.src_info.dtype == np.int32, where
        for e in range(L):
            g = d * L + e
            for s in range(R):
                start, c = int(res.block_starts[e, s]), int(res.counts[e, s])
                # blocks are source-major and contiguous inside the expert's group
                assert start == ro[e + se] + res.counts[e, :s].sum(), where
                t, k = res.src_info[start:start + c].T
                assert (np.diff(t) > 0).all(), f"{where}: block ({e}, {s}) not in token order"
                assert (ids[s][t, k] == g).all(), f"{where}: src_info does not point back"
                assert (res.out_tokens[start:start + c] == tokens[s][t]).all(), \
                    f"{where}: row differs from its source token"
                seen.update((s, int(tt), int(kk)) for tt, kk in zip(t, k))
        routed = res.routed_rows_mask()
        assert (res.src_info[~routed] == -1).all(), where
    want = Counter((s, t, k) for s in range(R) for t in range(ids[s].shape[0])
                   for k in range(ids[s].shape[1]))
    assert seen == want, f"{where}: (token, k) pairs are not delivered exactly once"


@pytest.mark.parametrize("E,R,K,H", [(16, 4, 3, 16), (8, 1, 2, 8), (64, 8, 8, 64),
                                     (32, 2, 8, 128), (256, 8, 8, 8), (6, 6, 6, 8)])
def test_random_routings(E, R, K, H, seed):
    rng = np.random.default_rng(seed)
    max_tpr = 16
    cfg = make_cfg(E=E, R=R, K=K, H=H, max_tpr=max_tpr)
    for _ in range(5):
        n_tokens = rng.integers(0, max_tpr + 1, R)
        tokens, ids = random_inputs(rng, cfg, n_tokens)
        check_properties(cfg, tokens, ids, reference.dispatch(cfg, tokens, ids), seed)


def test_known_small_example():
    cfg = make_cfg(E=4, R=2, K=2, H=8, max_tpr=4)
    tok = [np.arange(3 * 8, dtype=np.uint16).reshape(3, 8),
           np.arange(100, 100 + 2 * 8, dtype=np.uint16).reshape(2, 8)]
    ids = [np.array([[0, 3], [2, 0], [1, 0]], np.int32), np.array([[0, 1], [3, 2]], np.int32)]
    r0, r1 = reference.dispatch(cfg, tok, ids)
    # rank 0 owns experts 0, 1: expert 0 gets (r0,t0,k0) (r0,t1,k1) (r0,t2,k1) (r1,t0,k0)
    assert r0.counts.tolist() == [[3, 1], [1, 1]]
    assert r0.row_offsets.tolist() == [0, 4, 6]
    assert r0.src_info.tolist() == [[0, 0], [1, 1], [2, 1], [0, 0], [2, 0], [0, 1]]
    assert (r0.out_tokens[3] == tok[1][0]).all() and (r0.out_tokens[5] == tok[1][0]).all()
    assert r0.block_starts.tolist() == [[0, 3], [4, 5]]
    assert r1.counts.tolist() == [[1, 1], [1, 1]]
    assert r1.src_info.tolist() == [[1, 0], [1, 1], [0, 1], [1, 0]]


def test_zero_tokens_everywhere():
    cfg = make_cfg()
    tokens, ids = random_inputs(np.random.default_rng(0), cfg, [0, 0, 0, 0])
    for res in reference.dispatch(cfg, tokens, ids):
        assert res.row_offsets.tolist() == [0] * 5 and not res.counts.any()
        assert res.out_tokens.shape == (0, 16) and res.src_info.shape == (0, 2)
    check_properties(cfg, tokens, ids, reference.dispatch(cfg, tokens, ids), 0)


def test_one_hot_expert(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, max_tpr=8)
    hot = int(rng.integers(0, 16))
    n_tokens = [8, 5, 0, 8]
    tokens = [random_tokens(rng, T, 16) for T in n_tokens]
    others = np.setdiff1d(np.arange(16), [hot])
    ids = [np.concatenate([np.full((T, 1), hot), random_ids(rng, T, 16, 2, others)], axis=1)
           .astype(np.int32) for T in n_tokens]
    results = reference.dispatch(cfg, tokens, ids)
    check_properties(cfg, tokens, ids, results, seed)
    d, e = divmod(hot, 4)
    assert results[d].counts[e].tolist() == n_tokens, f"seed={seed}"


def test_all_tokens_to_one_rank(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, max_tpr=8)
    dst = int(rng.integers(0, 4))
    n_tokens = [8, 3, 8, 1]
    tokens = [random_tokens(rng, T, 16) for T in n_tokens]
    ids = [random_ids(rng, T, 16, 3, np.arange(4 * dst, 4 * dst + 4)) for T in n_tokens]
    results = reference.dispatch(cfg, tokens, ids)
    check_properties(cfg, tokens, ids, results, seed)
    for d, res in enumerate(results):
        assert res.row_offsets[-1] == (3 * sum(n_tokens) if d == dst else 0), f"seed={seed}"


def test_full_ranks_and_a_rank_with_no_tokens(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=32, R=4, K=8, max_tpr=16)
    tokens, ids = random_inputs(rng, cfg, [16, 0, 16, 16])
    results = reference.dispatch(cfg, tokens, ids)
    check_properties(cfg, tokens, ids, results, seed)
    for res in results:
        assert not res.counts[:, 1].any(), f"seed={seed}"
    assert sum(int(r.row_offsets[-1]) for r in results) == 48 * 8


def test_bfloat16_input_gives_the_same_bits(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=8, R=2, K=2, H=16)
    vals = [rng.standard_normal((5, 16)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    ids = [random_ids(rng, 5, 8, 2) for _ in range(2)]
    a = reference.dispatch(cfg, vals, ids)
    b = reference.dispatch(cfg, [v.view(np.uint16) for v in vals], ids)
    for x, y in zip(a, b):
        assert x.out_tokens.dtype == np.uint16
        assert (x.out_tokens == y.out_tokens).all(), f"seed={seed}"


# ---- shared expert ------------------------------------------------------------------------
def test_fused_shared_expert_is_group_zero(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, fused_shared_expert=True)
    tokens, ids = random_inputs(rng, cfg, [8, 0, 3, 7])
    results = reference.dispatch(cfg, tokens, ids)
    check_properties(cfg, tokens, ids, results, seed)
    for d, res in enumerate(results):
        T = tokens[d].shape[0]
        assert res.se == 1 and res.se_tokens == T and res.se_token_start == 0
        assert res.row_offsets[1] == T and res.expert_ids.tolist() == list(range(5))
        assert (res.out_tokens[:T] == tokens[d]).all(), f"seed={seed}"
        assert (res.src_info[:T] == -1).all()


@pytest.mark.parametrize("T,W", [(10, 3), (0, 2), (1, 4), (7, 1), (128, 8), (5, 5)])
def test_se_slices_partition_the_tokens(T, W):
    covered = []
    for r in range(W):
        row0, n = se_slice(T, r, W)
        covered += list(range(row0, row0 + n))
    assert covered == list(range(T))
    assert se_slice(T, 0, None) == (0, T)


# ---- skip_a2a ------------------------------------------------------------------------------
def skip_cfg(L=4, K=3, **flags):
    return EPConfig(num_threads=128, n_sms=16, n_experts=L, n_ranks=1, max_tokens_per_rank=16,
                    p2p_world_size=1, token_fmt=BF16Format(16, K), skip_a2a=True,
                    use_shmem=False, **flags)


def test_skip_a2a_keeps_only_local_experts(seed):
    rng = np.random.default_rng(seed)
    L, D, E_global = 4, 3, 24      # 3 devices run; the model has 6 devices' worth of experts
    cfg = skip_cfg(L=L, K=5)
    T = 12
    tok = random_tokens(rng, T, 16)
    ids = random_ids(rng, T, E_global, 5)
    results = reference.dispatch(cfg, [tok] * D, [ids] * D)  # replicated after the allreduce
    assert [r.rank for r in results] == [0, 1, 2]
    for d, res in enumerate(results):
        assert res.counts.shape == (L, 1)
        for e in range(L):
            t, k = np.nonzero(ids == d * L + e)
            start, c = int(res.block_starts[e, 0]), int(res.counts[e, 0])
            assert c == len(t), f"seed={seed}"
            assert (res.src_info[start:start + c] == np.stack([t, k], 1)).all(), f"seed={seed}"
            assert (res.out_tokens[start:start + c] == tok[t]).all(), f"seed={seed}"
    # explicit device ids
    res5 = reference.dispatch(cfg, [tok], [ids], ranks=[5])[0]
    assert res5.rank == 5 and res5.counts[:, 0].tolist() == \
        [int((ids == 5 * L + e).sum()) for e in range(L)]


def test_skip_a2a_with_shared_expert_slices(seed):
    rng = np.random.default_rng(seed)
    cfg = skip_cfg(L=4, K=3, fused_shared_expert=True)
    T, W = 11, 3
    tok = random_tokens(rng, T, 16)
    ids = random_ids(rng, T, 16, 3)
    results = reference.dispatch(cfg, [tok] * 2, [ids] * 2, allreduce_world_size=W)
    for d, res in enumerate(results):
        row0, n = se_slice(T, d, W)
        assert (res.se_token_start, res.se_tokens) == (row0, n)
        assert res.row_offsets[1] == n
        assert (res.out_tokens[:n] == tok[row0:row0 + n]).all(), f"seed={seed}"
    with pytest.raises(EPInputError, match="allreduce_world_size"):
        reference.dispatch(cfg, [tok] * 2, [ids] * 2, ranks=[0, 3], allreduce_world_size=3)


# ---- padding and layouts -------------------------------------------------------------------
@attrs.frozen
class PaddedBF16(BF16Format):
    expert_m_padding = 4


def test_expert_m_padding(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, fmt=PaddedBF16(16, 3), fused_shared_expert=True)
    tokens, ids = random_inputs(rng, cfg, [5, 8, 1, 0])
    for res in reference.dispatch(cfg, tokens, ids):
        ro = res.row_offsets.astype(np.int64)
        assert (ro % 4 == 0).all(), f"seed={seed}"
        assert (np.diff(ro) == -(-res.group_counts // 4) * 4).all(), f"seed={seed}"
        pad = ~res.routed_rows_mask()
        pad[:res.se_tokens] = False
        assert (res.out_tokens[pad] == 0).all() and (res.src_info[pad] == -1).all()
        assert len(res.out_tokens) <= cfg.layout.max_out_rows


def test_capacity_strided_final_layout(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, max_tpr=8, ep_final_layout=True)
    tokens, ids = random_inputs(rng, cfg, [8, 2, 0, 5])
    for res in reference.dispatch(cfg, tokens, ids):
        assert res.row_offsets.tolist() == [e * 4 * 8 for e in range(5)]
        assert res.block_starts[:, 0].tolist() == [e * 4 * 8 for e in range(4)]
    prod = reference.dispatch(cfg.replace(ep_prod_reserve=True), tokens, ids)
    plain = reference.dispatch(make_cfg(E=16, R=4, K=3, max_tpr=8), tokens, ids)
    for a, b in zip(prod, plain):  # prod_reserve: the standard contiguous layout
        assert (a.row_offsets == b.row_offsets).all() and (a.out_tokens == b.out_tokens).all()


# ---- canonical form and comparison -----------------------------------------------------------
def shuffled_copy(rng, res, garbage=True):
    """What a correct kernel may return: rows permuted inside each (expert, source) block,
    stale data in rows it never writes, and a larger allocation."""
    n = res.n_rows
    extra = 7
    out = rng.integers(0, 1 << 16, (n + extra, *res.out_tokens.shape[1:]), dtype=np.uint16)
    src = rng.integers(-5, 5, (n + extra, 2)).astype(np.int32)
    if not garbage:
        out[:n], src[:n] = res.out_tokens, res.src_info
    written = res.routed_rows_mask()
    written[:res.se_tokens] = True
    out[:n][written] = res.out_tokens[written]
    src[:n][res.routed_rows_mask()] = res.src_info[res.routed_rows_mask()]
    for _e, _s, start, c in res.blocks():
        p = start + rng.permutation(c)
        out[start:start + c], src[start:start + c] = out[p], src[p]
    return RankResult(rank=res.rank, out_tokens=out, row_offsets=res.row_offsets.copy(),
                      expert_ids=res.expert_ids.copy(), src_info=src, counts=res.counts.copy(),
                      block_starts=res.block_starts.copy(), se_tokens=res.se_tokens,
                      se_token_start=res.se_token_start)


def test_compare_ignores_order_within_blocks_and_unwritten_rows(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, fmt=PaddedBF16(16, 3), fused_shared_expert=True)
    tokens, ids = random_inputs(rng, cfg, [8, 8, 3, 6])
    expected = reference.dispatch(cfg, tokens, ids)
    actual = [shuffled_copy(rng, r) for r in expected]
    reference.assert_match(cfg, expected, actual)
    for x, a in zip(expected, actual):
        cx, ca = x.canonical(), a.canonical()
        assert (cx.out_tokens == ca.out_tokens).all() and (cx.src_info == ca.src_info).all(), \
            f"seed={seed}"


def test_compare_detects_errors(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3)
    tokens, ids = random_inputs(rng, cfg, [8, 8, 8, 8])
    expected = reference.dispatch(cfg, tokens, ids)
    x = expected[0]
    routed = np.nonzero(x.routed_rows_mask())[0]
    assert len(routed) >= 2, f"seed={seed}"

    def broken(**changes):
        a = shuffled_copy(rng, x, garbage=False)
        for k, v in changes.items():
            v(a)
        return a

    def flip_bit(a):
        a.out_tokens[routed[0], 3] ^= 1

    def wrong_k(a):
        a.src_info[routed[0], 1] = (a.src_info[routed[0], 1] + 1) % 3

    def swap_blocks(a):  # two rows of different (expert, source) blocks exchanged
        first = next((st, c) for _e, _s, st, c in x.blocks() if c)
        i = first[0]
        j = next(r for r in routed if not first[0] <= r < first[0] + first[1])
        a.out_tokens[[i, j]] = a.out_tokens[[j, i]]
        a.src_info[[i, j]] = a.src_info[[j, i]]

    def wrong_count(a):
        a.counts[0, 0] += 1

    def wrong_offsets(a):
        a.row_offsets[-1] += 1

    for name, fn in [("flip", flip_bit), ("k", wrong_k), ("swap", swap_blocks),
                     ("count", wrong_count), ("offsets", wrong_offsets)]:
        diffs = reference.compare(cfg, x, broken(f=fn))
        assert diffs, f"seed={seed}: {name} not detected"
        with pytest.raises(AssertionError):
            reference.assert_match(cfg, x, broken(f=fn))


def test_from_outputs_derives_block_starts(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=16, R=4, K=3, fused_shared_expert=True)
    tokens, ids = random_inputs(rng, cfg, [8, 4, 0, 6])
    for x in reference.dispatch(cfg, tokens, ids):
        a = RankResult.from_outputs(cfg, x.rank, x.out_tokens, x.row_offsets, x.expert_ids,
                                    x.src_info, x.counts, se_tokens=x.se_tokens)
        assert (a.block_starts == x.block_starts).all(), f"seed={seed}"
        assert not reference.compare(cfg, x, a)


def test_strided_compare_allows_any_block_order(seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=8, R=2, K=2, max_tpr=8, ep_final_layout=True)
    tokens, ids = random_inputs(rng, cfg, [8, 8])
    x = reference.dispatch(cfg, tokens, ids)[0]
    # the source-1 block first, then the source-0 block, inside each expert's range
    out, src, starts = x.out_tokens.copy(), x.src_info.copy(), x.block_starts.copy()
    for e in range(x.counts.shape[0]):
        c0, c1 = x.counts[e]
        g = int(x.row_offsets[e])
        b0, b1 = slice(g, g + c0), slice(g + c0, g + c0 + c1)
        out[g:g + c1 + c0] = np.concatenate([x.out_tokens[b1], x.out_tokens[b0]])
        src[g:g + c1 + c0] = np.concatenate([x.src_info[b1], x.src_info[b0]])
        starts[e] = [g + c1, g]
    a = attrs.evolve(x, out_tokens=out, src_info=src, block_starts=starts)
    assert not reference.compare(cfg, x, a), f"seed={seed}"


def test_strided_compare_rejects_blocks_that_do_not_tile(seed):
    """Capacity-strided: blocks may come in any order, but must tile [start, start + total)."""
    rng = np.random.default_rng(seed)
    cfg = make_cfg(E=8, R=2, K=2, max_tpr=8, ep_final_layout=True)
    for _ in range(100):       # a routing where some expert of rank 0 hears from both sources
        tokens, ids = random_inputs(rng, cfg, [8, 8])
        x = reference.dispatch(cfg, tokens, ids)[0]
        if (x.counts > 0).all(axis=1).any():
            break
    e = int(np.argmax((x.counts > 0).all(axis=1) * x.counts.sum(axis=1)))
    assert (x.counts[e] > 0).all(), f"seed={seed}: no expert with two blocks in 100 routings"
    for shift in (1, -1):      # a gap after the expert's start, or an overlap
        starts = x.block_starts.copy()
        starts[e, 1] += shift
        a = attrs.evolve(x, block_starts=starts)
        assert any("block_starts" in d for d in reference.compare(cfg, x, a)), f"seed={seed}"
    starts = x.block_starts.copy()
    starts[e] += 1             # the whole expert one row late
    assert reference.compare(cfg, x, attrs.evolve(x, block_starts=starts)), f"seed={seed}"


# ---- input validation ---------------------------------------------------------------------------
def good_inputs(cfg, n_tokens=(3, 0, 2, 4)):
    return random_inputs(np.random.default_rng(1), cfg, list(n_tokens))


def test_validate_inputs_returns_token_counts():
    cfg = make_cfg()
    tokens, ids = good_inputs(cfg)
    assert validate_inputs(cfg, tokens, ids) == (3, 0, 2, 4)
    assert validate_inputs(cfg, tokens, ids, strict_dtypes=True) == (3, 0, 2, 4)
    validate_inputs(cfg, [t.view(ml_dtypes.bfloat16) for t in tokens], ids)


def mutate(which, r, fn):
    def apply(tokens, ids):
        tokens, ids = list(tokens), list(ids)
        (tokens if which == "tokens" else ids)[r] = fn(
            (tokens if which == "tokens" else ids)[r])
        return tokens, ids
    return apply


INVALID = [
    ("too few ranks", lambda t, i: (t[:3], i[:3]), "n_ranks=4"),
    ("length mismatch", lambda t, i: (t, i[:3]), "topk_ids has 3"),
    ("not a list", lambda t, i: ("abc", i), "list"),
    ("hid_dim", mutate("tokens", 0, lambda x: x[:, :8]), "hid_dim=16"),
    ("1-d tokens", mutate("tokens", 2, lambda x: x[0]), r"tokens\[2\]"),
    ("float tokens", mutate("tokens", 0, lambda x: x.astype(np.float32)), "float32"),
    ("ids shape", mutate("ids", 3, lambda x: x[:, :2]), r"topk_ids\[3\]: shape"),
    ("ids rows", mutate("ids", 0, lambda x: x[:2]), r"\[3, 3\]"),
    ("float ids", mutate("ids", 0, lambda x: x.astype(np.float64)), "integer"),
    ("id too large", mutate("ids", 3, lambda x: np.where(x == x[1, 1], 16, x)), r"\[0, 16\)"),
    ("negative id", mutate("ids", 0, lambda x: np.where(x == x[0, 0], -2, x)), "-2"),
    ("duplicate", mutate("ids", 2, lambda x: np.concatenate([x[:, :1], x[:, :1], x[:, 2:]], 1)),
     "more than once"),
    ("too many tokens", lambda t, i: ([np.zeros((9, 16), np.uint16)] + t[1:],
                                      [np.zeros((9, 3), np.int32) + [0, 1, 2]] + i[1:]),
     "max_tokens_per_rank=8"),
]


@pytest.mark.parametrize("name,fn,match", INVALID, ids=[x[0] for x in INVALID])
def test_invalid_inputs(name, fn, match):
    cfg = make_cfg()
    tokens, ids = fn(*good_inputs(cfg))
    with pytest.raises(EPInputError, match=match):
        validate_inputs(cfg, tokens, ids)
    with pytest.raises(ValueError, match=match):
        reference.dispatch(cfg, tokens, ids)


def test_strict_dtypes_and_option_misuse():
    cfg = make_cfg()
    tokens, ids = good_inputs(cfg)
    with pytest.raises(EPInputError, match="int32"):
        validate_inputs(cfg, tokens, [i.astype(np.int64) for i in ids], strict_dtypes=True)
    validate_inputs(cfg, tokens, [i.astype(np.int64) for i in ids])
    with pytest.raises(EPInputError, match="skip_a2a"):
        validate_inputs(cfg, tokens, ids, ranks=[0, 1, 2, 3])


def test_skip_a2a_input_rules():
    cfg = skip_cfg(L=4, K=3)
    rng = np.random.default_rng(0)
    tok = random_tokens(rng, 4, 16)
    ids = random_ids(rng, 4, 1000, 3)          # global ids may exceed n_experts
    validate_inputs(cfg, [tok, tok], [ids, ids])
    with pytest.raises(EPInputError, match=r"\[0, 65535\)"):
        validate_inputs(cfg, [tok], [ids + 65536])
    # 65535 is 0xffff on the wire, a masked slot's id there: refused, as the device check does
    with pytest.raises(EPInputError, match=r"= 65535 is not an expert id in \[0, 65535\)"):
        validate_inputs(cfg, [tok], [np.where(ids == ids[0, 0], 65535, ids)])
    with pytest.raises(EPInputError, match="distinct"):
        validate_inputs(cfg, [tok, tok], [ids, ids], ranks=[1, 1])
    with pytest.raises(EPInputError, match="ranks has 1"):
        validate_inputs(cfg, [tok, tok], [ids, ids], ranks=[1])


def test_recv_block_capacity_overflow_is_refused(seed):
    cfg = EPConfig(num_threads=256, n_sms=17, n_experts=32, n_ranks=2, max_tokens_per_rank=64,
                   p2p_world_size=2, use_shmem=False, token_fmt=BF16Format(hid_dim=64, top_k=2),
                   recv_block_capacity=8)
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, 2**16, (20, 64), dtype=np.uint16) for _ in range(2)]
    ids = [np.stack([np.full(20, 5), np.arange(6, 26)], axis=1).astype(np.int32),
           np.stack([np.arange(20), np.arange(20) + 10], axis=1).astype(np.int32)]
    with pytest.raises(ValueError, match="recv_block_capacity=8"):
        reference.validate_inputs(cfg, toks, ids)
    ids[0][:, 0] = np.arange(20) % 4            # at most 5 tokens per expert: fits
    assert reference.validate_inputs(cfg, toks, ids) == (20, 20)
