"""The FP8 combine (``fp8=True``: ``ep_combine_async_fp8``, ``ep_combine_wait_fp8``,
``ep_combine_fp8``; docs/combine.md, "FP8 combine") on the CPU simulator: every result equals
``epgen.reference.combine(..., fp8=True)`` bit for bit (the reference quantises with the
BlockwiseFP8 format's host quantiser), on 2 and 4 ranks, weighted, with a residual and
unreduced, after a quantising dispatch format, in the final layout, with the fused kernel,
the shared expert, ``skip_a2a``, the SHMEM transport (one put per row, codes and scales
together), ``P2PWorld`` and ``ShmemWorld``, a captured graph, the DeepEP API, rank masks,
masked (``-1``) slots, zero / -0 / NaN / infinite / subnormal rows, and consecutive calls alternating the FP8 and the BF16 combine (each exact, without a rebuild)."""

from __future__ import annotations

import numpy as np
import pytest

import epgen
from backends import sim as sim_backend
from backends.sim import shmem as sim_shmem
from epgen import combine_fp8, reference, routing
from epgen.errors import EPInputError
from epgen.formats import make_format
from epgen.reference_combine import source_of_rows
from epgen.runtime.world import EmulatedWorld

from combine_checks import expert_outputs, round_trip_inputs, weights
from combine_fp8_checks import assert_same, check_fp8_round_trips, plant_special_rows
from mask_checks import assert_survivors, combine_and_check, draw
from sim_world import sim_world
from world_checks import make_cfg


def _tiny(fmt="BF16", H=128, R=2, K=2, T=4, **flags):
    """A grid the simulator runs quickly: 64 threads x 5 blocks, 4 tokens per rank."""
    return epgen.EPConfig(num_threads=64, n_sms=5, n_experts=2 * R, n_ranks=R,
                          max_tokens_per_rank=T, p2p_world_size=R, use_shmem=False,
                          token_fmt=make_format(fmt, H, K), **flags)


def _launched(world) -> set[str]:
    """The combine kernels the world has launched (both modules)."""
    comb = world.combiner()
    names = {k for k, _ in comb.program.loaded.launched}
    if comb.fp8_side is not None:
        names |= {k for k, _ in comb.fp8_side.program.loaded.launched}
    return names


@pytest.mark.parametrize("R", [2, 4])
def test_fp8_combine_matches_the_reference_bit_for_bit(R, seed):
    """Weighted with a residual, weighted, unreduced; each followed by a BF16 combine of the
    same dispatch (the two switch per call); 3 calls, masked slots on the odd ones."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=R, H=256, K=4 if R == 4 else 2)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 3), f"R={R}")
    assert _launched(world) == {"ep_combine_async", "ep_combine_wait",
                                "ep_combine_async_fp8", "ep_combine_wait_fp8"}


def test_a_quantising_dispatch_format(seed):
    """A BlockwiseFP8 dispatch: the experts' outputs are BF16 all the same, quantised again
    for the combine."""
    rng = np.random.default_rng(seed)
    cfg = _tiny("BlockwiseFP8", H=128)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2), "BlockwiseFP8",
                          alternate=False)


def test_final_layout(seed):
    """``ep_final_layout`` + ``ep_prod_reserve``, 4 ranks: rows found as the BF16 combine
    finds them."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=4, ep_final_layout=True, ep_prod_reserve=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2), "final layout",
                          forms=("weighted+residual", "unreduced"), alternate=False)


@pytest.mark.parametrize("R", [2, 4])
def test_fused_kernel(R, seed):
    """``ep_combine_fp8`` (one launch per rank) when the world runs the fused dispatch."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=R)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, fused=True)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2), "fused",
                          forms=("weighted+residual", "unreduced"))
    assert _launched(world) == {"ep_combine", "ep_combine_fp8"}


@pytest.mark.parametrize("devices", [None, 3], ids=["ranks", "skip_a2a"])
def test_fused_shared_expert(devices, seed):
    """The shared expert's rows are the source's own BF16 rows (they do not cross a link):
    added after the dequantised routed slots, before the residual."""
    rng = np.random.default_rng(seed)
    skip = devices is not None
    cfg = _tiny(R=1 if skip else 2, skip_a2a=skip, fused_shared_expert=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=devices)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2, devices=devices),
                          "fused SE", forms=("weighted+residual",))


def test_skip_a2a(seed):
    """Independent devices: each combines its own local slots in FP8."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=1, K=4, skip_a2a=True)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed, devices=3)
    check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2, devices=3),
                          "skip_a2a", forms=("weighted", "unreduced"), alternate=False)


def test_special_rows(seed):
    """Zero, -0, NaN, +-inf and subnormal expert-output rows: the kernels give the
    reference's bits, and the reference gives what docs/combine.md states (an all-zero or
    all -0 row adds +0; a subnormal row quantises to zero codes; a NaN element becomes -448 of
    its group's scale; an infinite element makes its group's scale +inf: the element
    dequantises to -inf, the rest of its group to NaN)."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(R=2, H=256)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = world.dispatch(toks, ids)
    ys = expert_outputs(rng, cfg, results)
    planted = plant_special_rows(rng, ys)
    w = weights(rng, cfg, ids)
    for wt in (w, None):
        got = world.combine(ys, wt, fp8=True)
        assert_same(got, reference.combine(cfg, results, ys, wt, n_tokens=[len(i) for i in ids],
                                           fp8=True), f"seed {seed} special rows {wt is None}")
    H = cfg.token_fmt.hid_dim
    for d, row, case in planted:
        y = ys[d][row:row + 1]
        v = combine_fp8.wire_values(cfg, y)[0]
        codes, scales = combine_fp8.quantize_rows(cfg, y)
        g = np.arange(H) // combine_fp8.GROUP
        if case in ("zero", "neg_zero", "subnormal"):
            assert not np.any(codes & 0x7F) and np.all(v == 0), case
        elif case == "nan":
            col = int(np.nonzero(y[0] == 0x7FC0)[0][0])
            assert v[col] == np.float32(-448) * scales[0, g[col]], case
        else:
            col = int(np.nonzero((y[0] & 0x7FFF) == 0x7F80)[0][0])
            group = g == g[col]
            assert np.isinf(scales[0, g[col]]) and v[col] == -np.inf, case
            assert np.all(np.isnan(v[group & (np.arange(H) != col)])), case
            assert np.all(np.isfinite(v[~group])), case


@pytest.mark.parametrize("group", [(2, 1), (4, 2)], ids=["p2p1", "mixed"])
def test_shmem_transport(group, seed, monkeypatch):
    """Sources outside the P2P group get each row by ONE put-with-signal of its whole slot
    (codes and scales), from the send staging; in-group sources by peer stores; weighted,
    residual and unreduced equal the reference; then a BF16 combine of the same world."""
    R, P = group
    cfg = epgen.EPConfig(num_threads=64, n_sms=R + 2, n_experts=2 * R, n_ranks=R,
                         max_tokens_per_rank=4, p2p_world_size=P, use_shmem=True,
                         token_fmt=make_format("BF16", 128, 2))
    rng = np.random.default_rng(seed)
    seen = []
    translate = sim_shmem.SymmetricHeap.translate

    def record(heap, addr, pe, nbytes=1):
        src, name, _ = heap.locate(addr, nbytes)
        seen.append((name, src, int(pe), nbytes))
        return translate(heap, addr, pe, nbytes)
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank] * R)
        results = world.dispatch(toks, ids)
        ys = expert_outputs(rng, cfg, results)
        w = weights(rng, cfg, ids)
        monkeypatch.setattr(sim_shmem.SymmetricHeap, "translate", record)
        assert_same(world.combine(ys, w, fp8=True),
                    reference.combine(cfg, results, ys, w, fp8=True), f"seed {seed} weighted")
        monkeypatch.undo()
        puts = sorted((d, s) for n, d, s, _ in seen if n == "combine_fp8_recv")
        want = sorted((d, int(s)) for d, res in enumerate(results)
                      for s in source_of_rows(res) if int(s) // P != d // P)
        assert puts and puts == want, "one put per row to each remote source"
        assert {b for n, _, _, b in seen if n == "combine_fp8_recv"} == \
            {combine_fp8.slot_bytes(cfg)}, "a put carries the whole slot: codes and scales"
        n_tok = [len(i) for i in ids]
        res = [rng.integers(0, 1 << 16, size=(len(i), 128), dtype=np.uint16) & np.uint16(0xBFFF)
               for i in ids]
        assert_same(world.combine(ys, w, residual=res, fp8=True),
                    reference.combine(cfg, results, ys, w, residual=res, fp8=True),
                    f"seed {seed} residual")
        assert_same(world.combine(ys, None, fp8=True),
                    reference.combine(cfg, results, ys, None, n_tokens=n_tok, fp8=True),
                    f"seed {seed} unreduced")
        assert_same(world.combine(ys, w), reference.combine(cfg, results, ys, w),
                    f"seed {seed} bf16 after fp8")


def test_rank_masks(seed):
    """A rank masked by hand gets no row and is not waited for; its experts' slots weigh
    nothing in the FP8 combine either (the reference without it)."""
    rng = np.random.default_rng(seed)
    cfg = make_cfg(4, 8, 128, 2, 4, 64, 6, ep_rank_mask=True)
    world = epgen.EmulatedWorld(cfg, backend=sim_backend.Machine(seed, max_spins=1000))
    world.update_mask(2, True)
    (toks, ids), (full_t, full_i) = draw(rng, cfg)
    world.load_inputs(toks, ids)
    world.enqueue_round_trip()
    world.check()
    res = world.results()
    assert_survivors(cfg, res, full_t, full_i, {2})
    assert combine_and_check(world, rng, res, full_t, full_i, {2}, fp8=True) == []


def test_refusals_leave_the_world_usable(seed):
    """``fp8=True`` with ``hid_dim`` not a multiple of 128 and a non-bool ``fp8`` are refused
    by name before anything runs; the next BF16 combine is exact."""
    rng = np.random.default_rng(seed)
    cfg = _tiny(H=64)
    world = EmulatedWorld(cfg, backend="sim", sim_seed=seed)
    toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
    results = world.dispatch(toks, ids)
    ys, w = expert_outputs(rng, cfg, results), weights(rng, cfg, ids)
    with pytest.raises(ValueError, match="hid_dim to be a multiple of 128.*hid_dim=64"):
        world.combine(ys, w, fp8=True)
    with pytest.raises(EPInputError, match="fp8: must be True or False"):
        world.combine(ys, w, fp8="yes")
    assert world.combiner_if_built() is None or world.combiner().fp8_side is None
    assert_same(world.combine(ys, w), reference.combine(cfg, results, ys, w), "bf16 after")


def test_deepep_low_latency_combine_use_fp8(seed):
    """``Buffer.low_latency_combine(..., use_fp8=True)`` (epgen's extension) on the
    simulator's ranks: DeepEP's combine properties with the FP8 bound, after a BF16 and after
    an FP8 dispatch, plain and zero-copy with a receive hook."""
    torch = pytest.importorskip("torch")
    import epgen.deepep as deep_ep
    from deepep_checks import LLCase, rank_inputs, rank_rounds
    case = LLCase(n_ranks=2, num_experts=4, tokens=4, hidden=256, top_k=2)
    inputs = rank_inputs(torch, case, seed)
    for variant in ("bf16", "fp8"):
        group = deep_ep.EmulatedGroup(case.n_ranks, backend="sim", sim_seed=seed % 1000)
        group.run(lambda rank: rank_rounds(
            torch, deep_ep.Buffer(group.rank(rank), low_latency_mode=True,
                                  num_qps_per_rank=2),
            rank, case, inputs, variant, rounds=((False, False, 1), (True, True, 1)),
            combine_fp8=True))


def test_deepep_use_fp8_is_refused_by_name():
    torch = pytest.importorskip("torch")
    import epgen.deepep as deep_ep
    from deepep_checks import LLCase, rank_inputs
    case = LLCase(n_ranks=1, num_experts=2, tokens=2, hidden=64, top_k=1, masked=0)
    (x, idx, w), = rank_inputs(torch, case, 0)
    group = deep_ep.EmulatedGroup(1, backend="sim")

    def body(rank):
        buf = deep_ep.Buffer(group.rank(rank), low_latency_mode=True, num_qps_per_rank=2)
        recv_x, _, handle, event, _ = buf.low_latency_dispatch(x, idx, 2, 2, use_fp8=False)
        event.current_stream_wait()
        for bad, match in (("yes", "use_fp8: must be True or False"),
                           (True, "use_fp8: .*multiple of 128.*hidden=64")):
            with pytest.raises(EPInputError, match=match):
                buf.low_latency_combine(recv_x, idx, w, handle, use_fp8=bad)
    group.run(body)


@pytest.mark.parametrize("flags", [{}, {"use_shmem": True, "p2p_world_size": 1}],
                         ids=["p2p", "shmem_p2p1"])
def test_shmem_world_two_pes(flags, seed):
    """``ShmemWorld.combine(..., fp8=True)``, each PE its own part: bit for bit the reference;
    the FP8 buffers are symmetric allocations (the staging too, under the SHMEM transport),
    made on the first FP8 call and followed by one barrier; a BF16 call in between."""
    from test_shmem_world import SymmetricMachine, collectively, make_worlds, round_trip, small
    cfg = small(num_threads=64, n_sms=4, n_experts=4, max_tokens_per_rank=4, **flags)
    machine = SymmetricMachine(seed)
    log = []
    worlds = make_worlds(cfg, machine, log)
    rng = np.random.default_rng(seed)

    def combine_all(ys, w, fp8):
        out, errors = collectively(machine, worlds, [
            (lambda i=i: worlds[i].combine(ys[i], None if w is None else w[i], fp8=fp8))
            for i in range(len(worlds))])
        assert errors == [None] * len(worlds), errors
        return out
    for call in range(2):
        toks, ids = routing.routing(rng, cfg, [cfg.max_tokens_per_rank, 3 - call])
        results = round_trip(worlds, machine, toks, ids)
        ys, wt = expert_outputs(rng, cfg, results), weights(rng, cfg, ids)
        for fp8, w in ((True, wt), (False, wt), (True, None)):
            want = reference.combine(cfg, results, ys, w, n_tokens=[len(i) for i in ids],
                                     fp8=fp8)
            assert_same(combine_all(ys, w, fp8), want, f"seed {seed} call {call} fp8={fp8}")
    assert sum(1 for e in log if e == ("barrier", 0, "combine-fp8-ready")) == 1
    for w in worlds:
        side = w.combiner().fp8_side
        allocs = {a.ptr for a in w.pool.allocs}
        assert side.recv[0].ptr in allocs
        assert (side.stage[0] is not None) == cfg.needs_shmem
        if side.stage[0] is not None:
            assert side.stage[0].ptr in allocs
    for w in worlds:
        w.close()


def test_captured_graph(seed):
    """``capture_moe(fp8=True)``: replays of fresh inputs (``graph.combiner.load(...,
    fp8=True)``) equal the reference's FP8 combine; a load that chooses the BF16 combine is
    refused at launch (the graph froze the FP8 kernels); a BF16 graph after an FP8 call
    captures the BF16 kernels."""
    from test_final_layout_sim import SHAPES
    cfg = make_cfg(*SHAPES["R2-E4-H512"])
    rng = np.random.default_rng(seed)
    counts = [cfg.max_tokens_per_rank] * cfg.n_ranks
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, counts)
        world.load_inputs(toks, ids)
        with world.capture_moe(fp8=True) as graph:
            for call in range(2):
                toks, ids = routing.routing(rng, cfg, counts)
                world.load_inputs(toks, ids)
                want_d = reference.dispatch(cfg, toks, ids)
                ys = expert_outputs(rng, cfg, want_d)
                w = weights(rng, cfg, ids)
                graph.combiner.load(ys, w, fp8=True)
                graph.launch()
                got = graph.combiner.finish()
                assert_same(got, reference.combine(cfg, world.results(), ys, w, fp8=True),
                            f"seed {seed} replay {call}")
            graph.combiner.load(ys, w)
            with pytest.raises(ValueError, match="combine fp8"):
                graph.launch()
        world.dispatch(toks, ids)
        world.combine(ys, w, fp8=True)
        with world.capture_moe() as graph:
            assert graph.combiner.fp8 is False
            graph.combiner.load(ys, w)
            graph.launch()
            assert_same(graph.combiner.finish(),
                        reference.combine(cfg, world.results(), ys, w), f"seed {seed} bf16")


@pytest.mark.parametrize("group", [(2, None), (4, 2)], ids=["p2p", "shmem_between_groups"])
def test_p2p_world(group, seed):
    """``P2PWorld.combine(..., fp8=True)`` on simulated GPUs with placement checks (every
    pointer argument on its own GPU, every table entry reachable: the FP8 receive buffers come
    from the peer-accessible pools), one GPU per rank; 4 ranks in P2P groups of 2 reach the
    other group by the simulator's NVSHMEM."""
    from epgen.presets import config_from_dict, preset_data
    from sim_p2p import sim_p2p_world
    R, P = group
    cfg = config_from_dict({**preset_data("small"), "n_ranks": R,
                            "p2p_world_size": R if P is None else P, "n_experts": 2 * R,
                            "num_threads": 64, "n_sms": R + 2, "max_tokens_per_rank": 4,
                            "use_shmem": P is not None})
    rng = np.random.default_rng(seed)
    with sim_p2p_world(cfg, seed) as world:
        check_fp8_round_trips(world, rng, seed, round_trip_inputs(rng, cfg, 2), "P2PWorld",
                              forms=("weighted+residual", "unreduced"))
        assert set(world.combiner().fp8_side.programs) == set(world.device_ids)
