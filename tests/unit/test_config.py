"""EPConfig: parameters, defaults, and every validation rule (each a ValueError naming the
parameters it concerns)."""

import attrs
import numpy as np
import pytest

from epgen import BF16Format, EPConfig, EPConfigError, TokenFormat
from epgen.presets import load_preset

PAGE_PARAMS = ["num_threads", "n_sms", "n_experts", "n_ranks", "max_tokens_per_rank",
               "p2p_world_size", "token_fmt", "use_shmem", "fused_shared_expert", "skip_a2a",
               "has_rank_flag", "ep_ord_r", "ep_final_layout", "ep_prod_reserve",
               "ep_copy_role_split", "ep_send_join_named"]

BASE = dict(num_threads=1024, n_sms=132, n_experts=256, n_ranks=8, max_tokens_per_rank=128,
            p2p_world_size=8, token_fmt=BF16Format(hid_dim=7168, top_k=8), use_shmem=False)


def make(**changes):
    return EPConfig(**{**BASE, **changes})


def test_every_page_parameter_exists_with_its_default():
    names = [f.name for f in attrs.fields(EPConfig)]
    assert names[:len(PAGE_PARAMS)] == PAGE_PARAMS
    cfg = EPConfig(**{k: v for k, v in BASE.items() if k != "use_shmem"})
    assert cfg.use_shmem is True
    for flag in PAGE_PARAMS[8:]:
        assert getattr(cfg, flag) is False, flag
    assert cfg.timeout_ns == 2_000_000_000
    assert cfg.token_fmt_type is cfg.token_fmt


def test_keyword_only_frozen_hashable():
    with pytest.raises(TypeError):
        EPConfig(1024, 132, 256, 8, 128, 8, BF16Format(7168, 8))
    cfg = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.n_sms = 10
    assert cfg == make() and hash(cfg) == hash(make())
    assert {cfg: 1}[make()] == 1


def test_numpy_scalars_are_accepted():
    cfg = make(n_sms=np.int64(132), fused_shared_expert=np.bool_(True))
    assert type(cfg.n_sms) is int and cfg.fused_shared_expert is True


def test_layout_is_cached():
    cfg = make()
    assert cfg.layout is cfg.layout
    assert cfg.layout.n_local_experts == 32


def test_replace_and_describe():
    cfg = make()
    c2 = cfg.replace(n_sms=100)
    assert c2.n_sms == 100 and cfg.n_sms == 132 and c2.layout.n_dispatch_async_comm_sms == 92
    with pytest.raises(ValueError, match="num_threads"):
        cfg.replace(num_threads=1000)
    d = cfg.describe()
    assert list(d)[:len(PAGE_PARAMS)] == PAGE_PARAMS and d["timeout_ns"] == 2_000_000_000
    assert d["token_fmt"]["name"] == "BF16" and d["token_fmt"]["msg_size"] == 14368


def test_needs_shmem_and_the_shmem_flags():
    cfg = make()
    assert not cfg.needs_shmem and not cfg.shmem_all_p2p and cfg.effective_flags() == {}
    two_nodes = make(p2p_world_size=4, use_shmem=True)
    assert two_nodes.needs_shmem and not two_nodes.shmem_all_p2p
    assert "NVSHMEM" in two_nodes.effective_flags()["use_shmem"]
    assert not hasattr(two_nodes, "require_p2p_only")
    # use_shmem with every destination in the P2P group: the P2P kernels, said so
    all_p2p = make(use_shmem=True)
    assert all_p2p.shmem_all_p2p and not all_p2p.needs_shmem
    assert "no NVSHMEM call" in all_p2p.effective_flags()["use_shmem"]
    skip = make(n_experts=48, n_ranks=1, p2p_world_size=1, skip_a2a=True)
    assert not skip.needs_shmem and not skip.shmem_all_p2p


def test_use_shmem_false_with_remote_destinations_is_refused():
    # the reference silently skips those destinations; we refuse
    with pytest.raises(EPConfigError) as ei:
        make(p2p_world_size=4)
    (names, text), = ei.value.violations
    assert set(names) == {"use_shmem", "p2p_world_size", "n_ranks"}
    assert "use_shmem=False" in text and "p2p_world_size=4 < n_ranks=8" in text


@pytest.mark.parametrize("flags", [dict(ep_final_layout=True),
                                   dict(ep_final_layout=True, ep_prod_reserve=True),
                                   dict(fused_shared_expert=True),
                                   dict(ep_copy_role_split=True)],
                         ids=["final_layout", "prod_reserve", "shared_expert", "role_split"])
def test_shmem_refuses_the_flags_it_does_not_take(flags):
    with pytest.raises(EPConfigError) as ei:
        make(use_shmem=True, p2p_world_size=4, **flags)
    for flag in flags:
        hits = [text for names, text in ei.value.violations
                if names == ("use_shmem", "p2p_world_size", flag)]
        assert hits and "exclusive" in hits[0] and "p2p_world_size=4 < n_ranks=8" in hits[0]
    # every destination in the P2P group: the same flags are fine
    make(use_shmem=True, **flags)


# (changes, parameter names the error must name, a phrase of the rule)
VIOLATIONS = [
    (dict(num_threads=1000), ["num_threads"], "multiple of the warp size"),
    (dict(num_threads=2048, n_experts=256), ["num_threads"], "<= 1024"),
    (dict(n_experts=250), ["n_experts", "n_ranks"], "multiple of n_ranks"),
    (dict(p2p_world_size=3), ["p2p_world_size", "n_ranks"], "divide"),
    (dict(n_ranks=16, n_experts=256, p2p_world_size=16), ["p2p_world_size"], "<= 8"),
    (dict(num_threads=128, n_experts=256), ["n_experts", "num_threads"], "<= num_threads"),
    (dict(n_experts=2048, n_ranks=32, p2p_world_size=8), ["n_experts"], "<= 1024"),
    (dict(n_experts=64 * 33, n_ranks=64, p2p_world_size=8), ["n_ranks"], "<= 32"),
    (dict(token_fmt=BF16Format(hid_dim=7168, top_k=33)), ["top_k"], "<= 32"),
    (dict(n_experts=8, n_ranks=8, num_threads=256, token_fmt=BF16Format(7168, 9)),
     ["top_k", "n_experts"], "top_k must be <= n_experts"),
    (dict(n_experts=256, n_ranks=1, p2p_world_size=1), ["n_sms", "n_local_experts"],
     "n_sms - 1"),
    (dict(num_threads=32, n_experts=32, n_ranks=1, p2p_world_size=1, n_sms=32),
     ["n_sms", "n_signal_sms"], "at least one comm SM"),
    (dict(ep_prod_reserve=True), ["ep_prod_reserve", "ep_final_layout"], "requires"),
    (dict(ep_final_layout=True, skip_a2a=True, n_ranks=1, n_experts=32, p2p_world_size=1),
     ["ep_final_layout", "skip_a2a"], "exclusive"),
    (dict(ep_final_layout=True, n_experts=256, max_tokens_per_rank=2**23),
     ["ep_final_layout", "n_experts", "max_tokens_per_rank"], "< 2**31"),
    (dict(has_rank_flag=True), ["has_rank_flag", "ep_ord_r"], "requires ep_ord_r"),
    (dict(ep_ord_r=True), ["has_rank_flag", "ep_ord_r"], "requires ep_ord_r"),
    (dict(timeout_ns=-1), ["timeout_ns"], ">= 0"),
    (dict(timeout_ns=1.5), ["timeout_ns"], "integer"),
    (dict(token_fmt="bf16"), ["token_fmt"], "TokenFormat"),
    (dict(use_shmem=1), ["use_shmem"], "bool"),
    (dict(ep_send_join_named="yes"), ["ep_send_join_named"], "bool"),
]
for _name in ("num_threads", "n_sms", "n_experts", "n_ranks", "max_tokens_per_rank",
              "p2p_world_size"):
    for _bad in (0, -4, 2.0, True, None):
        VIOLATIONS.append((dict([(_name, _bad)]), [_name], "positive integer"))


@pytest.mark.parametrize("changes,params,rule", VIOLATIONS,
                         ids=[f"{'-'.join(map(str, c))}={list(c.values())[0]!r}"
                              for c, _, _ in VIOLATIONS])
def test_each_rule_raises_value_error_naming_parameters(changes, params, rule):
    with pytest.raises(ValueError) as ei:
        make(**changes)
    msg = str(ei.value)
    assert isinstance(ei.value, EPConfigError)
    # one reported violation names every expected parameter and states the rule
    assert any(rule in text and all(p in f"{', '.join(names)}: {text}" for p in params)
               for names, text in ei.value.violations), msg
    for p in params:
        assert p in msg, (p, msg)


def test_all_violations_are_reported_together():
    with pytest.raises(EPConfigError) as ei:
        make(num_threads=1000, has_rank_flag=True, ep_prod_reserve=True)
    names = {p for params, _ in ei.value.violations for p in params}
    assert {"num_threads", "has_rank_flag", "ep_prod_reserve"} <= names


def test_format_constraints_are_reported():
    @attrs.frozen
    class Needs32Warps(BF16Format):
        def check_config(self, cfg):
            if cfg.num_threads != 1024:
                return [(("num_threads", "token_fmt"), "this format needs 32 warps")]
            return []

    make(token_fmt=Needs32Warps(7168, 8))
    with pytest.raises(ValueError, match="32 warps"):
        make(token_fmt=Needs32Warps(7168, 8), num_threads=512)


VALID = [
    dict(),
    dict(use_shmem=True, p2p_world_size=4),
    dict(has_rank_flag=True, ep_ord_r=True),
    dict(ep_final_layout=True),
    dict(ep_final_layout=True, ep_prod_reserve=True),
    dict(fused_shared_expert=True, ep_copy_role_split=True, ep_send_join_named=True),
    dict(n_experts=48, n_ranks=1, p2p_world_size=1, skip_a2a=True),
    dict(n_experts=48, n_ranks=1, p2p_world_size=1, skip_a2a=True, fused_shared_expert=True,
         token_fmt=BF16Format(7168, 64 // 8)),
    dict(num_threads=32, n_sms=4, n_experts=2, n_ranks=2, p2p_world_size=2,
         max_tokens_per_rank=1, token_fmt=BF16Format(8, 1)),
    dict(num_threads=1024, n_sms=132, n_experts=1024, n_ranks=32, p2p_world_size=8,
         token_fmt=BF16Format(7168, 32), use_shmem=True),
    dict(use_shmem=True, p2p_world_size=1, has_rank_flag=True, ep_ord_r=True,
         ep_send_join_named=True),
    dict(timeout_ns=0),
    # K may exceed n_experts under skip_a2a: the ids are global, n_experts is one device's
    dict(n_experts=4, n_ranks=1, p2p_world_size=1, skip_a2a=True, num_threads=128, n_sms=8),
    # skip_a2a with the reference's parameters: n_ranks and n_experts global, any P | R
    dict(skip_a2a=True),
    dict(skip_a2a=True, p2p_world_size=1),
    dict(skip_a2a=True, p2p_world_size=2, has_rank_flag=True, ep_ord_r=True,
         fused_shared_expert=True),
    dict(n_experts=16, n_ranks=8, skip_a2a=True, num_threads=128, n_sms=8),  # K = 8 > L = 2
]


@pytest.mark.parametrize("changes", VALID)
def test_valid_configurations(changes):
    cfg = make(**changes)
    cfg.layout.assert_l1_vslot_ticket_layout()
    cfg.layout.check()
    assert isinstance(cfg.token_fmt, TokenFormat)


def test_final_layout_excludes_the_fused_shared_expert():
    from epgen import BF16Format, EPConfig
    with pytest.raises(ValueError, match="ep_final_layout.*fused_shared_expert"):
        EPConfig(num_threads=256, n_sms=17, n_experts=32, n_ranks=2, max_tokens_per_rank=8,
                 p2p_world_size=2, use_shmem=False, token_fmt=BF16Format(hid_dim=64, top_k=2),
                 ep_final_layout=True, fused_shared_expert=True)


@pytest.mark.parametrize("preset,largest", [("small", 2**27 - 1), ("default", 2**23 - 1)])
def test_32_bit_index_limit_at_the_boundary(preset, largest):
    """The largest max_tokens_per_rank whose receive-buffer slots (E * T here) and src_info
    words stay below 2**31 builds; one more is refused, naming the parameters and the rule."""
    from epgen.config import INDEX_LIMIT
    base = load_preset(preset)
    cfg = base.replace(max_tokens_per_rank=largest)
    assert max(v for _, _, v in cfg.index_extents()) < INDEX_LIMIT
    lay = cfg.layout
    assert lay.recv_buf_bytes // lay.msg_bytes == cfg.index_extents()[0][2]
    with pytest.raises(EPConfigError) as err:
        base.replace(max_tokens_per_rank=largest + 1)
    assert any("max_tokens_per_rank" in params and "must be < 2**31" in rule
               and "32-bit" in rule for params, rule in err.value.violations)
    if base.n_experts * 100_000_000 >= 2**31:
        with pytest.raises(EPConfigError, match="receive-buffer slots"):
            base.replace(max_tokens_per_rank=100_000_000)


def test_32_bit_limit_counts_the_receive_block_capacity():
    """recv_block_capacity bounds the receive slots: a huge max_tokens_per_rank with a small
    capacity is refused only by the rows it can still receive."""
    base = load_preset("small")
    cfg = base.replace(max_tokens_per_rank=2**27, recv_block_capacity=2**25)
    assert cfg.index_extents()[0][2] == 16 * 2**25
    with pytest.raises(EPConfigError, match="src_info words 2 \\* max_out_rows"):
        base.replace(max_tokens_per_rank=2**28, recv_block_capacity=2**26 + 1)


def test_skip_a2a_keeps_the_global_parameters():
    """skip_a2a takes the reference's n_ranks and n_experts as they are: L = E // R experts
    per device, the derived members in the global E and R (not a per-device E)."""
    cfg = make(skip_a2a=True)
    assert (cfg.n_experts, cfg.n_ranks, cfg.layout.n_local_experts) == (256, 8, 32)
    assert cfg.layout.rank_flag_base == 256 and cfg.layout.cleanup_counter_offset == 1024
    assert not cfg.needs_shmem and cfg.effective_flags() == {}
    with pytest.raises(EPConfigError, match="n_experts must be a multiple of n_ranks"):
        make(skip_a2a=True, n_experts=250)
