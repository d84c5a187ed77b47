"""Every derived member of the reference page, against the page's formulas transcribed here
independently (not by calling the implementation), on many configurations."""


import numpy as np
import pytest

import ir
from epgen import BF16Format, EPConfig, EPConfigError, Layout
from epgen.config import SHMEM_EXCLUSIVE


# ---- the reference page, transcribed ------------------------------------------------------
def ceildiv(a, b):
    return -(-a // b)


def _resolve_warp_size():
    return 32


def align_up(x, a):
    return (x + a - 1) // a * a


def page_members(num_threads, n_sms, n_experts, n_ranks, max_tokens_per_rank, hid_dim, top_k,
                 alignment=16, ep_copy_role_split=False):
    """EPDispatchKernel comptime members as the reference page writes them."""
    # BF16TokenFormat
    token_size = align_up(2 * hid_dim, alignment)
    msg_size = token_size + align_up(4, alignment) + align_up(2 * top_k, alignment)

    m = {}
    m["cleanup_counter_offset"] = (4 * n_experts)
    m["hid_dim"] = hid_dim
    m["n_local_experts"] = (n_experts // n_ranks)
    m["l2_pool_cursor_slots"] = ((2 * m["n_local_experts"]) + 2)
    m["l1_vslot_ticket_offset"] = (
        ((3 * n_experts) + m["n_local_experts"])
        if ((1 + m["l2_pool_cursor_slots"]) <= (n_experts - m["n_local_experts"]))
        else ((4 * n_experts) + 4))
    m["l2_pool_cursor_offset"] = (m["l1_vslot_ticket_offset"] + 1)
    m["msg_bytes"] = msg_size
    m["n_dispatch_async_comm_sms"] = (
        n_sms - ceildiv(n_experts, (num_threads // _resolve_warp_size())))
    m["n_dispatch_wait_comm_sms"] = (n_sms - 1)
    m["n_offset_sms"] = 1
    m["n_signal_sms"] = ceildiv(n_experts, (num_threads // _resolve_warp_size()))
    m["n_warps"] = (num_threads // _resolve_warp_size())
    m["NB_SEND"] = 3
    m["rank_flag_base"] = (m["n_local_experts"] * n_ranks)
    m["rank_prefix_offset"] = (2 * n_experts)
    m["rc_cursor_base"] = (m["rank_flag_base"] + n_ranks)
    m["ready_flag_offset"] = ((4 * n_experts) + 1)
    m["send_buf_ready_offset"] = ((4 * n_experts) + 2)
    m["shared_expert_started_offset"] = ((4 * n_experts) + 3)
    m["sm_schedule_offset"] = ((6 * n_experts) + 7)
    m["top_k"] = top_k
    m["work_counter_offset"] = (3 * n_experts)
    # EPRoleSplit[num_threads, hid_dim // 8, ep_copy_role_split] (the copy/publisher warp split)
    n_copy_warps = num_threads // 32 - 4
    m["role_split"] = {
        "n_publisher_warps": 4, "n_copy_warps": n_copy_warps,
        "n_copy_threads": 32 * n_copy_warps, "n_trips": 3,
        "enabled": bool(ep_copy_role_split and n_copy_warps >= 1
                        and hid_dim // 8 == 3 * 32 * n_copy_warps)}
    # recv_count_size(): the [L, R] grid, R rank flags, L reservation cursors
    m["recv_count_size"] = m["n_local_experts"] * n_ranks + n_ranks + m["n_local_experts"]
    return m


CONFIGS = [
    # num_threads, n_sms, E, R, max_tpr, P, H, K
    (1024, 132, 256, 8, 128, 8, 7168, 8),     # default preset; ticket in Region C's tail
    (256, 16, 16, 4, 8, 4, 128, 4),           # small preset; 1 + 10 <= 12: first branch
    (128, 12, 8, 1, 4, 1, 64, 2),             # L = E: second branch (4E + 4)
    (256, 16, 16, 2, 8, 2, 128, 4),           # 1 + 18 > 8: second branch
    (64, 4, 6, 6, 2, 6, 8, 1),                # 1 + 4 == 5 == E - L: first branch at equality
    (64, 8, 12, 6, 2, 6, 8, 1),               # L = 2: 1 + 6 <= 10
    (32, 40, 32, 2, 3, 2, 16, 2),             # one warp per block: n_signal_sms = 32
    (1024, 132, 1024, 32, 64, 8, 7168, 32),   # largest E
    (384, 64, 48, 4, 16, 4, 6144, 8),         # role-split geometry (384 threads, H = 6144)
    (1024, 148, 128, 8, 4096, 8, 7168, 8),    # prefill-sized max_tpr
    (512, 8, 2, 2, 1, 1, 8, 2),               # P < R
]


def make(c, **flags):
    """The config of ``c``; with ``P < R`` it needs ``use_shmem``, which refuses some flags
    (``SHMEM_EXCLUSIVE``): those combinations are skipped, as no build has them."""
    num_threads, n_sms, E, R, max_tpr, P, H, K = c
    if P < R and any(flags.get(f) for f in SHMEM_EXCLUSIVE):
        pytest.skip(f"P={P} < R={R} needs use_shmem, which refuses {sorted(flags)}")
    return EPConfig(num_threads=num_threads, n_sms=n_sms, n_experts=E, n_ranks=R,
                    max_tokens_per_rank=max_tpr, p2p_world_size=P,
                    token_fmt=BF16Format(hid_dim=H, top_k=K), use_shmem=P < R, **flags)


def check_members(cfg, c, split=False):
    num_threads, n_sms, E, R, max_tpr, P, H, K = c
    want = page_members(num_threads, n_sms, E, R, max_tpr, H, K, ep_copy_role_split=split)
    lay = cfg.layout
    for name, value in want.items():
        if name == "role_split":
            rs = lay.role_split
            got = {k: getattr(rs, k) for k in value}
            assert got == value, (c, got, value)
        elif name == "recv_count_size":
            assert lay.recv_count_size() == value, c
        else:
            assert getattr(lay, name) == value, (name, c, getattr(lay, name), value)


@pytest.mark.parametrize("c", CONFIGS)
def test_members_match_reference_page(c):
    check_members(make(c), c)
    check_members(make(c, ep_copy_role_split=True), c, split=True)


def test_members_on_random_configurations(seed):
    rng = np.random.default_rng(seed)
    n_valid = 0
    for _ in range(400):
        R = int(rng.choice([1, 2, 3, 4, 6, 8, 16, 32]))
        L = int(rng.integers(1, 40))
        c = (int(rng.choice([32, 64, 128, 256, 512, 1024])), int(rng.integers(2, 160)), L * R, R,
             int(rng.integers(1, 300)), int(rng.choice([p for p in (1, 2, 4, 8) if R % p == 0])),
             8 * int(rng.integers(1, 1000)), int(rng.integers(1, 33)))
        try:
            cfg = make(c)
        except EPConfigError:
            continue
        n_valid += 1
        try:
            check_members(cfg, c)
        except AssertionError as exc:
            raise AssertionError(f"seed={seed}: {exc}") from exc
    assert n_valid > 50, f"seed={seed}: only {n_valid} valid configurations drawn"


def test_role_split_enabled_only_on_its_geometry():
    on = make((384, 64, 48, 4, 16, 4, 6144, 8), ep_copy_role_split=True).layout.role_split
    assert on.enabled and on.n_copy_warps == 8 and on.n_copy_threads == 256
    assert [on.publisher_idx(w) for w in range(8, 12)] == [0, 1, 2, 3]
    assert on.is_publisher(8) and not on.is_publisher(7)
    with pytest.raises(IndexError):
        on.publisher_idx(3)
    assert not make((384, 64, 48, 4, 16, 4, 6144, 8)).layout.role_split.enabled
    assert not make(CONFIGS[0], ep_copy_role_split=True).layout.role_split.enabled


def test_members_dict_lists_every_page_member():
    lay = make(CONFIGS[0]).layout
    members = lay.members()
    want = page_members(*CONFIGS[0][:5], *CONFIGS[0][6:])
    for name in want:
        key = "recv_count_size()" if name == "recv_count_size" else name
        assert key in members, name
    assert members["rank_flag_offset(src)"] is None
    flagged = make(CONFIGS[0], has_rank_flag=True, ep_ord_r=True).layout.members()
    assert flagged["rank_flag_offset(src)"] == "256 + src"


def test_rank_flag_offset():
    c = CONFIGS[1]
    lay = make(c, has_rank_flag=True, ep_ord_r=True).layout
    L, R = 16 // 4, 4
    assert [lay.rank_flag_offset(s) for s in range(R)] == [L * R + s for s in range(R)]
    with pytest.raises(IndexError):
        lay.rank_flag_offset(R)
    with pytest.raises(ValueError, match="has_rank_flag"):
        make(c).layout.rank_flag_offset(0)


@pytest.mark.parametrize("c", CONFIGS)
def test_recv_count_size_and_tails(c):
    cfg = make(c)
    lay = cfg.layout
    L, R = cfg.n_experts // cfg.n_ranks, cfg.n_ranks
    # always both tails: rank flags at [L*R, L*R + R), cursors at [L*R + R, L*R + R + L);
    # under the SHMEM transport the L*R arrival words follow, initialised 0
    assert lay.recv_count_size() == L * R + R + L
    assert lay.rc_cursor_base + L == lay.recv_count_size()
    arrivals = L * R if cfg.needs_shmem else 0
    assert lay.shmem_arrival_base == L * R + R + L and lay.shmem_arrival_words == arrivals
    init = lay.recv_count_initial()
    assert init.dtype == np.uint64 and len(init) == L * R + R + L + arrivals
    assert (init[:L * R + R] == np.uint64(2**64 - 1)).all() and (init[L * R + R:] == 0).all()
    assert lay.recv_count_bytes == 8 * (L * R + R + L + arrivals)


@pytest.mark.parametrize("c", CONFIGS)
def test_buffer_layouts(c):
    cfg = make(c)
    lay = cfg.layout
    num_threads, n_sms, E, R, max_tpr, P, H, K = c
    L = E // R
    msg = page_members(*c[:5], H, K)["msg_bytes"]
    rng = np.random.default_rng(0)
    for _ in range(50):
        e, r, slot, byte = (int(rng.integers(0, n)) for n in (L, R, max_tpr, msg))
        assert lay.recv_buf_layout(e, r, slot, byte) == \
            np.ravel_multi_index((e, r, slot, byte), (L, R, max_tpr, msg))
        assert lay.recv_count_layout(e, r) == np.ravel_multi_index((e, r), (L, R))
        assert lay.send_buf_layout(slot, byte) == np.ravel_multi_index((slot, byte),
                                                                       (max_tpr, msg))
    # vectorised over numpy arrays
    e = np.arange(L)
    assert (lay.recv_count_layout(e, R - 1) == e * R + R - 1).all()
    assert lay.recv_buf_bytes == L * R * max_tpr * msg == E * max_tpr * msg
    assert lay.block_capacity == max_tpr
    assert lay.send_buf_bytes == max_tpr * msg
    for bad in [(L, 0, 0, 0), (0, R, 0, 0), (0, 0, max_tpr, 0), (0, 0, 0, msg), (-1, 0, 0, 0)]:
        with pytest.raises(IndexError):
            lay.recv_buf_layout(*bad)
    with pytest.raises(IndexError):
        lay.send_buf_layout(max_tpr, 0)


def test_skip_a2a_forces_rank_coordinate_zero():
    cfg = EPConfig(num_threads=1024, n_sms=132, n_experts=48, n_ranks=1, max_tokens_per_rank=32,
                   p2p_world_size=1, token_fmt=BF16Format(7168, 8), skip_a2a=True,
                   use_shmem=False)
    lay = cfg.layout
    msg = 14368
    for my_rank in (0, 1, 5):
        assert lay.recv_count_layout(7, my_rank) == 7
        assert lay.recv_buf_layout(7, my_rank, 3, 10) == (7 * 32 + 3) * msg + 10
    assert "rank coord 0" in lay.members()["recv_buf_layout"]


def _skip(c, **flags):
    """The skip_a2a config of ``c`` in the reference's form: ``n_ranks = R`` and
    ``n_experts = E`` global, as without skip_a2a (skip_a2a sends nothing off the device, so no
    SHMEM transport whatever ``P``)."""
    num_threads, n_sms, E, R, max_tpr, P, H, K = c
    return EPConfig(num_threads=num_threads, n_sms=n_sms, n_experts=E, n_ranks=R,
                    max_tokens_per_rank=max_tpr, p2p_world_size=P,
                    token_fmt=BF16Format(hid_dim=H, top_k=K), use_shmem=False, skip_a2a=True,
                    **flags)


@pytest.mark.parametrize("c", CONFIGS)
def test_skip_a2a_members_keep_the_page_formulas(c):
    """Under skip_a2a every comptime member keeps the page's formula in the global
    ``n_experts`` and ``n_ranks`` (the page has no skip_a2a-dependent member)."""
    check_members(_skip(c), c)


# E = 32 experts over R = 4 ranks (L = 8), 256 threads (8 warps), 9 SMs, 16 tokens per rank,
# BF16 H = 256, K = 4: msg = align16(512) + align16(4) + align16(8) = 544 bytes. Every value
# below is worked out by hand from the page's formulas.
SKIP_REF = (256, 9, 32, 4, 16, 4, 256, 4)
SKIP_REF_MEMBERS = {
    "n_local_experts": 8,                  # E // R
    "n_warps": 8, "msg_bytes": 544,
    "n_signal_sms": 4,                     # ceildiv(32, 8)
    "n_dispatch_async_comm_sms": 5,        # 9 - 4
    "n_dispatch_wait_comm_sms": 8,         # 9 - 1
    "rank_prefix_offset": 64, "work_counter_offset": 96, "cleanup_counter_offset": 128,
    "ready_flag_offset": 129, "send_buf_ready_offset": 130,
    "shared_expert_started_offset": 131,
    "sm_schedule_offset": 199,             # 6 * 32 + 7
    "l2_pool_cursor_slots": 18,            # 2 * 8 + 2
    "l1_vslot_ticket_offset": 104,         # 1 + 18 <= 32 - 8: 3 * 32 + 8
    "l2_pool_cursor_offset": 105,
    "rank_flag_base": 32,                  # L * R
    "rc_cursor_base": 36,                  # 32 + R
}


def test_skip_a2a_reference_form_by_hand():
    cfg = _skip(SKIP_REF, has_rank_flag=True, ep_ord_r=True)
    lay = cfg.layout
    for name, want in SKIP_REF_MEMBERS.items():
        assert getattr(lay, name) == want, (name, getattr(lay, name), want)
    assert lay.recv_count_size() == 44                 # L*R + R + L = 32 + 4 + 8
    assert lay.rank_flag_offset(0) == 32 and lay.rank_flag_offset(3) == 35
    # the rank coordinate is forced to 0 for any my_rank; the expert stride stays R slots
    for my_rank in (0, 1, 3, 7):
        assert lay.recv_count_layout(5, my_rank) == 20                 # 5 * 4 + 0
        assert lay.recv_buf_layout(5, my_rank, 3, 10) == 323 * 544 + 10  # (5*4*16 + 3)
    assert lay.send_buf_layout(3, 10) == 3 * 544 + 10
    assert lay.recv_buf_bytes == 8 * 4 * 16 * 544                      # [L, R, 16, msg]
    assert lay.recv_count_bytes == 8 * 44
    assert lay.dispatch_async_region.size == 2 * 32 + 8
    assert lay.dispatch_wait_region.size == 6 * 32 + 8 + 9
    # ours: one source (the device itself), the device's 8 experts monitored
    assert (lay.n_sources, lay.n_monitored_experts) == (1, 8)
    assert lay.max_recv_tokens == 64                   # 1 source x min(16 * 4, 8 * 16)
    words = lay.recv_count_initial()
    assert (words[:36] == 2**64 - 1).all() and (words[36:] == 0).all()


def test_skip_a2a_second_ticket_branch_by_hand():
    # E = 8 over R = 4 (L = 2): 1 + (2*2 + 2) = 7 > E - L = 6, so the ticket is 4E + 4
    cfg = _skip((64, 5, 8, 4, 4, 1, 64, 2))
    lay = cfg.layout
    assert (lay.l1_vslot_ticket_offset, lay.l2_pool_cursor_offset) == (36, 37)
    assert (lay.rank_flag_base, lay.rc_cursor_base, lay.recv_count_size()) == (8, 12, 14)
    # msg = 128 + 16 + 16 = 160; slot row (1 * 4 + 0) * 4 + 3 = 19
    assert lay.recv_count_layout(1, 2) == 4 and lay.recv_buf_layout(1, 2, 3) == 19 * 160


def test_skip_a2a_per_device_form_is_the_r1_case():
    """n_ranks = 1 with n_experts = one device's experts (the reference host's
    instantiation): the same formulas with R = 1, by hand."""
    cfg = _skip((256, 9, 8, 1, 16, 1, 256, 4))
    lay = cfg.layout
    assert lay.n_local_experts == 8 and lay.n_signal_sms == 1
    assert (lay.rank_flag_base, lay.rc_cursor_base, lay.recv_count_size()) == (8, 9, 17)
    assert (lay.l1_vslot_ticket_offset, lay.sm_schedule_offset) == (36, 55)  # 4E+4, 6E+7
    assert lay.recv_count_layout(5, 3) == 5 and lay.recv_buf_layout(5, 3, 3) == 83 * 544
    assert (lay.n_sources, lay.n_monitored_experts) == (1, 8)


def test_layout_methods_accept_ir_expressions():
    lay = make(CONFIGS[0]).layout
    e = ir.const(3)
    off = lay.recv_buf_layout(e, ir.const(1), ir.const(2))
    assert isinstance(off, ir.nodes.ExprOps)
    assert isinstance(lay.recv_count_layout(e, ir.const(0)), ir.nodes.ExprOps)


@pytest.mark.parametrize("c", CONFIGS)
@pytest.mark.parametrize("flags", [{}, {"fused_shared_expert": True},
                                   {"has_rank_flag": True, "ep_ord_r": True}])
def test_counter_regions_cover_every_offset(c, flags):
    cfg = make(c, **flags)
    lay = cfg.layout
    num_threads, n_sms, E, R, max_tpr, P, H, K = c
    m = page_members(*c[:5], H, K)
    regions = lay.counter_regions()
    assert list(regions) == ["dispatch_async", "dispatch_wait", "combine_wait",
                             "combine_rank_completion", "final_layout"]
    assert regions["dispatch_async"].offset == 0
    assert regions["dispatch_async"].size == 2 * E + 8
    wait = regions["dispatch_wait"].size
    assert wait >= 4 * E + 4 and wait >= 6 * E + 8 + n_sms
    assert wait >= m["l2_pool_cursor_offset"] + m["l2_pool_cursor_slots"]
    for name in ("rank_prefix_offset", "work_counter_offset", "cleanup_counter_offset",
                 "ready_flag_offset", "send_buf_ready_offset", "shared_expert_started_offset",
                 "l1_vslot_ticket_offset", "l2_pool_cursor_offset", "sm_schedule_offset"):
        assert 0 <= m[name] < wait, name
    assert m["sm_schedule_offset"] + n_sms <= wait
    assert regions["combine_wait"].size >= max(2 * E, n_sms)
    assert regions["combine_rank_completion"].size == 8
    assert lay.combine_async_region == regions["dispatch_wait"]
    spans = sorted((r.offset, r.end) for r in regions.values())
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert lay.counter_words == spans[-1][1] and lay.counter_bytes == 4 * lay.counter_words
    assert all(r.offset % 32 == 0 for r in regions.values())
    assert regions["final_layout"].size == E and lay.final_base_offset == 0
    lay.assert_l1_vslot_ticket_layout()
    lay.check()


@pytest.mark.parametrize("c", CONFIGS)
def test_ticket_and_cursors_avoid_every_named_word(c):
    lay = make(c).layout
    num_threads, n_sms, E, R = c[:4]
    L = E // R
    t = lay.l1_vslot_ticket_offset
    used = set(range(t, lay.l2_pool_cursor_offset + lay.l2_pool_cursor_slots))
    others = (set(range(0, 3 * E + L)) | {4 * E, 4 * E + 1, 4 * E + 2, 4 * E + 3}
              | set(range(6 * E + 7, 6 * E + 7 + n_sms)))
    assert not used & others
    if t == 3 * E + L:
        assert max(used) < 4 * E


def test_assert_l1_vslot_ticket_layout_catches_a_bad_offset():
    class Overlapping(Layout):
        @property
        def l1_vslot_ticket_offset(self):
            return 3 * self.cfg.n_experts  # Region C's first claim counter

    class Outside(Layout):
        @property
        def l1_vslot_ticket_offset(self):
            return 10 * self.cfg.n_experts + 10 * self.cfg.n_sms

    cfg = make(CONFIGS[0])
    for bad in (Overlapping(cfg), Outside(cfg)):
        with pytest.raises(AssertionError):
            bad.assert_l1_vslot_ticket_layout()


# routed rows: R sources x max_tpr tokens x min(K, L) copies each (K=8, L=32, R=8, max_tpr=128)
@pytest.mark.parametrize("flags,rows", [
    ({}, 8 * 128 * 8),
    ({"fused_shared_expert": True}, 8 * 128 * 8 + 128),
    ({"ep_final_layout": True}, 8 * 128 * 8),
    ({"ep_final_layout": True, "ep_prod_reserve": True}, 8 * 128 * 8),
    ({"recv_block_capacity": 16}, 8 * 32 * 16),
])
def test_output_sizes(flags, rows):
    lay = make(CONFIGS[0], **flags).layout
    se = int(bool(flags.get("fused_shared_expert")))
    assert lay.max_recv_tokens == rows
    assert lay.max_out_rows >= rows
    s = lay.sizes()
    assert s["row_offsets_len"] == 32 + 1 + se and s["expert_ids_len"] == 32 + se
    assert s["out_tokens_shape"] == [lay.max_out_rows, 7168]
    assert s["src_info_shape"] == [lay.max_out_rows, 2]


def test_recv_block_capacity_bounds_the_receive_buffer():
    lay = make(CONFIGS[0], recv_block_capacity=16).layout
    L, R, msg = 32, 8, lay.msg_bytes
    assert lay.block_capacity == 16
    assert lay.recv_buf_bytes == L * R * 16 * msg
    assert lay.recv_buf_layout(1, 2, 15, 3) == ((1 * R + 2) * 16 + 15) * msg + 3
    with pytest.raises(IndexError):
        lay.recv_buf_layout(0, 0, 16, 0)
    for bad in (0, 129, True, 2.5):
        with pytest.raises(ValueError, match="recv_block_capacity"):
            make(CONFIGS[0], recv_block_capacity=bad)


# ---- ep_final_layout / ep_prod_reserve buffers (ours, docs/final-layout.md) -------------------
@pytest.mark.parametrize("c", CONFIGS)
def test_final_layout_buffers(c):
    num_threads, n_sms, E, R, max_tpr, P, H, K = c
    L = E // R
    plain = make(c).layout
    assert plain.hdr_buf_bytes == 0 and plain.prod_buf_words == 0
    lay = make(c, ep_final_layout=True).layout
    fmt = lay.cfg.token_fmt
    # a header row is the staged message's header fields: src index, src rank, top-k ids
    assert lay.hdr_bytes == fmt.msg_size() - fmt.token_size and lay.hdr_bytes % 16 == 0
    assert lay.hdr_src_rank_offset == 4 and lay.hdr_src_rank_offset + 4 <= fmt.src_info_size
    assert lay.hdr_topk_offset == fmt.src_info_size
    assert lay.hdr_topk_offset + 2 * K <= lay.hdr_bytes
    assert lay.capacity_strided and lay.max_out_rows == L * R * max_tpr
    assert lay.hdr_buf_bytes == lay.max_out_rows * lay.hdr_bytes
    assert lay.recv_buf_bytes == 0 and lay.prod_buf_words == 0   # nothing staged
    prod = make(c, ep_final_layout=True, ep_prod_reserve=True).layout
    assert not prod.capacity_strided
    assert prod.max_out_rows == make(c).layout.max_out_rows
    # E early counts (destination side), then E mailboxes (source side), UInt64 words
    assert prod.prod_early_count_offset == 0 and prod.prod_mailbox_offset == E
    assert prod.prod_gen_word_offset == 2 * E     # after the early counts and mailboxes
    assert prod.prod_buf_words == 2 * E + 1 and prod.prod_buf_bytes == 16 * E + 8
    assert prod.sizes()["prod_buf_words"] == 2 * E + 1
    # the reservation cursors end the receive-count buffer and start at 0
    init = prod.recv_count_initial()
    assert (init[prod.rc_cursor_base:] == 0).all() and len(init) == prod.rc_cursor_base + L


def test_recv_block_capacity_has_no_effect_with_final_layout():
    lay = make(CONFIGS[0], ep_final_layout=True, recv_block_capacity=16).layout
    assert lay.block_capacity == 128 and lay.recv_buf_bytes == 0
