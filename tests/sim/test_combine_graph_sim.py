"""Dispatch + combine captured as one CUDA graph (``world.capture_moe``, docs/combine.md "CUDA
graphs") on the simulator: every replay, with fresh random dispatch inputs (``load_inputs``)
and combine inputs (``graph.combiner.load``), equals ``epgen.reference.dispatch`` and
``epgen.reference.combine`` bit for bit (weighted, with a residual, unreduced, several calls
per replay, stream calls in between); a changed launch argument is refused."""

from __future__ import annotations

import numpy as np
import pytest

from epgen import reference, routing

from combine_checks import weights
from sim_world import sim_world
from test_final_layout_sim import SHAPES, make_cfg


def _cfg(**flags):
    return make_cfg(*SHAPES["R2-E4"], **flags)


def _expert_outputs(rng, cfg, toks, ids):
    """Random BF16 rows (finite, every sign), as many per destination as the reference
    dispatch of these inputs gives it (the world's row count is the same)."""
    H = cfg.token_fmt.hid_dim
    return [rng.integers(0, 1 << 16, size=(len(r.src_info), H), dtype=np.uint16)
            & np.uint16(0xBFFF) for r in reference.dispatch(cfg, toks, ids)]


def _check(world, cfg, toks, ids, ys, w, got, seed, what, residual=None):
    """The replay's dispatch against the reference, and its combine against the reference
    combine of the dispatch results the world produced."""
    results = world.results()
    try:
        reference.assert_match(cfg, reference.dispatch(cfg, toks, ids), results)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}, {what}: dispatch: {exc}") from None
    want = reference.combine(cfg, results, ys, w, residual=residual,
                             n_tokens=[len(i) for i in ids])
    for s, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"seed {seed}, {what}, rank {s}: {np.count_nonzero(g != r)} elements differ"


def test_replays_of_fresh_inputs_match_the_reference(seed):
    cfg = _cfg()
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(cfg.n_ranks)]
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, counts)
        world.load_inputs(toks, ids)
        with world.capture_moe() as graph:
            assert len(graph.exec.nodes) == 4 * cfg.n_ranks     # async, wait, c_async, c_wait
            for call in range(3):
                toks, ids = routing.routing(rng, cfg, counts)
                world.load_inputs(toks, ids)
                ys, w = _expert_outputs(rng, cfg, toks, ids), weights(rng, cfg, ids)
                graph.combiner.load(ys, w)
                launched = len(world.cuda.graph.GraphExec.instances)
                graph.launch()
                got = graph.combiner.finish()
                assert graph.exec.replays == call + 1
                assert len(world.cuda.graph.GraphExec.instances) == launched   # no re-capture
                _check(world, cfg, toks, ids, ys, w, got, seed, f"replay {call}")


def test_residual_and_stream_calls_between_replays(seed):
    cfg = _cfg()
    rng = np.random.default_rng(seed)
    T, H = cfg.max_tokens_per_rank, cfg.token_fmt.hid_dim
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, T)
        world.load_inputs(toks, ids)
        with world.capture_moe(residual=True) as graph:
            for call in range(3):
                toks, ids = routing.routing(rng, cfg, T)
                ys, w = _expert_outputs(rng, cfg, toks, ids), weights(rng, cfg, ids)
                res = [rng.integers(0, 1 << 16, size=(T, H), dtype=np.uint16)
                       & np.uint16(0xBFFF) for _ in ids]
                if call == 1:               # a stream call between the replays
                    world.dispatch(toks, ids)
                    got = world.combine(ys, w, res)
                else:
                    world.load_inputs(toks, ids)
                    graph.combiner.load(ys, w, res)
                    graph.launch()
                    got = graph.combiner.finish()
                _check(world, cfg, toks, ids, ys, w, got, seed, f"call {call}", residual=res)
            assert graph.exec.replays == 2


def test_unreduced_rows_two_calls_per_replay(seed):
    cfg = _cfg()
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, T)
        world.load_inputs(toks, ids)
        with world.capture_moe(calls=2, weighted=False) as graph:
            assert len(graph.exec.nodes) == 8 * cfg.n_ranks
            for call in range(2):
                toks, ids = routing.routing(rng, cfg, T)
                world.load_inputs(toks, ids)
                ys = _expert_outputs(rng, cfg, toks, ids)
                graph.combiner.load(ys)
                graph.launch()
                got = graph.combiner.finish()
                _check(world, cfg, toks, ids, ys, None, got, seed, f"replay {call}")


def test_a_changed_combine_choice_or_token_count_is_refused(seed):
    cfg = _cfg()
    rng = np.random.default_rng(seed)
    T = cfg.max_tokens_per_rank
    with sim_world(cfg, seed) as world:
        toks, ids = routing.routing(rng, cfg, T)
        world.load_inputs(toks, ids)
        with pytest.raises(ValueError, match="residual=True needs weighted=True"):
            world.capture_moe(weighted=False, residual=True)
        with pytest.raises(ValueError, match="must be bools"):
            world.capture_moe(weighted=1)
        graph = world.capture_moe()
        graph.combiner.load(_expert_outputs(rng, cfg, toks, ids))       # no weights
        replays = graph.exec.replays
        with pytest.raises(ValueError, match="combine weighted changed since the capture"):
            graph.launch()
        toks, ids = routing.routing(rng, cfg, T - 1)
        world.load_inputs(toks, ids)
        graph.combiner.load(_expert_outputs(rng, cfg, toks, ids), weights(rng, cfg, ids))
        with pytest.raises(ValueError, match="rank 0 n_tokens changed"):
            graph.launch()
        assert graph.exec.replays == replays                # nothing ran
        graph.close()


def test_configurations_combine_does_not_take_are_refused_before_capture(seed, monkeypatch):
    """Whatever ``check_supported`` refuses (here: everything) is refused before a capture."""
    from epgen.runtime import combine as combine_mod

    def refuse(cfg):
        raise ValueError("world.combine: not supported for this configuration: testing")
    monkeypatch.setattr(combine_mod, "check_supported", refuse)
    with sim_world(_cfg(), seed) as world:
        with pytest.raises(ValueError, match="not supported for this configuration: testing"):
            world.capture_moe()
        assert world.cuda.capture is None
