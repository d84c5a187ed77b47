"""``ep_rank_dedup`` with destinations outside the P2P group (``use_shmem``; docs/flags.md,
docs/shmem.md) on the simulator's NVSHMEM model (every put and signal landing rounds late, in
any order NVSHMEM allows): against ``epgen.reference.dispatch`` for every format, all ranks
remote and mixed groups, ORD-R, the fused kernel, routings with all of a token's experts on
one rank and ``-1`` slots; the puts (one message per (token, remote rank), one index word put
with its arrival signal per remote top-k slot); the calls the send kernel makes; and that the
fence between a (token, rank)'s puts and its slots' signals is caught when removed."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
import ir
from backends.sim import shmem as sim_shmem
from epgen import reference
from epgen.formats import make_format
from epgen.ordering import mutations

import format_cases
from format_cases import case_ids
from sim_world import sim_world
from test_rank_dedup_sim import _edge_calls, _run
from test_shmem_sim import call_sites, failing_seeds, run_calls

FORMATS = [(f, 256) for f in format_cases.PLAIN] + format_cases.sim_cases()
#: (n_ranks, p2p_world_size): every peer remote, and mixed
GROUPS = {"p2p1": (2, 1), "mixed": (4, 2)}


def make_cfg(fmt="BF16", H=256, R=2, P=1, K=2, L=2, T=4, **flags):
    return epgen.EPConfig(num_threads=64, n_sms=max(R + 2, -(-L * R // 2) + 2),
                          n_experts=L * R, n_ranks=R, max_tokens_per_rank=T,
                          p2p_world_size=P, use_shmem=True, token_fmt=make_format(fmt, H, K),
                          ep_rank_dedup=True, **flags)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("fmt,H", FORMATS, ids=case_ids(FORMATS))
def test_round_trips_match_reference(fmt, H, group, seed):
    R, P = GROUPS[group]
    run_calls(make_cfg(fmt, H, R=R, P=P), seed)


def test_ord_r_mixed(seed):
    run_calls(make_cfg(R=4, P=2, ep_ord_r=True, has_rank_flag=True), seed)


def test_fused_kernel_mixed(seed):
    run_calls(make_cfg(R=4, P=2), seed, fused=True)


@pytest.mark.parametrize("group", GROUPS)
def test_several_and_all_experts_on_one_rank_and_masked_slots(group, seed):
    R, P = GROUPS[group]
    cfg = make_cfg(R=R, P=P, K=3, L=3, T=6)
    _run(cfg, seed, _edge_calls(cfg, seed))


def test_one_put_per_token_and_remote_rank(seed, monkeypatch):
    """Every put and signal, by target buffer: one message put (the message and the token's
    weights, ``dedup_row_bytes``) per (source, token, remote rank with one of its experts),
    one 4-byte slot-word put, one 4-byte index-word put and one arrival signal per remote
    top-k slot; nothing to a rank of the issuer's own group."""
    seen = []
    translate = sim_shmem.SymmetricHeap.translate
    cfg = make_cfg(R=4, P=2, K=3, L=3, T=6)
    lay = cfg.layout

    def record(heap, addr, pe, nbytes=1):
        src, name, off = heap.locate(addr, nbytes)
        if name == "recv_count":
            name = "arrival" if off // 8 >= lay.shmem_arrival_base else "count"
        elif name == "recv_buf":
            name = "slot" if off >= lay.dedup_slot_offset else \
                "index" if off >= lay.dedup_index_offset else "message"
        seen.append((name, src, int(pe), nbytes))
        return translate(heap, addr, pe, nbytes)
    monkeypatch.setattr(sim_shmem.SymmetricHeap, "translate", record)
    (toks, ids), = _edge_calls(cfg, seed, n_calls=1)
    with sim_world(cfg, seed) as world:
        reference.assert_match(cfg, reference.dispatch(cfg, toks, ids),
                               world.dispatch(toks, ids))
    P, L = cfg.p2p_world_size, lay.n_local_experts
    assert seen and all(src // P != dst // P for _, src, dst, _ in seen)
    slots = sorted((src, int(g) // L) for src, x in enumerate(ids) for g in np.ravel(x)
                   if g >= 0 and src // P != int(g) // L // P)
    tokens = sorted({(src, t, int(g) // L) for src, x in enumerate(ids)
                     for t, row in enumerate(x) for g in row
                     if g >= 0 and src // P != int(g) // L // P})
    messages = [(s, d, n) for name, s, d, n in seen if name == "message"]
    assert sorted((s, d) for s, d, _ in messages) == sorted((s, d) for s, _, d in tokens)
    assert all(n == lay.dedup_row_bytes for _, _, n in messages)     # message + weights
    assert len(tokens) < len(slots)                 # the routings repeat ranks
    assert sorted((s, d) for name, s, d, n in seen if name == "index" and n == 4) == slots
    assert sorted((s, d) for name, s, d, n in seen if name == "slot" and n == 4) == slots
    assert sorted((s, d) for name, s, d, _ in seen if name == "arrival") == slots


def test_send_kernel_calls():
    """The send kernel's NVSHMEM calls, in statement order: the message put, each slot's
    slot-word put, the fence, each slot's index word put with its arrival signal, the warp's
    quiet; the monitor's count signal and quiet."""
    module = epgen.build_module(make_cfg(R=4, P=2))
    kernel = module.kernel("ep_dispatch_async")
    comm = [name for name, role, _ in call_sites(kernel) if role == "comm"]
    assert comm == ["nvshmemx_putmem_nbi_warp", "nvshmemx_putmem_nbi_warp", "nvshmem_fence",
                    "nvshmemx_putmem_signal_nbi_warp", "nvshmem_quiet"]
    others = {name for name, role, _ in call_sites(kernel) if role != "comm"}
    assert others == {"nvshmemx_signal_op", "nvshmem_quiet"}
    assert ir.check(module) == []


def test_missing_fence_is_caught(monkeypatch):
    """Without the fence a slot's arrival signal may land before the message or its slot
    word: some seeds' destinations copy a row that has not landed (the fused kernel, where a
    rank's copy runs while its peers still send). Eight seeds: each message is read once, by
    the slot that copies it, so fewer reads can see one early."""
    def drop_fences(module):
        found = [oid for k in module.kernels for oid, _ in mutations.ordered_ops(k)
                 if oid.endswith("nvshmem_fence")]
        assert found
        for oid in reversed(found):
            module = mutations.mutate(module, oid, "removed")
        return module
    assert failing_seeds(make_cfg(R=4, P=1), monkeypatch, drop_fences, seeds=range(8),
                         fused=True) >= 2
