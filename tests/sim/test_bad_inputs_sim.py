"""Bad inputs a new user would try, on the CPU simulator, in every world (``EmulatedWorld``,
``P2PWorld``, a one-PE ``ShmemWorld``): expert outputs that do not cover every row the last
dispatch delivered, and a combine before any dispatch, are refused naming the argument, the
rank and both row counts, with nothing written and the world usable afterwards; a wrong
dtype, a string, None or a bad ``input_scale`` is refused with an error that names the
argument and the rule (``epgen.runtime.call_args``)."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

import epgen
from epgen import reference, routing
from epgen.errors import EPInputError
from epgen.formats import make_format
from epgen.presets import load_preset

from combine_checks import expert_outputs, weights
from test_shmem_world import SymmetricMachine, make_worlds, small

WORLDS = ["emulated", "p2p", "shmem"]
#: tokens per rank: enough that every rank receives rows
TOKENS = 12


class _OnePE:
    """A one-PE ``ShmemWorld`` behind the list-per-rank calls of the other worlds (it takes
    its own rank's arrays), so one test body runs every world."""

    def __init__(self, world):
        self.world = world

    def __getattr__(self, name):
        return getattr(self.world, name)

    def dispatch(self, tokens, topk_ids, input_scale=None):
        return [self.world.dispatch(tokens[0], topk_ids[0], input_scale)]

    def combine(self, ys, w=None, res=None):
        first = lambda a: None if a is None else a[0]  # noqa: E731
        return [self.world.combine(first(ys), first(w), first(res))]


@contextlib.contextmanager
def world_of(kind: str, seed: int):
    """A world of ``kind`` on the simulator (``ShmemWorld``: one PE of a one-rank group)."""
    if kind == "shmem":
        (w,) = make_worlds(small(n_ranks=1, p2p_world_size=1, n_experts=8),
                           SymmetricMachine(seed), [])
        try:
            yield _OnePE(w)
        finally:
            w.close()
        return
    world_class = {"emulated": epgen.EmulatedWorld, "p2p": epgen.P2PWorld}[kind]
    yield world_class(load_preset("small"), backend="sim", sim_seed=seed)


def _dispatch(world, rng):
    toks, ids = routing.routing(rng, world.cfg, TOKENS)
    return ids, world.dispatch(toks, ids)


def _assert_combine_matches(world, rng, seed, what):
    """A fresh dispatch and a weighted combine equal ``reference.combine``."""
    ids, results = _dispatch(world, rng)
    ys, w = expert_outputs(rng, world.cfg, results), weights(rng, world.cfg, ids)
    got = world.combine(ys, w)
    for s, (g, r) in enumerate(zip(got, reference.combine(world.cfg, results, ys, w))):
        assert g.shape == r.shape and np.array_equal(g, r), \
            f"seed {seed} {what}: rank {s}: {np.count_nonzero(g != r)} elements differ"


def _combine_buffers(world) -> list:
    return [[getattr(b, name).to_host().copy() for name in ("expert_out", "weights", "out")]
            for b in world.combiner().bufs]


@pytest.mark.parametrize("kind", WORLDS)
def test_expert_outputs_short_of_the_delivered_rows_are_refused(kind, seed):
    """One row short and no rows at all, for the last rank: ``EPInputError`` naming
    ``expert_outputs[d]``, the rank, the rows given and the rows the last dispatch
    delivered; no combine buffer changes; the next combine is exact."""
    rng = np.random.default_rng(seed)
    with world_of(kind, seed) as world:
        ids, results = _dispatch(world, rng)
        ys, w = expert_outputs(rng, world.cfg, results), weights(rng, world.cfg, ids)
        world.combine(ys, w)                        # builds the combine side
        before = _combine_buffers(world)
        d = len(results) - 1
        n = len(results[d].src_info)
        assert n > 0, f"seed {seed}: rank {d} received no rows"
        for given in (n - 1, 0):
            short = [y if q != d else y[:given] for q, y in enumerate(ys)]
            with pytest.raises(EPInputError, match=(
                    rf"expert_outputs\[{d}\]: {given} rows given, but the last dispatch "
                    rf"delivered {n} rows to rank {results[d].rank}")):
                world.combine(short, w)
        for got, was in zip(_combine_buffers(world), before):
            for a, b in zip(got, was):
                assert np.array_equal(a, b), f"seed {seed}: a refused combine wrote a buffer"
        _assert_combine_matches(world, rng, seed, "after the refusals")


@pytest.mark.parametrize("kind", WORLDS)
def test_combine_before_any_dispatch_is_refused(kind, seed):
    rng = np.random.default_rng(seed)
    H = load_preset("small").token_fmt.hid_dim
    with world_of(kind, seed) as world:
        for rows in (0, 4):
            ys = [np.zeros((rows, H), np.uint16) for _ in world.ranks]
            with pytest.raises(RuntimeError, match="no dispatch to combine: call dispatch "
                                                   "first"):
                world.combine(ys, None)
        _assert_combine_matches(world, rng, seed, "after the refusal")


def _bad_calls(world, ids, results):
    """``(call, message)`` per bad argument of the list-per-rank calls."""
    K, H = world.cfg.token_fmt.top_k, world.cfg.token_fmt.hid_dim
    n = len(world.ranks)
    ys = [np.zeros((len(r.src_info), H), np.uint16) for r in results]
    w = [np.ones((len(i), K), np.float32) for i in ids]
    return [
        (lambda: world.combine([y.astype(np.float32) for y in ys], w),
         r"expert_outputs\[0\]: dtype float32, must be BF16 bits as uint16 \(or a bfloat16"),
        (lambda: world.combine(ys, w, [np.zeros((len(i), H), np.float32) for i in ids]),
         r"residual\[0\]: dtype float32, must be BF16 bits as uint16"),
        (lambda: world.combine(ys, [np.full((len(i), K), "a") for i in ids]),
         r"topk_weights\[0\]: dtype <U1, must be float32 \(an array of real numbers\)"),
        (lambda: world.combine(ys, [a[:, :1] for a in w]),
         rf"topk_weights\[0\]: shape \({len(ids[0])}, 1\), must be \[T, top_k\]"),
        (lambda: world.combine(ys[:1] * (n + 1), w),
         rf"expert_outputs: one array per rank \({n}\), got {n + 1}"),
        (lambda: world.combine(None, w),
         rf"expert_outputs: must be a list of one array per rank \({n}\), got None"),
    ]


@pytest.mark.parametrize("kind", ["emulated", "p2p"])
def test_bad_arguments_are_named_with_their_rule(kind, seed):
    rng = np.random.default_rng(seed)
    with world_of(kind, seed) as world:
        ids, results = _dispatch(world, rng)
        for call, message in _bad_calls(world, ids, results):
            with pytest.raises(EPInputError, match=message):
                call()
        toks, ids = routing.routing(rng, world.cfg, TOKENS)
        with pytest.raises(EPInputError, match="input_scale: must be a finite float32 > 0, "
                                               "got 'abc'"):
            world.dispatch(toks, ids, input_scale="abc")
        with pytest.raises(EPInputError, match="tokens: must be a list of one array per "
                                               "rank, got NoneType"):
            world.dispatch(None, ids)
        _assert_combine_matches(world, rng, seed, "after the refusals")


def test_a_shmem_pe_names_its_bad_arguments(seed):
    rng = np.random.default_rng(seed)
    with world_of("shmem", seed) as world:
        ids, results = _dispatch(world, rng)
        pe, H = world.world, world.cfg.token_fmt.hid_dim
        y = np.zeros((len(results[0].src_info), H), np.uint16)
        with pytest.raises(EPInputError, match=r"expert_outputs\[0\]: dtype float32"):
            pe.combine(y.astype(np.float32))
        with pytest.raises(EPInputError, match=r"expert_outputs\[0\]: missing \(None\)"):
            pe.combine(None)
        with pytest.raises(EPInputError, match=r"topk_weights\[0\]: dtype <U1"):
            pe.combine(y, np.full((TOKENS, world.cfg.token_fmt.top_k), "a"))
        _assert_combine_matches(world, rng, seed, "after the refusals")


BAD_SCALES = [float("nan"), -1.0, 0.0, float("inf"), 1e39, "abc", True, None, [1.0]]


@pytest.mark.parametrize("fmt", ["BF16", "NVFP4"])
@pytest.mark.parametrize("value", BAD_SCALES, ids=repr)
def test_a_bad_input_scale_is_refused_on_every_format(fmt, value):
    """Constructor and ``dispatch`` alike, BF16 (which does not read it) as NVFP4: one
    message; the world keeps its scale."""
    cfg = load_preset("small")
    cfg = cfg.replace(token_fmt=make_format(fmt, cfg.token_fmt.hid_dim, cfg.token_fmt.top_k))
    message = re.escape(f"input_scale: must be a finite float32 > 0, got {value!r}")
    with pytest.raises(EPInputError, match=message):
        epgen.EmulatedWorld(cfg, backend="sim", input_scale=value)
    world = epgen.EmulatedWorld(cfg, backend="sim", input_scale=0.5)
    toks, ids = routing.routing(np.random.default_rng(0), cfg, 4)
    if value is not None:               # None: dispatch keeps the world's scale
        with pytest.raises(EPInputError, match=message):
            world.dispatch(toks, ids, input_scale=value)
    assert world.input_scale == 0.5
