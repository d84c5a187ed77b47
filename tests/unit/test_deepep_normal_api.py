"""``epgen.deepep.Buffer.dispatch`` (the normal mode)'s host side: every argument DeepEP
would reject, and every one epgen cannot serve yet, is refused with an ``EPInputError``
naming it before any world is made or anything sent; a normal-mode combine without a handle
is refused
with its reason."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import epgen.deepep as deep_ep  # noqa: E402
from epgen.deepep.normal import NormalShape  # noqa: E402
from epgen.errors import EPInputError  # noqa: E402

R, E, T, H, K = 2, 4, 4, 32, 2


@pytest.fixture
def group():
    return deep_ep.EmulatedGroup(R, backend="sim")


@pytest.fixture
def buf(group):
    return deep_ep.Buffer(group.rank(0), num_max_dispatch_tokens_per_rank=T)


def args(buf, T=T, K=K):
    x = torch.zeros((T, H), dtype=torch.bfloat16)
    idx = (torch.arange(T * K, dtype=torch.int64).view(T, K) % E)
    ntpr, _, ntpe, itir, _ = buf.get_dispatch_layout(idx, E)
    return x, dict(num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                   num_tokens_per_expert=ntpe, topk_idx=idx)


@pytest.mark.parametrize("change,match", [
    (lambda x, a: ((x.to(torch.float8_e4m3fn), torch.ones((T, 1))), a), r"^x: FP8 input"),
    (lambda x, a: (x.float(), a), r"^x: dtype torch.float32"),
    (lambda x, a: (x, {**a, "topk_weights": torch.ones((T, K), dtype=torch.float64)}),
     r"^topk_weights: dtype"),
    (lambda x, a: (x, {**a, "topk_weights": torch.ones((T, K + 1))}), r"^topk_weights: shape"),
    (lambda x, a: (x, {**a, "topk_idx": None}), r"^topk_idx: required"),
    (lambda x, a: (x, {**a, "num_tokens_per_expert": None}), r"^num_tokens_per_expert: "),
    (lambda x, a: (x, {**a, "is_token_in_rank": None}), r"^is_token_in_rank: required"),
    (lambda x, a: (x, {**a, "num_tokens_per_rdma_rank": torch.ones(1)}),
     r"^num_tokens_per_rdma_rank: must be None"),
    (lambda x, a: (x, {**a, "expert_alignment": 0}), r"^expert_alignment: "),
    (lambda x, a: (x, {**a, "num_worst_tokens": -1}), r"^num_worst_tokens: must be"),
    (lambda x, a: (x, {**a, "num_worst_tokens": R * T + 1}), r"^num_worst_tokens: .*exceeds"),
    (lambda x, a: (x[:, :12].contiguous(), a), r"^x: hidden 12"),
    (lambda x, a: (x, {**a, "is_token_in_rank": ~a["is_token_in_rank"]}),
     r"^topk_idx: .*mismatch"),
    (lambda x, a: (x, {**a, "topk_idx": a["topk_idx"] + E}), r"^topk_idx: .*mismatch"),
], ids=["fp8", "dtype", "weights", "weights_shape", "no_topk", "no_per_expert", "no_in_rank", "rdma",
        "alignment", "worst_negative", "worst_too_many", "hidden", "layout", "bad_ids"])
def test_refused_by_name_before_anything_is_sent(buf, group, change, match):
    x, a = args(buf)
    x, a = change(x, a)
    with pytest.raises(EPInputError, match=match):
        buf.dispatch(x, **a)
    assert group.worlds() == []


def test_more_tokens_than_the_buffer_takes_and_no_buffer_size(group):
    big = deep_ep.Buffer(group.rank(0), num_max_dispatch_tokens_per_rank=T - 1)
    x, a = args(big)
    with pytest.raises(EPInputError, match=r"^x: 4 tokens, more than"):
        big.dispatch(x, **a)
    unsized = deep_ep.Buffer(group.rank(0))
    with pytest.raises(EPInputError, match=r"^num_max_dispatch_tokens_per_rank: the normal"):
        unsized.dispatch(x, **a)
    with pytest.raises(EPInputError, match=r"^num_max_dispatch_tokens_per_rank: must be"):
        deep_ep.Buffer(group.rank(0), num_max_dispatch_tokens_per_rank=0)
    assert group.worlds() == []


def test_cached_dispatch_refusals(buf, group):
    x, a = args(buf)
    other = deep_ep.Buffer(group.rank(0), num_max_dispatch_tokens_per_rank=T)
    from epgen.deepep.normal import NormalHandle
    foreign = NormalHandle(torch.zeros((R, R)), torch.zeros((0, 2)), None,
                           topk_idx=a["topk_idx"], n_rows=0,
                           shape=NormalShape(R, E, T, H, K), owner=other, slot=0,
                           generation=1)
    with pytest.raises(EPInputError, match=r"^handle: must be a handle this buffer"):
        buf.dispatch(x, handle=foreign)
    with pytest.raises(EPInputError, match=r"^handle: must be"):
        buf.dispatch(x, handle=(1, 2, 3))
    mine = NormalHandle(torch.zeros((R, R)), torch.zeros((0, 2)), None,
                        topk_idx=a["topk_idx"], n_rows=0, shape=NormalShape(R, E, T, H, K),
                        owner=buf, slot=0, generation=1)
    with pytest.raises(EPInputError, match=r"^topk_idx: a cached dispatch"):
        buf.dispatch(x, handle=mine, topk_idx=a["topk_idx"])
    with pytest.raises(EPInputError, match=r"^x: 3 tokens, the handle's dispatch had 4"):
        buf.dispatch(x[:3], handle=mine)
    with pytest.raises(EPInputError, match=r"^x: hidden 16, the handle's"):
        buf.dispatch(x[:, :16].contiguous(), handle=mine)
    assert group.worlds() == []


def test_shrink_buffers_and_a_combine_without_a_handle_are_refused(group):
    sim = deep_ep.EmulatedGroup(R, backend="sim")
    shrink = deep_ep.Buffer(sim.rank(0), enable_shrink=True, num_max_dispatch_tokens_per_rank=T)
    x, a = args(shrink)
    with pytest.raises(EPInputError, match=r"^enable_shrink: the normal mode"):
        shrink.dispatch(x, **a)
    with pytest.raises(EPInputError, match=r"^handle: must be the handle .* normal-mode"):
        deep_ep.Buffer(group.rank(0)).combine(x, None)
    assert group.worlds() == []


def test_handle_keeps_deepeps_positions():
    from epgen.deepep.normal import NormalHandle
    src = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    prefix, in_rank, ids = torch.zeros((2, 2)), torch.ones((4, 2), dtype=torch.bool), \
        torch.zeros((4, 2), dtype=torch.int64)
    h = NormalHandle(prefix, src, in_rank, topk_idx=ids, n_rows=2,
                     shape=NormalShape(2, 4, 4, 32, 2), owner=None, slot=0, generation=1)
    rpm, cpm, rcpm, recv_src_idx, itir, send_head = h
    assert rpm is prefix and itir is in_rank and (cpm, rcpm, send_head) == (None, None, None)
    assert recv_src_idx.tolist() == [3, 2] and h.recv_src is src and h.topk_idx is ids


@pytest.mark.parametrize("n_ranks,num_experts,n_sms,threads", [
    (2, 16, 8, 512),       # 8 local experts on 8 blocks: one comm block each is not enough
    (4, 32, 8, 512),
    (4, 64, None, None),   # 16 local experts, the default grid
    (8, 256, 4, 1024),     # the signal blocks of 256 experts with 32 warps a block
])
@pytest.mark.parametrize("sim", [False, True])
def test_the_grid_is_a_valid_config_whatever_n_sms_asks(n_ranks, num_experts, n_sms, threads,
                                                        sim):
    """``NormalShape.grid`` raises ``n_sms`` to what the kernels need (a dispatch_wait comm
    block per local expert plus one, more blocks than dispatch_async's signal blocks), as
    ``LowLatencyShape.grid`` does, so that ``config`` never refuses its own grid."""
    shape = NormalShape(n_ranks, num_experts, 16, 256, 4)
    got_sms, got_threads = shape.grid(n_sms, threads, sim)
    cfg = shape.config(got_sms, got_threads)         # EPConfigError before the fix
    assert got_sms >= num_experts // n_ranks + 1 and got_sms >= (n_sms or 0)
    assert cfg.n_sms == got_sms
