"""Runs of the protocol under the simulator's weak-memory mode (``backends.sim.weak``),
each compared with ``epgen.reference``.

``checked()`` names the variants the checker knows: each names a golden variant (its kernels'
names are the ones mutated: the variant's own, or ``Spec.golden``'s for a check that runs a
golden's kernels another way) with the world that runs it (standalone or fused kernels,
dispatch alone or dispatch then combine) and a small configuration (``SMALL``: fewer threads,
blocks, experts and tokens than the variant's preset, so one run takes a second or two; the
SHMEM checks keep remote destinations with their own ``p2p_world_size``); ``--preset`` and
``--set`` replace or change the configuration.

``run_once(cfg, spec, seed, mutation)`` runs ``CALLS`` back-to-back round trips on a fresh
weak machine seeded with ``seed`` (the interleaving and the memory model's choices), the
variant's kernels with ``mutation`` applied, and returns the outcome: ``"ok"``, ``"wrong"``
(a result differs from the reference), ``"hang"`` (a bounded wait polled past its limit:
the protocol waits on a word that is never published) or ``"error"`` (the kernels did
something the simulator refuses, e.g. an access out of bounds computed from a stale count).
With ``observe`` (a dict) it also fills in the run's stale reads: load site
(``kernel:role:load<i>``, ``i`` counting the role's global loads in statement order) ->
how many of its loads returned an older value than memory's newest. The sweep
(``sweep.py``) calls a load site *guarded* when no unmutated run read it stale, and a
mutated run that reads one stale is detected (``"stale"``) even when its results come out
right.
"""

from __future__ import annotations

import attrs
import numpy as np

from backends import sim as sim_backend
from epgen import combine_run, goldens, reference, reference_tokens, routing
from epgen import ep_goldens as eg
from epgen.errors import EPTimeoutError
from epgen.presets import config_from_dict, preset_data, with_overrides
from epgen.runtime.world import EmulatedWorld

from ir import nodes as N

from .mutations import Mutation, is_shared, mutate

CALLS = 2
"""Round trips per run: the second one also checks the re-arming of the first."""

MAX_SPINS = 20000

MAX_ROUNDS = 100000
"""Scheduler rounds per run (an unmutated run takes a few hundred): a mutated run past it
is a hang, e.g. a copy loop bounded by a stale count that never ends."""

SMALL = {"num_threads": 64, "n_sms": 4, "n_experts": 4, "n_ranks": 4, "p2p_world_size": 4,
         "max_tokens_per_rank": 6,
         "hid_dim": 64, "top_k": 2}
"""The configuration changes every checked variant is run with (on top of its own)."""


@attrs.frozen
class Spec:
    """A checked variant: its preset and parameter changes, the world's ``fused`` and
    whether a combine follows each dispatch."""

    preset: str
    changes: dict
    fused: bool = False
    combine: bool = False
    small: dict = attrs.Factory(dict)   # changes of ``SMALL`` for this variant
    golden: str | None = None           # the golden variant whose kernels are mutated
    #: the combine is the partial-reduce one (``ep_rank_dedup``; the dispatch carries weights)
    partial: bool = False
    #: DeepEP's normal mode (``ep_rank_dedup``): the token-major receive
    #: (``world.dispatch_tokens``) and, with ``combine``, the token-major combine
    #: (``world.combine_tokens``), against ``epgen.reference_tokens``
    tokens: bool = False


def _flag(name: str) -> dict:
    return dict({**eg.FLAG_VARIANTS, **eg.SHMEM_VARIANTS}[name][1])


def checked() -> dict[str, Spec]:
    """``variant -> Spec`` of every variant the checker runs."""
    return {
        "ep/small": Spec("small", {}),
        # two local experts per rank: the election then has more than one producer
        "ep/ord_r": Spec("small", _flag("ord_r"), small={"n_experts": 8, "num_threads": 128}),
        "ep/final_layout_prod_reserve": Spec("small", _flag("final_layout_prod_reserve")),
        "ep/fused": Spec("small", {}, fused=True),
        # the SHMEM transport: every destination remote, and groups of 2 of the 4 ranks
        "ep/shmem_p2p1": Spec("small", _flag("shmem_p2p1"), small=_SHMEM_P2P1),
        "ep/shmem_mixed": Spec("small", _flag("shmem_mixed"), small=_SHMEM_MIXED),
        "ep/shmem_mixed_ord_r": Spec("small", _flag("shmem_mixed_ord_r"),
                                     small={**_SHMEM_MIXED, "n_experts": 8,
                                            "num_threads": 128}),
        "ep/shmem_fused": Spec("small", _flag("shmem_mixed"), fused=True, small=_SHMEM_MIXED,
                               golden="ep/shmem_mixed"),
        # one message per (token, destination rank) through NVSHMEM too: the fence between
        # a (token, rank)'s puts and each slot's signal
        "ep/shmem_mixed_rank_dedup": Spec("small", _flag("shmem_mixed_rank_dedup"),
                                          small={**_SHMEM_MIXED, "n_experts": 8,
                                                 "num_threads": 128}),
        # the rank mask on, every rank alive: its give-up waits and mask reads must not
        # weaken what the protocol orders
        "ep/rank_mask": Spec("small", _flag("rank_mask")),
        # one message per (token, destination rank): two local experts per rank, so that
        # tokens with both experts on one rank send one message for two slots
        "ep/rank_dedup": Spec("small", _flag("rank_dedup"),
                              small={"n_experts": 8, "num_threads": 128}),
        # DeepEP's normal mode: the token-major receive after the deduplicated send, and its
        # combine (rows back to each token's lead slot, weights summed)
        "ep/rank_dedup_tokens": Spec("small", _flag("rank_dedup"), tokens=True,
                                     small=_TWO_PER_RANK),
        "ep/rank_dedup_combine_tokens": Spec("small", _flag("rank_dedup"), tokens=True,
                                             combine=True, small=_TWO_PER_RANK),
        "combine/small": Spec("small", {}, combine=True),
        "combine/fused": Spec("small", {}, fused=True, combine=True),
        "combine/shmem": Spec("small", {"use_shmem": True}, combine=True, small=_SHMEM_P2P1),
        "combine/shmem_fused": Spec("small", {"use_shmem": True}, fused=True, combine=True,
                                    small=_SHMEM_MIXED, golden="combine/fused"),
        "combine/rank_mask": Spec("small", {"ep_rank_mask": True}, combine=True),
        # the partial-reduce combine (ours): two local experts per rank, so that a token
        # with both on one rank gets one summed row back for two slots; split, fused, and
        # every source reached by NVSHMEM
        "combine/rank_dedup_partial": Spec("small", {"ep_rank_dedup": True}, combine=True,
                                           partial=True, small=_TWO_PER_RANK),
        "combine/rank_dedup_partial_fused": Spec("small", {"ep_rank_dedup": True},
                                                 fused=True, combine=True, partial=True,
                                                 small=_TWO_PER_RANK,
                                                 golden="combine/rank_dedup_partial"),
        "combine/shmem_rank_dedup_partial": Spec(
            "small", {"ep_rank_dedup": True, "use_shmem": True}, combine=True, partial=True,
            small={**_SHMEM_P2P1, **_TWO_PER_RANK}),
        "combine/shmem_rank_dedup_partial_fused": Spec(
            "small", {"ep_rank_dedup": True, "use_shmem": True}, fused=True, combine=True,
            partial=True, small={**_SHMEM_MIXED, **_TWO_PER_RANK},
            golden="combine/rank_dedup_partial"),
    }


_SHMEM_P2P1 = {"p2p_world_size": 1}
_SHMEM_MIXED = {"p2p_world_size": 2}
_TWO_PER_RANK = {"n_experts": 8, "num_threads": 128}


def config(spec: Spec, preset: str | None = None, overrides: dict | None = None):
    """The ``EPConfig`` a variant is checked with: ``preset`` (default the variant's) with the
    variant's changes, ``SMALL`` and the variant's changes of it (only when no preset is
    named) and ``overrides``."""
    table = with_overrides(preset_data(preset or spec.preset),
                           {**spec.changes, **({} if preset else {**SMALL, **spec.small}),
                            **(overrides or {})})
    table.pop("description", None)
    return config_from_dict(table)


class WeakMachine(sim_backend.Machine):
    """A weak-memory ``Machine`` that loads every module through ``transform`` (an
    ``ir.Module -> ir.Module`` function: a mutation, or a hand-made hazard) and records the
    kernels launched."""

    def __init__(self, seed: int, transform=None):
        super().__init__(seed, memory="weak", max_spins=MAX_SPINS)
        self.transform = transform
        self.modules: list = []
        self.kernels_run: set[str] = set()
        self._rounds = 0
        self._round = self.sim.weak.round
        self.sim.weak.round = self._bounded_round

    def _bounded_round(self) -> None:
        self._rounds += 1
        if self._rounds > MAX_ROUNDS:
            raise sim_backend.SimHang(f"the run took more than {MAX_ROUNDS} scheduler rounds")
        self._round()

    def load_module(self, module, device=None):
        if self.transform is not None:
            module = self.transform(module)
        self.modules.append(module)
        return super().load_module(module, device)

    def launched(self, kernel, params, stream, deps) -> None:
        self.kernels_run.add(kernel.name)


def _world(cfg, spec: Spec, machine):
    world = EmulatedWorld(cfg, backend=machine, fused=True if spec.fused else None)
    if spec.tokens and spec.combine:
        # each rank's receive half after its own send half only: no event hides the
        # arrival words' ordering (as for the fused combines)
        world.token_combiner().halves_ordered = False
    return world


def _round_trips(world, cfg, spec: Spec, seed: int) -> bool:
    """``CALLS`` round trips; whether every result equals the reference."""
    rng = np.random.default_rng(seed)
    if spec.tokens:
        return _token_major_round_trips(world, cfg, spec, rng)
    for _ in range(CALLS):
        toks, ids = routing.routing(rng, cfg, cfg.max_tokens_per_rank)
        w = combine_run.router_weights(rng, cfg, ids) if spec.combine else None
        got = world.dispatch(toks, ids, topk_weights=w) if spec.partial \
            else world.dispatch(toks, ids)
        want = reference.dispatch(cfg, toks, ids)
        if any(reference.compare(cfg, x, a) for x, a in zip(want, got)):
            return False
        if spec.combine:
            ys = [combine_run.expert_outputs(cfg, r) for r in got]
            if spec.partial:
                out = world.combine(ys, partial_reduce=True)
                ref = reference.combine(cfg, got, ys, w, partial_reduce=True)
            else:
                out = world.combine(ys, w)
                ref = reference.combine(cfg, got, ys, w)
            if combine_run.differences(out, ref):
                return False
    return True


_TOKEN_MAJOR_FIELDS = ("x", "topk_idx", "topk_weights", "src", "rank_prefix",
                       "expert_counts")


def _token_major_round_trips(world, cfg, spec: Spec, rng) -> bool:
    """``CALLS`` normal-mode round trips (``Spec.tokens``) with masked slots (``-1``, and one
    token of ``-1`` only per rank) and router weights; whether every rank's receive (and
    combine) equals ``reference_tokens``."""
    R, H, K = cfg.n_ranks, cfg.token_fmt.hid_dim, cfg.token_fmt.top_k
    for _ in range(CALLS):
        toks, ids = routing.masked_routing(rng, cfg, cfg.max_tokens_per_rank, fraction=0.25)
        w = [rng.standard_normal(i.shape).astype(np.float32) for i in ids]
        got = world.dispatch_tokens(toks, ids, topk_weights=w)
        for d in range(R):
            want = reference_tokens.normal_dispatch(cfg.n_experts, toks, ids, d, w)
            if got[d].n_rows != want.n_rows or not all(
                    np.array_equal(getattr(got[d], f), getattr(want, f))
                    for f in _TOKEN_MAJOR_FIELDS):
                return False
        if spec.combine:
            xs = [routing.random_tokens(rng, g.n_rows, H) for g in got]
            ws = [rng.standard_normal((g.n_rows, K)).astype(np.float32) for g in got]
            out = world.combine_tokens(xs, ws)
            ref = reference_tokens.normal_combine(cfg.n_experts, ids, [g.src for g in got],
                                                  xs, ws)
            if any(not (np.array_equal(o[0], r[0]) and np.array_equal(o[1], r[1]))
                   for o, r in zip(out, ref)):
                return False
    return True


def load_sites(modules) -> dict[int, str]:
    """``id(load statement) -> kernel:role:load<i>`` for the global loads of ``modules``
    (a name that a mutation leaves as it is: mutations change orderings, not loads)."""
    names = {}
    for m in modules:
        for k in m.kernels:
            for role in k.roles:
                i = 0
                for s in N.walk(role.body):
                    if isinstance(s, N.Load) and not is_shared(s):
                        names[id(s)] = f"{k.name}:{role.name}:load{i}"
                        i += 1
    return names


def run_once(cfg, spec: Spec, seed: int, mutation: Mutation | None = None,
             machine: WeakMachine | None = None, transform=None,
             observe: dict | None = None) -> tuple[str, str]:
    """One weak-memory run (module docstring) with ``mutation`` (or ``transform``, a
    function of the modules) applied: the outcome (``"ok"``, ``"wrong"``, ``"hang"`` or
    ``"error"``) and, for a hang or an error, its message; ``observe``: filled with the
    run's stale reads by load site."""
    if mutation is not None:
        transform = lambda m: mutate(m, mutation.op_id, mutation.kind)  # noqa: E731
    machine = machine or WeakMachine(seed, transform)
    try:
        world = _world(cfg, spec, machine)
        return ("ok" if _round_trips(world, cfg, spec, seed) else "wrong"), ""
    except (sim_backend.SimHang, EPTimeoutError) as e:
        return "hang", str(e)
    except (sim_backend.SimError, IndexError, ValueError, RuntimeError) as e:
        return "error", f"{type(e).__name__}: {e}"
    finally:
        if observe is not None:
            names = load_sites(machine.modules)
            for site, n in machine.sim.weak.stale_reads.items():
                if site in names:
                    observe[names[site]] = observe.get(names[site], 0) + n


def targets(cfg, spec: Spec, variant: str, seed: int = 0, observe: dict | None = None):
    """The kernels a variant's mutations apply to: those of its golden module that the
    world launches (from one unmutated run with ``seed``), as built by the world; and that
    run's outcome (``observe`` as in ``run_once``)."""
    names = {k.name for k in goldens.build_module(spec.golden or variant).kernels}
    machine = WeakMachine(seed)
    outcome = run_once(cfg, spec, seed, machine=machine, observe=observe)
    kernels = {}
    for m in machine.modules:
        for k in m.kernels:
            if k.name in names and k.name in machine.kernels_run:
                kernels.setdefault(k.name, k)
    return list(kernels.values()), outcome
