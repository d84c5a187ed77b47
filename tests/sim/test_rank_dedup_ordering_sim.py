"""``ep_rank_dedup`` under the simulator's weak-memory mode (``epgen check-ordering``'s runs,
``epgen.ordering.runs``): on each send path (the warp path, the block-staged broadcast, the
send-buffer path of the fused shared expert) the kernels match the reference for every seed,
and weakening the releases that count a slot's copy finished is detected, so the ordering
argument of docs/flags.md (a token's message and a slot's index word before the release of
each of its slots' finished counters) is what the results rest on; the send-buffer path
built with its releases before its message stores is caught."""

from __future__ import annotations

import pytest

from epgen.kernels import destination, send_policy
from epgen.kernels.rank_dedup import RankDedupDestination
from epgen.ordering import mutations as M
from epgen.ordering import runs, sweep

SEEDS = (0, 1, 2)
#: ``ep/rank_dedup``'s check configuration on each send path
PATHS = {"warp": {}, "block": {"ep_send_join_named": True},
         "buffer": {"fused_shared_expert": True}}


def _cfg(path):
    spec = runs.checked()["ep/rank_dedup"]
    cfg = runs.config(spec, overrides=PATHS[path])
    assert cfg.ep_rank_dedup and cfg.layout.n_local_experts == 2
    assert send_policy.uses_warp_send(cfg) == (path == "warp")
    assert send_policy.uses_block_broadcast(cfg) == (path == "block")
    return spec, cfg


def _finished_releases(kernels):
    """The mutations that weaken a comm role's ``red.release`` (a slot counted finished)."""
    return [m for m in sweep.all_mutations(kernels)
            if ":comm:" in m.op_id and "red.release.gpu" in m.op_id and m.kind == "relaxed"]


@pytest.mark.parametrize("path", PATHS)
def test_every_path_passes_and_needs_its_finished_releases(path):
    spec, cfg = _cfg(path)
    kernels, outcome = runs.targets(cfg, spec, "ep/rank_dedup", SEEDS[0])
    assert outcome[0] == "ok", outcome
    for seed in SEEDS[1:]:
        got = runs.run_once(cfg, spec, seed)
        assert got[0] == "ok", f"{path}, seed {seed}: {got}"
    weakened = _finished_releases(kernels)
    assert weakened, f"{path}: no finished-counter release found"
    for m in weakened:
        got = [runs.run_once(cfg, spec, s, mutation=M.Mutation(m.op_id, m.kind, True))[0]
               for s in SEEDS]
        assert any(o != "ok" for o in got), f"{path}: {m.name} not detected in {SEEDS}"


class _CountedBeforeCopied(RankDedupDestination):
    """A hazard: the send-buffer path counts a (token, rank)'s slots finished before its
    message is stored (the release then publishes nothing of the message)."""

    def send_slot(self, r, msg, t, k, g, dst_rank, e):
        with r.if_(self.takes_slot(g, dst_rank) & self.leads(r, t, k, dst_rank)):
            recv = self._recv(r, dst_rank)
            live = r.let("dst_live", self._live(r, dst_rank))
            self.reserve_rank_slots(r, recv, t, k, dst_rank, live)
            r.warp_sync()
            self.count_rank_slots(r, t, k, dst_rank)
            self.copy_to_message_area(r, msg, recv, t, live)


def test_hazard_slots_counted_before_the_message_is_stored(monkeypatch):
    spec, cfg = _cfg("buffer")
    monkeypatch.setattr(destination, "strategy_class", lambda c: _CountedBeforeCopied)
    got = [runs.run_once(cfg, spec, s)[0] for s in SEEDS]
    assert any(o != "ok" for o in got), f"the hazard is not detected in {SEEDS}: {got}"
