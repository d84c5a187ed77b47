"""``epgen check-ordering``: the protocol under the weak-memory mode, and which ordered
operations it needs.

``check(variant, seeds=..., mutate=...)`` first runs the variant's kernels unmutated for every
seed (each must match the reference: the kernels' orderings are enough, as far as the model
sees), then, for each mutation asked for (``mutations.py``), the mutated kernels for every
seed; a mutation is *detected* in ``k`` of ``N`` seeds when ``k`` runs went wrong, hung,
failed, or read a guarded load stale (``"stale"``: a load site that no unmutated run of any
seed read stale returned an older value than memory's newest, ``runs.py``), so a weakening
whose stale data happened to equal the new data still counts. ``report.ok`` holds when the
unmutated runs all pass and every mutation not excused for the variant (``undetected.toml``:
the mutation and the argument why it needs no detection) is detected. The excused ones are
reported too: an excused mutation that is detected after all is a note (the excuse is
stale), not a failure.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import attrs

from . import mutations as M
from . import runs

EXCUSES_FILE = Path(__file__).with_name("undetected.toml")


def excuses() -> dict[str, dict[str, str]]:
    """``variant -> {mutation name -> why it need not be detected}`` (``undetected.toml``)."""
    data = tomllib.loads(EXCUSES_FILE.read_text())
    return {v: {e["mutation"]: e["why"] for e in entries} for v, entries in data.items()}


@attrs.define
class Result:
    mutation: M.Mutation
    outcomes: list          # per seed: (seed, outcome, message)
    excuse: str | None

    @property
    def detected(self) -> int:
        return sum(1 for _, o, _ in self.outcomes if o != "ok")

    @property
    def missed(self) -> bool:
        return self.excuse is None and self.mutation.modelled and not self.detected


@attrs.define
class Report:
    variant: str
    seeds: list
    baseline: list          # per seed: (seed, outcome, message)
    results: list = attrs.Factory(list)
    racy: list = attrs.Factory(list)    # load sites the unmutated runs read stale

    @property
    def baseline_ok(self) -> bool:
        return all(o == "ok" for _, o, _ in self.baseline)

    @property
    def missed(self) -> list:
        return [r for r in self.results if r.missed]

    @property
    def ok(self) -> bool:
        return self.baseline_ok and not self.missed

    def to_json(self) -> dict:
        return {"variant": self.variant, "seeds": self.seeds, "ok": self.ok,
                "baseline": [{"seed": s, "outcome": o, "message": m}
                             for s, o, m in self.baseline],
                "racy_loads": list(self.racy),
                "mutations": [{"operation": r.mutation.op_id, "mutation": r.mutation.kind,
                               "modelled": r.mutation.modelled,
                               "detected": r.detected, "runs": len(r.outcomes),
                               "outcomes": {str(s): o for s, o, _ in r.outcomes},
                               "excuse": r.excuse} for r in self.results]}


def from_json(data: dict) -> Report:
    """The ``Report`` a ``to_json`` dict describes, its excuses read again from
    ``undetected.toml`` (so an edited excuse shows in a table made from a saved run)."""
    excused = excuses().get(data["variant"], {})
    report = Report(data["variant"], data["seeds"],
                    [(b["seed"], b["outcome"], b["message"]) for b in data["baseline"]],
                    racy=list(data.get("racy_loads", [])))
    for m in data["mutations"]:
        mut = M.Mutation(m["operation"], m["mutation"], m["modelled"])
        outcomes = [(int(s), o, "") for s, o in m["outcomes"].items()]
        report.results.append(Result(mut, outcomes, excused.get(mut.name)))
    return report


def all_mutations(kernels) -> list[M.Mutation]:
    return [m for k in kernels for oid, s in M.ordered_ops(k) for m in M.mutations_of(s, oid)]


def select(available: list[M.Mutation], wanted) -> list[M.Mutation]:
    """The mutations ``wanted`` names (``"all"``, or operation ids / mutation names /
    substrings of them); ``ValueError`` naming one that matches nothing."""
    if wanted in (None, [], ["all"], "all"):
        return list(available)
    out = []
    for w in wanted:
        hit = [m for m in available if w == m.name or w == m.op_id or w in m.name]
        if not hit:
            raise ValueError(f"--mutate {w!r}: no ordered operation matches (see --list)")
        out += [m for m in hit if m not in out]
    return out


def check(variant: str, seeds, mutate=None, cfg=None, progress=None) -> Report:
    """The report of ``variant`` (module docstring). ``seeds``: the seeds; ``mutate``: None
    (no mutations), ``"all"`` or names (``select``); ``cfg``: the configuration (default
    ``runs.config`` of the variant); ``progress(line)``: called as runs finish."""
    spec = runs.checked()[variant]
    cfg = cfg or runs.config(spec)
    seeds = list(seeds)
    racy: dict = {}
    kernels, first = runs.targets(cfg, spec, variant, seeds[0], observe=racy)
    baseline = [(seeds[0], *first)] + [(s, *runs.run_once(cfg, spec, s, observe=racy))
                                       for s in seeds[1:]]
    report = Report(variant, seeds, baseline, racy=sorted(racy))
    if progress:
        progress(f"{variant}: unmutated: " + ", ".join(f"seed {s} {o}" for s, o, _ in baseline))
    if mutate is None or not report.baseline_ok:
        return report
    excused = excuses().get(variant, {})
    for m in select(all_mutations(kernels), mutate):
        outcomes = [(s, *_mutated_run(cfg, spec, s, m, racy)) for s in seeds] \
            if m.modelled else []
        r = Result(m, outcomes, excused.get(m.name))
        report.results.append(r)
        if progress:
            progress(f"  {m.name}: " + (f"detected {r.detected}/{len(outcomes)}"
                                        if m.modelled else "not modelled"))
    return report


def _mutated_run(cfg, spec, seed: int, m: M.Mutation, racy) -> tuple[str, str]:
    """One mutated run's outcome, ``"stale"`` when it came out right but read a guarded
    load (one not in ``racy``) stale."""
    seen: dict = {}
    outcome, message = runs.run_once(cfg, spec, seed, m, observe=seen)
    guarded = sorted(set(seen) - set(racy))
    if outcome == "ok" and guarded:
        return "stale", "guarded loads read stale: " + ", ".join(guarded)
    return outcome, message


def _how(r: Result) -> str:
    kinds = sorted({o for _, o, _ in r.outcomes if o != "ok"})
    return ", ".join(kinds)


def table(report: Report) -> str:
    """The per-operation table of ``report`` (Markdown)."""
    lines = [f"`{report.variant}`, seeds {', '.join(map(str, report.seeds))}: unmutated runs "
             + ("all match the reference" if report.baseline_ok else "FAIL: " + "; ".join(
                 f"seed {s} {o} {m}" for s, o, m in report.baseline if o != "ok")), ""]
    if report.racy:
        lines[-1:-1] = ["", "Loads the unmutated runs read stale (racy by design, not guarded): "
                        + ", ".join(f"`{x}`" for x in report.racy)]
    if not report.results:
        return "\n".join(lines)
    lines += ["| operation | weakened to | detected | how | must detect |",
              "|---|---|---:|---|---|"]
    for r in report.results:
        det = f"{r.detected}/{len(r.outcomes)}" if r.mutation.modelled else "not modelled"
        must = "yes" if r.excuse is None and r.mutation.modelled else \
            "no: " + (r.excuse or "the weak model treats both forms alike")
        flag = " **MISSED**" if r.missed else ""
        lines.append(f"| `{r.mutation.op_id}` | {r.mutation.kind} | {det}{flag} | {_how(r)} "
                     f"| {must} |")
    return "\n".join(lines)


def write_json(reports, path: str) -> None:
    Path(path).write_text(json.dumps([r.to_json() for r in reports], indent=2) + "\n")
