"""``ep_rank_mask`` on the host alone: the configuration rules (each combination it does
not take refused, naming the flags), ``reference.mask_ranks`` against a hand-made case, and
the MASK records' decoding."""

from __future__ import annotations

import numpy as np
import pytest

from epgen.config import EPConfigError
from epgen.errors import EPInputError
from epgen.presets import load_preset
from epgen import reference
from ir import diag


def _small(**change):
    return load_preset("small").replace(**change)


@pytest.mark.parametrize("flag,extra", [
    ("skip_a2a", {}), ("ep_ord_r", {"has_rank_flag": True}),
    ("ep_prod_reserve", {"ep_final_layout": True}), ("fused_shared_expert", {})])
def test_flags_the_mask_does_not_take(flag, extra):
    with pytest.raises(EPConfigError) as err:
        _small(ep_rank_mask=True, **{flag: True}, **extra)
    assert any(set(params) == {"ep_rank_mask", flag} for params, _ in err.value.violations)


def test_the_shmem_transport_is_refused_naming_use_shmem():
    with pytest.raises(EPConfigError) as err:
        _small(ep_rank_mask=True, use_shmem=True, p2p_world_size=1)
    (params, text), = [v for v in err.value.violations if "ep_rank_mask" in v[0]]
    assert set(params) == {"ep_rank_mask", "use_shmem", "p2p_world_size"}
    assert "SHMEM" in text


@pytest.mark.parametrize("change", [{}, {"ep_final_layout": True}, {"use_shmem": True}],
                         ids=["staged", "final_layout", "use_shmem_all_p2p"])
def test_the_mask_is_legal_over_p2p(change):
    assert _small(ep_rank_mask=True, **change).ep_rank_mask


def test_mask_ranks_by_hand():
    """R = 2, E = 4 (L = 2): rank 1 masked. Rank 1's input is empty; rank 0's slots on
    experts 2 and 3 become -1, a -1 stays -1, experts 0 and 1 stay."""
    cfg = _small(n_ranks=2, n_experts=4, max_tokens_per_rank=3)
    K, H = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim
    assert (K, cfg.layout.n_local_experts) == (4, 2)
    ids0 = np.array([[0, 2, 3, 1], [3, -1, 1, 2], [1, 0, -1, -1]], np.int32)
    ids1 = np.array([[1, 0, 2, 3]], np.int32)
    toks = [np.ones((3, H), np.uint16), np.ones((1, H), np.uint16)]
    mt, mi = reference.mask_ranks(cfg, toks, [ids0, ids1], [1])
    assert np.array_equal(mi[0], [[0, -1, -1, 1], [-1, -1, 1, -1], [1, 0, -1, -1]])
    assert mi[1].shape == (0, K) and mt[1].shape == (0, H)
    assert mt[0] is toks[0] and np.array_equal(ids0[0], [0, 2, 3, 1])     # inputs unchanged
    # its dispatch: rank 0 receives only its own slots 0 and 1, nothing from rank 1
    res = reference.dispatch(cfg, mt, mi)
    assert res[0].counts[:, 1].sum() == 0 and res[0].counts[:, 0].sum() == 5
    assert res[1].counts.sum() == 0


def test_mask_ranks_refuses_what_it_cannot_model():
    cfg = _small()
    with pytest.raises(EPInputError, match=r"masked: ranks \[2\]"):
        reference.mask_ranks(cfg, [], [], [2])
    with pytest.raises(EPInputError, match="skip_a2a"):
        reference.mask_ranks(_small(skip_a2a=True), [], [], [0])


def test_mask_records_decode():
    words = np.zeros(diag.BUFFER_WORDS, np.uint32)
    words[diag.COUNT_WORD] = 2
    F = diag.FIELDS
    base = diag.HEADER_WORDS
    words[base + F["magic"]] = diag.RECORD_MAGIC
    base2 = diag.HEADER_WORDS + diag.RECORD_WORDS
    for name, v in {"magic": diag.MASK_MAGIC, "kernel_tag": diag.kernel_tag("kx"),
                    "site_id": 0, "rank": 3, "block": 5, "thread": 7, "index": 9,
                    "expected": 2, "last_seen": 0x55}.items():
        words[base2 + F[name]] = v

    class K:
        name = "kx"
        sites = ()
    (rec,) = diag.decode_masks(words, [K])
    assert (rec.kernel, rec.rank, rec.masked, rec.block, rec.thread, rec.index,
            rec.last_seen) == ("kx", 3, 2, 5, 7, 9, 0x55)
    assert "masked rank 2" in str(rec)
    assert [r.rank for r in diag.decode(words, [K])] == [0]       # the timeout record only
