"""The combine under the SHMEM transport on the CPU (``use_shmem`` with ``p2p_world_size <
n_ranks``; docs/combine.md): rows to a source outside the sender's P2P group go by a warp's
``nvshmemx_putmem_signal_nbi_warp`` (the row, then 1 on the arrival word), the publication
by ``nvshmemx_signal_op`` (the simulator's model, ``backends.sim.shmem``: every transfer
lands rounds late, in any order NVSHMEM allows). ``EmulatedWorld(cfg,
backend="sim").combine`` equals ``epgen.reference.combine`` bit for bit with every source
remote (``p2p_world_size = 1``) and mixed (4 ranks in groups of 2), weights and None, a
residual, back-to-back calls; puts and signals target remote PEs only, one put per row and
on each arrival word one signal per row plus the publication; a missing quiet, an unordered
signal and a missing wait for the rows are caught; a corrupted ``src_info`` row bound for a
remote source is reported and nothing is written for it; the kernels' calls."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
import ir
from backends import sim as sim_backend
from backends.sim import shmem as sim_shmem
from epgen import reference, routing
from epgen.combine_layout import CombineLayout
from epgen.errors import EPInputError
from epgen.formats import make_format
from epgen.kernels import build_combine_module, combine_async
from epgen.reference_combine import source_of_rows
from epgen.runtime import combine as combine_mod

from combine_checks import expert_outputs, weights
from sim_world import sim_world

#: (n_ranks, p2p_world_size): every source remote, and mixed
GROUPS = {"p2p1": (2, 1), "mixed": (4, 2)}
NVSHMEM_CALLS = {"nvshmemx_putmem_signal_nbi_warp", "nvshmem_quiet", "nvshmemx_signal_op"}


def make_cfg(R=2, P=1, T=4, **flags):
    L = 2
    return epgen.EPConfig(num_threads=64, n_sms=R + 2, n_experts=L * R, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=P, use_shmem=True,
                          token_fmt=make_format("BF16", 256, 2), **flags)


def residuals(rng, cfg, ids):
    H = cfg.token_fmt.hid_dim
    return [rng.integers(0, 1 << 16, size=(len(i), H), dtype=np.uint16) & np.uint16(0xBFFF)
            for i in ids]


def assert_same(got, want, what):
    assert len(got) == len(want), what
    for s, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"{what} rank {s}: {np.count_nonzero(g != r)} elements differ"


def calls_in(kernel: ir.Kernel) -> list[str]:
    names = []

    def walk(stmts):
        for s in stmts:
            if isinstance(s, ir.nodes.Call):
                names.append(s.name)
            for attr in ("then", "orelse", "body"):
                walk(getattr(s, attr, None) or ())
    for role in kernel.roles:
        walk(role.body)
    return names


@pytest.mark.parametrize("group", GROUPS, ids=list(GROUPS))
def test_combine_matches_the_reference_bit_for_bit(group, seed):
    R, P = GROUPS[group]
    cfg = make_cfg(R, P)
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        for call in range(3):
            counts = ([cfg.max_tokens_per_rank] * R if call == 0 else
                      [int(rng.integers(0, cfg.max_tokens_per_rank + 1)) for _ in range(R)])
            toks, ids = routing.routing(rng, cfg, counts)
            results = world.dispatch(toks, ids)
            ys = expert_outputs(rng, cfg, results)
            w = weights(rng, cfg, ids)
            what = f"seed {seed} call {call} counts {counts}"
            assert_same(world.combine(ys, w), reference.combine(cfg, results, ys, w),
                        f"{what} weighted")
            assert_same(world.combine(ys, None),
                        reference.combine(cfg, results, ys, None,
                                          n_tokens=[len(i) for i in ids]),
                        f"{what} unreduced")
            res = residuals(rng, cfg, ids)
            assert_same(world.combine(ys, w, residual=res),
                        reference.combine(cfg, results, ys, w, residual=res),
                        f"{what} residual")


def test_puts_and_signals_go_to_remote_sources_only(seed, monkeypatch):
    """Every combine put targets the row's source, outside the sender's group, one per row;
    on the arrival word of each (destination, remote source) one signal per row (the
    put-with-signal's) and one publication; the in-group rows and words go by peer stores
    (no call)."""
    seen = []
    translate = sim_shmem.SymmetricHeap.translate

    def record(heap, addr, pe, nbytes=1):
        src, name, _ = heap.locate(addr, nbytes)
        seen.append((name, src, int(pe)))
        return translate(heap, addr, pe, nbytes)
    cfg = make_cfg(4, 2)
    P = cfg.p2p_world_size
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank] * cfg.n_ranks)
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        monkeypatch.setattr(sim_shmem.SymmetricHeap, "translate", record)
        assert_same(world.combine(ys, w), reference.combine(cfg, results, ys, w),
                    f"seed {seed}")
    puts = sorted((d, s) for n, d, s in seen if n == "combine_recv")
    want = sorted((d, int(s)) for d, res in enumerate(results) for s in source_of_rows(res)
                  if int(s) // P != d // P)
    assert puts and puts == want
    signals = sorted((d, s) for n, d, s in seen if n == "combine_arrival")
    publications = [(d, s) for d in range(4) for s in range(4) if d // P != s // P]
    assert signals == sorted(puts + publications)
    assert {n for n, _, _ in seen} == {"combine_recv", "combine_arrival"}


def test_missing_quiet_is_caught(seed, monkeypatch):
    """Without the warps' quiet the puts and signals are never completed: NVSHMEM promises
    nothing at a kernel's end, so the simulator fails a thread that exits with operations
    issued after its last quiet instead of passing by luck."""
    monkeypatch.setattr(combine_async, "complete_puts", lambda r, cfg, issued: None)
    cfg = make_cfg(2, 1)
    rng = np.random.default_rng(seed)
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank] * 2)
        results = world.dispatch(toks, ids)
        with pytest.raises(sim_backend.SimError, match="never completed"):
            world.combine(expert_outputs(rng, cfg, results), None)


def test_a_corrupted_row_bound_for_a_remote_source_is_reported_and_writes_nothing(seed):
    """A row of destination 1 whose source is remote gets ``t = max_tokens_per_rank``: the
    error names it, no slot and no guard byte of any rank's receive buffer (pre-filled with
    0xA5) is written for it, every valid row lands, and the next call is exact."""
    cfg = make_cfg(2, 1)
    K, H, T = cfg.token_fmt.top_k, cfg.token_fmt.hid_dim, cfg.max_tokens_per_rank
    rng = np.random.default_rng(seed)
    d = 1
    with sim_world(cfg, seed) as world:
        for _ in range(20):      # a routing where destination d got a row from rank 0
            toks, ids = routing.routing(rng, cfg, [T] * 2)
            results = world.dispatch(toks, ids)
            remote = np.flatnonzero(source_of_rows(results[d]) != d)
            if len(remote):
                break
        assert len(remote), f"seed {seed}: no remote row in 20 routings"
        ys = expert_outputs(rng, cfg, results)
        world.combine(ys, None)                   # builds the buffers
        row = int(rng.choice(remote))
        bad = results[d].src_info.copy()
        bad[row] = (T, 0)
        comb = world._combiner
        nbytes = comb.bufs[0].recv_bytes
        for b in comb.bufs:
            b.recv.copy_from_host(np.full(nbytes + combine_mod.GUARD_BYTES, 0xA5, np.uint8))
        with pytest.raises(EPInputError, match=rf"rank {d} src_info\[{row}\] = \({T}, 0\)"):
            world.combine(ys, None, _src_info=[None, bad])
        for s, b in enumerate(comb.bufs):
            mem = b.recv.to_host()
            assert np.all(mem[nbytes:] == 0xA5), f"seed {seed} rank {s}: guard bytes written"
            slots = mem[:nbytes].view(np.uint16).reshape(T, K, H)
            written = np.zeros((T, K), bool)
            expect = np.zeros((T, K, H), np.uint16)
            for dd, (res, y) in enumerate(zip(results, ys)):
                srcs = source_of_rows(res)
                for i in range(len(res.src_info)):
                    if srcs[i] == s and not (dd == d and i == row):
                        t, k = res.src_info[i]
                        written[t, k] = True
                        expect[t, k] = y[i]
            assert np.array_equal(slots[written], expect[written]), f"rank {s}: rows wrong"
            assert np.all(slots[~written].view(np.uint8) == 0xA5), \
                f"seed {seed} rank {s}: a slot no valid row targets was written"
        toks, ids = routing.routing(rng, cfg, [T] * 2)
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        assert_same(world.combine(ys, w), reference.combine(cfg, results, ys, w),
                    f"seed {seed} after the error")


def test_kernel_calls_only_with_remote_sources():
    """combine_async calls NVSHMEM only under the SHMEM transport; combine_wait only for the
    consistency step after its arrival polls (``nvshmem_signal_wait_until``); with every
    source in the group the module is the P2P one."""
    m = build_combine_module(make_cfg(4, 2))
    names = {k.name: calls_in(k) for k in m.kernels}
    assert set(names["ep_combine_async"]) == NVSHMEM_CALLS
    assert names["ep_combine_wait"] == ["nvshmem_signal_wait_until"]
    seq = names["ep_combine_async"]
    # per source: a put-with-signal per row, a signal for a refused row, the publication;
    # then one quiet for the warp, after the last source
    assert seq.count("nvshmemx_putmem_signal_nbi_warp") == 4
    assert seq.count("nvshmemx_signal_op") == 8
    assert seq.count("nvshmem_quiet") == 1 and seq[-1] == "nvshmem_quiet"
    same = make_cfg(2, 2)
    assert all(calls_in(k) == [] for k in build_combine_module(same).kernels)
    assert ir.print_module(build_combine_module(same)) == \
        ir.print_module(build_combine_module(same.replace(use_shmem=False)))


def test_arrival_words_are_u64_under_the_shmem_transport():
    assert CombineLayout(make_cfg(2, 1)).arrival_word_bytes == 8
    assert CombineLayout(make_cfg(2, 2)).arrival_word_bytes == 4
    assert combine_mod.combine_sizes(make_cfg(4, 2))["combine_arrival_word_bytes"] == 8
    combine_mod.check_supported(make_cfg(4, 2))         # no longer refused


def failing_seeds(cfg, monkeypatch, transform, seeds=range(4)) -> int:
    """How many of ``seeds`` fail a dispatch then a fused combine (``EmulatedWorld(fused=
    True)``: a rank reduces while its peers still send) whose combine modules are built
    through ``transform`` (a wrong result or a hang)."""
    build = combine_mod.build_combine_module
    monkeypatch.setattr(combine_mod, "build_combine_module",
                        lambda c, *a, **k: transform(build(c, *a, **k)))
    failures = 0
    for s in seeds:
        rng = np.random.default_rng(s)
        try:
            with sim_world(cfg, s, max_spins=3000, fused=True) as world:
                toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank] * cfg.n_ranks)
                results = world.dispatch(toks, ids)
                ys = expert_outputs(rng, cfg, results)
                w = weights(rng, cfg, ids)
                assert_same(world.combine(ys, w), reference.combine(cfg, results, ys, w),
                            f"seed {s}")
        except (AssertionError, sim_backend.SimHang):
            failures += 1
    return failures


def test_unordered_signal_is_caught(monkeypatch):
    """Each row's put-with-signal orders the row before its count on the arrival word: split
    into the same put and a plain signal by lane 0, some seed's source reduces a row that
    has not landed."""
    from epgen.ordering import mutations

    def split(module):
        found = [oid for k in module.kernels for oid, _ in mutations.ordered_ops(k)
                 if oid.endswith("nvshmemx_putmem_signal_nbi_warp")]
        for oid in reversed(found):     # the last first: the others' indices stay
            module = mutations.mutate(module, oid, "unordered")
        return module
    assert failing_seeds(make_cfg(4, 1, T=8), monkeypatch, split) >= 2


def test_missing_wait_for_the_rows_is_caught(monkeypatch):
    """The source must wait for the low half of the arrival word to count every published
    row: with the publication alone (the P2P transport's wait), some seed reduces a row that
    has not landed."""
    from epgen.kernels import combine_shmem, combine_wait

    def publication_only(r, cfg, arrival, d):
        r.spin_wait(combine_shmem.word(arrival, d, 8), ir.types.u64, ir.CmpOp.NE, 0,
                    buffer="combine_arrival", index=d, sem=ir.Sem.ACQUIRE,
                    scope=ir.Scope.SYS)
    monkeypatch.setattr(combine_wait, "wait_arrival", publication_only)
    assert failing_seeds(make_cfg(4, 1, T=8), monkeypatch, lambda m: m) >= 2
