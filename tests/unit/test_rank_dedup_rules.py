"""``ep_rank_dedup`` on the host alone: the combinations it refuses (each naming both
parameters and the reason), the ones it takes, and the receive buffer's layout against the
sizes written out by hand."""

from __future__ import annotations

import pytest

from epgen.config import EPConfigError
from epgen.kernels import destination
from epgen.kernels.rank_dedup import RankDedupDestination
from epgen.kernels.staged import StagedDestination
from epgen.presets import load_preset


def _small(**change):
    return load_preset("small").replace(**change)


@pytest.mark.parametrize("flag,extra,reason", [
    ("ep_final_layout", {}, "in place"),
    ("ep_final_layout", {"ep_prod_reserve": True}, "in place"),
    ("skip_a2a", {"n_ranks": 1, "p2p_world_size": 1, "n_experts": 8}, "nothing crosses"),
    ("skip_a2a", {}, "nothing crosses")])
def test_refused_with(flag, extra, reason):
    with pytest.raises(EPConfigError) as err:
        _small(ep_rank_dedup=True, **{flag: True}, **extra)
    (params, text), = [v for v in err.value.violations if "ep_rank_dedup" in v[0]]
    assert set(params) == {"ep_rank_dedup", flag}
    assert reason in text


@pytest.mark.parametrize("change", [
    {}, {"ep_ord_r": True, "has_rank_flag": True}, {"ep_rank_mask": True},
    {"ep_send_join_named": True}, {"fused_shared_expert": True},
    {"ep_copy_role_split": True, "num_threads": 384}, {"use_shmem": True},
    {"use_shmem": True, "p2p_world_size": 1}, {"recv_block_capacity": 8}],
    ids=["staged", "ord_r", "rank_mask", "send_join_named", "fused_se", "role_split",
         "use_shmem_all_p2p", "use_shmem_remote", "block_capacity"])
def test_taken_with(change):
    cfg = _small(ep_rank_dedup=True, **change)
    assert destination.strategy_class(cfg) is RankDedupDestination
    assert destination.strategy_class(cfg.replace(ep_rank_dedup=False)) is StagedDestination


@pytest.mark.parametrize("capacity", [None, 5])
def test_receive_buffer_layout(capacity):
    """The message area (R * T rows of the message and the token's K float32 weights, the
    weights from the message rounded up to 16, the row rounded up to 16), the index table
    (L * R * capacity u32 words), then the slot table (R * T * K u32 words), each rounded up
    to 16 bytes; the plain buffer is L *
    R * capacity messages."""
    cfg = _small(recv_block_capacity=capacity)
    dd = cfg.replace(ep_rank_dedup=True)
    R, T, L = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.n_experts // cfg.n_ranks
    cap = capacity or T
    msg = cfg.token_fmt.msg_size()
    lay = dd.layout
    assert cfg.layout.recv_buf_bytes == L * R * cap * msg
    K = cfg.token_fmt.top_k
    row = -(-(-(-msg // 16) * 16 + 4 * K) // 16) * 16
    assert (lay.dedup_weights_offset, lay.dedup_row_bytes) == (-(-msg // 16) * 16, row)
    area = R * T * row
    assert lay.dedup_index_offset == -(-area // 16) * 16
    assert lay.dedup_index_words == L * R * cap
    assert lay.dedup_slot_offset == lay.dedup_index_offset + -(-4 * L * R * cap // 16) * 16
    assert lay.dedup_slot_words == R * T * K
    assert lay.recv_buf_bytes == lay.dedup_slot_offset + -(-4 * R * T * K // 16) * 16
    assert lay.dedup_slot_word(1, 3, K - 1) == (T + 3) * K + K - 1
    with pytest.raises(IndexError, match="dedup_slot_word: k"):
        lay.dedup_slot_word(0, 0, K)
    assert lay.dedup_msg_row(1, 3) == T + 3
    assert lay.dedup_index_word(1, 1, 2) == (R + 1) * cap + 2
    with pytest.raises(IndexError, match="dedup_msg_row: t"):
        lay.dedup_msg_row(0, T)
    with pytest.raises(IndexError, match="dedup_index_word: j"):
        lay.dedup_index_word(0, 0, cap)
    assert cfg.layout.dedup_msg_rows == cfg.layout.dedup_index_words \
        == cfg.layout.dedup_slot_words == 0


def test_the_receive_buffer_shrinks_at_the_default_preset():
    cfg = load_preset("default")
    assert cfg.replace(ep_rank_dedup=True).layout.recv_buf_bytes \
        < cfg.layout.recv_buf_bytes // 4
