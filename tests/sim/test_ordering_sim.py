"""The ordering checker (``epgen check-ordering``, ``epgen.ordering``) and the simulator's
weak-memory mode (``backends.sim.weak``) it runs on: the correct kernels pass for every seed,
the two hazards of the reference protocol are caught when built into the kernels (count
words published by plain stores before the last release; the combine's reduce polling
without acquire), weakened operations are detected, the mutations touch exactly one
operation, and the command's table, JSON and exit status.

Seeds: every weak-memory run is seeded; the seeds used are printed (``-s``) and named in
each failure message. The sweeps run on ``epgen.ordering.runs.SMALL`` configurations (about
a second or two per run)."""

from __future__ import annotations

import json

import attrs
import pytest


from backends import sim as sim_backend
from epgen import cli
from epgen.commands import check_ordering
from epgen.ordering import mutations as M
from epgen.ordering import runs, sweep
from ir import nodes as N
from ir import types as T
from ir.enums import CmpOp, Scope, Sem

SEEDS = (0, 1, 2)


def _spec_cfg(variant: str, **overrides):
    spec = runs.checked()[variant]
    return spec, runs.config(spec, overrides=overrides)


def _outcomes(cfg, spec, seeds, **kw) -> dict:
    out = {s: runs.run_once(cfg, spec, s, **kw) for s in seeds}
    print(f"seeds {list(seeds)}: " + ", ".join(f"{s}: {o[0]}" for s, o in out.items()))
    return out


# -- the weak mode itself -----------------------------------------------------------------------

def test_the_default_machine_stays_sequentially_consistent():
    assert sim_backend.Machine(0).sim.weak is None
    assert sim_backend.Machine(0, memory="weak").sim.weak is not None
    with pytest.raises(ValueError, match="memory must be one of sc, weak, got 'tso'"):
        sim_backend.Machine(0, memory="tso")


@pytest.mark.parametrize("variant", ["ep/small", "combine/small"])
def test_correct_kernels_pass_under_the_weak_model(variant):
    spec, cfg = _spec_cfg(variant)
    got = _outcomes(cfg, spec, SEEDS)
    bad = {s: o for s, o in got.items() if o[0] != "ok"}
    assert not bad, f"{variant}: unmutated kernels fail under the weak model: {bad}"


# -- the reference's two hazards, built into the kernels ---------------------------------------

def _plain_before_last(cfg):
    """The legacy signal of the reference: a destination's count words are plain stores,
    but the last local expert's is a release (``signal_offset = e * R + my_rank``: words
    below ``(L - 1) * R`` belong to the earlier experts)."""
    L, R = cfg.layout.n_local_experts, cfg.n_ranks
    bound = N.Const((L - 1) * R * 8, T.u64)

    def hazard(s):
        if not (isinstance(s, N.Store) and s.sem is Sem.RELEASE and s.scope is Scope.SYS):
            return s
        early = N.Cmp(CmpOp.LT, s.addr.offset, bound)
        return N.If(early, (attrs.evolve(s, sem=Sem.WEAK, scope=None),), (s,))

    def body(stmts):
        out = []
        for s in stmts:
            s = hazard(s)
            for f in N.CHILD_BODIES.get(type(s), ()):
                s = attrs.evolve(s, **{f: body(getattr(s, f))})
            out.append(s)
        return tuple(out)

    def transform(module):
        kernels = []
        for k in module.kernels:
            if k.name == "ep_dispatch_async":
                k = attrs.evolve(k, roles=tuple(
                    attrs.evolve(r, body=body(r.body)) if r.name == "signal" else r
                    for r in k.roles))
            kernels.append(k)
        return attrs.evolve(module, kernels=tuple(kernels))
    return transform


def test_hazard_plain_count_words_before_the_last_release():
    # two local experts per rank, so the first one's words are the plain ones
    spec, cfg = _spec_cfg("ep/small", n_experts=8, num_threads=128)
    assert cfg.layout.n_local_experts == 2
    good = _outcomes(cfg, spec, SEEDS)
    assert all(o[0] == "ok" for o in good.values()), f"correct kernels fail: {good}"
    bad = _outcomes(cfg, spec, SEEDS, transform=_plain_before_last(cfg))
    assert any(o[0] != "ok" for o in bad.values()), \
        f"plain count words before the last release not detected in seeds {SEEDS}"


def test_hazard_combine_reduce_polls_without_acquire():
    # the fused ep_combine: no kernel boundary between a peer's sends and this rank's reduce
    spec, cfg = _spec_cfg("combine/fused")
    good = _outcomes(cfg, spec, SEEDS)
    assert all(o[0] == "ok" for o in good.values()), f"correct kernels fail: {good}"
    op = "ep_combine:reduce:0:spin_wait.acquire.sys.global.u32 combine_arrival"
    bad = _outcomes(cfg, spec, SEEDS, mutation=M.Mutation(op, "relaxed", True))
    assert any(o[0] != "ok" for o in bad.values()), \
        f"the reduce's poll without acquire not detected in seeds {SEEDS}"


# -- mutations ---------------------------------------------------------------------------------

def _small_kernels():
    spec, cfg = _spec_cfg("ep/small")
    kernels, outcome = runs.targets(cfg, spec, "ep/small", 0)
    assert outcome[0] == "ok"
    return kernels


def _statements(module):
    """Every simple statement (no if / for / while, whose bodies change with their
    contents) of every role, in order."""
    return [s for k in module.kernels for r in k.roles for s in N.walk(r.body)
            if type(s) not in N.CHILD_BODIES]


def test_each_mutation_changes_exactly_one_operation():
    kernels = _small_kernels()
    module = N.Module("m", tuple(kernels))
    assert {k.name for k in kernels} == {"ep_dispatch_async", "ep_dispatch_wait"}
    before = _statements(module)
    mutations = sweep.all_mutations(kernels)
    assert len({m.name for m in mutations}) == len(mutations) >= 8
    for m in mutations:
        after = _statements(M.mutate(module, m.op_id, m.kind))
        assert len(after) == len(before), m.name
        diff = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert len(diff) == 1 and M.is_ordered(before[diff[0]]), m.name
        weak = after[diff[0]]
        assert (weak.sem is Sem.RELAXED) if m.kind == "relaxed" else \
            (weak.scope is Scope.GPU), m.name
    with pytest.raises(KeyError, match="no ordered operation"):
        M.mutate(module, "ep_dispatch_wait:aux:99:st.release.gpu.global", "relaxed")


def _assert_detected(variant: str, weakenings) -> None:
    """Each (operation, kind) weakening of ``variant`` fails at least one of ``SEEDS``."""
    spec, cfg = _spec_cfg(variant)
    for op, kind in weakenings:
        got = _outcomes(cfg, spec, SEEDS, mutation=M.Mutation(op, kind, True))
        assert any(o[0] != "ok" for o in got.values()), \
            f"{variant}: {op} -> {kind} not detected in seeds {SEEDS}"


def test_weakened_operations_are_detected():
    _assert_detected("ep/small",
                     [("ep_dispatch_async:comm:0:red.release.gpu.global.add", "relaxed"),
                      ("ep_dispatch_async:signal:1:st.release.sys.global", "gpu")])


# -- the command -------------------------------------------------------------------------------

def test_cli_table_json_and_exit_status(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    op = "ep_dispatch_wait:aux:2:st.release.gpu.global"
    assert cli.main(["check-ordering", "ep/small", "--seeds", "1", "--mutate", op,
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "seeds 0..0" in text and f"| `{op}` | relaxed | 1/1 |" in text
    (rep,) = json.loads(out.read_text())
    assert rep["ok"] and rep["mutations"][0]["detected"] == 1
    # a run that detects nothing: the must-detect operation is named, exit 1
    kernels = _small_kernels()
    monkeypatch.setattr(runs, "targets", lambda *a, **k: (kernels, ("ok", "")))
    monkeypatch.setattr(runs, "run_once", lambda *a, **k: ("ok", ""))
    assert cli.main(["check-ordering", "ep/small", "--seeds", "1", "--mutate", op]) == 1
    assert f"not detected in any of seeds [0]: {op} -> relaxed" in capsys.readouterr().err


def test_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check-ordering", "ep/small", "--seeds", "0"])
    assert e.value.code == 2 and "--seeds: must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["check-ordering", "ep/small", "--seeds", "1", "--mutate", "no_such_op"])
    assert e.value.code == 2 and "no ordered operation matches" in capsys.readouterr().err


def test_every_excuse_names_an_existing_mutation():
    known = runs.checked()
    for variant, entries in sweep.excuses().items():
        assert variant in known, variant
        for name, why in entries.items():
            assert " -> " in name and why.startswith(("redundant", "out of reach")), \
                (variant, name)


def test_the_cli_lists_the_checked_variants():
    assert set(check_ordering.CHECKED_VARIANTS) == set(runs.checked())


def test_combine_fused_needs_its_elections_and_sys_arrival_stores():
    # causal release views: an election without release leaves its warp's rows unpublished;
    # scopes across GPUs: a gpu-scope arrival store does not synchronise with the sys poll
    _assert_detected("combine/fused",
                     [("ep_combine:send:1:atom.acq_rel.sys.global.add", "relaxed"),
                      ("ep_combine:send:2:st.release.sys.global", "gpu")])


def test_a_mutated_run_that_reads_a_guarded_load_stale_is_detected(monkeypatch):
    """A mutated run whose results come out right but which read stale a load that no
    unmutated run read stale is detected (``"stale"``, naming the load); stale reads of a
    racy load (read stale unmutated too) are not."""
    def fake_run(cfg, spec, seed, mutation=None, observe=None, **kw):
        observe.update({"k:r:load3": 2, "k:r:load0": 1} if seed == 1 else {"k:r:load0": 5})
        return "ok", ""
    monkeypatch.setattr(runs, "run_once", fake_run)
    mut = M.Mutation("k:r:0:st.release.gpu.global", "relaxed", True)
    racy = {"k:r:load0": 1}
    assert sweep._mutated_run(None, None, 0, mut, racy) == ("ok", "")
    assert sweep._mutated_run(None, None, 1, mut, racy) == \
        ("stale", "guarded loads read stale: k:r:load3")


def test_load_sites_name_a_kernels_global_loads_in_statement_order():
    """``runs.load_sites`` names every global load ``kernel:role:load<i>`` in statement
    order and no shared one; a mutation keeps the names (it changes orderings, not loads)."""
    import ir
    module = ir.Module("m", tuple(_small_kernels()))
    names = runs.load_sites([module])
    assert names, "no global load named"
    for k in module.kernels:
        for role in k.roles:
            loads = [s for s in N.walk(role.body) if isinstance(s, N.Load)]
            got = [names[id(s)] for s in loads if id(s) in names]
            assert got == [f"{k.name}:{role.name}:load{i}" for i in range(len(got))]
            assert all(id(s) in names or M.is_shared(s) for s in loads)
    op, mutation = M.ordered_ops(module.kernels[0])[0][0], "relaxed"
    mutated = runs.load_sites([M.mutate(module, op, mutation)])
    assert sorted(mutated.values()) == sorted(names.values())
